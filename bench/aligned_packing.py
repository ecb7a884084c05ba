"""What batch-invariant packing costs in computed tokens (docs/performance.md, "Exact rollouts").

In `model.batch_invariant` mode every sequence of a packed row starts at a multiple of the attention's key
block (`StepRows.aligned`, batching/plan.py), so a packed row computes more padding than one packed back to
back. This plans the no-grad pass's layout (`plan_chunks`, host only: no device work) of 64 rows drawn from a
few length mixes, back to back and aligned, and prints the computed tokens of each next to the real and the
padded ones.

Run: `python bench/aligned_packing.py [--rows 64] [--seed 0]`. Prints one JSON line per (mix, chunk size).
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from jaxrl_llm import batching
from jaxrl_llm.models.invariant import KEY_BLOCK

# (name, prompt columns P, response columns R, shortest response): prompts of 20..P tokens, responses of
# shortest..R tokens, drawn uniformly
MIXES = (("gsm8k_like", 256, 512, 30), ("long", 1024, 2048, 100), ("short", 128, 128, 10))
CHUNK_ROWS = (8, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    for name, prompt_cols, response_cols, shortest in MIXES:
        prompts = rng.integers(20, prompt_cols, size=args.rows)
        responses = rng.integers(shortest, response_cols, size=args.rows)
        rows = batching.StepRows.of_lengths(prompts, responses, prompt_cols + response_cols, response_cols)
        for chunk in CHUNK_ROWS:
            back_to_back = batching.packing_stats(batching.plan_chunks(rows, chunk, 1))["computed_tokens"]
            aligned = batching.packing_stats(batching.plan_chunks(rows.aligned(KEY_BLOCK), chunk, 1))
            print(json.dumps({"mix": name, "rows_per_chunk": chunk, "real_tokens": aligned["real_tokens"],
                              "computed_back_to_back": back_to_back, "computed_aligned": aligned["computed_tokens"],
                              "aligned_over_back_to_back": round(aligned["computed_tokens"] / back_to_back, 3),
                              "padded": args.rows * (prompt_cols + response_cols)}))


if __name__ == "__main__":
    main()
