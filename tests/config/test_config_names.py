"""The validator's name lists are the registries' own names (no second list to drift)."""
import pytest

from jaxrl_llm.config import names
from jaxrl_llm.data import synthetic
from jaxrl_llm.losses import agg, rollout_correction
from jaxrl_llm.losses.advantages import ADV_ESTIMATORS
from jaxrl_llm.losses.kl import KL_ESTIMATORS
from jaxrl_llm.losses.policy import POLICY_LOSSES
from jaxrl_llm.models.dtypes import COMPUTE_DTYPES
from jaxrl_llm.rewards.managers import REWARD_MANAGERS

SOURCES = [
    (names.adv_estimators, lambda: ADV_ESTIMATORS.names()),
    (names.policy_losses, lambda: POLICY_LOSSES.names()),
    (names.kl_base_names, lambda: KL_ESTIMATORS.names()),
    (names.loss_agg_modes, lambda: agg.LOSS_AGG_MODES),
    (names.rollout_is_levels, lambda: rollout_correction.IS_LEVELS),
    (names.rollout_rs_modes, lambda: tuple(rollout_correction.RS_MODES) + tuple(rollout_correction.RS_LEGACY)),
    (names.reward_managers, lambda: REWARD_MANAGERS),
    (names.synthetic_tasks, lambda: synthetic.TASKS),
    (names.synthetic_answer_formats, lambda: synthetic.ANSWER_FORMATS),
]


@pytest.mark.parametrize("read,source", SOURCES, ids=[s[0].__name__ for s in SOURCES])
def test_names_are_the_registries(read, source):
    got = read()
    assert isinstance(got, tuple) and got == tuple(sorted(got))
    assert set(got) == set(source())


def test_no_fallback_lists_left():
    assert not [n for n in vars(names) if n.startswith("FALLBACK")]


def test_kl_names_include_straight_through_and_full():
    kl = names.kl_names()
    assert {"k1", "k3+", "low_var_kl+", "full", "mse"} <= set(kl)
    assert set(kl) == set(KL_ESTIMATORS.names()) | {n + "+" for n in KL_ESTIMATORS.names()} | {"full"}


def test_capability_filters_reach_the_config():
    assert names.adv_estimators(needs_group_ids=True) == (
        "gpg", "grpo", "grpo_passk", "grpo_vectorized", "opo", "reinforce_plus_plus_baseline", "rloo",
        "rloo_vectorized", "trl_rloo")
    assert names.adv_estimators(needs_values=True) == ("gae",)
    assert names.policy_losses(fixed_agg_mode=None) == ("cispo", "gpg", "m2po", "reinforce", "topr", "vanilla")


def test_dtypes_come_from_the_dtype_table():
    assert names.DTYPES == COMPUTE_DTYPES == ("float32", "bfloat16")
