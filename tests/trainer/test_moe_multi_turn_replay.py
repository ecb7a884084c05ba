"""Routing replay in multi-turn rollouts (actor.router_replay = rollout with rollout.multi_turn): every
generation records its experts and each continuation's prefill replays the experts its conversation
ran in the earlier turns, so every token has one routing across all turns. On a near-tied router the
trainer's own routing flips and its log-probs drift from the sampler's on the later turns; replaying
the rollout's record brings every turn's model tokens back to the fp32 floor. Static sampler (rounds)
and the paged engine (streaming, and in rounds as several processes run it) alike."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import tiny_runs
from moe_cases import near_tied
from tiny_runs import GUESS_YAML

from jaxrl_llm.models.moe import NOT_RECORDED
from jaxrl_llm.rollout import multi_turn as mt_module
from jaxrl_llm.trainer import Trainer

pytestmark = pytest.mark.usefixtures("smollm2_gguf")
MT = "actor_rollout_ref.rollout.multi_turn"


@pytest.fixture(scope="module", params=["static", "paged", "paged_rounds"])
def rollout(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"mt_moe_{request.param}")
    (tmp / "guess.yaml").write_text(GUESS_YAML)
    cfg = tiny_runs.tiny_config(tmp / "run", **{
        "actor_rollout_ref.model.path": "tiny:qwen3_moe", "actor_rollout_ref.actor.router_replay": "rollout",
        "data.synthetic.task": "guess", "data.max_prompt_length": 96, "data.max_response_length": 64,
        f"{MT}.enable": True, f"{MT}.interaction_config_path": str(tmp / "guess.yaml"),
        f"{MT}.max_assistant_turns": 3,
        # every token ends a turn: three one-token model turns with the environment's replies between
        "actor_rollout_ref.rollout.stop_token_ids": list(range(49152)),
        "actor_rollout_ref.rollout.engine": request.param.removesuffix("_rounds")})
    trainer = Trainer(cfg)
    params = near_tied(trainer.actor.model_params)
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "paged_rounds":  # the rounds several processes run (PagedContinue), in this one
            patch.setattr(mt_module, "jax", tiny_runs.TwoProcesses())
        out = trainer.generator.generate(next(trainer.train_loader), params, trainer.spec.train_sampling,
                                         jax.random.key(0))
    return trainer, params, out


def test_every_turn_is_recorded_in_the_rollout_layout(rollout):
    trainer, _, out = rollout
    cfg = trainer.actor.model_cfg
    assert out.routing is not None
    routing, attention = np.asarray(out.routing), np.asarray(out.attention_mask).astype(bool)
    assert routing.shape == (*attention.shape, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert (routing[~attention] == NOT_RECORDED).all()  # padding: nothing fed
    fed = attention.copy()
    last = attention.shape[1] - 1 - np.argmax(attention[:, ::-1], axis=1)
    fed[np.arange(len(fed)), last] = False  # the last model token is never fed
    assert (routing[fed] >= 0).all() and (routing[fed] < cfg.num_experts).all()
    assert (routing[np.arange(len(fed)), last] == NOT_RECORDED).all()
    assert float(np.asarray(out.response_mask).sum(1).min()) == 3  # three model turns per trajectory


def test_replay_brings_every_turn_to_the_floor(rollout):
    trainer, params, out = rollout
    on = np.asarray(out.response_mask) > 0
    sampled = np.asarray(out.rollout_log_probs)
    replayed = np.asarray(trainer.log_probs(params, out))
    free = np.asarray(trainer.log_probs(params, dataclasses.replace(out, routing=None)))
    assert np.abs(free - sampled)[on].max() > 1e-3  # routed by itself, the trainer drifts
    # one routing per token for all turns: the sampler's prefills replayed the earlier turns' experts.
    # The fp32 floor: a few units in the last place of each log-prob (~-11 here, 1 ulp = 9.5e-7; the
    # engine's block sums may round differently from the trainer's), against > 1e-3 routed freely
    floor = 4 * np.spacing(np.abs(sampled[on]).astype(np.float32))
    assert (np.abs(replayed - sampled)[on] <= floor).all(), np.abs(replayed - sampled)[on].max()
    metrics = trainer.step()
    assert 0.0 < metrics["moe/routing_agreement"] <= 1.0
