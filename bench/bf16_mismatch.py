"""Sampler vs trainer log-prob mismatch (rollout/trainer numerics) on a tiny model and SmolLM2.

Samples with each rollout engine (`static`: one padded batch, `paged`: the continuous-batching
engine) in `--dtype`, rescores prompt + response with the trainer's `response_log_probs` in the
same dtype, and prints veRL's rollout-correction diagnostics (`rollout_corr/kl`,
`log_ppl_abs_diff`) and max |Δ logp| over the response tokens, one line per engine.

Run: `.venv/bin/python bench/bf16_mismatch.py [--model tiny|smollm2] [--dtype bfloat16]
[--engine static|paged|both] [--new-tokens 64]`.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.losses.rollout_correction import compute_rollout_correction
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.roles.forward import response_log_probs
from jaxrl_llm.sampler import SamplingParams, left_pad, sample
from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged

QUESTIONS = ["What is 12 times 7?", "Name three primary colours.", "Write a haiku about autumn leaves.",
             "Explain in one sentence why the sky is blue.", "What is the capital of France?",
             "Give me a synonym for happy.", "How many legs does a spider have?", "What is 3 + 4?"]


def tiny_model(seed: int = 0) -> tuple[ModelConfig, dict, list[list[int]], int]:
    cfg = ModelConfig.tiny("llama")
    params = init_params(cfg, jax.random.key(seed))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if "norm" in jax.tree_util.keystr(path) else x * 10.0, params)
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, cfg.vocab_size, size=int(n))) for n in rng.integers(3, 20, size=8)]
    return cfg, params, prompts, 0


def smollm2() -> tuple[ModelConfig, dict, list[list[int]], int]:
    from jaxrl_llm.config import smollm2_gguf_path
    from jaxrl_llm.hf import load_gguf, load_tokenizer

    path = smollm2_gguf_path()
    cfg, params = load_gguf(path)
    tok = load_tokenizer(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
               for q in QUESTIONS]
    return cfg, params, prompts, int(tok.pad_token_id or 0)


ENGINES = ("static", "paged")


def mismatch(cfg: ModelConfig, params: dict, prompts, pad_id: int, *, dtype: str, new_tokens: int,
             temperature: float = 1.0, seed: int = 0, engine: str = "static") -> dict:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True)
    settings, knobs = sp.compile_args(cfg.eos_token_ids, pad_id, vocab_size=cfg.vocab_size, compute_dtype=dtype)
    if engine == "paged":
        out, _ = sample_paged(params, cfg, prompts, jax.random.key(seed), knobs, settings=settings,
                              opts=EngineOptions(engine="paged"))
    elif engine == "static":
        ids, mask = left_pad(prompts, pad_id)
        out = sample(params, cfg, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed), knobs, settings=settings)
    else:
        raise ValueError(f"engine={engine!r}: expected one of {ENGINES}")
    full_ids = jnp.concatenate([jnp.asarray(out.prompt_ids), jnp.asarray(out.tokens)], axis=1)
    full_mask = jnp.concatenate([jnp.asarray(out.prompt_mask), jnp.asarray(out.response_mask)], axis=1)
    score = jax.jit(response_log_probs, static_argnums=(1, 4), static_argnames=("temperature", "compute_dtype"))
    train = score(params, cfg, full_ids, full_mask, new_tokens, temperature=temperature, compute_dtype=dtype)
    rmask = jnp.asarray(out.response_mask).astype(jnp.float32)
    _, _, metrics = compute_rollout_correction(train, jnp.asarray(out.log_probs), rmask, rollout_is="token",
                                               rollout_is_threshold=2.0)
    real = np.asarray(rmask) > 0
    diff = np.abs(np.asarray(out.log_probs) - np.asarray(train))[real]
    result = {"kl": float(metrics["rollout_corr/kl"]),
              "log_ppl_abs_diff": float(metrics["rollout_corr/log_ppl_abs_diff"]),
              "max_abs_dlogp": float(diff.max()), "frac_exact": float(np.mean(diff == 0)), "tokens": int(diff.size)}
    if dtype != "float32":  # the same tokens scored in fp32: how far each bf16 path is from fp32
        exact = score(params, cfg, full_ids, full_mask, new_tokens, temperature=temperature, compute_dtype="float32")
        result["trainer_mean_abs_err_vs_fp32"] = float(np.mean(np.abs(np.asarray(train) - np.asarray(exact))[real]))
        rollout_err = np.abs(np.asarray(out.log_probs) - np.asarray(exact))[real]
        result["rollout_mean_abs_err_vs_fp32"] = float(np.mean(rollout_err))
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--engine", default="both", choices=ENGINES + ("both",))
    args = ap.parse_args(argv)
    cfg, params, prompts, pad = tiny_model() if args.model == "tiny" else smollm2()
    for engine in ENGINES if args.engine == "both" else (args.engine,):
        result = mismatch(cfg, params, prompts, pad, dtype=args.dtype, new_tokens=args.new_tokens, engine=engine)
        print(args.model, args.dtype, engine, result)


if __name__ == "__main__":
    sys.exit(main())
