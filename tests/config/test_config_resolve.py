"""`resolve(config) -> RunSpec`: typed, frozen, derived once; the BatchPlan is the one source of every
batch size; no package below trainer/ reads a config tree."""
import ast
import dataclasses
import pathlib

import pytest

from jaxrl_llm.batching.batch_plan import MicroBatching
from jaxrl_llm.config import apply_overrides, default_config, resolve, resolve_config, validate_config

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "jaxrl_llm"


def _spec(*overrides, dp=4, samples=None):
    cfg = apply_overrides(default_config(), ["actor_rollout_ref.model.path=tiny:llama", "data.tokenizer=tok",
                                             "data.train_files=x.parquet", *overrides])
    return resolve_config(cfg, dp_size=dp, num_train_samples=samples, check_paths=False)


def test_run_spec_values_are_derived_once():
    spec = _spec("algorithm.adv_estimator=grpo", "data.train_batch_size=32", "actor_rollout_ref.rollout.n=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.clip_ratio=0.3",
                 "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "trainer.total_epochs=2", samples=100)
    assert spec.trainer.total_steps == 3 * 2  # 100 // 32 batches x 2 epochs
    assert (spec.actor_optim.total_steps, spec.actor_optim.warmup_steps) == (6, 0)
    assert (spec.actor.clip_ratio_low, spec.actor.clip_ratio_high) == (0.3, 0.3)  # derived from clip_ratio
    assert spec.critic is None and spec.critic_optim is None and not spec.need_ref
    assert spec.train_sampling.n == 4 and spec.train_sampling.max_new_tokens == 512
    assert spec.val_sampling.greedy and spec.val_sampling.n == 1
    assert spec.data.train_files == ("x.parquet",) and spec.data.max_prompt_length == 512
    assert spec.reward.max_resp_len == 512 and spec.reward.reward_manager == "naive"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.actor.clip_ratio_low = 0.1
    hash(spec.actor), hash(spec.advantage), hash(spec.rollout_correction)  # jit static arguments


def test_spec_without_dataset_size_leaves_steps_unresolved():
    spec = _spec("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2")
    assert spec.trainer.total_steps is None and spec.actor_optim.total_steps is None


def test_critic_and_reference_specs():
    spec = _spec("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
                 "critic.optim.lr=3e-5", "trainer.total_training_steps=7")
    assert spec.critic is not None and spec.critic_model.path == "tiny:llama"
    assert spec.critic_optim.lr == 3e-5 and spec.critic_optim.total_steps == 7
    assert spec.need_ref and not spec.recompute_old_log_probs
    bf16 = _spec("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.model.dtype=bfloat16")
    assert bf16.recompute_old_log_probs  # sampler log-probs are exact only in fp32


def test_batch_plan_sizes_used_by_the_run():
    spec = _spec("algorithm.adv_estimator=gae", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "critic.use_dynamic_bsz=true",
                 "critic.ppo_max_token_len_per_device=4096", "critic.forward_max_token_len_per_device=2048",
                 "data.max_prompt_length=256", "data.max_response_length=256", dp=4)
    plan = spec.plan
    # actor: 32 sequences in mini-batches of 16 (4/device), micro-batches of 2/device
    assert plan.update_split(plan.actor, 32, 512) == (2, 2)
    assert plan.actor.accumulation_steps == 2
    # critic: dynamic, 4096 // 512 = 8 sequences fit, so the 4/device of a mini-batch is one micro-batch
    assert plan.update_split(plan.critic, 32, 512) == (2, 1)
    assert plan.critic.accumulation_steps is None
    # no-grad passes: reference at 4/device, values by the 2048-token budget (4 rows at 512 tokens)
    assert plan.forward_micro_rows(plan.ref_log_prob, 32, 512) == 16
    assert plan.forward_micro_rows(plan.values, 32, 512) == 16
    assert plan.forward_micro_rows(plan.values, 32, 1024) == 8
    text = plan.summary()
    assert "reference log-probs 4/device" in text and "critic values dynamic (<= 2048 tokens/device)" in text


def test_micro_batching_errors_name_the_key():
    micro = MicroBatching("actor_rollout_ref.actor.ppo_micro_batch_size_per_device", 3, None)
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.actor.ppo_micro_batch_size_per_device=3 does not divide"):
        micro.sequences_per_device(8, 100)


def test_resolve_takes_the_validated_tree():
    cfg = validate_config(apply_overrides(default_config(), [
        "actor_rollout_ref.model.path=tiny:llama", "data.tokenizer=tok", "data.train_files=x.parquet",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]), dp_size=1, check_paths=False)
    before = cfg.to_json_best_effort()
    spec = resolve(cfg, dp_size=1, num_train_samples=4096)
    assert cfg.to_json_best_effort() == before  # the caller's tree is not changed
    assert spec.trainer.total_steps == 4096 // 1024 * 30


LOWER_PACKAGES = ("data", "rewards", "sampler", "losses", "models", "hf", "sharding", "agents")


@pytest.mark.parametrize("package", LOWER_PACKAGES)
def test_lower_packages_never_read_a_config_tree(package):
    """Typed at the boundary: below trainer/ nothing imports ml_collections or the config package."""
    for path in sorted((PACKAGE / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith(("ml_collections", "jaxrl_llm.config", "jaxrl_llm.trainer")), \
                    f"{path.relative_to(PACKAGE)} imports {name}"


def test_rollout_engine_auto_is_paged_at_rl_lengths_and_static_for_short_responses():
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.sampler.engine.setup import AUTO_PAGED_MIN_NEW_TOKENS, EngineOptions, engine_spec

    assert AUTO_PAGED_MIN_NEW_TOKENS == 64
    assert _spec().rollout_engine.engine == "paged"  # the default: 512 new tokens
    assert _spec("data.max_response_length=64").rollout_engine.engine == "paged"
    assert _spec("data.max_response_length=63").rollout_engine.engine == "static"
    assert _spec("actor_rollout_ref.rollout.engine=static").rollout_engine.engine == "static"
    paged = _spec("actor_rollout_ref.rollout.engine=paged", "data.max_response_length=8")
    assert paged.rollout_engine.engine == "paged"
    assert EngineOptions().resolved(8, multi_turn=True).engine == "paged"  # multi-turn rollouts stream
    assert EngineOptions(engine="static").resolved(512, multi_turn=True).engine == "static"
    # rollout.paged_attention reaches the engine's programs
    opts = _spec("actor_rollout_ref.rollout.paged_attention=xla").rollout_engine
    cfg = ModelConfig.tiny("llama")
    spec = engine_spec(cfg, opts, num_requests=4, max_prompt_len=10, max_new_tokens=64, compute_dtype="float32")
    assert opts.attention_impl == "xla" and spec.attn_impl == "xla"
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.paged_attention='triton'"):
        _spec("actor_rollout_ref.rollout.paged_attention=triton")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.engine='vllm'"):
        _spec("actor_rollout_ref.rollout.engine=vllm")


def test_rollout_speculative_reaches_the_engine_spec():
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.sampler.engine.setup import engine_spec
    from jaxrl_llm.sampler.speculative import SpeculativeSpec

    key = "actor_rollout_ref.rollout.speculative"
    assert _spec().rollout_engine.speculative is None  # off by default
    opts = _spec(f"{key}.method=ngram", f"{key}.num_tokens=6", f"{key}.prompt_lookup_max=4",
                 "data.max_response_length=16").rollout_engine
    want = SpeculativeSpec("ngram", num_tokens=6, ngram_max=4, ngram_min=1)
    assert opts.speculative == want and opts.engine == "paged"  # short responses: auto still picks paged
    spec = engine_spec(ModelConfig.tiny("llama"), opts, num_requests=4, max_prompt_len=10, max_new_tokens=16,
                       compute_dtype="float32")
    assert spec.speculative == want
    with pytest.raises(ConfigError, match=rf"^actor_rollout_ref.rollout.engine='static': {key}.method='ngram'"):
        _spec(f"{key}.method=ngram", "actor_rollout_ref.rollout.engine=static")
    with pytest.raises(ConfigError, match=rf"^{key}.method='ngram': recording the experts"):
        _spec(f"{key}.method=ngram", "actor_rollout_ref.actor.router_replay=rollout")
    with pytest.raises(ConfigError, match=rf"^{key}.prompt_lookup_min=3: must be <= "):
        _spec(f"{key}.method=ngram", f"{key}.prompt_lookup_min=3", f"{key}.prompt_lookup_max=2")
    with pytest.raises(ConfigError, match=rf"{key}.method='eagle'"):
        _spec(f"{key}.method=eagle")
