"""Per-token outputs of the update loop (roles/update.py TOKEN_OUTPUT): whatever the micro- and
mini-batch split and the shuffle, each row's values come back in the batch's row order, from epoch 0
(what the actor's in-loss rollout correction returns its log-probs through)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_runs import ToyBatch, toy_loss

from jaxrl_llm.roles.update import TOKEN_OUTPUT, run_update_epochs

KEY = TOKEN_OUTPUT + "prediction"


def _loss_with_prediction(params, mb, denoms):
    loss, metrics = toy_loss(params, mb, denoms)
    # the rows' predictions under the params this micro-batch saw, 0 off its tokens
    metrics = {**metrics, KEY: jnp.where(mb.response_mask > 0, jax.lax.stop_gradient(mb.x @ params["w"]), 0.0)}
    return loss, metrics


def _batch(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    mask = (rng.random((rows, 4)) > 0.3).astype(np.float32)
    x, y = (np.asarray(rng.normal(size=(rows, d)), np.float32) for d in (3, 4))
    return ToyBatch(x, y, mask)


def _run(batch, params, **kw):
    tx = optax.sgd(0.1)
    update = jax.jit(functools.partial(run_update_epochs, tx=tx, loss_fn=_loss_with_prediction, metric_prefix="toy",
                                       token_outputs=(KEY,), **kw))
    new, _, metrics = update(params, tx.init(params), batch, jax.random.PRNGKey(3))
    return jax.device_get(new), jax.device_get(metrics)


@pytest.mark.parametrize("num_mini,num_micro,shuffle,epochs", [(1, 1, False, 1), (1, 4, True, 1), (2, 2, True, 3)])
def test_token_outputs_come_back_in_row_order(num_mini, num_micro, shuffle, epochs):
    batch = _batch()
    params = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(3, 4)), jnp.float32), "b": jnp.zeros(4)}
    new, metrics = _run(batch, params, ppo_epochs=epochs, num_mini_batches=num_mini, num_micro_batches=num_micro,
                        shuffle=shuffle)
    got = metrics[KEY]
    assert got.shape == batch.y.shape
    assert not np.allclose(new["w"], params["w"])  # the optimizer steps moved the params
    if num_mini == 1:  # one optimizer step per epoch: epoch 0 saw the initial params for every row
        want = np.where(batch.response_mask > 0, batch.x @ np.asarray(params["w"]), 0.0)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:  # epoch 0's first mini-batch ran at the initial params, its second one step later
        first = np.where(batch.response_mask > 0, batch.x @ np.asarray(params["w"]), 0.0)
        at_start = np.all(np.isclose(got, first, rtol=1e-6, atol=1e-6), axis=1)
        assert batch.response_mask.sum(1).min() > 0  # every row has tokens to tell the two apart
        assert at_start.sum() == len(at_start) // num_mini
    # the other metrics are still the summed scalars
    assert np.ndim(metrics["toy/loss"]) == 0
