"""Exact rollouts (`actor_rollout_ref.model.batch_invariant`, models/invariant.py): in bf16 the log-prob of
every sampled token equals the trainer's recomputation bit for bit, through both engines, and in a GRPO
step (`rollout_corr/max_abs_log_ratio` 0); with the mode off they differ (the mismatch the mode removes)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.roles.forward import response_log_probs
from jaxrl_llm.sampler import SamplingParams, left_pad, sample
from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged

NEW_TOKENS = 12
TEMPERATURE = 0.7  # a division both sides must do alike (models/invariant.py `vocab_scan`)


def _model(arch: str, **dims):
    """A tiny random model with peaked logits (weights x 10, norms left at 1), and 8 prompts of 3..20 ids."""
    cfg = ModelConfig.tiny(arch, **dims)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if "norm" in jax.tree_util.keystr(path) else x * 10.0, init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, size=int(n))) for n in rng.integers(3, 20, size=8)]
    return cfg, params, prompts


_score = jax.jit(response_log_probs, static_argnums=(1, 4), static_argnames=("temperature", "compute_dtype"))


def _rollout_vs_trainer(cfg, params, prompts, engine: str, seed: int = 0, n: int = 1,
                        opts: EngineOptions | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(the sampler's, the trainer's) bf16 log-probs of the response tokens (flattened); `n` samples a prompt."""
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE, ignore_eos=True, n=n)
    settings, knobs = sp.compile_args(cfg.eos_token_ids, 0, vocab_size=cfg.vocab_size, compute_dtype="bfloat16")
    if engine == "paged":
        out, _ = sample_paged(params, cfg, prompts, jax.random.key(seed), knobs, settings=settings,
                              opts=opts or EngineOptions(engine="paged"))
    else:
        ids, mask = left_pad(prompts, 0)
        out = sample(params, cfg, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed), knobs, settings=settings)
    ids = jnp.concatenate([jnp.asarray(out.prompt_ids), jnp.asarray(out.tokens)], axis=1)
    mask = jnp.concatenate([jnp.asarray(out.prompt_mask), jnp.asarray(out.response_mask)], axis=1)
    train = _score(params, cfg, ids, mask, NEW_TOKENS, temperature=TEMPERATURE, compute_dtype="bfloat16")
    real = np.asarray(out.response_mask) > 0
    return np.asarray(out.log_probs)[real], np.asarray(train)[real]


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_bf16_rollout_log_probs_equal_the_trainers_bit_for_bit(engine):
    cfg, params, prompts = _model("llama")
    rollout, trainer = _rollout_vs_trainer(dataclasses.replace(cfg, batch_invariant=True), params, prompts, engine)
    assert rollout.size == 8 * NEW_TOKENS
    np.testing.assert_array_equal(rollout, trainer)
    # the mode off: XLA's kernels sum the decode step, the prefill and the training forward in other orders
    rollout, trainer = _rollout_vs_trainer(cfg, params, prompts, engine)
    assert np.abs(rollout - trainer).max() > 0 and np.mean(rollout == trainer) < 0.99


@pytest.mark.parametrize("variant", ["chunked_prefill", "cascade_and_batch_prefill"])
def test_the_paged_engines_prefill_and_decode_variants_stay_exact(variant):
    """Prompts of 3..19 ids prefilled in chunks of 4 over their growing cache; or a prompt's 2 samples sharing its
    pages (cascade attention on) with a round's prompts prefilled in one call: the same bits as the trainer."""
    cfg, params, prompts = _model("llama")
    opts = {"chunked_prefill": EngineOptions(engine="paged", max_num_batched_tokens=4, enable_chunked_prefill=True),
            "cascade_and_batch_prefill": EngineOptions(engine="paged", cascade_attention=True,
                                                       batch_prefill=True)}[variant]
    rollout, trainer = _rollout_vs_trainer(dataclasses.replace(cfg, batch_invariant=True), params, prompts, "paged",
                                           n=2, opts=opts)
    assert rollout.size == 2 * 8 * NEW_TOKENS
    np.testing.assert_array_equal(rollout, trainer)


def test_exact_after_the_weights_move_and_with_a_sliding_window():
    """The paged engine's weight copy keeps the stacked norm scales in fp32 (models/dtypes.py): once an update
    moves them off bf16 values the rollout still equals the trainer; a Mistral-style sliding window (shorter
    than the rows) attends over the same anchored key blocks on both sides."""
    cfg, params, prompts = _model("mistral", sliding_window=8)
    cfg = dataclasses.replace(cfg, batch_invariant=True)
    moved = jax.tree.map(lambda x: x * 1.01, params)  # norm scales 1.01: not a bf16 value
    for engine in ("paged", "static"):
        rollout, trainer = _rollout_vs_trainer(cfg, moved, prompts, engine, seed=1)
        np.testing.assert_array_equal(rollout, trainer)


@pytest.mark.parametrize("tensor", [1, 2])
def test_grpo_steps_log_zero_mismatch(tmp_path, smollm2_gguf, tensor):
    """A bf16 GRPO run of the tiny config with the mode on (paged engine) on 8 devices, fsdp 8 or fsdp 4 x
    tensor 2: at every step the trainer's log-probs of the rollout's tokens are the sampler's (max_abs_log_ratio
    0, every token exact). On the tensor split each GEMM gathers its weight and sums its rows on one device."""
    from tiny_runs import read_metrics, tiny_config

    from jaxrl_llm.trainer import Trainer

    Trainer(tiny_config(tmp_path, **{
        "actor_rollout_ref.model.dtype": "bfloat16", "actor_rollout_ref.model.batch_invariant": True,
        "actor_rollout_ref.model.use_remove_padding": False, "actor_rollout_ref.rollout.engine": "paged",
        "actor_rollout_ref.rollout.temperature": TEMPERATURE, "mesh.tensor": tensor})).fit()
    rows = [r for r in read_metrics(tmp_path) if "rollout_corr/max_abs_log_ratio" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["rollout_corr/max_abs_log_ratio"] == 0.0 and row["rollout_corr/exact_token_frac"] == 1.0, row


@pytest.mark.parametrize("key, value, named", [
    ("actor_rollout_ref.model.use_remove_padding", True, "unpacked rows"),
    ("actor_rollout_ref.rollout.speculative.method", "ngram", "verification"),
    ("actor_rollout_ref.rollout.kv_cache_dtype", "int8", "int8 pages"),
    ("mesh.context", 2, "mesh.context"),
])
def test_what_the_mode_does_not_cover_is_refused_by_name(key, value, named):
    from tiny_runs import tiny_config

    from jaxrl_llm.config import validate_config

    overrides = {"actor_rollout_ref.model.batch_invariant": True, "actor_rollout_ref.model.use_remove_padding": False,
                 key: value}
    if key.endswith("speculative.method"):
        overrides["actor_rollout_ref.rollout.engine"] = "paged"
    with pytest.raises(ConfigError, match=named):
        validate_config(tiny_config("/tmp/unused", **overrides), dp_size=1)


def test_a_mixture_of_experts_model_is_refused_at_load():
    from jaxrl_llm.config.spec import ModelSpec
    from jaxrl_llm.roles.trained import _as_configured

    cfg = ModelConfig.tiny("qwen3_moe")
    with pytest.raises(ConfigError, match="routed experts"):
        _as_configured(cfg, ModelSpec(path="tiny:qwen3_moe", param_dtype="float32", tiny=(), batch_invariant=True))
