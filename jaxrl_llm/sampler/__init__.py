"""Jitted prefill + KV-cache decode on the policy's own (sharded) parameters.

Trainer path (inside or outside another jit):

    settings, knobs = SamplingParams.from_rollout_config(cfg.actor_rollout_ref.rollout).compile_args(
        model_cfg.eos_token_ids, pad_id, vocab_size=model_cfg.vocab_size)
    out = sample(params, model_cfg, prompt_ids, prompt_mask, rng, knobs, settings=settings, mesh=mesh)
    # out.tokens / response_mask / log_probs [B*n, R], lengths / finish_reason [B*n], num_steps

Notebook path: `generate(model, prompts, SamplingParams(...)) -> GenerationResult`.
"""
from jaxrl_llm.sampler.core import FINISH_EOS, FINISH_LENGTH, FINISH_REASONS, FINISH_STOP, SampleOutput, sample
from jaxrl_llm.sampler.facade import generate, prompts_to_ids
from jaxrl_llm.sampler.host import (
    GenerationResult,
    bucket_batch,
    bucket_length,
    decode_texts,
    eos_ids_of,
    left_pad,
)
from jaxrl_llm.sampler.params import NO_TOKEN, SampleKnobs, SampleSettings, SamplingParams, id_table
from jaxrl_llm.sampler.sampling import choose_tokens, filtered_logits

__all__ = [
    "FINISH_EOS", "FINISH_LENGTH", "FINISH_REASONS", "FINISH_STOP", "GenerationResult", "NO_TOKEN",
    "SampleKnobs", "SampleOutput", "SampleSettings", "SamplingParams", "bucket_batch", "bucket_length",
    "choose_tokens", "decode_texts", "eos_ids_of", "filtered_logits", "generate", "id_table", "left_pad",
    "prompts_to_ids", "sample",
]
