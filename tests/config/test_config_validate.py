"""validate_config: derived values, batch arithmetic, and one message naming the key per failure."""
import json

import pytest

from jaxrl_llm.config import (
    ConfigError,
    apply_overrides,
    default_config,
    resolve_batch_plan,
    resolve_total_steps,
    validate_config,
)
from jaxrl_llm.models import ModelConfig


def _cfg(*overrides):
    base = ["actor_rollout_ref.model.path=tiny:llama", "data.tokenizer=tok", "data.train_files=train.parquet",
            "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=4", "data.max_prompt_length=64", "data.max_response_length=32"]
    return apply_overrides(default_config(), base + list(overrides))


def _validate(cfg, dp=2, **kw):
    kw.setdefault("check_paths", False)
    return validate_config(cfg, dp_size=dp, **kw)


def test_derived_values():
    cfg = _validate(_cfg("actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                         "trainer.project_name=p", "trainer.experiment_name=e"))
    a, arr = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref
    assert (a.clip_ratio_low, a.clip_ratio_high) == (0.3, 0.28)
    assert a.ppo_micro_batch_size_per_device == 8 * 4 // 2  # whole per-device mini-batch
    assert arr.ref.log_prob_micro_batch_size_per_device == 16
    assert arr.rollout.log_prob_micro_batch_size_per_device == 16
    assert arr.rollout.response_length == 32
    assert cfg.data.val_batch_size is None  # veRL: the whole validation set in one batch
    assert cfg.critic.enable is True  # adv_estimator defaults to gae
    assert cfg.critic.model.path == "tiny:llama" and cfg.critic.ppo_mini_batch_size == 8
    assert cfg.critic.loss_agg_mode == "token-mean" and cfg.critic.ppo_epochs == 1
    assert cfg.trainer.default_local_dir == "checkpoints/p/e"
    assert cfg.reward_model.reward_kwargs.max_resp_len == 32 and cfg.reward_model.max_length == 96
    grpo = _validate(_cfg("algorithm.adv_estimator=grpo"))
    assert grpo.critic.enable is False


def test_the_peer_feature_keys_reach_the_run_spec():
    """The keys of open-r1's reward functions, pf-PPO, TRL's truncation mask and LoRA dropout resolve into
    the specs the reward manager, the trainer and the update read."""
    from jaxrl_llm.config.resolve import resolve_advantage, resolve_reward

    cfg = _validate(_cfg("custom_reward_function.reward_funcs=[accuracy,cosine]",
                         "custom_reward_function.reward_weights=[1.0,0.5]",
                         "custom_reward_function.openr1.cosine_max_len=500",
                         "custom_reward_function.openr1.repetition_n_grams=4",
                         "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min",
                         "algorithm.pf_ppo.weight_pow=1.5", "algorithm.mask_truncated_completions=true",
                         "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_dropout=0.1"))
    named = resolve_reward(cfg).named
    assert named is not None and (named.funcs, named.weights) == (("accuracy", "cosine"), (1.0, 0.5))
    assert (named.cosine_max_len, named.repetition_n_grams) == (500, 4)
    adv = resolve_advantage(cfg)
    assert adv.pf_ppo == ("max_min", 1.5) and adv.mask_truncated
    from jaxrl_llm.config import resolve as resolve_spec

    spec = resolve_spec(cfg, dp_size=2)
    assert spec.model.lora is not None and spec.model.lora.dropout == 0.1
    plain = _validate(_cfg())
    assert resolve_reward(plain).named is None and resolve_advantage(plain).pf_ppo is None


def test_policy_loss_keys_reach_the_actor_spec_and_misuse_is_refused():
    """m2po with its threshold (bypass mode: the sampler's log-probs are the old ones), the policy loss's own
    aggregation and its dual clip reach ActorSpec; each key where it cannot act is an error naming it."""
    from jaxrl_llm.config import resolve as resolve_spec

    a = "actor_rollout_ref.actor."
    spec = resolve_spec(_validate(_cfg(f"{a}policy_loss.loss_mode=m2po", f"{a}m2_threshold=0.1",
                                       "algorithm.rollout_correction.bypass_mode=true")), dp_size=2)
    assert (spec.actor.loss_mode, spec.actor.loss_kwargs) == ("m2po", (("m2_threshold", 0.1),))
    assert not spec.recompute_old_log_probs and not spec.actor.old_log_probs_from_update
    spec = resolve_spec(_validate(_cfg(f"{a}policy_loss.loss_mode=gspo", f"{a}policy_loss.loss_agg_mode=token-mean",
                                       f"{a}policy_loss.dual_clip=true")), dp_size=2)
    assert (spec.actor.policy_loss_agg_mode, spec.actor.dual_clip) == ("token-mean", True)
    for overrides, match in [
        ([f"{a}policy_loss.loss_mode=m2po"], "set algorithm.rollout_correction.bypass_mode=true"),
        ([f"{a}policy_loss.loss_mode=m2po", "algorithm.rollout_correction.bypass_mode=true",
          "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_dropout=0.05"], "lora_dropout=0.05"),
        ([f"{a}policy_loss.loss_mode=geo_mean", f"{a}policy_loss.loss_agg_mode=token-mean"], "one number per sequence"),
        ([f"{a}policy_loss.loss_mode=sapo", f"{a}policy_loss.dual_clip=true"], "'sapo' has no dual clip"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _validate(_cfg(*overrides))


def test_validate_returns_a_copy_and_is_idempotent():
    cfg = _cfg("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1")
    before = cfg.to_dict()
    once = _validate(cfg, num_train_samples=100)
    assert cfg.to_dict() == before
    assert _validate(once, num_train_samples=100).to_dict() == once.to_dict()
    assert once.trainer.total_training_steps == (100 // 16) * 30
    assert once.actor_rollout_ref.actor.optim.total_training_steps == 180
    assert once.actor_rollout_ref.actor.optim.lr_warmup_steps == 18


def test_resolve_total_steps_respects_max_samples_and_explicit_steps():
    cfg = _validate(_cfg("algorithm.adv_estimator=grpo", "data.train_max_samples=40", "trainer.total_epochs=2"))
    assert resolve_total_steps(cfg, 1000).trainer.total_training_steps == (40 // 16) * 2
    fixed = _validate(_cfg("algorithm.adv_estimator=grpo", "trainer.total_training_steps=7"))
    assert fixed.actor_rollout_ref.actor.optim.total_training_steps == 7
    with pytest.raises(ConfigError, match=r"^data.train_batch_size=16 is larger than the 10 training prompts"):
        resolve_total_steps(fixed, 10)


def test_batch_plan_numbers():
    cfg = _validate(_cfg("data.train_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                         "actor_rollout_ref.actor.ppo_epochs=2", "algorithm.adv_estimator=grpo"), dp=4)
    plan = resolve_batch_plan(cfg, 4)
    assert (plan.sequences, plan.sequences_per_device, plan.max_tokens_per_step) == (128, 32, 128 * 96)
    a = plan.actor
    assert (a.mini_batches, a.mini_batch_sequences, a.per_device, a.accumulation_steps, a.optimizer_steps) == \
        (4, 32, 8, 2, 8)
    assert plan.critic is None
    text = plan.summary()
    assert "32 prompts x n=4 = 128 sequences per step; data-parallel size 4 -> 32 sequences/device" in text
    assert "micro-batch 4/device -> 2 accumulation step(s)" in text


@pytest.mark.parametrize("overrides,dp,prefix", [
    (["algorithm.adv_estimator=grpoo"], 2, "algorithm.adv_estimator='grpoo': unknown name; valid: "),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=ppo"], 2, "actor_rollout_ref.actor.policy_loss.loss_mode='ppo'"),
    (["actor_rollout_ref.actor.kl_loss_type=k4"], 2, "actor_rollout_ref.actor.kl_loss_type='k4'"),
    (["algorithm.kl_penalty=bogus"], 2, "algorithm.kl_penalty='bogus'"),
    (["actor_rollout_ref.actor.loss_agg_mode=mean"], 2, "actor_rollout_ref.actor.loss_agg_mode='mean'"),
    (["reward_model.reward_manager=fast"], 2, "reward_model.reward_manager='fast'"),
    (["data.synthetic.task=divide"], 2,
     "data.synthetic.task='divide': unknown name; valid: add, guess, larger, multiply, repeat"),
    (["data.truncation=cut"], 2, "data.truncation='cut'"),
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=polynomial"], 2,
     "actor_rollout_ref.actor.optim.lr_scheduler_type='polynomial'"),
    (["trainer.resume_mode=latest"], 2, "trainer.resume_mode='latest'"),
    (["trainer.logger=[console,mlflow]"], 2, "trainer.logger: unknown sink 'mlflow'"),
    (["actor_rollout_ref.model.path=tiny:gpt2"], 2, "actor_rollout_ref.model.path='tiny:gpt2'"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=5"], 2,
     "actor_rollout_ref.actor.ppo_mini_batch_size=5: must divide data.train_batch_size=16"),
    (["actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=1"], 2,
     "actor_rollout_ref.actor.ppo_mini_batch_size=1: 1 prompts x rollout.n=3 = 3 sequences do not split over "
     "the data-parallel size 2"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_device=3"], 2,
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=3: must divide the per-device mini-batch"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_device=4",
      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5"], 2,
     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device=5: must divide the per-device batch"),
    (["critic.ppo_micro_batch_size_per_device=3"], 2, "critic.ppo_micro_batch_size_per_device=3"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_device=50",
      "algorithm.adv_estimator=grpo"], 2, "actor_rollout_ref.actor.ppo_max_token_len_per_device=50: smaller than"),
    (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"], 2, "actor_rollout_ref.rollout.n=1:"),
    (["actor_rollout_ref.rollout.response_length=16"], 2, "actor_rollout_ref.rollout.response_length=16 differs"),
    (["actor_rollout_ref.actor.clip_ratio_c=0.5"], 2, "actor_rollout_ref.actor.clip_ratio_c=0.5: must be > 1"),
    (["actor_rollout_ref.rollout.top_p=0"], 2, "actor_rollout_ref.rollout.top_p=0.0: must be in (0, 1]"),
    (["actor_rollout_ref.actor.optim.lr=-1"], 2, "actor_rollout_ref.actor.optim.lr=-1.0: must be > 0"),
    (["actor_rollout_ref.actor.optim.betas=[0.9]"], 2, "actor_rollout_ref.actor.optim.betas=[0.9]"),
    (["data.train_batch_size=abc"], 2, "data.train_batch_size='abc': expected int, got str"),
    (["actor_rollout_ref.actor.use_kl_loss=1"], 2, "actor_rollout_ref.actor.use_kl_loss=1: expected bool"),
    (["data.max_prompt_length=200"], 2, "data.max_prompt_length=200: prompt + response (200 + 32 = 232) "
                                         "exceeds the model context of 128 positions"),
    (["algorithm.rollout_correction.rollout_rs=token_k9", "algorithm.rollout_correction.rollout_rs_threshold=2"],
     2, "algorithm.rollout_correction.rollout_rs: unknown mode 'token_k9'"),
    (["algorithm.rollout_correction.rollout_rs=token_k1"], 2,
     "algorithm.rollout_correction.rollout_rs_threshold=None: required"),
    (["algorithm.rollout_correction.rollout_rs=seq_max_k2",
      "algorithm.rollout_correction.rollout_rs_threshold=0.5_2"], 2,
     "algorithm.rollout_correction.rollout_rs_threshold='0.5_2'"),
    (["trainer.resume_mode=resume_path"], 2, "trainer.resume_from_path=None: required"),
    (["algorithm.adv_estimator=trl_rloo", "algorithm.use_kl_in_reward=true"], 2,
     "algorithm.use_kl_in_reward=True: adv_estimator='trl_rloo' folds the KL"),
    (["critic.enable=false"], 2, "critic.enable=False: algorithm.adv_estimator='gae' needs a critic"),
    (["reward_model.reward_kwargs.overlong_buffer_cfg.enable=true"], 2,
     "reward_model.reward_kwargs.overlong_buffer_cfg.len=4096: must be shorter than max_resp_len=32"),
    (["mesh.data=-1"], None, "mesh.fsdp=-1: only one mesh axis may be -1 (also mesh.data=-1)"),
    (["actor_rollout_ref.actor.kl_loss_type=full"], 2,
     "actor_rollout_ref.actor.kl_loss_type='full': the exact vocabulary KL is not available in the training step"),
    (["algorithm.kl_penalty=full"], 2, "algorithm.kl_penalty='full': the exact vocabulary KL"),
    (["mesh.tensor=3"], None, "mesh.tensor=3 does not divide the 8 available devices"),
    (["actor_rollout_ref.model.path=null"], 2, "actor_rollout_ref.model.path=None: set the policy"),
    (["data.tokenizer=null"], 2, "data.tokenizer=None: a tiny:llama model needs a tokenizer path"),
    (["actor_rollout_ref.model.tiny.num_experts=4"], 2,
     "actor_rollout_ref.model.tiny.num_experts=4: only a tiny mixture-of-experts model reads it"),
    (["actor_rollout_ref.actor.router_replay=always"], 2, "actor_rollout_ref.actor.router_replay='always'"),
    (["algorithm.adv_estimator=grpo", "algorithm.use_pf_ppo=true"], 2,
     "algorithm.use_pf_ppo=True with adv_estimator='grpo': veRL resamples the rows after GAE only"),
    (["algorithm.pf_ppo.reweight_method=top"], 2, "algorithm.pf_ppo.reweight_method='top'"),
    (["custom_reward_function.reward_funcs=[accuracy,fmt]"], 2,
     "custom_reward_function.reward_funcs: 'fmt' is not one of accuracy, format"),
    (["custom_reward_function.reward_funcs=[accuracy,format]", "custom_reward_function.reward_weights=[1.0]"], 2,
     "custom_reward_function.reward_weights=[1.0]: 1 weights for 2 reward_funcs"),
])
def test_each_failure_is_one_message_naming_the_key(overrides, dp, prefix):
    cfg = _cfg("actor_rollout_ref.model.tiny.max_position_embeddings=128", *overrides)
    with pytest.raises(ConfigError) as err:
        if dp is None:
            validate_config(cfg, num_devices=8, check_paths=False)
        else:
            _validate(cfg, dp=dp)
    message = str(err.value)
    assert message.startswith(prefix), message
    assert "\n" not in message


def test_model_max_positions_argument():
    cfg = _cfg("actor_rollout_ref.model.path=/m.gguf", "algorithm.adv_estimator=grpo")
    _validate(cfg, model_max_positions=96)
    with pytest.raises(ConfigError, match=r"^data.max_prompt_length=64: .* exceeds the model context of 95"):
        _validate(cfg, model_max_positions=95)


def test_mesh_sizes_give_dp_size():
    cfg = _cfg("algorithm.adv_estimator=grpo", "mesh.data=2", "mesh.fsdp=-1", "mesh.tensor=2")
    out = validate_config(cfg, num_devices=8, check_paths=False)
    assert out.actor_rollout_ref.actor.ppo_micro_batch_size_per_device == 8 * 4 // 4  # dp = 2 x 2


def test_paths_must_exist(tmp_path):
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    model = tmp_path / "model"  # an HF folder as validation sees one: config.json, weights, tokenizer
    model.mkdir()
    (model / "config.json").write_text(json.dumps(ModelConfig.tiny(max_position_embeddings=4096).to_hf_config()))
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    ok = _cfg(f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}", "algorithm.adv_estimator=grpo",
              "data.tokenizer=null")  # derived: the model path
    validate_config(ok, dp_size=2)
    cases = [
        (f"data.train_files={tmp_path}/missing.parquet", "data.train_files="),
        (f"data.val_files=[{train},{tmp_path}/nope.jsonl]", "data.val_files="),
        (f"actor_rollout_ref.model.path={tmp_path}/missing", "actor_rollout_ref.model.path="),
        (f"custom_reward_function.path={tmp_path}/reward.py", "custom_reward_function.path="),
        (f"data.tokenizer={tmp_path}/tok", "data.tokenizer="),
    ]
    for override, prefix in cases:
        with pytest.raises(ConfigError) as err:
            validate_config(apply_overrides(ok.copy_and_resolve_references(), [override]), dp_size=2)
        assert str(err.value).startswith(prefix) and "not found" in str(err.value)


def test_synthetic_task_derives_data_files_and_steps(tmp_path):
    (tmp_path / "tok.gguf").write_bytes(b"")
    cfg = _cfg("data.train_files=null", f"data.tokenizer={tmp_path}/tok.gguf", "data.synthetic.task=add",
               "data.synthetic.n_train=64",
               "trainer.default_local_dir=/tmp/run", "trainer.total_epochs=2", "algorithm.adv_estimator=grpo")
    out = validate_config(cfg, dp_size=2)  # paths checked: synthetic files are written by the trainer
    assert out.data.train_files == "/tmp/run/data/train.parquet"
    assert out.data.val_files == "/tmp/run/data/test.parquet"
    assert out.trainer.total_training_steps == (64 // 16) * 2


def _declared() -> list[tuple[str, object]]:
    """(key, a value its Field's declared choices or bounds refuse) for every key that declares some."""
    from jaxrl_llm.config.overrides import FIELDS

    out = []
    for key, f in FIELDS.items():
        if f.names() is not None:
            out.append((key, "no_such_name"))
        elif f.gt is not None or f.ge is not None:  # the lower bound itself, or one below it
            out.append((key, f.gt if f.gt is not None else f.ge - 1))
        elif f.le is not None or f.lt is not None:
            out.append((key, (f.le if f.le is not None else f.lt) + 1))
    return out


@pytest.mark.parametrize("key,bad", _declared(), ids=[k for k, _ in _declared()])
def test_declared_choices_and_bounds_are_enforced(key, bad):
    """Every key's choices / bounds declared on its Field (config/tree.py) refuse a value outside them,
    in one message naming the key and what is allowed; docs/config.md shows the same rule."""
    from jaxrl_llm.config.overrides import FIELDS

    f = FIELDS[key]
    assert bad not in f.also
    cfg = _cfg(f"{key}={bad}")
    with pytest.raises(ConfigError) as err:
        _validate(cfg)
    message = str(err.value)
    assert message.startswith(f"{key}="), message
    rule = "unknown name; valid: " if f.names() is not None else f"must be {f.range_text()}"
    assert rule in message, message
    _validate(_cfg())  # the defaults (and this base config) pass every declared rule
