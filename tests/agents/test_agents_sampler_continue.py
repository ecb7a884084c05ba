"""End to end over the real (static) sampler: a tiny random model plays guess-the-number for three
turns; its rollout log-probs on the model tokens equal a fresh forward over the final token ids."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from agent_fixtures import hermes_char_tokenizer

from jaxrl_llm.agents import ChatRenderer, GuessNumberEnv, Trajectory, TurnLimits, run_multi_turn
from jaxrl_llm.agents.sampler_continue import StaticSamplerContinue, tool_call_stop_ids
from jaxrl_llm.models import ModelConfig, compute_logits, init_params
from jaxrl_llm.sampler import SamplingParams


def test_static_sampler_multi_turn_logprobs_match_a_forward_pass():
    tok = hermes_char_tokenizer()
    cfg = ModelConfig.tiny("llama", vocab_size=len(tok), max_position_embeddings=1024)
    # random params without compiling init_params: shapes from eval_shape, values from numpy
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    params = jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.ones(s.shape, s.dtype) if "norm" in jax.tree_util.keystr(path)
        else jnp.asarray(rng.normal(0.0, 0.1, s.shape), s.dtype), shapes)
    # every printable character stops a turn, so turns stay short and end on "stop" or EOS
    sampling = SamplingParams(temperature=1.0, stop_token_ids=tuple(range(4, len(tok))), seed=3)
    cont = StaticSamplerContinue(params, cfg, sampling, pad_token_id=tok.pad_token_id, prefix_length=320)
    renderer = ChatRenderer(tok)
    trajs = [Trajectory.start(renderer, [], row={"extra_info": {"interaction_kwargs": {"target": t}}},
                              env=GuessNumberEnv({"max_guesses": 3})) for t in (5, 50)]
    res = run_multi_turn(trajs, cont, limits=TurnLimits(max_response_length=200, max_tokens_per_turn=6),
                         sanity_check=True)
    assert tool_call_stop_ids(tok) == ()  # "</tool_call>" is 12 characters here
    # one right-padded forward over both final conversations (one compile)
    batch = np.zeros((2, 320), np.int32)
    valid = np.zeros((2, 320), np.int32)
    for row, t in enumerate(res.trajectories):
        batch[row, :len(t.ids)], valid[row, :len(t.ids)] = t.ids, 1
    all_logp = np.asarray(jax.nn.log_softmax(compute_logits(params, cfg, jnp.asarray(batch), jnp.asarray(valid)),
                                             axis=-1))
    for row, t in enumerate(res.trajectories):
        assert t.assistant_turns == 3 and t.stop_reason == "env_done" and t.user_turns == 2
        ids = np.asarray(t.ids)
        logp = all_logp[row, np.arange(len(ids) - 1), ids[1:]]
        p = len(t.prompt_ids)
        rescored = np.asarray(logp)[p - 1:]  # log p(response token i | everything before it)
        mask = np.asarray(t.loss_mask, bool)
        np.testing.assert_allclose(np.asarray(t.response_log_probs)[mask], rescored[mask], atol=2e-4)
        assert mask.sum() == sum(t.turn_lengths) and (~mask).sum() > 0
    assert res.mismatches == [None, None] and cont.calls == 3
    assert res.metrics["multi_turn/num_turns/mean"] == 6.0
