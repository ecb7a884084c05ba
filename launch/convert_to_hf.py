"""Convert a model to a Hugging Face folder.

    python launch/convert_to_hf.py --input PATH --output DIR [--dtype float32|bfloat16|float16]

PATH is an HF folder, a .gguf file, or anything a loader registered with
`jaxrl_llm.hf.register_loader` accepts (the trainer registers its checkpoints).
"""
from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

from jaxrl_llm.hf import export_hf, load_any, load_tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="HF folder, .gguf file or checkpoint")
    parser.add_argument("--output", required=True, help="output HF folder (replaced atomically)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--max-shard-size", type=int, default=5 * 1024**3, help="bytes per shard")
    parser.add_argument("--no-tokenizer", action="store_true", help="do not copy the tokenizer")
    args = parser.parse_args(argv)

    cfg, params = load_any(args.input, dtype=DTYPES[args.dtype])
    tokenizer = None if args.no_tokenizer else load_tokenizer(args.input)
    out = export_hf(cfg, params, args.output, tokenizer=tokenizer, max_shard_size=args.max_shard_size)
    print(f"wrote {cfg.architecture} ({cfg.num_hidden_layers} layers, {args.dtype}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
