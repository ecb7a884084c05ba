"""Config importers: veRL, Trinity-RFT, ROLL and TRL configs -> our tree (jaxrl_llm.config.importers).

Each fixture under tests/config/fixtures/ is a realistic GSM8K run in the other framework's format;
the tests check the resolved values of the keys that decide the run, the single warning listing
the ignored keys, an error naming the file and the key for each meaning-changing setting, and
`launch/train.py --import_config=... --dry_run` end to end.
"""
import importlib.util
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import yaml
from compile_flags import cpu_devices_flags

from jaxrl_llm.config import ConfigError, apply_overrides, default_config, validate_config
from jaxrl_llm.config.importers import (
    NO_DUAL_CLIP,
    detect_format,
    import_config,
    import_trl_flags,
    load_yaml,
    parse_trl_args,
    split_trl_flags,
)
from jaxrl_llm.config.importers.roll import device_count
from jaxrl_llm.config.importers.trinity_data import taskset_files
from jaxrl_llm.config.resolve import resolve_batch_plan, resolve_data
from jaxrl_llm.data.domains import domain_counts

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "config" / "fixtures"
VERL, TRINITY, ROLL, TRL = (str(FIX / f) for f in ("verl_grpo_gsm8k.yaml", "trinity_grpo_gsm8k.yaml",
                                                    "roll_rlvr_gsm8k.yaml", "trl_grpo_gsm8k.yaml"))
A, R, M = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MODEL_ROOT", raising=False)
    return tmp_path


def variant(path, tmp_path, changes, name="variant.yaml"):
    """The fixture (interpolations kept) with dotted keys changed (value None deletes); returns the new path."""
    data = yaml.safe_load(pathlib.Path(path).read_text())
    for key, value in changes.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    out = tmp_path / name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(out)


def values(result, *keys):
    return tuple(result.settings[k] for k in keys)


def load_config_file(name):
    spec = importlib.util.spec_from_file_location(f"config_{name}", ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


# ---------------------------------------------------------------- veRL


def test_verl_ppo_trainer_yaml(home):
    r = import_config(VERL, dp_size=4)
    s = r.settings
    assert r.format == "verl"
    assert s["data.train_files"] == f"{home}/data/gsm8k/train.parquet"  # ${oc.env:HOME}
    assert s["data.val_files"] == f"{home}/data/gsm8k/test.parquet"
    assert s["actor_rollout_ref.model.path"] == f"{home}/models/Qwen2.5-0.5B-Instruct"  # ${oc.env:MODEL_ROOT,...}
    assert values(r, "data.train_batch_size", f"{A}.ppo_mini_batch_size", f"{A}.ppo_micro_batch_size_per_device",
                  f"{R}.n", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device") == (1024, 256, 16, 5, 32)
    assert values(r, "data.max_prompt_length", "data.max_response_length") == (512, 1024)
    # vLLM engine keys that the paged rollout engine implements are imported, not ignored
    assert values(r, f"{R}.gpu_memory_utilization", f"{R}.max_num_seqs", f"{R}.max_num_batched_tokens") == (
        0.6, 1024, 8192)
    assert values(r, f"{A}.optim.lr", f"{A}.clip_ratio_low", f"{A}.clip_ratio_high", f"{A}.clip_ratio_c") == (
        1e-6, 0.2, 0.28, 3.0)
    assert values(r, f"{A}.use_kl_loss", f"{A}.kl_loss_coef", f"{A}.kl_loss_type") == (True, 0.001, "low_var_kl")
    assert values(r, "algorithm.adv_estimator", f"{A}.loss_agg_mode", f"{A}.optim.lr_scheduler_type") == (
        "grpo", "token-mean", "constant")  # warmup_style -> lr_scheduler_type
    assert values(r, "trainer.total_epochs", "trainer.save_freq", "trainer.test_freq") == (15, 20, 5)
    # veRL interpolations of the keys our tree derives the same way stay derived (None until validation)
    for key in (f"{R}.response_length", "critic.model.path", "critic.ppo_mini_batch_size",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_device", "trainer.default_local_dir"):
        assert key not in s
    # wandb kept where installed, else listed in the warning (a logging backend changes nothing computed)
    assert s["trainer.logger"] == ["console", "jsonl"] + (["wandb"] if importlib.util.find_spec("wandb") else [])
    # the rollout engine's TP is its layout: warned with its value, never the training mesh's tensor axis
    assert "mesh.tensor" not in s  # (2 here: veRL's default, so not even listed)
    for key, value in (("actor_rollout_ref.rollout.enforce_eager", True), ("critic.rollout_n", 5)):
        assert r.values[key] == value and f"{key}={value}" in r.warning()  # listed with the value
    # veRL's FSDP spelling of our reference offload maps from YAML as it does pasted (before: warned)
    assert s["actor_rollout_ref.ref.param_offload"] is True
    # at veRL's default: what jaxrl_llm computes, dropped without a line
    for key in ("trainer.nnodes", "data.reward_fn_key", "algorithm.pf_ppo.weight_pow",
                "actor_rollout_ref.actor.fsdp_config.param_offload"):
        assert key not in r.ignored
    assert not set(r.ignored) & {k for k in r.origin.values()}
    cfg = r.config()
    assert apply_overrides(default_config(), r.overrides()).to_dict() == cfg.to_dict()  # as key=value strings
    cfg.trainer.logger = ["console"]
    out = validate_config(cfg, dp_size=4, check_paths=False)
    assert out.actor_rollout_ref.actor.clip_ratio_high == 0.28 and out.critic.enable is False
    assert out.actor_rollout_ref.rollout.response_length == 1024
    assert out.critic.model.path == s["actor_rollout_ref.model.path"]
    assert out.actor_rollout_ref.ref.log_prob_max_token_len_per_device == 16384
    assert out.trainer.default_local_dir == "checkpoints/verl_grpo_example_gsm8k/qwen2_5_0_5b_grpo"
    cfg.data.max_response_length = 2048  # a later override carries over, as veRL's ${data.max_response_length}
    assert validate_config(cfg, dp_size=4, check_paths=False).actor_rollout_ref.rollout.response_length == 2048


def test_verl_env_default_aliases_and_special_keys(home, monkeypatch, tmp_path):
    monkeypatch.setenv("MODEL_ROOT", "/models")
    path = variant(VERL, tmp_path, {"actor_rollout_ref.actor.ppo_micro_batch_size": 64,
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
                                    "actor_rollout_ref.actor.fsdp_config.fsdp_size": 4,
                                    "reward_model.reward_manager": "dapo",
                                    "actor_rollout_ref.actor.optim.clip_grad": 0.5,
                                    "actor_rollout_ref.actor.grad_clip": None})
    s = import_config(path, dp_size=8).settings
    assert s["actor_rollout_ref.model.path"] == "/models/Qwen2.5-0.5B-Instruct"
    assert s[f"{A}.ppo_micro_batch_size_per_device"] == 8  # deprecated global 64 over 8 devices
    assert (s["mesh.fsdp"], s["mesh.data"]) == (4, -1)  # HSDP groups of fsdp_size
    assert s["reward_model.reward_manager"] == "naive" and s[f"{A}.grad_clip"] == 0.5


@pytest.mark.parametrize("spelling", ["ulysses_sequence_parallel_size", "fsdp_config.ulysses_sequence_parallel_size"])
def test_verl_ulysses_sequence_parallelism_is_mesh_context(home, tmp_path, spelling):
    """veRL's sp groups are our context groups: the actor's sp sets mesh.context, its per-GPU micro-batches
    (per sp group) stay, its token budgets hold sp x the per-GPU tokens; a critic of sp 2 on the sp-4 mesh
    has two of its groups in each context group, and the per-GPU tokens on each of the group's devices."""
    path = variant(VERL, tmp_path, {f"{A}.{spelling}": 4, "critic.ulysses_sequence_parallel_size": 2,
                                    f"{A}.ppo_micro_batch_size_per_gpu": 8, "critic.ppo_micro_batch_size_per_gpu": 8,
                                    "critic.enable": True})
    s = import_config(path, num_devices=8).settings
    assert s["mesh.context"] == 4
    assert s[f"{A}.ppo_micro_batch_size_per_device"] == 8
    assert s[f"{A}.ppo_max_token_len_per_device"] == 4 * 16384
    assert s[f"{R}.log_prob_max_token_len_per_device"] == 4 * 16384  # the reference's sp defaults to the actor's
    assert s["critic.ppo_micro_batch_size_per_device"] == 16 and s["critic.ppo_max_token_len_per_device"] == 4 * 32768
    # an sp size the devices cannot hold is reduced, and said so
    s = import_config(variant(VERL, tmp_path, {f"{A}.{spelling}": 4}), num_devices=2).settings
    assert s["mesh.context"] == 2


def test_trinity_and_roll_sequence_parallelism_is_mesh_context(home, tmp_path):
    s = import_config(variant(TRINITY, tmp_path, {"trainer.ulysses_sequence_parallel_size": 2}), num_devices=8).settings
    assert s["mesh.context"] == 2
    s = import_config(variant(ROLL, tmp_path, {"actor_train.model_args.ulysses_size": 2}), num_devices=8).settings
    assert s["mesh.context"] == 2


def test_ulysses_override_is_mesh_context():
    for key in ("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"):
        assert apply_overrides(default_config(), [f"{key}=4"]).mesh.context == 4


def test_verl_lora_keys_map_to_ours(home, tmp_path):
    path = variant(VERL, tmp_path, {"actor_rollout_ref.model.lora_rank": 32, "actor_rollout_ref.model.lora_alpha": 64,
                                    "actor_rollout_ref.model.target_modules": ["q_proj", "v_proj"]})
    s = import_config(path, dp_size=4).settings
    assert (s["actor_rollout_ref.model.lora_rank"], s["actor_rollout_ref.model.lora_alpha"]) == (32, 64)
    assert s["actor_rollout_ref.model.target_modules"] == ["q_proj", "v_proj"]


def test_verl_unresolved_interpolation_is_an_error_only_where_used(home, tmp_path):
    path = variant(VERL, tmp_path, {"actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap":
                                    "${oc.env:JAXRL_NO_SUCH_VAR}"})
    assert "actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap" in import_config(
        path, dp_size=4).ignored
    path = variant(VERL, tmp_path, {"data.train_files": "${oc.env:JAXRL_NO_SUCH_VAR}/train.parquet"})
    with pytest.raises(ConfigError, match=r"variant.yaml: data.train_files: cannot resolve .*JAXRL_NO_SUCH_VAR"):
        import_config(path, dp_size=4)


@pytest.mark.parametrize("key,value,why", [
    ("algorithm.adv_estimator", "my_estimator", "not available in jaxrl_llm"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode", "clip_cov", "not available in jaxrl_llm"),
    ("actor_rollout_ref.actor.optim.optimizer", "SGD", "AdamW"),
    ("algorithm.rollout_correction.loss_type", "dppo", "ppo_clip or reinforce"),
])
def test_verl_meaning_changing_keys_are_errors(home, tmp_path, key, value, why):
    with pytest.raises(ConfigError) as err:
        import_config(variant(VERL, tmp_path, {key: value}), dp_size=4)
    assert str(err.value).startswith(f"{tmp_path}/variant.yaml: {key}") and why in str(err.value)


def test_verl_pf_ppo_keys_are_ours(home, tmp_path):
    s = import_config(variant(VERL, tmp_path, {"algorithm.use_pf_ppo": True, "algorithm.pf_ppo.reweight_method":
                                               "max_min", "algorithm.pf_ppo.weight_pow": 1.5}), dp_size=4)
    assert values(s, "algorithm.use_pf_ppo", "algorithm.pf_ppo.reweight_method", "algorithm.pf_ppo.weight_pow") == (
        True, "max_min", 1.5)


def test_rollout_correction_loss_type(home, tmp_path):
    """Bypass mode's reinforce loss imports from veRL; pasted without bypass mode it is refused by name."""
    rc = "algorithm.rollout_correction."
    s = import_config(variant(VERL, tmp_path, {rc + "bypass_mode": True, rc + "loss_type": "reinforce",
                                               rc + "rollout_is": "sequence"}), dp_size=4)
    assert values(s, rc + "bypass_mode", rc + "loss_type", rc + "rollout_is") == (True, "reinforce", "sequence")
    cfg = apply_overrides(default_config(), ["algorithm.rollout_correction.loss_type=ppo_clip"])
    assert cfg.algorithm.rollout_correction.loss_type == "ppo_clip"
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction.loss_type='reinforce' is bypass mode's"):
        validate_config(apply_overrides(default_config(), ["algorithm.rollout_correction.loss_type=reinforce"]),
                        dp_size=1, check_paths=False)


def test_verl_multi_turn_keys_map_to_ours(home, tmp_path):
    s = import_config(variant(VERL, tmp_path, {"actor_rollout_ref.rollout.multi_turn.enable": True,
                                               "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
                                               "actor_rollout_ref.rollout.multi_turn.format": "hermes"}),
                      dp_size=4).settings
    assert s["actor_rollout_ref.rollout.multi_turn.enable"] is True
    assert s["actor_rollout_ref.rollout.multi_turn.max_assistant_turns"] == 3


def test_import_warns_once(home, caplog):
    r = import_config(VERL, dp_size=4)
    with caplog.at_level(logging.WARNING):
        r.warn()
    records = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(records) == 1 and f"{len(r.ignored)} key(s) change nothing" in records[0].getMessage()


# ---------------------------------------------------------------- Trinity-RFT


def test_trinity_grpo_like_the_alignment_guide(home):
    (home / "data" / "gsm8k").mkdir(parents=True)
    (home / "data" / "gsm8k" / "train-00000-of-00001.parquet").touch()  # a HF-style split file is found
    r = import_config(TRINITY, dp_size=4)
    s = r.settings
    assert r.format == "trinity"
    # the guide: veRL train_batch_size = batch_size x sync_interval, mini-batch = batch_size (= 2048 / 8)
    assert values(r, "data.train_batch_size", f"{A}.ppo_mini_batch_size", f"{R}.n") == (1024, 256, 8)
    assert values(r, "trainer.test_freq", "trainer.save_freq", "trainer.total_epochs") == (5, 20, 15)
    assert s["data.train_files"] == f"{home}/data/gsm8k/train-00000-of-00001.parquet"
    assert s["data.val_files"] == f"{home}/data/gsm8k/test.parquet"  # no file found: veRL's layout
    assert values(r, "data.max_prompt_length", "data.max_response_length", "data.filter_overlong_prompts") == (
        512, 1024, True)
    assert values(r, f"{A}.optim.lr", f"{A}.optim.lr_warmup_steps_ratio", f"{A}.clip_ratio",
                  f"{A}.clip_ratio_high") == (1e-6, 0.05, 0.2, 0.28)
    assert values(r, f"{A}.use_kl_loss", f"{A}.kl_loss_type", f"{A}.kl_loss_coef", "algorithm.use_kl_in_reward") == (
        True, "low_var_kl", 0.001, False)
    assert values(r, "algorithm.adv_estimator", f"{A}.loss_agg_mode", f"{A}.policy_loss.loss_mode") == (
        "grpo", "token-mean", "vanilla")
    assert values(r, f"{A}.use_dynamic_bsz", f"{A}.ppo_max_token_len_per_device",
                  f"{A}.ppo_micro_batch_size_per_device") == (True, 24000, 8)  # micro from trainer_config
    assert values(r, f"{R}.val_kwargs.n", f"{R}.val_kwargs.temperature", f"{R}.val_kwargs.top_p",
                  f"{R}.val_kwargs.do_sample") == (4, 0.6, 0.95, True)
    assert s["trainer.default_local_dir"] == f"{home}/checkpoints/verl_grpo_example_gsm8k/qwen2_5_0_5b_grpo"
    assert values(r, "trainer.logger", "trainer.resume_mode", "trainer.val_before_train") == (
        ["console", "jsonl", "tensorboard"], "auto", False)
    assert "mesh.tensor" not in s and r.values["explorer.rollout_model.tensor_parallel_size"] == 2
    for key in ("trainer.trainer_config.actor_rollout_ref.rollout.n", "synchronizer.sync_method",
                "cluster.gpu_per_node"):
        assert key in r.ignored
    assert s["actor_rollout_ref.ref.param_offload"] is True  # veRL's fsdp_config spelling, inside trainer_config
    # veRL's default (fsdp param_offload False) changes nothing and is not listed
    assert "trainer.trainer_config.actor_rollout_ref.actor.fsdp_config.param_offload" not in r.ignored
    assert validate_config(r.config(), dp_size=4, check_paths=False).data.train_batch_size == 1024


def test_trinity_defaults_of_the_algorithm_type(home, tmp_path):
    path = variant(TRINITY, tmp_path, {"algorithm": {"algorithm_type": "grpo"}, "trainer.trainer_config": None,
                                       "synchronizer.sync_interval": 1, "buffer.train_batch_size": None,
                                       "buffer.total_steps": 30})
    s = import_config(path, dp_size=4).settings
    assert (s[f"{R}.n"], s["data.train_batch_size"], s[f"{A}.ppo_mini_batch_size"]) == (2, 256, 256)
    assert (s[f"{A}.use_kl_loss"], s[f"{A}.kl_loss_type"], s[f"{A}.kl_loss_coef"]) == (True, "k2", 0.001)
    assert s["trainer.total_training_steps"] == 30 and s["trainer.test_freq"] == 20


def test_trinity_m2po_and_token_mean_sapo(home, tmp_path):
    """Trinity's m2po preset (its defaults: 8 samples, no KL, no entropy, threshold 0.04, the sampler's
    log-probs as the old ones) and its sapo with token-mean aggregation (Trinity's default for it)."""
    base = {"trainer.trainer_config": None, "synchronizer.sync_interval": 1, "buffer.train_batch_size": None}
    s = import_config(variant(TRINITY, tmp_path, {**base, "algorithm": {"algorithm_type": "m2po"}}), dp_size=4).settings
    assert (s[f"{A}.policy_loss.loss_mode"], s[f"{R}.n"], s[f"{A}.use_kl_loss"], s[f"{A}.entropy_coeff"]) == (
        "m2po", 8, False, 0.0)
    assert s[f"{A}.m2_threshold"] == 0.04 and s["algorithm.rollout_correction.bypass_mode"] is True
    spec = import_config(variant(TRINITY, tmp_path, {**base, "algorithm": {
        "algorithm_type": "m2po", "policy_loss_fn_args": {"m2_threshold": 0.1}}}), dp_size=4)
    assert spec.settings[f"{A}.m2_threshold"] == 0.1
    assert validate_config(spec.config(), dp_size=4, check_paths=False).actor_rollout_ref.actor.m2_threshold == 0.1
    for args, key, why in [({"bypass_old_logprobs": False}, "algorithm.bypass_old_logprobs", "sampler's log-probs"),
                           ({"policy_loss_fn_args": {"log_ratio_clip": 5.0}}, "algorithm.policy_loss_fn_args."
                            "log_ratio_clip", "clamps the log-ratio at 20")]:
        with pytest.raises(ConfigError, match=key) as err:
            import_config(variant(TRINITY, tmp_path, {**base, "algorithm": {"algorithm_type": "m2po", **args}}),
                          dp_size=4)
        assert why in str(err.value)
    s = import_config(variant(TRINITY, tmp_path, {**base, "algorithm": {"algorithm_type": "sapo"}}), dp_size=4).settings
    assert (s[f"{A}.policy_loss.loss_mode"], s[f"{A}.policy_loss.loss_agg_mode"]) == ("sapo", "token-mean")
    s = import_config(variant(TRINITY, tmp_path, {**base, "algorithm": {"algorithm_type": "grpo",
                                                                        "bypass_old_logprobs": True}}),
                      dp_size=4).settings
    assert s["algorithm.rollout_correction.bypass_mode"] is True


def test_trinity_multi_step_grpo_with_a_single_turn_workflow_is_grpo(home, tmp_path):
    """Step-wise GRPO broadcasts a run's final-step advantage to its steps; a single-turn run is one step."""
    base = {"trainer.trainer_config": None, "synchronizer.sync_interval": 1, "buffer.train_batch_size": None}
    s = import_config(variant(TRINITY, tmp_path, {**base, "algorithm": {
        "algorithm_type": "multi_step_grpo", "advantage_fn_args": {"enable_step_norm": True}}}), dp_size=4).settings
    assert (s["algorithm.adv_estimator"], s[f"{R}.n"], s[f"{A}.kl_loss_type"]) == ("grpo", 8, "k2")
    with pytest.raises(ConfigError, match="std_cal_level"):
        import_config(variant(TRINITY, tmp_path, {**base, "algorithm": {
            "algorithm_type": "multi_step_grpo", "advantage_fn_args": {"std_cal_level": "batch"}}}), dp_size=4)


def test_trinity_use_base_renders_mathboxedworkflows_plain_prompt(home, tmp_path):
    """workflow_args.use_base: the prompt as MathBoxedWorkflow.format_prompt writes it, no chat template; an eval
    taskset without it renders with the tokenizer's template (data.val_overrides)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from jaxrl_llm.config.importers.trinity_data import BASE_PROMPT_TEMPLATE

    def trinity_format_prompt(system_prompt, task_desc):  # trinity/common/workflows/customized_math_workflows.py
        if system_prompt:
            return "System:" + system_prompt + "\nUser:\n" + task_desc + "\nAssistant:\n"
        return "User:\n" + task_desc + "\nAssistant:\n"

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        BASE_PROMPT_TEMPLATE)  # as transformers compiles a chat template
    for system in ("Solve it.", None):
        chat = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "1+1?"}]
        assert template.render(messages=chat, add_generation_prompt=True) == trinity_format_prompt(system, "1+1?")
    ts = "buffer.explorer_input.taskset"
    changes = {f"{ts}.workflow_args": {"use_base": True}, "buffer.explorer_input.default_workflow_type":
               "math_boxed_workflow", "buffer.explorer_input.eval_tasksets": None}
    s = import_config(variant(TRINITY, tmp_path, changes), dp_size=4).settings
    assert s["data.chat_template"] == BASE_PROMPT_TEMPLATE
    # an eval taskset rendered with the tokenizer's template, its own prompt and answer columns (Trinity's DAPO
    # example): validation reads them through data.val_overrides
    evals = [{"name": "aime", "storage_type": "file", "path": str(tmp_path / "aime.jsonl"), "split": "test",
              "format": {"prompt_key": "question", "response_key": "answer"}}]
    s = import_config(variant(TRINITY, tmp_path, {**changes, "buffer.explorer_input.eval_tasksets": evals}),
                      dp_size=4).settings
    assert s["data.chat_template"] == BASE_PROMPT_TEMPLATE
    assert (s["data.val_overrides.chat_template"], s["data.val_overrides.prompt_key"],
            s["data.val_overrides.ground_truth_key"]) == ("native", "question", "answer")
    r = import_config(variant(TRINITY, tmp_path, {**changes, "buffer.explorer_input.eval_tasksets": evals}), dp_size=4)
    val = resolve_data(validate_config(r.config(), dp_size=4, check_paths=False)).for_split("val")
    assert (val.chat_template, val.prompt_key, val.ground_truth_key) == ("native", "question", "answer")
    with pytest.raises(ConfigError, match="use_base.*the plain-text prompt is math_boxed_workflow"):
        import_config(variant(TRINITY, tmp_path, {**changes, "buffer.explorer_input.default_workflow_type":
                                                  "math_workflow"}), dp_size=4)


def test_trinity_rubric_judge_becomes_our_judge(tmp_path, monkeypatch):
    """Trinity's grpo_rubric example with a fixed sync schedule: the auxiliary model judges with the prompts of
    the rubric workflow in the Trinity checkout (read, never run), the rows' rubric column, ```json ratings over
    1-10, greedy; its std_threshold is the zero-variance group filter."""
    from jaxrl_llm.config.importers.trinity_judge import read_prompts

    peers = pathlib.Path(__file__).parent / "peers" / "trinity"
    checkout = tmp_path / "trinity_checkout"
    (checkout / "examples").mkdir(parents=True)
    workflow = peers / "trinity/common/workflows/rubric_judge_workflow.py"
    (checkout / "trinity/common/workflows").mkdir(parents=True)
    (checkout / "trinity/common/workflows/rubric_judge_workflow.py").write_text(workflow.read_text())
    data = yaml.safe_load((peers / "examples/grpo_rubric/rubric.yaml").read_text())
    data["synchronizer"].pop("sync_style")
    path = checkout / "examples" / "rubric.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("TRINITY_MODEL_PATH", "/models/policy")
    cfg = validate_config(import_config(str(path), dp_size=8).config(), dp_size=8, check_paths=False)
    rm, judge = cfg.reward_model, cfg.reward_model.judge
    assert (rm.enable, rm.style, rm.model.path) == (True, "generative", "Qwen/Qwen3-30B-A3B-Instruct-2507")
    assert (judge.parser, judge.min_score, judge.max_score, judge.default_score, judge.temperature) == (
        "json_rating", 1.0, 10.0, 0.0, 0.0)
    assert (judge.rubric_key, list(cfg.data.extra_info_keys), judge.max_new_tokens, judge.max_prompt_length) == (
        "rubric", ["rubric"], 1024, 19456)
    assert judge.chat_template_kwargs.to_dict() == {"enable_thinking": False}
    assert (cfg.algorithm.filter_groups.enable, cfg.data.prompt_key) == (True, "question")
    # the workflow's own prompts, its f-string fields as ours
    prompts = read_prompts(workflow.read_text())
    assert judge.template == prompts["judge_user"] and judge.system_prompt == prompts["judge_system"]
    assert judge.template.startswith("Given the following prompt, response, and rubrics") and \
        "<prompt>\n{prompt}\n</prompt>\n<response>\n{response}\n</response>\n<rubrics>\n{rubric}\n</rubrics>" in \
        judge.template and judge.template.endswith("Your JSON Evaluation:")
    assert cfg.data.system_prompt.startswith("A conversation between User and Assistant.")
    assert "Example response:\n```json\n{\n\"rating\": 7\n}```" in judge.system_prompt
    data["algorithm"]["advantage_fn_args"]["std_threshold"] = 0.05
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="std_threshold: 0.05: the group filter drops zero-variance groups only"):
        import_config(str(path), dp_size=8)
    data["algorithm"]["advantage_fn_args"]["std_threshold"] = 0.0
    (checkout / "trinity/common/workflows/rubric_judge_workflow.py").unlink()
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="rubric_judge_workflow: its prompts are read from trinity/common/workflows"):
        import_config(str(path), dp_size=8)


def test_trinity_and_roll_off_policy_schedules(home, tmp_path):
    # Trinity: sync_offset explorer steps ahead, sync_interval explorer steps per jaxrl_llm step (= one version)
    path = variant(TRINITY, tmp_path, {"synchronizer.sync_offset": 1, "synchronizer.sync_interval": 4,
                                       "buffer.total_steps": None})
    s = import_config(path, dp_size=4).settings
    assert s["synchronizer.sync_offset"] == 1 and "synchronizer.sync_interval" not in s
    s = import_config(variant(ROLL, tmp_path, {"async_generation_ratio": 2}), dp_size=8).settings
    assert s["synchronizer.sync_offset"] == 2
    from jaxrl_llm.config import apply_overrides, default_config
    assert apply_overrides(default_config(), ["async_generation_ratio=1"]).synchronizer.sync_offset == 1


@pytest.mark.parametrize("key,value,why", [
    ("synchronizer.sync_style", "dynamic_by_explorer", "fixed schedule"),
    ("synchronizer.sync_offset", -1, ">= 0"),
    ("algorithm.algorithm_type", "dpo", "no SFT / DPO"),
    ("algorithm.algorithm_type", "sft", "no SFT / DPO"),
    ("algorithm.policy_loss_fn", "opmd", "jaxrl_llm has"),
    ("algorithm.kl_loss_fn", "corrected_k3", "jaxrl_llm has"),
    ("algorithm.kl_loss_fn_args.adaptive", True, "adaptive"),
    ("buffer.explorer_input.default_workflow_type", "alfworld_workflow", "single-turn"),
    ("buffer.explorer_input.taskset.format.system_prompt_key", "sys", "per-row system prompt"),
    ("buffer.explorer_input.taskset.workflow_args", {"with_think": True}, "not available (use_base is)"),
    ("buffer.total_steps", 30, "multiple of sync_interval"),
    ("explorer.auxiliary_models", [{"model_path": "judge"}], "auxiliary models"),
    ("mode", "train", "both"),
    ("explorer.rollout_model.enable_thinking", False, "changes what a Qwen3 template renders"),
])
def test_trinity_meaning_changing_keys_are_errors(home, tmp_path, key, value, why):
    with pytest.raises(ConfigError) as err:
        import_config(variant(TRINITY, tmp_path, {key: value}), dp_size=4)
    assert str(err.value).startswith(f"{tmp_path}/variant.yaml: {key}") and why in str(err.value)


def test_trinity_enable_thinking_true_is_the_template_default(home, tmp_path):
    # Qwen3's template thinks unless told otherwise: `true` renders what no flag renders (before: refused)
    r = import_config(variant(TRINITY, tmp_path, {"explorer.rollout_model.enable_thinking": True}), dp_size=4)
    assert "explorer.rollout_model.enable_thinking" in r.ignored


def test_trinity_trainer_config_path(home, tmp_path):
    (tmp_path / "verl_part.yaml").write_text(yaml.safe_dump(
        {"actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 4, "ppo_epochs": 2}}}))
    path = variant(TRINITY, tmp_path, {"trainer.trainer_config": None, "trainer.trainer_config_path": "verl_part.yaml"})
    s = import_config(path, dp_size=4).settings
    assert (s[f"{A}.ppo_micro_batch_size_per_device"], s[f"{A}.ppo_epochs"]) == (4, 2)


def test_taskset_files(tmp_path):
    assert taskset_files("/x/y.jsonl", "train") == ["/x/y.jsonl"]
    (tmp_path / "test.jsonl").touch()
    assert taskset_files(str(tmp_path), "test") == [f"{tmp_path}/test.jsonl"]
    assert taskset_files(str(tmp_path), "train") == [f"{tmp_path}/train.parquet"]


# ---------------------------------------------------------------- ROLL


def test_roll_rlvr(home, tmp_path):
    r = import_config(ROLL, dp_size=8)
    s = r.settings
    assert r.format == "roll"
    # 1 x 32 x 16 devices (len(device_mapping), Megatron tp=pp=1) = 512 sequences = 64 prompts x 8 per step
    assert values(r, "data.train_batch_size", f"{R}.n", f"{A}.ppo_mini_batch_size",
                  f"{A}.ppo_micro_batch_size_per_device") == (64, 8, 64, 1)
    assert values(r, "data.max_prompt_length", "data.max_response_length", f"{A}.ppo_epochs") == (2048, 4096, 1)
    assert values(r, "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo", f"{A}.loss_agg_mode") == (
        "grpo", True, "seq-mean-token-mean")  # reinforce + group/group norm; ROLL's default aggregation
    assert values(r, f"{A}.clip_ratio_low", f"{A}.clip_ratio_high", f"{A}.clip_ratio_c") == (0.2, 0.28, 1.4)
    assert values(r, f"{A}.use_kl_loss", f"{A}.kl_loss_coef", f"{A}.kl_loss_type", "algorithm.use_kl_in_reward") == (
        True, 0.001, "low_var_kl", False)
    assert values(r, f"{A}.optim.lr", f"{A}.optim.lr_warmup_steps", f"{A}.optim.weight_decay",
                  "actor_rollout_ref.model.dtype") == (1e-6, 20, 0, "bfloat16")
    assert values(r, "trainer.total_training_steps", "trainer.save_freq", "trainer.test_freq", "trainer.seed") == (
        500, 100, 10, 42)
    assert s["actor_rollout_ref.model.path"] == f"{home}/models/Qwen2.5-0.5B-Instruct"
    assert s["data.train_files"] == [f"{home}/data/gsm8k/train.jsonl"]
    assert s["data.val_files"] == f"{home}/data/gsm8k/test.jsonl"
    assert values(r, "data.prompt_key", f"{R}.temperature", f"{R}.top_k", f"{R}.val_kwargs.temperature") == (
        "instruction", 0.99, 100, 0.6)
    assert values(r, "trainer.resume_mode", "trainer.default_local_dir", "trainer.logger") == (
        "disable", "./output/rlvr", ["console", "jsonl", "tensorboard"])
    for key in ("reference.strategy_args.strategy_config", "actor_infer.strategy_args.strategy_config.block_size",
                "logging_steps"):
        assert key in r.ignored  # reference.strategy_config is ${deepspeed_zero3}: unresolved but unused
    # its math_rule worker's rows (tags gsm8k, math) score with our MATH scorer, as do rows of other tags (ROLL)
    assert (s["data.domains.key"], s["data.domains.members"], s["data.domains.data_sources"]) == (
        "tag", {"math_rule": ["gsm8k", "math"]}, {"math_rule": "lighteval/MATH"})
    assert s["data.default_data_source"] == "lighteval/MATH" and "data.domains.probs" not in s
    expand = import_config(variant(ROLL, tmp_path, {"is_num_return_sequences_expand": True}), dp_size=8)
    assert "is_num_return_sequences_expand" in expand.ignored  # how ROLL dispatches requests: the same samples
    assert validate_config(r.config(), dp_size=8, check_paths=False).actor_rollout_ref.actor.clip_ratio_c == 1.4


def test_roll_defaults_and_gspo(home, tmp_path):
    path = variant(ROLL, tmp_path, {"dual_clip_loss": None, "use_pg_clip_range": None, "importance_sampling": "seq"})
    s = import_config(path, dp_size=8).settings
    assert s[f"{A}.clip_ratio_c"] == NO_DUAL_CLIP and s[f"{A}.policy_loss.loss_mode"] == "gspo"
    assert (s[f"{A}.policy_loss.loss_agg_mode"], s[f"{A}.policy_loss.dual_clip"]) == ("seq-mean-token-mean", False)
    assert f"{A}.clip_ratio_high" not in s
    # ROLL's sequence ratio with its dual clip and any aggregation: gspo with both switched (tests/losses: values
    # and gradients equal ROLL's)
    path = variant(ROLL, tmp_path, {"dual_clip_loss": True, "importance_sampling": "seq",
                                    "loss_agg_mode": "token-mean"})
    a = validate_config(import_config(path, dp_size=8).config(), dp_size=8, check_paths=False).actor_rollout_ref.actor
    assert (a.policy_loss.loss_mode, a.policy_loss.loss_agg_mode, a.policy_loss.dual_clip, a.clip_ratio_c) == (
        "gspo", "token-mean", True, 1.4)


def test_roll_pg_worker_variants(home, tmp_path):
    """ROLL's ActorPGWorker reads actor_train.pg_variant (topr with its weights, vanilla = -A log pi, ppo); the PPO
    ActorWorker does not, so there the key is warned and the PPO loss kept."""
    pg = "roll.pipeline.rlvr.actor_pg_worker.ActorPGWorker"
    s = import_config(variant(ROLL, tmp_path, {"actor_train.worker_cls": pg, "actor_train.pg_variant": "topr",
                                               "actor_train.topr_negative_weight": 0.5}), dp_size=8).settings
    assert (s[f"{A}.policy_loss.loss_mode"], s[f"{A}.topr_negative_weight"]) == ("topr", 0.5)
    for variant_name, ours in (("vanilla", "gpg"), ("ppo", "vanilla"), (None, "gpg")):
        path = variant(ROLL, tmp_path, {"actor_train.worker_cls": pg, "actor_train.pg_variant": variant_name})
        s = import_config(path, dp_size=8).settings
        assert s[f"{A}.policy_loss.loss_mode"] == ours
    r = import_config(variant(ROLL, tmp_path, {"actor_train.pg_variant": "topr"}), dp_size=8)
    assert f"{A}.policy_loss.loss_mode" not in r.settings and "actor_train.pg_variant" in r.ignored
    with pytest.raises(ConfigError, match="actor_train.pg_variant: 'tis'"):
        import_config(variant(ROLL, tmp_path, {"actor_train.worker_cls": pg, "actor_train.pg_variant": "tis"}),
                      dp_size=8)
    # ROLL's reward normalisation over the batch, for a non-grpo estimator; 'running' is refused
    s = import_config(variant(ROLL, tmp_path, {"adv_estimator": "reinforce", "norm_mean_type": "batch",
                                               "norm_std_type": "batch"}), dp_size=8).settings
    assert (s["algorithm.norm_mean_type"], s["algorithm.norm_std_type"]) == ("batch", "batch")
    with pytest.raises(ConfigError, match="norm_std_type: 'running'"):
        import_config(variant(ROLL, tmp_path, {"adv_estimator": "reinforce", "norm_std_type": "running"}), dp_size=8)


def test_roll_llm_judge_becomes_the_generative_reward_model(home, tmp_path):
    """One LLMJudgeRewardWorker domain: our judge with ROLL's prompt (read from the ROLL checkout the file sits
    in), its yes-anywhere reading and its sampling; an API judge, an unknown or missing prompt and a judge beside
    rule domains are refused by key."""
    root = tmp_path / "roll_checkout"  # ROLL's root: the config beside its roll/ package
    checkout = root / "roll" / "utils"
    checkout.mkdir(parents=True)
    (checkout / "prompt.py").write_text((pathlib.Path(__file__).parent / "peers/roll/roll/utils/prompt.py").read_text())
    judge = {"worker_cls": "roll.pipeline.rlvr.rewards.llm_judge_reward_worker.LLMJudgeRewardWorker",
             "judge_prompt": "Qwen2.5-7B-Instruct-RLVR-prompt", "judge_model_type": "inference",
             "model_args": {"model_name_or_path": "/models/judge"},
             "generating_args": {"max_new_tokens": 32, "temperature": 0.0, "top_p": 0.9, "top_k": 20},
             "data_args": {"template": "qwen2_5"}}
    cfg = validate_config(import_config(variant(ROLL, root, {"rewards": {"llm_judge": judge}}), dp_size=8).config(),
                          dp_size=8, check_paths=False)
    rm = cfg.reward_model
    assert (rm.style, rm.model.path, rm.judge.parser, rm.judge.temperature, rm.judge.max_new_tokens) == (
        "generative", "/models/judge", "contains_yes", 0.0, 32)
    assert "{prompt}" in rm.judge.template and "{ground_truth}" in rm.judge.template
    assert rm.judge.max_prompt_length == 2048 + 4096 + 512  # no vLLM max_model_len: the policy's lengths
    for rewards, key, why in [
        ({"llm_judge": {**judge, "judge_model_type": "api"}}, "rewards.llm_judge.judge_model_type", "API judge"),
        ({"llm_judge": {**judge, "judge_prompt": None}}, "rewards.llm_judge.judge_prompt", "not given"),
        ({"llm_judge": {**judge, "judge_prompt": "mine"}}, "rewards.llm_judge.judge_prompt", "maps Qwen2.5-7B"),
        ({"llm_judge": judge, "second": judge}, "rewards.second", "a second LLM judge"),
        ({"mine": {"worker_cls": "my.Worker"}}, "rewards.mine.worker_cls", "no built-in counterpart"),
    ]:
        with pytest.raises(ConfigError, match=key) as err:
            import_config(variant(ROLL, root, {"rewards": rewards}), dp_size=8)
        assert why in str(err.value)
    elsewhere = tmp_path / "elsewhere"  # no ROLL checkout above the file (nor in the working directory)
    elsewhere.mkdir()
    with pytest.raises(ConfigError, match="rewards.llm_judge.judge_prompt: 'Qwen2.5-7B-Instruct-RLVR-prompt': ROLL's "
                                          "prompt text is read from roll/utils/prompt.py"):
        import_config(variant(ROLL, elsewhere, {"rewards": {"llm_judge": judge}}), dp_size=8)


def test_roll_domain_mixture_with_a_judge_domain_imports(home, tmp_path):
    """ROLL's domain_interleave_probs with a rule worker per domain and a judge on its own: the mixture's counts
    are ROLL's (int(p * B) each but the last, which takes the rest), each domain's rows get its scorer's
    data_source by their tag, and the judge grades only its domain's rows."""
    root = tmp_path / "roll_checkout"
    (root / "roll" / "utils").mkdir(parents=True)
    (root / "roll" / "utils" / "prompt.py").write_text(
        (pathlib.Path(__file__).parent / "peers/roll/roll/utils/prompt.py").read_text())
    rewards = {
        "math_rule": {"worker_cls": "r.MathRuleRewardWorker", "tag_included": ["deepmath_103k", "aime"]},
        "crossthinkqa": {"worker_cls": "r.CrossThinkQARuleRewardWorker", "reward_type": "strict",
                         "response_length_penalty_coef": 0.0, "tag_included": ["crossthinkqa"]},
        "ifeval": {"worker_cls": "r.GeneralRuleRewardWorker", "reward_type": "soft", "tag_included": ["ifeval"]},
        "code_sandbox": {"worker_cls": "r.CodeSandboxRewardWorker", "use_local": True, "tag_included": ["KodCode"]},
        "llm_judge": {"worker_cls": "r.LLMJudgeRewardWorker", "judge_prompt": "Qwen2.5-7B-Instruct-RLVR-prompt",
                      "judge_model_type": "inference", "model_args": {"model_name_or_path": "/models/judge"},
                      "tag_included": ["RLVR"]},
    }
    # 64 prompts: int(0.35 * 64) = 22, int(0.25 * 64) = 16, int(0.15 * 64) = 9, int(0.1 * 64) = 6, the last 11
    probs = {"math_rule": 0.35, "crossthinkqa": 0.25, "llm_judge": 0.15, "code_sandbox": 0.1, "ifeval": 0.15}
    path = variant(ROLL, root, {"rewards": rewards, "actor_train.data_args.domain_interleave_probs": probs})
    cfg = validate_config(import_config(path, dp_size=8).config(), dp_size=8, check_paths=False)
    domains = resolve_data(cfg).domains
    assert domain_counts(domains.probs, cfg.data.train_batch_size) == [
        ("code_sandbox", 6), ("crossthinkqa", 16), ("ifeval", 11), ("llm_judge", 9), ("math_rule", 22)]
    assert domains.key == "tag" and dict(domains.data_sources) == {
        "math_rule": "lighteval/MATH", "crossthinkqa": "crossthinkqa", "ifeval": "ifeval", "llm_judge": "llm_judge",
        "code_sandbox": "code"}
    # the code rows' test-case columns are their ground truth (rewards/scorers/roll_code.py)
    assert domains.ground_truth_of("code_sandbox", {"case_type": "assert", "test_cases": "[]", "x": 1}) == {
        "case_type": "assert", "test_cases": "[]", "test_case_function": None}
    assert domains.domain_of({"tag": "aime"}) == "math_rule" and domains.domain_of({"tag": "RLVR"}) == "llm_judge"
    assert list(cfg.reward_model.judge.data_sources) == ["llm_judge"] and cfg.reward_model.style == "generative"
    assert cfg.custom_reward_function.reward_kwargs.reward_type == "strict"
    for change, key, why in [
        ({"actor_train.data_args.domain_interleave_probs": {**probs, "code": 0.0}},
         "domain_interleave_probs.code", "no reward worker scores this domain"),
        ({"rewards": {**rewards, "crossthinkqa": {**rewards["crossthinkqa"], "response_length_penalty_coef": 0.1}}},
         "rewards.crossthinkqa.response_length_penalty_coef", "length reward"),
    ]:
        with pytest.raises(ConfigError, match=key) as err:
            import_config(variant(ROLL, root, {"rewards": rewards, "actor_train.data_args.domain_interleave_probs":
                                               probs, **change}), dp_size=8)
        assert why in str(err.value)


def test_roll_lora_targets_compare_by_the_projections_they_name(home, tmp_path):
    lora = {"actor_train.model_args.lora_rank": 8, "actor_train.model_args.lora_alpha": 16,
            "actor_train.model_args.lora_target": "all-linear", "actor_infer.model_args.lora_rank": 8,
            "actor_infer.model_args.lora_target": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"}
    s = import_config(variant(ROLL, tmp_path, lora), dp_size=8).settings
    assert (s["actor_rollout_ref.model.lora_rank"], s["actor_rollout_ref.model.target_modules"]) == (8, "all-linear")
    with pytest.raises(ConfigError, match="actor_infer.model_args.lora_target: 'q_proj,v_proj' differs"):
        import_config(variant(ROLL, tmp_path, {**lora, "actor_infer.model_args.lora_target": "q_proj,v_proj"}),
                      dp_size=8)


def test_roll_dataset_dir_joins_the_file_names(home, tmp_path):
    s = import_config(variant(ROLL, tmp_path, {"actor_train.data_args.dataset_dir": "/data",
                                               "actor_train.data_args.file_name": ["a.jsonl", "b/c.jsonl"]}),
                      dp_size=8).settings
    assert s["data.train_files"] == ["/data/a.jsonl", "/data/b/c.jsonl"]


def test_roll_shaping_and_sample_masks_import(home, tmp_path):
    """ROLL's whitening, clipping and sample masks become our algorithm.* keys of ROLL's names."""
    path = variant(ROLL, tmp_path, {"whiten_advantages": True, "advantage_clip": 2.0, "reward_clip": 10,
                                    "whiten_rewards": True, "max_len_mask": True, "difficulty_mask": True,
                                    "difficulty_low_threshold": 0.1, "difficulty_high_threshold": 0.95})
    cfg = validate_config(import_config(path, dp_size=8).config(), dp_size=8, check_paths=False)
    alg = cfg.algorithm
    assert (alg.whiten_advantages, alg.advantage_clip, alg.reward_clip, alg.whiten_rewards, alg.max_len_mask) == (
        True, 2.0, 10, True, True)
    assert (alg.difficulty_mask.enable, alg.difficulty_mask.low_threshold, alg.difficulty_mask.high_threshold) == (
        True, 0.1, 0.95)
    # reinforce without normalisation, whitened: REINFORCE++ (which whitens itself)
    path = variant(ROLL, tmp_path, {"adv_estimator": "reinforce", "norm_mean_type": None, "norm_std_type": None,
                                    "whiten_advantages": True})
    alg = import_config(path, dp_size=8).config().algorithm
    assert (alg.adv_estimator, alg.whiten_advantages) == ("reinforce_plus_plus", False)
    # ... and unwhitened: the discounted returns themselves, our `reinforce`
    path = variant(ROLL, tmp_path, {"adv_estimator": "reinforce", "norm_mean_type": None, "norm_std_type": None,
                                    "whiten_advantages": False})
    alg = import_config(path, dp_size=8).config().algorithm
    assert (alg.adv_estimator, alg.whiten_advantages) == ("reinforce", False)
    # ROLL's gae whitens only when asked; ours (veRL's) always does
    path = variant(ROLL, tmp_path, {"adv_estimator": "gae", "whiten_advantages": True})
    alg = import_config(path, dp_size=8).config().algorithm
    assert (alg.adv_estimator, alg.whiten_advantages) == ("gae", False)
    with pytest.raises(ConfigError, match="gae' without whiten_advantages"):
        import_config(variant(ROLL, tmp_path, {"adv_estimator": "gae", "whiten_advantages": False}), dp_size=8)


@pytest.mark.parametrize("key,value,why", [
    ("async_generation_ratio", 1.5, "whole number"),
    ("adv_estimator", "gigpo", "jaxrl_llm has gae, grpo"),
    ("error_max_len_clip", True, "wrong answers"),
    ("actor_infer.generating_args.repetition_penalty", 1.1, "repetition"),
    ("critic.model_args.model_type", "trl", "dropout 0.1"),
    ("actor_train.training_args.gradient_accumulation_steps", 3, "whole number of groups"),
    ("actor_train.training_args.lr_scheduler_type", "polynomial", "constant, cosine and linear"),
])
def test_roll_meaning_changing_keys_are_errors(home, tmp_path, key, value, why):
    changes = {key: value}
    with pytest.raises(ConfigError) as err:
        import_config(variant(ROLL, tmp_path, changes), dp_size=8)
    assert str(err.value).startswith(f"{tmp_path}/variant.yaml: {key}") and why in str(err.value)


def test_roll_device_mapping():
    assert [device_count(v) for v in ("list(range(0,16))", "range(8)", "[0, 1, 2]", [0, 1], "eval(x)")] == [
        16, 8, 3, 2, None]


# ---------------------------------------------------------------- TRL


def test_trl_yaml(home):
    r = import_config(TRL, "trl", dp_size=8)
    # 16 per device x 8 devices x 4 accumulation = 512 completions (64 prompts) per optimizer step;
    # 16 x 8 x steps_per_generation 8 = 1024 completions (128 prompts) per generation
    assert values(r, "data.train_batch_size", f"{A}.ppo_mini_batch_size", f"{A}.ppo_micro_batch_size_per_device",
                  f"{R}.n", f"{A}.ppo_epochs") == (128, 64, 16, 8, 2)
    assert r.settings[f"{A}.shuffle"] is True  # TRL shuffles a generation batch before splitting it into steps
    assert f"{A}.num_mini_batches" not in r.settings  # its optimizer steps are whole groups
    # the reference / old log-probs in TRL's training batches, not the base tree's sizes
    assert values(r, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device",
                  f"{R}.log_prob_micro_batch_size_per_device") == (16, 16)
    # 2 mini-batches x 2 iterations = 4 optimizer steps per step: max_steps 200 -> 50, save 50 -> 13, eval 20 -> 5
    assert values(r, "trainer.total_training_steps", "trainer.save_freq", "trainer.test_freq",
                  f"{A}.optim.lr_warmup_steps") == (50, 13, 5, 3)
    assert values(r, "data.max_prompt_length", "data.truncation", "data.max_response_length") == (256, "left", 768)
    assert values(r, f"{A}.clip_ratio_low", f"{A}.clip_ratio_high", f"{A}.clip_ratio_c") == (0.2, 0.28, 3.0)
    assert values(r, f"{A}.use_kl_loss", f"{A}.kl_loss_coef", f"{A}.kl_loss_type") == (True, 0.04, "low_var_kl")
    assert values(r, "algorithm.adv_estimator", f"{A}.loss_agg_mode", "algorithm.norm_adv_by_std_in_grpo") == (
        "grpo", "seq-mean-token-sum-norm", False)  # dr_grpo, scale_rewards false
    assert values(r, f"{A}.optim.lr", f"{A}.optim.lr_scheduler_type", f"{A}.optim.lr_warmup_steps_ratio",
                  f"{A}.optim.betas", f"{A}.grad_clip") == (1e-6, "cosine", 0.1, [0.9, 0.99], 0.2)
    assert values(r, f"{R}.temperature", f"{R}.top_k", "actor_rollout_ref.model.dtype", "trainer.seed") == (
        0.9, -1, "bfloat16", 1234)
    assert values(r, "trainer.max_actor_ckpt_to_keep", "trainer.logger", "trainer.default_local_dir") == (
        3, ["console", "jsonl", "tensorboard"], "runs/qwen-grpo-gsm8k")
    for key in ("use_vllm", "vllm_gpu_memory_utilization", "logging_steps", "dataset_name", "num_train_epochs"):
        assert key in r.ignored
    cfg = r.config()
    cfg.data.train_files = "train.parquet"  # TRL names a hub dataset (dataset_name): ignored
    assert validate_config(cfg, dp_size=8, check_paths=False).data.train_batch_size == 128


def test_trl_optimizer_steps_that_split_groups(home, tmp_path):
    """A TRL optimizer step that is not whole groups (4 per device x 8 devices = 32 completions, groups of 6):
    mini-batches counted in sequences (actor.num_mini_batches = 96 / 32), the generation batch shuffled first."""
    r = import_config(variant(TRL, tmp_path, {"num_generations": 6, "per_device_train_batch_size": 4,
                                              "gradient_accumulation_steps": 1, "steps_per_generation": 3,
                                              "max_steps": 30}), "trl", dp_size=8)
    assert values(r, "data.train_batch_size", f"{A}.num_mini_batches", f"{A}.shuffle", f"{R}.n") == (16, 3, True, 6)
    assert f"{A}.ppo_mini_batch_size" not in r.settings
    # 3 mini-batches x 2 iterations = 6 optimizer steps a training step: max_steps 30 -> 5
    assert r.settings["trainer.total_training_steps"] == 5
    cfg = r.config()
    cfg.data.train_files = "train.parquet"  # TRL names a hub dataset (dataset_name): ignored
    plan = resolve_batch_plan(validate_config(cfg, dp_size=8, check_paths=False), 8)
    assert (plan.actor.mini_batches, plan.actor.mini_batch_sequences, plan.actor.per_device) == (3, 32, 4)
    with pytest.raises(ConfigError, match="whole number of optimizer steps"):
        import_config(variant(TRL, tmp_path, {"num_generations": 6, "per_device_train_batch_size": 4,
                                              "gradient_accumulation_steps": 1, "generation_batch_size": 48}),
                      "trl", dp_size=8)


def test_trl_yaml_left_out_arguments_take_trl_defaults(home, tmp_path):
    # `trl grpo --config FILE` fills what the file leaves out with GRPOConfig's defaults (before: an error)
    r = import_config(variant(TRL, tmp_path, {"num_generations": None, "loss_type": None, "beta": None}), "trl",
                      dp_size=8)
    assert values(r, f"{R}.n", f"{A}.loss_agg_mode", f"{A}.use_kl_loss") == (8, "token-mean", False)
    rloo = import_config(variant(TRL, tmp_path, {"num_generations": None, "beta": None, "loss_type": None,
                                                  "scale_rewards": None, "importance_sampling_level": None,
                                                  "delta": None}), "trl_rloo", dp_size=8)
    assert values(rloo, "algorithm.adv_estimator", f"{R}.n", "algorithm.kl_ctrl.kl_coef") == ("trl_rloo", 2, 0.05)


def test_trl_use_peft_is_lora():
    r = import_trl_flags(["--use_peft", "--lora_r=16", "--lora_dropout=0", "--lora_target_modules", "q_proj,v_proj"],
                         dp_size=8)
    assert values(r, f"{M}.lora_rank", f"{M}.lora_alpha", f"{M}.target_modules", f"{M}.lora_dropout") == (
        16, 32, ["q_proj", "v_proj"], 0.0)
    r = import_trl_flags(["--mask_truncated_completions"], dp_size=8)
    assert values(r, "algorithm.mask_truncated_completions") == (True,)
    # TRL's default dropout (0.05) is PEFT's lora_dropout, trained as PEFT does (models/lora.py)
    r = import_trl_flags(["--use_peft", "--lora_r=16"], dp_size=8)
    assert values(r, f"{M}.lora_rank", f"{M}.lora_dropout") == (16, 0.05)


def test_trl_flags_on_a_config_file():
    base = load_config_file("grpo_gsm8k")
    r = import_trl_flags(["--learning_rate=1e-6", "--num_generations=8", "--beta=0.04",
                          "--max_completion_length=256", "--epsilon", "0.2", "--epsilon_high", "0.28"],
                         base=base, dp_size=8)
    assert r.settings == {
        f"{A}.optim.lr": 1e-6, f"{R}.n": 8, "data.max_response_length": 256, f"{A}.use_kl_loss": True,
        f"{A}.kl_loss_coef": 0.04, f"{A}.kl_loss_type": "low_var_kl", f"{A}.clip_ratio": 0.2,
        f"{A}.clip_ratio_low": 0.2, f"{A}.clip_ratio_high": 0.28}
    cfg = r.config(base)
    assert cfg.data.train_batch_size == 1024 and cfg.actor_rollout_ref.rollout.n == 8  # the rest: the file's


def test_trl_rloo_flags():
    r = import_trl_flags(["--rloo_k", "4", "--kl_coef=0.03", "--num_ppo_epochs", "2", "--num_mini_batches", "2",
                          "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "16",
                          "--total_episodes", "1000000", "--missing_eos_penalty", "1.0", "--token_level_kl",
                          "--normalize_advantage", "--learning_rate", "3e-6"], base=default_config(), dp_size=8)
    # 16 x 16 x 2 mini-batches x 8 devices = 4096 completions = 1024 prompts x rloo_k 4 per batch
    assert values(r, "data.train_batch_size", f"{A}.ppo_mini_batch_size", f"{A}.ppo_micro_batch_size_per_device",
                  f"{R}.n", f"{A}.ppo_epochs") == (1024, 512, 16, 4, 2)
    assert r.settings["trainer.total_training_steps"] == 245  # ceil(1e6 / 4096)
    assert values(r, "algorithm.adv_estimator", "algorithm.kl_ctrl.kl_coef",
                  "algorithm.trl_rloo.token_level_kl", "algorithm.trl_rloo.normalize_advantage",
                  "reward_model.missing_eos_penalty", f"{A}.use_kl_loss", "algorithm.use_kl_in_reward") == (
        "trl_rloo", 0.03, True, True, 1.0, False, False)
    validate_config(r.config(apply_tiny(default_config())), dp_size=8, check_paths=False)


def apply_tiny(cfg):
    cfg.actor_rollout_ref.model.path, cfg.data.tokenizer, cfg.data.train_files = "tiny:llama", "tok", "t.parquet"
    return cfg


@pytest.mark.parametrize("flags,key,why", [
    (["--repetition_penalty=1.1"], "repetition_penalty", "repetition penalty"),
    (["--loss_type=sapo_like"], "loss_type", "jaxrl_llm has grpo"),
    (["--lr_scheduler_type=polynomial"], "lr_scheduler_type", "constant, cosine and linear"),
    (["--scale_rewards=batch"], "scale_rewards", "group std"),
    (["--rloo_k=4", "--loss_type=grpo"], "loss_type", "a GRPOConfig argument in an RLOO run"),
    (["--epsilon=0.2", "--delta=1.1"], "delta", "dual clip"),
    (["--importance_sampling_level=sequence"], "importance_sampling_level", "gspo"),
    (["--num_generations=16", "--per_device_train_batch_size=3"], "per_device_train_batch_size", "whole groups"),
    (["--num_train_epochs=1.5"], "num_train_epochs", "fractional"),
])
def test_trl_meaning_changing_arguments_are_errors(flags, key, why):
    with pytest.raises(ConfigError) as err:
        import_trl_flags(flags, dp_size=8)
    assert str(err.value).startswith(f"TRL flags: {key}") and why in str(err.value)


def test_trl_delta_is_dual_clip():
    s = import_trl_flags(["--epsilon=0.2", "--delta=4"], dp_size=8).settings
    assert s[f"{A}.clip_ratio_c"] == 4


def test_parse_and_split_trl_flags():
    assert parse_trl_args(["--bf16", "--no_gradient_checkpointing", "--report_to", "wandb", "tensorboard",
                           "--top_k=50", "--warmup_ratio", "0.1", "--seed", "-3"]) == {
        "bf16": True, "gradient_checkpointing": False, "report_to": ["wandb", "tensorboard"], "top_k": 50,
        "warmup_ratio": 0.1, "seed": -3}
    assert split_trl_flags(["a.b=1", "--lr", "3", "--bf16", "c.d=2", "--x=1", "e=f"]) == (
        ["a.b=1", "c.d=2", "e=f"], ["--lr", "3", "--bf16", "--x=1"])


def test_detect_format(home):
    loaded = [load_yaml(p, missing_groups="skip") for p in (VERL, TRINITY, ROLL, TRL)]
    assert [detect_format(data) for data in loaded] == ["verl", "trinity", "roll", "trl"]
    with pytest.raises(ConfigError, match="--import_format"):
        detect_format({"foo": 1})


# ---------------------------------------------------------------- launch/train.py --import_config --dry_run


def run_train(*args, home):
    env = dict(os.environ, XLA_FLAGS=cpu_devices_flags(8), JAX_PLATFORMS="cpu",
               HOME=str(home), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def tiny_overrides(gguf, run_dir, n_train):
    return ["actor_rollout_ref.model.path=tiny:llama", f"data.tokenizer={gguf}", "data.synthetic.task=add",
            f"data.synthetic.n_train={n_train}", "data.train_files=null", "data.val_files=null",
            "trainer.logger=[console]", f"trainer.default_local_dir={run_dir}"]


def dry_run_config(proc):
    assert proc.returncode == 0, proc.stderr
    head, _, tail = proc.stdout.partition("\nbatch: ")
    return yaml.safe_load(head), "batch: " + tail


def test_dry_run_verl_import(smollm2_gguf, tmp_path):
    proc = run_train(f"--import_config={VERL}", "--dry_run", "--config.actor_rollout_ref.actor.optim.lr=2e-6", "--",
                     *tiny_overrides(smollm2_gguf, tmp_path / "run", 2048), home=tmp_path)
    cfg, summary = dry_run_config(proc)
    actor = cfg["actor_rollout_ref"]["actor"]
    assert actor["optim"]["lr"] == 2e-6 and actor["clip_ratio_high"] == 0.28 and actor["kl_loss_type"] == "low_var_kl"
    assert cfg["mesh"]["tensor"] == 1 and cfg["algorithm"]["adv_estimator"] == "grpo"  # rollout TP: placement
    assert "1024 prompts x n=5 = 5120 sequences per step; data-parallel size 8" in summary
    assert "4 mini-batch(es) of 256 prompts" in summary and "micro-batch 16/device" in summary
    assert proc.stderr.count("change nothing jaxrl_llm computes and were ignored") == 1
    assert "actor_rollout_ref.rollout.enforce_eager" in proc.stderr


def test_dry_run_trinity_on_the_default_tree_and_roll_with_trl_flags(smollm2_gguf, tmp_path):
    proc = run_train(f"--import_config={TRINITY}", "--dry_run", "--",
                     *tiny_overrides(smollm2_gguf, tmp_path / "t", 1024), home=tmp_path)
    cfg, summary = dry_run_config(proc)
    assert cfg["actor_rollout_ref"]["rollout"]["n"] == 8 and cfg["trainer"]["test_freq"] == 5
    assert cfg["trainer"]["log_val_generations"] == 0  # the default tree, not configs/quickstart.py (4)
    assert "1024 prompts x n=8 = 8192 sequences per step" in summary and "4 mini-batch(es) of 256" in summary
    proc = run_train(f"--import_config={ROLL}", "--import_format=roll", "--dry_run", "--", "--learning_rate=3e-6",
                     "--num_iterations", "2", *tiny_overrides(smollm2_gguf, tmp_path / "r", 64),
                     "data.max_prompt_length=64", "data.max_response_length=64", home=tmp_path)
    cfg, summary = dry_run_config(proc)
    actor = cfg["actor_rollout_ref"]["actor"]
    assert actor["optim"]["lr"] == 3e-6 and actor["ppo_epochs"] == 2 and actor["clip_ratio_c"] == 1.4
    assert "64 prompts x n=8 = 512 sequences per step" in summary
    # the file's warning; the flags have none
    assert proc.stderr.count("change nothing jaxrl_llm computes and were ignored") == 1


def test_dry_run_reports_an_import_error_in_one_line(tmp_path):
    bad = variant(TRINITY, tmp_path, {"synchronizer.sync_style": "dynamic_by_explorer"})
    proc = run_train(f"--import_config={bad}", "--dry_run", home=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"config error: {bad}: synchronizer.sync_style: 'dynamic_by_explorer':")


def test_keys_no_rule_takes_are_errors_unless_off(home, tmp_path):
    """TRL / ROLL / Trinity keys no mapping takes: listed (with the value) when off, an error naming
    file, key and value otherwise (what they would change cannot be honoured)."""
    with pytest.raises(ConfigError, match=r"TRL flags: future_trl_knob: 5: no counterpart in jaxrl_llm"):
        import_trl_flags(["--future_trl_knob=5"], dp_size=8)
    r = import_trl_flags(["--future_trl_knob=0"], dp_size=8)
    assert r.values["future_trl_knob"] == 0 and "future_trl_knob=0" in r.warning()
    with pytest.raises(ConfigError, match=r"variant.yaml: roll_new_switch: True: no counterpart"):
        import_config(variant(ROLL, tmp_path, {"roll_new_switch": True}), dp_size=8)
    with pytest.raises(ConfigError, match=r"variant.yaml: algorithm.new_fn_args.scale: 2: no counterpart"):
        import_config(variant(TRINITY, tmp_path, {"algorithm.new_fn_args.scale": 2}), dp_size=4)


def test_verl_router_replay_r3_maps_to_rollout_replay(home, tmp_path):
    s = import_config(variant(VERL, tmp_path, {"actor_rollout_ref.actor.router_replay.mode": "R3",
                                               "actor_rollout_ref.rollout.enable_rollout_routing_replay": True}),
                      dp_size=4).settings
    assert s["actor_rollout_ref.actor.router_replay"] == "rollout"
    for key, value, why in (("actor_rollout_ref.actor.router_replay.mode", "R2", "(R2) is not available"),
                            ("actor_rollout_ref.ref.router_replay.mode", "R3", "routes by itself"),
                            ("actor_rollout_ref.actor.router_replay.record_file", "/tmp/r.pt", "files")):
        with pytest.raises(ConfigError) as err:
            import_config(variant(VERL, tmp_path, {key: value}), dp_size=4)
        assert key in str(err.value) and why in str(err.value)
