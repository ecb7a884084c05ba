"""The peers' own config files as they ship (tests/config/peers, SOURCES.md there), each read the way
`launch/train.py --import_config=FILE` reads it on the devices the file was written for: it imports
with the checked values of the keys that matter, or it is refused naming the key and a reason that
is a real difference in what would be computed. The counts are the ones docs/importing.md reports.
"""
import os
import pathlib
import re

import pytest

from jaxrl_llm.config import ConfigError, default_config
from jaxrl_llm.config.importers.command_line import resolve_command_line
from jaxrl_llm.config.schema import get_path

PEERS = pathlib.Path(__file__).parent / "peers"
DOCS = pathlib.Path(__file__).parents[2] / "docs" / "importing.md"
A, R, M = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"
# what the veRL scripts read from the environment (a user sets these, as the scripts expect)
SCRIPT_ENV = {"HOME": "/home/user", "EXPERIMENT_NAME": "run", "NOW": "20260101", "SLURM_JOB_NUM_NODES": "1"}


def imports(**values):
    return ("imports", {k.replace("__", "."): v for k, v in values.items()})


def refused(key, reason):
    return ("refused", (key, reason))


GRPO_KL = dict(actor_rollout_ref__actor__use_kl_loss=True, actor_rollout_ref__actor__kl_loss_type="low_var_kl",
               actor_rollout_ref__actor__kl_loss_coef=0.001, algorithm__use_kl_in_reward=False)
# (file below peers/, working directory below peers/, devices the file is written for, extra items, outcome)
# ROLL's RLVR recipes: 64 prompts of math 0.4, code 0.3, judge 0.1, CrossThinkQA 0.1 and IFEval (the last: the rest)
FIVE_DOMAINS_64 = {"math_rule": 25 / 64, "code_sandbox": 19 / 64, "llm_judge": 6 / 64, "crossthinkqa": 6 / 64,
                   "ifeval": 8 / 64}
ROLL_DOMAINS = dict(
    data__domains__key="tag", reward_model__judge__data_sources=["llm_judge"], reward_model__style="generative",
    data__domains__data_sources={"math_rule": "lighteval/MATH", "code_sandbox": "code", "llm_judge": "llm_judge",
                                 "crossthinkqa": "crossthinkqa", "ifeval": "ifeval"},
    data__domains__ground_truth_columns={"code_sandbox": ["case_type", "test_cases", "test_case_function"]},
    custom_reward_function__reward_kwargs={"reward_type": "soft"})


CASES = {
    "verl/examples/grpo_trainer/run_qwen2-7b_math.sh": ("verl", 8, (), imports(
        algorithm__adv_estimator="grpo", actor_rollout_ref__rollout__n=5, data__train_batch_size=1024,
        actor_rollout_ref__actor__ppo_mini_batch_size=256, actor_rollout_ref__actor__ppo_micro_batch_size_per_device=16,
        actor_rollout_ref__actor__optim__lr=1e-6, data__max_prompt_length=1024, data__max_response_length=1024,
        data__train_files=["/home/user/data/gsm8k/train.parquet", "/home/user/data/math/train.parquet"],
        mesh__tensor=1, mesh__fsdp=-1, trainer__total_epochs=15, **GRPO_KL)),
    "verl/examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh": ("verl", 2, (), imports(
        actor_rollout_ref__model__lora_rank=64, actor_rollout_ref__model__lora_alpha=32,
        actor_rollout_ref__model__target_modules="all-linear", data__train_batch_size=16,
        actor_rollout_ref__actor__ppo_micro_batch_size_per_device=40, actor_rollout_ref__actor__optim__lr=3e-6,
        **GRPO_KL)),
    "verl/examples/grpo_trainer/run_deepseek7b_llm_seq_balance.sh": ("verl", 8, (), imports(
        algorithm__adv_estimator="grpo", actor_rollout_ref__actor__use_dynamic_bsz=True,
        actor_rollout_ref__actor__ppo_max_token_len_per_device=24000, actor_rollout_ref__rollout__n=5)),
    "verl/examples/ppo_trainer/run_deepseek7b_llm.sh": ("verl", 8, (), imports(
        algorithm__adv_estimator="gae", critic__enable=True, actor_rollout_ref__rollout__n=1,
        data__train_batch_size=1024, critic__optim__lr=1e-5, actor_rollout_ref__actor__use_kl_loss=False)),
    # Ulysses SP 2 -> mesh.context 2: the per-SP-group micro-batches are per context group as they are
    "verl/examples/ppo_trainer/run_deepseek7b_llm_sp2.sh": ("verl", 8, (), imports(
        algorithm__adv_estimator="gae", mesh__context=2, actor_rollout_ref__actor__ppo_micro_batch_size_per_device=32,
        actor_rollout_ref__rollout__log_prob_micro_batch_size_per_device=64,
        critic__ppo_micro_batch_size_per_device=64, critic__enable=True)),
    # as shipped, a `\ # comment` on line 6 ends bash's command there (test_pf_ppo_script_... reads it mended)
    "verl/examples/ppo_trainer/run_deepseek7b_llm_pfppo.sh": ("verl", 8, (), refused(
        "line 6", "the backslash before '#' escapes a blank, so bash ends the veRL command on this line")),
    "verl/examples/ppo_trainer/run_gemma.sh": ("verl", 8, (), imports(
        algorithm__adv_estimator="gae", actor_rollout_ref__model__path="google/gemma-2-2b-it", critic__enable=True)),
    "verl/examples/rloo_trainer/run_qwen2-7b.sh": ("verl", 8, (), imports(
        algorithm__adv_estimator="rloo", actor_rollout_ref__rollout__n=5, algorithm__use_kl_in_reward=True,
        algorithm__kl_penalty="kl", algorithm__kl_ctrl__kl_coef=0.001)),
    "verl/examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh": ("verl", 8, (), imports(
        algorithm__adv_estimator="reinforce_plus_plus", actor_rollout_ref__rollout__n=8,
        actor_rollout_ref__actor__kl_loss_type="mse")),
    "verl/examples/remax_trainer/run_qwen2.5-3b_seq_balance.sh": ("verl", 8, (), imports(
        algorithm__adv_estimator="remax", algorithm__use_kl_in_reward=True, algorithm__kl_penalty="kl")),
    "verl/examples/gpg_trainer/run_qwen2-7b_math.sh": ("verl", 8, (), imports(
        algorithm__adv_estimator="gpg", actor_rollout_ref__actor__policy_loss__loss_mode="gpg")),
    "verl/examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh": ("verl", 1, (), imports(
        actor_rollout_ref__actor__policy_loss__loss_mode="cispo", actor_rollout_ref__actor__clip_ratio_low=10,
        actor_rollout_ref__actor__clip_ratio_high=0.2, data__train_batch_size=256)),
    "verl/examples/gmpo_trainer/run_qwen2_5-7b_math.sh": ("verl", 8, (), imports(
        actor_rollout_ref__actor__policy_loss__loss_mode="geo_mean", actor_rollout_ref__actor__clip_ratio_low=0.4,
        actor_rollout_ref__actor__clip_ratio_high=0.4)),
    "verl/examples/gspo_trainer/test_gspo_3b_math.sh": ("verl", 8, (), imports(
        actor_rollout_ref__actor__policy_loss__loss_mode="gspo", actor_rollout_ref__rollout__n=16,
        actor_rollout_ref__actor__clip_ratio_low=0.0003, actor_rollout_ref__actor__clip_ratio_high=0.0004,
        data__max_response_length=8192, actor_rollout_ref__actor__loss_agg_mode="seq-mean-token-mean")),
    # bypass mode's reinforce loss imports; on 8 devices its 32 sequences a mini-batch leave 4 a device, fewer than
    # its micro-batch of 8 (veRL asserts the same)
    "verl/examples/rollout_correction/run_with_rollout_corr.sh": ("verl", 8, (), refused(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=8", "must divide the per-device mini-batch")),
    "verl/examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh": ("verl", 8, (), refused(
        "actor_rollout_ref.rollout.over_sample_rate", "over-sampling (aborting the slowest requests")),
    "verl/examples/tuning/0.5b/qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh": ("verl", 1, (), refused(
        "actor_rollout_ref.rollout.n=1", "compares samples of the same prompt and needs n >= 2")),
    # Hydra defaults composed from veRL's own config groups (copied beside it)
    "verl/verl/trainer/config/ppo_trainer.yaml": ("verl", 8, ("actor_rollout_ref.model.path=/m",), imports(
        algorithm__adv_estimator="gae", data__train_batch_size=1024, actor_rollout_ref__rollout__n=1,
        actor_rollout_ref__actor__clip_ratio=0.2, actor_rollout_ref__actor__optim__lr=1e-6, critic__optim__lr=1e-5,
        data__max_prompt_length=512, actor_rollout_ref__actor__ppo_mini_batch_size=256)),
    "verl/verl/trainer/config/_generated_ppo_trainer.yaml": ("verl", 8, (), imports(
        algorithm__adv_estimator="gae", data__train_batch_size=1024, actor_rollout_ref__actor__ppo_epochs=1)),
    # TRL's documented CLI configs and open-r1's recipes
    "trl/docs/grpo_config.yaml": (".", 4, ("data.train_files=/d/train.parquet",), imports(
        algorithm__adv_estimator="grpo", actor_rollout_ref__rollout__n=8, data__train_batch_size=4,
        actor_rollout_ref__actor__ppo_micro_batch_size_per_device=8, actor_rollout_ref__actor__optim__lr=1e-6,
        actor_rollout_ref__actor__optim__lr_scheduler_type="linear", actor_rollout_ref__actor__use_kl_loss=False,
        actor_rollout_ref__actor__loss_agg_mode="token-mean", actor_rollout_ref__model__dtype="bfloat16",
        data__max_response_length=512, trainer__total_epochs=3, actor_rollout_ref__model__path="Qwen/Qwen2.5-0.5B")),
    "trl/docs/rloo_config.yaml": (".", 4, ("data.train_files=/d/train.parquet",), imports(
        algorithm__adv_estimator="trl_rloo", actor_rollout_ref__rollout__n=2, algorithm__kl_ctrl__kl_coef=0.05,
        data__train_batch_size=16, actor_rollout_ref__actor__use_kl_loss=False)),
    # open-r1's reward functions by name (rewards/named.py), weighted
    "open-r1/recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml": (".", 8, ("data.train_files=/d/train.parquet",),
                                                                    imports(
        custom_reward_function__reward_funcs=["accuracy", "format", "tag_count"],
        custom_reward_function__reward_weights=[1.0, 1.0, 1.0], actor_rollout_ref__rollout__n=16)),
    "open-r1/recipes/DeepSeek-R1-Distill-Qwen-1.5B/grpo/config_demo.yaml": (
        ".", 8, ("data.train_files=/d/train.parquet",), imports(
            custom_reward_function__reward_funcs=["accuracy", "format", "tag_count"],
            custom_reward_function__reward_weights=[1.0, 1.0, 1.0])),
    # 16 x 8 x 4 = 512 completions per optimizer step are not whole groups of 14 generations
    # launched as open-r1's README launches its GRPO recipes with use_vllm: 7 training processes, the 8th GPU
    # serving vLLM (on 8 its 16 x 8 x 4 = 512 completions a step are not whole groups of 14: TRL refuses it too)
    "open-r1/recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo_code.yaml": (".", 7, ("data.train_files=/d/train.parquet",),
                                                                         imports(
        algorithm__adv_estimator="grpo", actor_rollout_ref__rollout__n=14, data__train_batch_size=32,
        actor_rollout_ref__actor__ppo_mini_batch_size=32, custom_reward_function__reward_funcs=["code", "format"],
        custom_reward_function__reward_weights=[1.0, 0.1], data__max_response_length=2048)),
    "open-r1/recipes/Qwen2.5-Coder-7B-Instruct/grpo/config_codeforces.yaml": (".", 8, (), refused(
        "reward_funcs", "['cf_code']: these run competition checkers on open-r1's Piston / Morph servers")),
    # Trinity-RFT examples (run from Trinity's repository root, as Trinity reads them)
    "trinity/examples/grpo_lora_gsm8k/gsm8k.yaml": ("trinity", 8, (), imports(
        algorithm__adv_estimator="grpo", actor_rollout_ref__rollout__n=8, data__train_batch_size=96,
        actor_rollout_ref__model__lora_rank=16, actor_rollout_ref__model__lora_alpha=16,
        data__max_prompt_length=256, data__max_response_length=1024, data__ground_truth_key="answer",
        data__prompt_key="question", data__default_data_source="openai/gsm8k",
        data__train_files="openai/gsm8k/main/train.parquet", actor_rollout_ref__actor__optim__lr=1e-5,
        actor_rollout_ref__actor__kl_loss_type="k2", actor_rollout_ref__actor__use_dynamic_bsz=True,
        trainer__total_epochs=10)),
    "trinity/examples/ppo_countdown/countdown.yaml": ("trinity", 8, (), imports(
        algorithm__adv_estimator="gae", critic__enable=True, actor_rollout_ref__rollout__n=5,
        data__train_batch_size=960, actor_rollout_ref__actor__ppo_mini_batch_size=96, critic__optim__lr=1e-5,
        critic__cliprange_value=0.5, data__max_prompt_length=256, trainer__total_epochs=20)),
    # its training taskset's use_base (plain-text prompts) imports; its eval taskset uses the chat template
    # its eval taskset's own keys and chat template import (data.val_overrides); a key Trinity's config lacks stops it
    "trinity/examples/dapo_math/dapo.yaml": ("trinity", 8, (), refused(
        "model.max_token_len", "not a field of Trinity's ModelConfig")),
    # its rubric judge (the auxiliary model with the workflow's prompts) and std_threshold import; the explorer's
    # dynamic sync schedule stops it
    "trinity/examples/grpo_rubric/rubric.yaml": ("trinity", 8, (), refused(
        "synchronizer.sync_style", "'dynamic_by_explorer': only the fixed schedule is available")),
    "trinity/examples/dpo_humanlike/dpo.yaml": ("trinity", 8, (), refused(
        "algorithm.algorithm_type", "'dpo'")),
    "trinity/examples/mix_math/mix_math.yaml": ("trinity", 8, (), refused("algorithm.algorithm_type", "'mix'")),
    "trinity/examples/rec_gsm8k/gsm8k.yaml": ("trinity", 8, (), refused("algorithm.algorithm_type", "'rec'")),
    # its trainer_config_path file is not in Trinity's published tree we copied: the error names key and file
    "trinity/examples/cispo_gsm8k/gsm8k.yaml": ("trinity", 8, (), refused(
        "trainer.trainer_config_path", "the included file is not there")),
    # ROLL examples: whitening, reward / advantage clipping, sample masks (losses/shaping.py) and the RLVR recipes'
    # five-domain mixture (data.domains: ROLL's counts of each batch, a scorer per domain by the rows' tags, the code
    # domain's test-case columns as its ground truth, the judge on its own domain) import
    "roll/examples/docs_examples/example_grpo.yaml": (".", 8, (), imports(
        algorithm__adv_estimator="grpo", data__domains__probs=FIVE_DOMAINS_64, **ROLL_DOMAINS)),
    "roll/examples/docs_examples/example_ppo.yaml": (".", 8, (), refused(
        "critic.model_args.model_type", "TRL's value head drops its input (dropout 0.1)")),
    # its sequence-ratio loss with the dual clip: gspo with policy_loss.dual_clip
    "roll/examples/docs_examples/example_gspo.yaml": (".", 8, (), imports(
        actor_rollout_ref__actor__policy_loss__loss_mode="gspo", actor_rollout_ref__actor__policy_loss__dual_clip=True,
        data__domains__probs=FIVE_DOMAINS_64, **ROLL_DOMAINS)),
    # reward_norm / reward_shift / reward_scale: not fields of ROLL's config (dacite drops them)
    "roll/examples/docs_examples/example_reinforce_pp.yaml": (".", 8, (), imports(
        algorithm__adv_estimator="reinforce", data__domains__probs=FIVE_DOMAINS_64, **ROLL_DOMAINS)),
    "roll/examples/qwen2.5-7B-rlvr_megatron/rlvr_config.yaml": (".", 8, (), imports(
        algorithm__adv_estimator="reinforce_plus_plus", data__domains__probs=FIVE_DOMAINS_64, **ROLL_DOMAINS)),
    # its LoRA (all-linear for training = the seven projections listed for inference); 128 prompts a step
    "roll/examples/qwen2.5-7B-rlvr_megatron/rlvr_config_lora.yaml": (".", 8, (), imports(
        actor_rollout_ref__model__lora_rank=64, data__train_batch_size=128,
        data__domains__probs={"math_rule": 51 / 128, "code_sandbox": 38 / 128, "llm_judge": 12 / 128,
                              "crossthinkqa": 12 / 128, "ifeval": 15 / 128}, **ROLL_DOMAINS)),
    "roll/examples/qwen2.5-7B-rlvr_megatron/rlvr_fsdp2_sp2.yaml": (".", 8, (), imports(
        data__domains__probs=FIVE_DOMAINS_64, **ROLL_DOMAINS)),
    # one domain judged by an LLM (the policy's own initial weights): our generative reward model with ROLL's prompt
    "roll/examples/qwen2.5-7B-rlvr_megatron/rlvr_config_8gpus_llm_as_judge.yaml": (".", 8, (), imports(
        reward_model__style="generative", reward_model__model__path="Qwen/Qwen2.5-7B",
        reward_model__judge__parser="contains_yes", reward_model__judge__temperature=0.3,
        reward_model__judge__top_p=0.7, reward_model__judge__top_k=50, reward_model__judge__max_new_tokens=512,
        reward_model__judge__max_prompt_length=7680, reward_model__judge__combine="judge",
        algorithm__adv_estimator="reinforce_plus_plus", actor_rollout_ref__rollout__n=8,
        data__train_files=["data/data/llm_judge_Multi-subject-RLVR_deal_new.jsonl"])),
    # data_args.dataset_dir joins each file name, as ROLL's get_dataset does
    "roll/examples/qwen3-30BA3B-rlvr_fsdp2/rlvr_config.yaml": (".", 8, (), imports(
        algorithm__adv_estimator="reinforce_plus_plus", actor_rollout_ref__rollout__n=8, data__train_batch_size=16,
        data__train_files=["data/data/math_deepmath_deal.jsonl"], data__max_response_length=4096,
        data__domains__key="tag", data__domains__data_sources={"math_rule": "lighteval/MATH"},
        data__domains__members={"math_rule": ["deepmath_103k", "aime"]}, data__default_data_source="lighteval/MATH",
        actor_rollout_ref__actor__clip_ratio_c=1.4, algorithm__advantage_clip=2.0, algorithm__reward_clip=10,
        algorithm__difficulty_mask__enable=True, mesh__context=4)),
    # ROLL's ActorPGWorker with pg_variant topr, rewards normalised over the batch, then whitened (REINFORCE++)
    "roll/examples/qwen2.5-7B-rlvr-offpolicy/rlvr_config.yaml": (".", 8, (), imports(
        actor_rollout_ref__actor__policy_loss__loss_mode="topr", actor_rollout_ref__actor__topr_positive_weight=1.0,
        algorithm__adv_estimator="reinforce_plus_plus", algorithm__norm_mean_type="batch",
        algorithm__norm_std_type="batch", algorithm__reward_clip=10.0, algorithm__advantage_clip=2.0,
        actor_rollout_ref__rollout__n=8, data__train_batch_size=128, data__max_response_length=8192,
        data__train_files=["data/data/math_deepmath_deal.jsonl"], trainer__test_freq=10)),
    "roll/examples/qwen2.5-0.5B-agentic/agent_val_frozen_lake.yaml": (".", 8, (), refused(
        "train_env_manager", "a ROLL agentic pipeline")),
}


def resolve_peer(name, monkeypatch, items=()):
    cwd, devices, extra, _ = CASES[name]
    for key, value in SCRIPT_ENV.items():
        monkeypatch.setenv(key, value)
    folder = PEERS / cwd if cwd != "." else PEERS
    monkeypatch.chdir(folder)
    path = os.path.relpath(PEERS / name, folder)
    return resolve_command_line(default_config(), [*extra, *items], import_path=path, num_devices=devices,
                                check_paths=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_peer_file(name, monkeypatch):
    kind, expected = CASES[name][3]
    if kind == "imports":
        cfg, _ = resolve_peer(name, monkeypatch)
        got = {key: get_path(cfg, key) for key in expected}
        got = {key: value.to_dict() if hasattr(value, "to_dict") else value for key, value in got.items()}
        assert got == expected
    else:
        key, reason = expected
        with pytest.raises(ConfigError) as err:
            resolve_peer(name, monkeypatch)
        assert key in str(err.value) and reason in str(err.value), str(err.value)


def test_counts_match_docs():
    """docs/importing.md states the fixture set's outcome; no file may be a defect."""
    counts = {"imports": 0, "refused": 0}
    frameworks = {name.split("/")[0] for name in CASES}
    for _, _, _, (kind, _) in CASES.values():
        counts[kind] += 1
    text = DOCS.read_text()
    found = re.search(r"(\d+) peer files: (\d+) imported with a checked mapping, (\d+) refused with a stated "
                      r"reason, (\d+) defects", text)
    assert found, "docs/importing.md: the fixture-set count line is missing"
    assert tuple(map(int, found.groups())) == (len(CASES), counts["imports"], counts["refused"], 0)
    assert frameworks == {"verl", "trl", "open-r1", "trinity", "roll"}


def test_script_reader_names_what_it_cannot_read(tmp_path, monkeypatch):
    """Nothing in a script runs: a command substitution or an unset variable is an error naming the line."""
    script = tmp_path / "run.sh"
    script.write_text("set -x\nSTAMP=$(date +%s)\npython3 -m verl.trainer.main_ppo \\\n"
                      "    trainer.experiment_name=x_$STAMP \\\n    data.train_batch_size=$((4 * 8)) $@\n")
    monkeypatch.delenv("STAMP", raising=False)
    with pytest.raises(ConfigError, match=r"run.sh line 3: \$STAMP is set on line 2 from a command that is not run"):
        resolve_command_line(default_config(), [], import_path=str(script), num_devices=8, check_paths=False)
    monkeypatch.setenv("STAMP", "7")  # the environment wins over the script's assignment
    cfg, _ = resolve_command_line(default_config(), ["data.train_files=/d.parquet", f"{M}.path=/m",
                                                     f"{A}.ppo_mini_batch_size=8"],
                                  import_path=str(script), num_devices=8, check_paths=False)
    assert cfg.trainer.experiment_name == "x_7" and cfg.data.train_batch_size == 32


def test_hydra_searchpath_is_found_from_any_working_directory(tmp_path, monkeypatch):
    """veRL's multi-turn YAML names its config groups by `hydra.searchpath: file://verl/trainer/config`,
    relative to veRL's root; run from elsewhere it is looked for from the file's folder up."""
    folder = PEERS / "verl" / "examples" / "sglang_multiturn" / "config"
    monkeypatch.chdir(tmp_path)
    cfg, _ = resolve_command_line(default_config(), [
        f"{R}.multi_turn.tool_config_path={folder / 'tool_config' / 'gsm8k_tool_config.yaml'}"],
        import_path=str(folder / "gsm8k_multiturn_grpo.yaml"), num_devices=8, check_paths=False)
    assert cfg.data.train_batch_size == 256 and cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 5
    # from ppo_trainer.yaml, the group the searchpath found (the script sets grpo on the command line)
    assert cfg.algorithm.adv_estimator == "gae" and cfg.actor_rollout_ref.actor.ppo_epochs == 1


def test_pf_ppo_script_with_its_comment_moved_imports(tmp_path, monkeypatch):
    """veRL's pf-PPO example, its line-6 comment moved off the continued line: pf-PPO imports."""
    shipped = (PEERS / "verl" / "examples" / "ppo_trainer" / "run_deepseek7b_llm_pfppo.sh").read_text()
    mended = tmp_path / "run_deepseek7b_llm_pfppo.sh"
    mended.write_text(shipped.replace('reweight_method=pow \\  # ["pow", "max_min", "max_random"]',
                                      "reweight_method=pow \\"))
    assert mended.read_text() != shipped
    monkeypatch.chdir(PEERS / "verl")
    cfg, _ = resolve_command_line(default_config(), [], import_path=str(mended), num_devices=8, check_paths=False)
    alg = cfg.algorithm
    assert (alg.adv_estimator, alg.use_pf_ppo, alg.pf_ppo.reweight_method, alg.pf_ppo.weight_pow) == (
        "gae", True, "pow", 2.0)
    assert cfg.critic.enable


def test_the_root_reward_manager_of_a_resolved_verl_yaml(tmp_path, monkeypatch):
    """Current veRL reads the root `reward_manager.name` (its default interpolates the older
    `reward_model.reward_manager`): a resolved YAML's `dapo` imports as the naive manager with DAPO's
    shaping keys, and an explicit root name wins over the older key."""
    shipped = (PEERS / "verl" / "verl" / "trainer" / "config" / "_generated_ppo_trainer.yaml").read_text()
    interpolated = "  name: ${oc.select:reward_model.reward_manager,naive}\n"
    assert interpolated in shipped
    for name, ours in (("dapo", "naive"), ("prime", "prime")):
        resolved = tmp_path / f"{name}.yaml"
        resolved.write_text(shipped.replace(interpolated, f"  name: {name}\n"))
        cfg, _ = resolve_command_line(default_config(), [], import_path=str(resolved), num_devices=8,
                                      check_paths=False)
        assert cfg.reward_model.reward_manager == ours, name
    # as shipped (interpolated), the older key decides
    monkeypatch.chdir(PEERS / "verl")
    cfg, _ = resolve_command_line(default_config(), ["reward_model.reward_manager=prime"],
                                  import_path="verl/trainer/config/_generated_ppo_trainer.yaml", num_devices=8,
                                  check_paths=False)
    assert cfg.reward_model.reward_manager == "prime"


def test_pasted_and_yaml_placement_agree(tmp_path, monkeypatch):
    """One placement rule from YAML and from the command line, never a mesh the devices cannot hold."""
    monkeypatch.setenv("HOME", str(tmp_path))
    items = [f"{R}.tensor_model_parallel_size=4", f"{A}.fsdp_config.fsdp_size=32", "trainer.n_gpus_per_node=8",
             "trainer.nnodes=8", "data.train_files=/d.parquet", f"{M}.path=/m", "data.train_batch_size=512",
             f"{A}.ppo_mini_batch_size=64"]
    pasted, _ = resolve_command_line(default_config(), items, num_devices=64, check_paths=False)
    yaml_file = tmp_path / "placement.yaml"
    yaml_file.write_text("actor_rollout_ref:\n  rollout:\n    tensor_model_parallel_size: 4\n  actor:\n"
                         "    fsdp_config:\n      fsdp_size: 32\ntrainer:\n  n_gpus_per_node: 8\n  nnodes: 8\n")
    from_yaml, _ = resolve_command_line(default_config(), items[4:], import_path=str(yaml_file), num_devices=64,
                                        check_paths=False)
    # fsdp groups of 32, replicated over the rest (data=-1: 2 here); was fsdp 32 x tensor 4 = 128 devices
    assert (pasted.mesh.data, pasted.mesh.fsdp, pasted.mesh.tensor) == (-1, 32, 1)
    assert dict(from_yaml.mesh) == dict(pasted.mesh)
    # an HSDP group larger than the devices: one FSDP group over all of them
    small, _ = resolve_command_line(default_config(), items[1:], num_devices=8, check_paths=False)
    assert (small.mesh.data, small.mesh.fsdp) == (1, -1)


def test_megatron_expert_parallelism_becomes_the_expert_axis():
    """veRL's / ROLL's Megatron EP -> mesh.expert (reduced to what the devices hold); it splits the
    batch, so per-device sizes count it as data parallelism."""
    base = ["data.train_files=/d.parquet", f"{M}.path=/m", "data.train_batch_size=16", f"{A}.ppo_mini_batch_size=8",
            f"{A}.ppo_micro_batch_size=8"]
    cfg, _ = resolve_command_line(default_config(), [*base, f"{A}.megatron.expert_model_parallel_size=4"],
                                  num_devices=8, check_paths=False)
    assert cfg.mesh.expert == 4
    # the deprecated global micro-batch size over data x fsdp x expert = 8 devices: 1 per device
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_device == 1
    reduced, _ = resolve_command_line(default_config(), [*base, f"{A}.megatron.expert_model_parallel_size=6"],
                                      num_devices=8, check_paths=False)
    assert reduced.mesh.expert == 2


def test_rolls_judge_prompt_is_read_from_rolls_checkout():
    """The judge template the ROLL importer writes is ROLL's prompt, read (with `ast`, never run) from
    roll/utils/prompt.py of the checkout the config sits in (copied beside the examples), its fields renamed."""
    from jaxrl_llm.config.importers.roll_rewards import prompt_maps

    text = (PEERS / "roll/roll/utils/prompt.py").read_text()
    names: dict = {}
    exec(text, names)  # the peer's module holds string constants only
    assert prompt_maps(text) == names["prompt_maps"] and names["prompt_maps"]


def test_verl_vision_language_recipe_imports(tmp_path, monkeypatch):
    """veRL's Qwen2.5-VL geometry recipe as its script spells it (data.image_key, a VL model path, vLLM's
    multimodal-cache switch): it imports with the image column, the model and the packing it names, and the
    vLLM-only keys listed as changing nothing here; veRL's freeze_vision_tower is ours (False: the tower trains,
    docs/vision.md)."""
    script = tmp_path / "run_qwen2_5_vl.sh"
    script.write_text("python3 -m verl.trainer.main_ppo \\\n" + " \\\n".join(f"    {item}" for item in [
        "algorithm.adv_estimator=grpo", "data.train_files=/data/geo3k/train.parquet",
        "data.val_files=/data/geo3k/test.parquet", "data.train_batch_size=512", "data.max_prompt_length=1024",
        "data.max_response_length=2048", "data.filter_overlong_prompts=True", "data.truncation='error'",
        "data.image_key=images", f"{M}.path=/models/Qwen2.5-VL-7B-Instruct", f"{M}.use_remove_padding=True",
        f"{A}.ppo_mini_batch_size=128", f"{A}.ppo_micro_batch_size_per_gpu=10", f"{A}.use_kl_loss=True",
        f"{A}.kl_loss_coef=0.01", f"{A}.kl_loss_type=low_var_kl", f"{A}.freeze_vision_tower=True",
        f"{R}.name=vllm", f"{R}.engine_kwargs.vllm.disable_mm_preprocessor_cache=True", f"{R}.n=5",
        "trainer.n_gpus_per_node=8", "trainer.nnodes=1"]) + " $@\n")
    monkeypatch.chdir(tmp_path)
    cfg, _ = resolve_command_line(default_config(), [], import_path=str(script), num_devices=8, check_paths=False)
    assert (cfg.data.image_key, cfg.actor_rollout_ref.model.path, cfg.actor_rollout_ref.rollout.n) == (
        "images", "/models/Qwen2.5-VL-7B-Instruct", 5)
    assert cfg.actor_rollout_ref.model.use_remove_padding and cfg.data.max_prompt_length == 1024
    assert cfg.actor_rollout_ref.actor.freeze_vision_tower is True
    cfg, _ = resolve_command_line(default_config(), [f"{A}.freeze_vision_tower=False"], import_path=str(script),
                                  num_devices=8, check_paths=False)
    assert cfg.actor_rollout_ref.actor.use_kl_loss and cfg.actor_rollout_ref.actor.freeze_vision_tower is False
