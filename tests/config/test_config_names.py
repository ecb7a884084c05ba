"""The validator's name lists come from the registries; the built-in fallbacks agree with them."""
import importlib.util

import pytest

from jaxrl_llm.config import names

REGISTRIES = [
    ("jaxrl_llm.losses.advantages", names.adv_estimators, names.FALLBACK_ADV_ESTIMATORS),
    ("jaxrl_llm.losses.policy", names.policy_losses, names.FALLBACK_POLICY_LOSSES),
    ("jaxrl_llm.losses.kl", names.kl_base_names, names.FALLBACK_KL_BASE),
    ("jaxrl_llm.losses.agg", names.loss_agg_modes, names.FALLBACK_LOSS_AGG_MODES),
    ("jaxrl_llm.losses.rollout_correction", names.rollout_is_levels, names.FALLBACK_ROLLOUT_IS),
    ("jaxrl_llm.losses.rollout_correction", names.rollout_rs_modes, names.FALLBACK_ROLLOUT_RS),
    ("jaxrl_llm.rewards.managers", names.reward_managers, names.FALLBACK_REWARD_MANAGERS),
    ("jaxrl_llm.data.synthetic", names.synthetic_tasks, names.FALLBACK_SYNTHETIC_TASKS),
    ("jaxrl_llm.data.synthetic", names.synthetic_answer_formats, names.FALLBACK_SYNTHETIC_FORMATS),
]


@pytest.mark.parametrize("module,read,fallback", REGISTRIES, ids=[r[1].__name__ for r in REGISTRIES])
def test_fallback_lists_agree_with_registries(module, read, fallback):
    names_now = read()
    if importlib.util.find_spec(module) is None:
        assert names_now == tuple(sorted(fallback))
    else:  # the registry has landed: the fallback must list exactly its names
        assert set(names_now) == set(fallback)


def test_kl_names_include_straight_through_and_full():
    kl = names.kl_names()
    assert {"k1", "k3+", "low_var_kl+", "full", "mse"} <= set(kl)
