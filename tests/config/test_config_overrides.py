"""Overrides, value parsing, aliases (TRL / ROLL / veRL *_per_gpu), torch-only keys, unknown keys."""
import logging

import pytest

from jaxrl_llm.config import (
    ConfigError,
    apply_overrides,
    default_config,
    normalize_config,
    parse_value,
    split_config_flag_overrides,
)


@pytest.mark.parametrize("text,expected", [
    ("1e-6", 1e-6), ("3", 3), ("-1", -1), ("0.28", 0.28), ("true", True), ("False", False),
    ("null", None), ("None", None), ("~", None), ("grpo", "grpo"), ("'error'", "error"), ('"a b"', "a b"),
    ("[console,wandb]", ["console", "wandb"]), ("['console', 'jsonl']", ["console", "jsonl"]),
    ("[0.9, 0.95]", [0.9, 0.95]), ("[]", []), ("[[1,2],[3]]", [[1, 2], [3]]),
    ("{rope_theta: 10000.0}", {"rope_theta": 10000.0}), ("token_k1,seq_max_k2", "token_k1,seq_max_k2"),
    ("0.5_2.0", "0.5_2.0"), ("0.5_2", "0.5_2"), ("1_000", "1_000"),
])
def test_parse_value(text, expected):
    value = parse_value(text)
    assert value == expected and type(value) is type(expected)


def test_overrides_set_values_with_field_types():
    cfg = apply_overrides(default_config(), [
        "actor_rollout_ref.actor.optim.lr=3e-6", "data.train_batch_size=64", "trainer.logger=console",
        "trainer.experiment_name=2024", "algorithm.adv_estimator=grpo", "data.val_files=null",
        "actor_rollout_ref.model.override_config.rope_theta=10000.0", "+trainer.val_before_train=false",
        "actor_rollout_ref.rollout.stop_token_ids=[2,7]",
    ])
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-6
    assert cfg.data.train_batch_size == 64
    assert cfg.trainer.logger == ["console"]
    assert cfg.trainer.experiment_name == "2024"
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.val_files is None
    assert cfg.actor_rollout_ref.model.override_config.rope_theta == 10000.0
    assert cfg.trainer.val_before_train is False
    assert cfg.actor_rollout_ref.rollout.stop_token_ids == [2, 7]


@pytest.mark.parametrize("alias,value,key", [
    ("rloo_k", "4", "actor_rollout_ref.rollout.n"),
    ("num_generations", "8", "actor_rollout_ref.rollout.n"),
    ("num_return_sequences_in_group", "6", "actor_rollout_ref.rollout.n"),
    ("rollout_batch_size", "32", "data.train_batch_size"),
    ("kl_coef", "0.05", "algorithm.kl_ctrl.kl_coef"),
    ("cliprange", "0.1", "actor_rollout_ref.actor.clip_ratio"),
    ("missing_eos_penalty", "1.0", "reward_model.missing_eos_penalty"),
    ("token_level_kl", "true", "algorithm.trl_rloo.token_level_kl"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "4",
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_device"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "9000",
     "actor_rollout_ref.actor.ppo_max_token_len_per_device"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "16",
     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device"),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "8192",
     "actor_rollout_ref.rollout.log_prob_max_token_len_per_device"),
    ("critic.ppo_micro_batch_size_per_gpu", "8", "critic.ppo_micro_batch_size_per_device"),
    ("critic.forward_micro_batch_size_per_gpu", "8", "critic.forward_micro_batch_size_per_device"),
    ("reward_model.micro_batch_size_per_gpu", "8", "reward_model.micro_batch_size_per_device"),
    ("actor_rollout_ref.actor.optim.warmup_style", "cosine", "actor_rollout_ref.actor.optim.lr_scheduler_type"),
])
def test_aliases_map_onto_our_keys(alias, value, key):
    cfg = apply_overrides(default_config(), [f"{alias}={value}"])
    node = cfg
    for part in key.split("."):
        node = node[part]
    assert node == parse_value(value)
    parent = cfg
    for part in alias.split(".")[:-1]:
        parent = parent[part]
    assert alias.rsplit(".", 1)[-1] not in parent  # the alias itself never lands in the tree


def test_torch_only_keys_warn_once_each_and_change_nothing(caplog):
    torch_keys = [
        "actor_rollout_ref.actor.fsdp_config.param_offload=True", "reward_model.model.fsdp_config.param_offload=True",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.free_cache_engine=True", "critic.ulysses_sequence_parallel_size=2",
        "trainer.nnodes=1", "trainer.n_gpus_per_node=8", "reward_model.model.use_remove_padding=True",
        "actor_rollout_ref.actor.strategy=fsdp", "critic.model.fsdp_config.param_offload=False",
        "trainer.balance_batch=True",
    ]
    reference = default_config().to_dict()
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.config.overrides"):
        cfg = apply_overrides(default_config(), torch_keys)
    assert cfg.to_dict() == reference
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == len(torch_keys)
    for item, message in zip(torch_keys, warned):
        assert item.split("=")[0] in message and "no effect in jaxrl_llm" in message


def test_verl_optimizer_offload_is_our_optim_offload():
    cfg = apply_overrides(default_config(), ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
                                             "critic.model.fsdp_config.optimizer_offload=True"])
    assert cfg.actor_rollout_ref.actor.optim.offload is True and cfg.critic.optim.offload is True
    assert "fsdp_config" not in cfg.actor_rollout_ref.actor and "fsdp_config" not in cfg.critic.model


def test_verl_ref_fsdp_param_offload_is_our_ref_param_offload():
    cfg = apply_overrides(default_config(), ["actor_rollout_ref.ref.fsdp_config.param_offload=True"])
    assert cfg.actor_rollout_ref.ref.param_offload is True and "fsdp_config" not in cfg.actor_rollout_ref.ref
    file_cfg = default_config()
    file_cfg.actor_rollout_ref.ref.fsdp_config = {"param_offload": True, "wrap_policy": {"min_num_params": 0}}
    assert normalize_config(file_cfg).actor_rollout_ref.ref.param_offload is True


@pytest.mark.parametrize("key,suggestion", [
    ("actor_rollout_ref.actor.ppo_mini_batch", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("algorithm.adv_estimater", "algorithm.adv_estimator"),
    ("data.max_respons_length", "data.max_response_length"),
    ("actor.optim.lr", "actor_rollout_ref.actor.optim.lr"),  # same leaf under its real section
    ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_device"),
])
def test_unknown_key_suggests_close_match(key, suggestion):
    with pytest.raises(ConfigError) as err:
        apply_overrides(default_config(), [f"{key}=1"])
    message = str(err.value)
    assert message.startswith(f"{key}: unknown config key") and suggestion in message


def test_override_without_equals_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"^override 'data.shuffle': expected key=value"):
        apply_overrides(default_config(), ["data.shuffle"])


def test_normalize_config_resolves_names_written_by_a_config_file(caplog):
    cfg = default_config()
    cfg.num_generations = 8  # TRL name at top level
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    cfg.actor_rollout_ref.actor.fsdp_config = {"param_offload": True}
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.config.overrides"):
        cfg = normalize_config(cfg)
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_device == 2
    assert "num_generations" not in cfg and "fsdp_config" not in cfg.actor_rollout_ref.actor
    assert "ppo_micro_batch_size_per_gpu" not in cfg.actor_rollout_ref.actor
    assert len(caplog.records) == 1
    cfg.data.shufle = True
    with pytest.raises(ConfigError, match=r"^data.shufle: unknown config key; did you mean data.shuffle"):
        normalize_config(cfg)


def test_split_config_flag_overrides_handles_absl_spellings():
    argv = ["train.py", "--config=configs/x.py", "--config.data.shuffle=false", "--config.trainer.seed", "3",
            "--config.trainer.val_only", "--noconfig.data.return_raw_chat", "--dry_run", "--", "a.b=c"]
    rest, overrides = split_config_flag_overrides(argv)
    assert rest == ["train.py", "--config=configs/x.py", "--dry_run", "--", "a.b=c"]
    assert overrides == ["data.shuffle=false", "trainer.seed=3", "trainer.val_only=true", "data.return_raw_chat=false"]


def test_a_bare_value_is_wrapped_only_where_the_key_does_not_take_it():
    from jaxrl_llm.config import default_config
    from jaxrl_llm.config.overrides import apply_overrides

    cfg = apply_overrides(default_config(), ["mesh.rollout_devices=4", "trainer.logger=console"])
    assert cfg.mesh.rollout_devices == 4  # a device count, not the device id list [4]
    assert cfg.trainer.logger == ["console"]
