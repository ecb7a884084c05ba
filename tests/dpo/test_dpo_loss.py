"""The DPO losses and their gradients equal TRL's formulas (written out below as TRL's DPOTrainer computes
them, in torch); the loss of a batch through the model equals those formulas on transformers' log-probs;
micro-batches of whole pairs accumulate to the whole batch's gradient."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.dpo.loss import DpoBatch, dpo_loss, pair_losses, pair_metrics
from jaxrl_llm.roles.update import denominators
from jaxrl_llm.sft.batch import collate
from jaxrl_llm.sft.data import SftExample


def trl_losses(chosen, rejected, ref_chosen, ref_rejected, loss_type, beta, label_smoothing):
    """TRL DPOTrainer.dpo_loss for sigmoid / ipo / hinge (torch tensors in, per-pair losses out)."""
    import torch.nn.functional as F

    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    return F.relu(1 - beta * logits)


@pytest.mark.parametrize("loss_type,beta,ls", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0),
                                               ("ipo", 0.7, 0.0), ("hinge", 0.1, 0.0), ("hinge", 2.0, 0.0)])
def test_losses_and_gradients_equal_trls_formulas(loss_type, beta, ls):
    import torch

    rng = np.random.default_rng(0)
    values = [rng.normal(-20.0, 5.0, 16).astype(np.float32) for _ in range(4)]
    tensors = [torch.tensor(v, requires_grad=True) for v in values]
    want = trl_losses(*tensors, loss_type, beta, ls)
    want.mean().backward()

    def ours(c, r, rc, rr):
        return jnp.mean(pair_losses(c, r, rc, rr, loss_type=loss_type, beta=beta, label_smoothing=ls))

    got = pair_losses(*map(jnp.asarray, values), loss_type=loss_type, beta=beta, label_smoothing=ls)
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    grads = jax.grad(ours, argnums=(0, 1, 2, 3))(*map(jnp.asarray, values))
    for g, t in zip(grads, tensors):
        np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=1e-4, atol=1e-7)


def test_metrics_have_trls_names_and_values():
    c, r, rc, rr = (jnp.asarray(x, jnp.float32) for x in ([-1.0, -5.0], [-2.0, -1.0], [-1.5, -4.0], [-1.5, -1.5]))
    m = pair_metrics(c, r, rc, rr, beta=0.5, num_pairs=jnp.float32(2.0))
    np.testing.assert_allclose([float(m["rewards/chosen"]), float(m["rewards/rejected"])],
                               [0.5 * ((0.5) + (-1.0)) / 2, 0.5 * ((-0.5) + (0.5)) / 2])
    assert float(m["rewards/accuracies"]) == 0.5  # pair 0: 0.25 > -0.25; pair 1: -0.5 < 0.25
    assert float(m["rewards/margins"]) == pytest.approx(float(m["rewards/chosen"]) - float(m["rewards/rejected"]))
    assert float(m["logps/chosen"]) == -3.0 and float(m["logps/rejected"]) == -1.5


def _pairs(rng: np.random.Generator, vocab: int) -> list[SftExample]:
    rows = []
    for p, rc, rr in [(4, 5, 3), (6, 2, 7), (3, 4, 4)]:
        prompt = rng.integers(3, vocab, p).astype(np.int32)
        for r in (rc, rr):
            rows.append(SftExample(prompt, rng.integers(3, vocab, r).astype(np.int32), np.ones(r, np.float32), "row"))
    return rows


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_the_batch_loss_equals_trl_on_transformers_log_probs(hf_llama, loss_type):
    import torch

    torch_model, cfg, params = hf_llama
    host = collate(_pairs(np.random.default_rng(1), cfg.vocab_size), pad_id=0, group_size=2)
    ref = np.asarray([-30.0, -28.0, -25.0, -31.0, -27.0, -26.0], np.float32)
    batch = DpoBatch(host.input_ids, host.attention_mask, host.response_mask, jnp.asarray(ref))
    loss, _ = dpo_loss(params, batch, denominators(host.response_mask), model_cfg=cfg, loss_type=loss_type,
                       beta=0.1, label_smoothing=0.0, compute_dtype="float32", remat=False, logprob_impl="xla")
    p = host.input_ids.shape[1] - host.response_mask.shape[1]
    positions = np.maximum(np.cumsum(host.attention_mask, axis=1) - 1, 0)
    with torch.no_grad():
        logits = torch_model(input_ids=torch.tensor(host.input_ids, dtype=torch.long),
                             attention_mask=torch.tensor(host.attention_mask),
                             position_ids=torch.tensor(positions)).logits
    logps = torch.log_softmax(logits[:, p - 1:-1].float(), -1).gather(
        -1, torch.tensor(host.input_ids[:, p:], dtype=torch.long)[..., None])[..., 0]
    mask = torch.tensor(host.response_mask)
    seq, ref_t = (logps * mask).sum(-1), torch.tensor(ref)
    if loss_type == "ipo":  # TRL averages the log-probs per token for ipo
        seq, ref_t = seq / mask.sum(-1), ref_t / mask.sum(-1)
    want = trl_losses(seq[0::2], seq[1::2], ref_t[0::2], ref_t[1::2], loss_type, 0.1, 0.0).mean()
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)


def test_micro_batches_of_whole_pairs_accumulate_to_the_whole_batch_gradient(hf_llama):
    _, cfg, params = hf_llama
    host = collate(_pairs(np.random.default_rng(2), cfg.vocab_size), pad_id=0, group_size=2)
    ref = jnp.asarray(np.random.default_rng(3).normal(-25, 3, 6).astype(np.float32))
    denoms = denominators(host.response_mask)

    def loss_of(rows: slice):
        mb = DpoBatch(host.input_ids[rows], host.attention_mask[rows], host.response_mask[rows], ref[rows])
        return lambda q: dpo_loss(q, mb, denoms, model_cfg=cfg, loss_type="sigmoid", beta=0.1, label_smoothing=0.0,
                                  compute_dtype="float32", remat=False, logprob_impl="xla")[0]

    whole = jax.grad(loss_of(slice(0, 6)))(params)
    parts = [jax.grad(loss_of(slice(i, i + 2)))(params) for i in (0, 2, 4)]
    summed = jax.tree.map(lambda *g: sum(g), *parts)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(summed)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-7)
