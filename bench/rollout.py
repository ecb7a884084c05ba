"""RL-style rollout throughput on SmolLM2-135M (fp32): the paged engine vs the static sampler vs
`transformers.generate`, same prompts, same limits (temperature 1, natural EOS, n samples each).

Prompts spread response lengths the way RL answers do: one-word answers, short explanations and
long step-by-step solutions. The static sampler and transformers run the requests in batches of
`--slots` rows (the paged engine's slot count, so all three hold about the same KV memory).
Reported per engine: useful new tokens/s (response tokens up to and including EOS / wall time of
a warm run), slot utilisation (useful token-steps / slot-steps), prompt tokens prefilled
(computed, bucket padding included), KV bytes held, compiled programs and compile time (a
warm-up run for the paged engine, lowering + compiling for the static one). The machine may be
shared with other jobs: numbers are wall-clock.

Run: `.venv/bin/python bench/rollout.py [--quick]`  (full: 64 prompts x n=4, 512 new tokens).

Last measured (--quick, 2026-11-24, idle 2-core CPU): paged 138.1 tok/s, 96% utilisation (79% before
the drain shrinks the slot set), 864 prefill tokens, 11 programs; static 90.2 tok/s, 50%, 4608
prefill tokens; transformers 59.6 tok/s: paged 1.53x static, 2.30x transformers (docs/performance-history.md).
Full size (2026-11-25, `--skip static`, then `--skip paged transformers`): paged 102.0 tok/s, 94%;
transformers 40.7 tok/s, 25%; static 16.7 tok/s, 28% (paged 2.50x transformers, 6.1x static).
Rows `paged` (the defaults), `paged_unrolled` / `paged_scan` (rollout.unroll_layers=True / False: decode
over per-layer weight arrays / the scan over the stack; the default 'auto' unrolls on CPU from 512 new
tokens on, so at full size `paged` is `paged_unrolled`), `paged_cascade` (rollout.cascade_attention=True: a
prompt's samples read its shared pages once; the default 'auto' does so only with the GPU / TPU
kernels) and `paged_bpf` (rollout.batch_prefill=True).
Cascade attention (2026-11-27, --quick, one engine row per process, then the default): paged 161.9 /
181.2 tok/s, cascade off 103.7 / 105.0 tok/s (1.6-1.7x); transformers 78.8 tok/s in the 181.2 run (2.30x).
At full size on 2026-11-28 (after the product-sum scores) the XLA path measured the other way:
cascade on 89.6 tok/s, off 103.8 (0.86x), so 'auto' leaves it off on the XLA path (see below).
Batched prefill (then the `paged` row; `paged_1pf`: one prefill call per prompt, 2026-11-27,
`--prompts 64 --n 4 --slots 64 --new-tokens 32 --skip static transformers`): 38 vs 64 prefill
calls, 0.77x useful tokens/s with the default warm-up (its new (bucket, rows) shapes compile in the
timed run: 27 vs 6 programs) and 0.98x with `--warm-all` (411.0 vs 419.7 tok/s): on CPU a prefill
call's overhead is small next to its compute, so `rollout.batch_prefill` stays off by default.
Per-layer decode weights (then on by default on CPU; both rows with product-sum attention scores,
2026-11-28, --quick, a slower shared machine): 69.4 tok/s against 46.1 for the layer scan (1.51x; 53.2
before both changes); transformers 39.8 (1.74x). A rerun later that day: paged 55.1, paged_unrolled 60.1
(1.09x), transformers 40.4 (paged 1.37x). The per-layer weights cost 176-186 s of warm-up against
33-57 s, so they became the option `rollout.unroll_layers` (row `paged_unrolled`), off by default;
since 2026-11-29 'auto' turns them on for CPU rollouts of 512 new tokens or more.
Half size at 512 new tokens (2026-11-28, `--prompts 32 --slots 32 --n 4 --new-tokens 512`, same
host): paged 72.8 tok/s, 96%; transformers 25.7 tok/s, 28%: 2.83x.
Full size (2026-11-28 afternoon, `--skip static paged_unrolled paged_bpf paged_ngram paged_draft`, the
same host, cascade 'auto'): paged 103.9 tok/s, 94%; paged_cascade 95.8; transformers 27.9 tok/s, 25%:
paged 3.72x transformers. An earlier full-size run that day (cascade then on by default): paged 89.6,
paged_unrolled 91.4, cascade off 103.8, paged_bpf 84.4 (docs/performance-history.md).
Row `paged_ngram` (rollout.speculative.method=ngram, 4 drafts; 2026-11-27, --quick): 103.8 vs 157.8
tok/s for `paged` (0.66x), 1.15 tokens per live slot and step, 4% of drafts kept: off by default.
Row `paged_draft` (method 'draft', the draft = SmolLM2's first 6 layers, 2026-11-27, --quick): 60.5
vs 137.6 tok/s (0.44x), 2% of drafts kept.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import time

import jax
import numpy as np

from jaxrl_llm.config import smollm2_gguf_path
from jaxrl_llm.hf import load_gguf
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampler import SamplingParams, left_pad
from jaxrl_llm.sampler.core import sample_program
from jaxrl_llm.sampler.engine import programs
from jaxrl_llm.sampler.engine.setup import EngineOptions, engine_spec, sample_paged
from jaxrl_llm.sampler.host import bucket_length
from jaxrl_llm.sampler.speculative import SpeculativeSpec

ONE_WORD = ["What colour is grass? Answer with one word.", "What is the capital of Italy? One word.",
            "Is fire hot or cold? One word.", "What animal says moo? One word."]
SHORT = ["Explain in one sentence why ice floats.", "Why do we have seasons? Answer briefly.",
         "What does a thermometer measure? Explain briefly.", "Why is the sea salty? Be brief."]
LONG = ["Solve step by step: a train travels 60 km/h for 2.5 hours, then 80 km/h for 1.5 hours. "
        "How far does it go in total?",
        "Solve step by step: Tom has 3 boxes of 12 apples and gives away 17 apples. How many are left?",
        "Write a detailed step-by-step explanation of how to compute 15% of 240.",
        "Explain step by step how photosynthesis works, then summarise it."]


# the paged engine's rows: its defaults, then one rollout option flipped each
PAGED_ROWS = {"paged": {}, "paged_xla": {"attention_impl": "xla"},
              "paged_unrolled": {"unroll_layers": True}, "paged_scan": {"unroll_layers": False},
              "paged_cascade": {"cascade_attention": True},
              "paged_bpf": {"batch_prefill": True},
              "paged_ngram": {"speculative": SpeculativeSpec(num_tokens=4)},
              "paged_draft": {"speculative": "draft"}}  # the draft: the model's first --draft-layers layers


def layer_draft(cfg: ModelConfig, params: dict, layers: int) -> tuple[ModelConfig, dict]:
    """A draft model from the target itself: its first `layers` decoder layers, its final norm and
    head (self-speculation; the only smaller model of SmolLM2's vocabulary on this machine)."""
    draft = dict(params, layers=jax.tree.map(lambda x: x[:layers], params["layers"]))
    return dataclasses.replace(cfg, num_hidden_layers=layers), draft


def rl_prompts(count: int) -> list[str]:
    kinds = [ONE_WORD, SHORT, LONG]
    return [kinds[i % 3][(i // 3) % 4] for i in range(count)]


def cache_sizes() -> int:
    return sum(f._cache_size() for f in (programs.prefill, programs.prefill_batch, programs.insert,
                                         programs.insert_at, programs.generate))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def progress(name: str, batch: int, batches: int, useful: int, t0: float) -> None:
    """One line per finished batch: a run stopped early still gives a measured rate."""
    wall = time.perf_counter() - t0
    eta = wall / (batch + 1) * (batches - batch - 1)
    print(f"      {name}: batch {batch + 1}/{batches} done, {useful} useful tokens in {wall:.1f} s "
          f"({useful / wall:.1f} tok/s so far, ETA {eta:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--quick", action="store_true", help="16 prompts x n=4, 128 new tokens, 16 slots")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--warm-all", action="store_true",
                        help="warm the paged engine on the timed prompts (steady state: no compile in the timed run)")
    parser.add_argument("--skip", nargs="*", default=[], choices=[*PAGED_ROWS, "static", "transformers"])
    parser.add_argument("--draft-layers", type=int, default=6, help="layers of the paged_draft row's draft model")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.slots = 16, 128, 16
    path = pathlib.Path(args.gguf or smollm2_gguf_path())
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cfg, params = load_gguf(path)
    texts = rl_prompts(args.prompts)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for t in texts]
    pad, eos = tok.pad_token_id, tok.eos_token_id
    n, r, slots = args.n, args.new_tokens, args.slots
    sp = SamplingParams(max_new_tokens=r, temperature=1.0, n=n, seed=0)
    settings, knobs = sp.compile_args([eos], pad, vocab_size=cfg.vocab_size)
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32 K+V per token
    print(f"backend={jax.default_backend()} cpu_count={os.cpu_count()} prompts={len(prompts)} x n={n} "
          f"max_new_tokens={r} slots/batch rows={slots} prompt lengths {min(map(len, prompts))}.."
          f"{max(map(len, prompts))} (shared machine: other jobs may be running)")
    rows = {}

    def report(name: str, m: dict) -> None:
        rows[name] = m
        print(f"{name:>12} | {m['tps']:>7.1f} {m['util']:>5.0%} {m['useful']:>7d} {m['wall']:>7.1f} | "
              f"{m['prefill']:>11d} {m['kv'] / 2**20:>7.1f} | {m['compiles']:>8d} {m['compile_s']:>9.1f}", flush=True)

    print(f"{'engine':>12} | {'tok/s':>7} {'util':>5} {'tokens':>7} {'wall s':>7} | {'prefill tok':>11} "
          f"{'KV MiB':>7} | {'programs':>8} {'compile s':>9}", flush=True)
    # the paged engine with its defaults, then each rollout option flipped: per-layer decode weights,
    # samples reading their prompt's shared pages once (rollout.cascade_attention=True; 'auto' leaves it
    # off on CPU), new prompts of a round batched into one prefill call (rollout.batch_prefill=True),
    # speculative decoding with n-gram or draft-model drafts
    for name, options in PAGED_ROWS.items():
        if name in args.skip:
            continue
        draft_params = None
        if options.get("speculative") == "draft":
            draft_cfg, draft_params = layer_draft(cfg, params, args.draft_layers)
            options = {"speculative": SpeculativeSpec("draft", num_tokens=4, draft_cfg=draft_cfg)}
        opts = EngineOptions(max_num_seqs=slots, **options)
        before = cache_sizes()
        # warm-up (compiles): one prompt per length bucket, the longest included, enough requests
        # for the same slot count -> the very programs of the timed run
        by_bucket = {bucket_length(len(p)): p for p in sorted(prompts, key=len)}
        warm = list(by_bucket.values())
        while len(warm) * n <= slots // 2:
            warm += warm
        if args.warm_all:  # the timed prompts themselves (other seed): the steady state of an RL run
            warm = prompts
        _, compile_s = timed(lambda: sample_paged(params, cfg, warm, jax.random.key(0), knobs, settings=settings,
                                                  opts=opts, draft_params=draft_params))
        (out, stats), warm_s = timed(lambda: sample_paged(params, cfg, prompts, jax.random.key(1), knobs,
                                                          settings=settings, opts=opts, draft_params=draft_params))
        spec = engine_spec(cfg, opts, num_requests=len(prompts) * n, max_prompt_len=max(map(len, prompts)),
                           max_new_tokens=r, compute_dtype="float32")
        useful = int(out.lengths.sum())
        report(name, dict(tps=useful / warm_s, util=stats.utilisation, useful=useful, wall=warm_s,
                          prefill=sum(bucket_length(len(p)) for p in prompts),
                          kv=spec.num_pages * spec.page_bytes(cfg, "float32"),
                          compiles=cache_sizes() - before, compile_s=compile_s))
        print(f"{name:>12}: {stats.decode_steps} decode steps, {stats.generate_calls} generate calls, "
              f"{stats.prefill_calls} prefill calls, {stats.resizes} slot-set resizes, peak "
              f"{stats.peak_pages_used} of {spec.num_pages - 1} pages used, warm-up run incl. compiles "
              f"{compile_s:.1f} s", flush=True)
        if stats.speculative:
            spec_m = stats.speculative_metrics()
            print(f"{name:>12}: {spec_m['rollout/tokens_per_step']:.2f} tokens per live slot and step, "
                  f"{spec_m['rollout/spec_accept_rate']:.0%} of drafts kept", flush=True)

    requests = [p for p in prompts for _ in range(n)]  # prompt-major, n copies (the static path's repeat)

    if "static" not in args.skip:
        # rows in batches of `slots`: slots // n prompts with n samples each (the prompt prefilled n times)
        per = max(1, slots // n)
        batches = [left_pad(prompts[b:b + per], pad) for b in range(0, len(prompts), per)]
        compiled, compile_s = {}, 0.0
        for ids, mask in batches:  # compile each batch shape once, untimed runs excluded
            if ids.shape not in compiled:
                t0 = time.perf_counter()
                compiled[ids.shape] = sample_program.lower(params, cfg, ids, mask, jax.random.key(0), knobs,
                                                        settings=settings, mesh=None).compile()
                compile_s += time.perf_counter() - t0
        lengths, slot_steps, prefill, kv = [], 0, 0, 0
        t0 = time.perf_counter()
        for b, (ids, mask) in enumerate(batches):
            o = jax.block_until_ready(compiled[ids.shape](params, ids, mask, jax.random.key(b), knobs))
            lengths.append(np.asarray(o.lengths))
            slot_steps += int(o.num_steps) * ids.shape[0] * n
            prefill += ids.size  # each prompt prefilled once, its KV repeated n times (sampler/core.py)
            kv = max(kv, ids.shape[0] * n * (ids.shape[1] + r - 1) * kv_token)
            progress("static", b, len(batches), int(np.concatenate(lengths).sum()), t0)
        wall = time.perf_counter() - t0
        useful = int(np.concatenate(lengths).sum())
        report("static", dict(tps=useful / wall, util=useful / slot_steps, useful=useful, wall=wall,
                              prefill=prefill, kv=kv, compiles=len(compiled), compile_s=compile_s))

    if "transformers" not in args.skip:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
        torch.manual_seed(0)
        lengths, slot_steps, prefill, kv = [], 0, 0, 0
        t0 = time.perf_counter()
        for b in range(0, len(requests), slots):
            chunk = requests[b:b + slots]
            ids, mask = left_pad(chunk, pad, length=max(map(len, chunk)))
            with torch.no_grad():
                gen = model.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                                     attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=True,
                                     temperature=1.0, top_k=None, top_p=None, max_new_tokens=r,
                                     eos_token_id=eos, pad_token_id=pad)
            new = gen[:, ids.shape[1]:].numpy()
            for row in new:
                hits = np.flatnonzero(row == eos)
                lengths.append(hits[0] + 1 if len(hits) else new.shape[1])
            slot_steps += new.size
            prefill += ids.size
            kv = max(kv, ids.shape[0] * (ids.shape[1] + new.shape[1]) * kv_token)
            progress("transformers", b // slots, -(-len(requests) // slots), int(np.sum(lengths)), t0)
        wall = time.perf_counter() - t0
        useful = int(np.sum(lengths))
        report("transformers", dict(tps=useful / wall, util=useful / slot_steps, useful=useful, wall=wall,
                                    prefill=prefill, kv=kv, compiles=0, compile_s=0.0))

    if "paged" in rows:
        for other in (*list(PAGED_ROWS)[1:], "static", "transformers"):
            if other in rows:
                print(f"paged / {other}: {rows['paged']['tps'] / rows[other]['tps']:.2f}x useful tokens/s")


if __name__ == "__main__":
    main()
