"""Every configs/*.py loads (get_config) and validates on 1 and 8 data-parallel devices."""
import importlib.util
import pathlib

import pytest

from jaxrl_llm.config import default_config, resolve, validate_config

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.py"))


def load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_all_expected_configs_exist():
    names = {p.stem for p in CONFIG_FILES}
    assert {"quickstart", "tiny", "grpo_gsm8k", "ppo_gsm8k", "rloo", "reinforce_pp", "dapo"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("dp", [1, 8])
def test_config_loads_and_validates(path, dp):
    loaded = load(path)
    if path.stem.startswith("sft_"):  # launch/sft.py validates the RL keys it derives from the sft section
        from jaxrl_llm.sft import sft_view

        loaded = sft_view(loaded)
    cfg = validate_config(loaded, dp_size=dp, check_paths=False)
    assert set(cfg.keys()) == set(default_config().keys())
    spec = resolve(cfg, dp_size=dp, num_train_samples=4096)
    plan = spec.plan
    assert plan.actor.optimizer_steps >= 1
    assert plan.sequences % dp == 0
    assert spec.trainer.total_steps >= 1 and spec.actor_optim.total_steps == spec.trainer.total_steps


def test_algorithm_specific_settings():
    ppo = validate_config(load(CONFIG_DIR / "ppo_gsm8k.py"), dp_size=8, check_paths=False)
    assert ppo.algorithm.adv_estimator == "gae" and ppo.critic.enable
    dapo = validate_config(load(CONFIG_DIR / "dapo.py"), dp_size=8, check_paths=False)
    a = dapo.actor_rollout_ref.actor
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert dapo.algorithm.filter_groups.enable and dapo.reward_model.reward_kwargs.overlong_buffer_cfg.enable
    assert not dapo.critic.enable
    for name, estimator in [("rloo", "rloo"), ("reinforce_pp", "reinforce_plus_plus"), ("grpo_gsm8k", "grpo"),
                            ("quickstart", "grpo")]:
        assert load(CONFIG_DIR / f"{name}.py").algorithm.adv_estimator == estimator


def test_quickstart_and_tiny_validate_with_paths(smollm2_gguf, tmp_path):
    for name in ("quickstart", "tiny"):
        cfg = load(CONFIG_DIR / f"{name}.py")
        cfg.trainer.default_local_dir = str(tmp_path / name)
        out = validate_config(cfg, num_devices=1)  # paths checked; the synthetic data is written at start
        assert out.data.train_files == str(tmp_path / name / "data" / "train.parquet")
        assert out.trainer.total_training_steps == cfg.trainer.total_training_steps
    assert load(CONFIG_DIR / "quickstart.py").actor_rollout_ref.model.path == str(smollm2_gguf)
