"""Shared-prompt packing (`model.share_packed_prompts`, batching/plan.py `_units`): rows with the
same prompt (a group's n samples) packed into one micro-batch hold the prompt once, each response
attending to it and to itself only. Log-probs, values, updates and metrics equal the padded rows."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from test_packing import CFG, SETTINGS, N, P, R, _assert_same, _batch, _budget_update, _masked, _update

from jaxrl_llm import batching as pk
from jaxrl_llm.batching.batch_plan import MicroBatching
from jaxrl_llm.config import CriticSpec
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.roles.actor import update_actor
from jaxrl_llm.roles.critic import update_critic
from jaxrl_llm.roles.experience import log_probs_no_grad, values_no_grad
from jaxrl_llm.roles.forward import response_log_probs

GROUP = 4  # samples per prompt


def _grouped(seed=0):
    """`_batch` whose rows come in groups of GROUP with one prompt (ids and length) per group."""
    b = _batch(seed)
    ids, mask = np.asarray(b.input_ids).copy(), np.asarray(b.attention_mask).copy()
    lead = np.repeat(np.arange(0, N, GROUP), GROUP)
    ids[:, :P], mask[:, :P] = ids[lead, :P], mask[lead, :P]
    return dataclasses.replace(b, input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(mask))


def _shared(b):
    return pk.prompt_groups(np.asarray(b.input_ids), np.asarray(b.attention_mask), R)


def test_prompt_groups_match_equal_prompts_only():
    b = _grouped()
    groups = _shared(b)
    assert len(set(groups.tolist())) == N // GROUP
    assert all(len(set(groups[i:i + GROUP].tolist())) == 1 for i in range(0, N, GROUP))
    # the same tokens under another left padding (prompt length) are another prompt
    mask = np.asarray(b.attention_mask).copy()
    first = int(np.argmax(mask[0] > 0))
    mask[0, first] = 0
    again = pk.prompt_groups(np.asarray(b.input_ids), mask, R)
    assert again[0] != again[1] and again[1] == again[2]


def test_shared_layout_holds_each_prompt_once_and_scores_every_token():
    b = _grouped(3)
    mask = np.asarray(b.attention_mask)
    start, length = pk.sequence_spans(mask)
    prompt = np.clip(P - start, 0, length)
    plain = pk.plan_chunks(pk.StepRows.of_mask(mask, R), micro_rows=N, shards=1)
    shared = pk.plan_chunks(pk.StepRows.of_mask(mask, R, _shared(b)), micro_rows=N, shards=1)
    real = lambda lay: int((np.asarray(lay.segment_ids) > 0).sum())  # noqa: E731
    assert real(plain) == length.sum()
    # rows of width 16 hold a prompt and every response that fits after it
    assert real(shared) < real(plain) - prompt[::GROUP].sum()
    cover = np.asarray(pk.response_coverage(jax.tree.map(lambda x: x[0], shared), N, R))
    resp_first = np.maximum(P, start + 1)
    want = (np.arange(P, P + R)[None] >= resp_first[:, None]) & (np.arange(P, P + R)[None] < (start + length)[:, None])
    np.testing.assert_array_equal(cover, want.astype(np.float32))
    # a response's positions continue its prompt's
    pos, br = np.asarray(shared.positions)[0, 0], np.asarray(shared.branch_ids)[0, 0]
    seg = np.asarray(shared.segment_ids)[0, 0]
    r, s_ = np.unravel_index(np.argmax((br == 2) & (seg > 0)), br.shape)
    assert br[r, s_] == 2 and pos[r, s_] == (pos[r][(seg[r] == seg[r, s_]) & (br[r] == 0)].max() + 1)


def test_shared_no_grad_passes_equal_padded():
    b = _grouped(2)
    params = init_params(CFG, jax.random.PRNGKey(0))
    vparams = init_params(CFG, jax.random.PRNGKey(0), head="value")
    rows = pk.StepRows.of_mask(np.asarray(b.attention_mask), R, _shared(b))
    for layout, micro_rows in ((pk.plan_chunks(rows, 8, 2), 8), (pk.plan_capacity_chunks(rows, 2, 40), 0)):
        assert (np.asarray(layout.branch_ids) >= 2).any()  # some prompt is shared
        kw = dict(model_cfg=CFG, temperature=0.7, compute_dtype="float32")
        want = log_probs_no_grad(params, b.input_ids, b.attention_mask, b.response_mask, micro_rows=8, **kw)
        got = log_probs_no_grad(params, b.input_ids, b.attention_mask, b.response_mask, layout,
                                micro_rows=micro_rows, **kw)
        np.testing.assert_allclose(_masked(got, b.response_mask), _masked(want, b.response_mask), atol=1e-5)
        kw = dict(model_cfg=CFG, compute_dtype="float32")
        want = values_no_grad(vparams, b.input_ids, b.attention_mask, b.response_mask, micro_rows=8, **kw)
        got = values_no_grad(vparams, b.input_ids, b.attention_mask, b.response_mask, layout,
                             micro_rows=micro_rows, **kw)
        np.testing.assert_allclose(_masked(got, b.response_mask), _masked(want, b.response_mask), atol=1e-5)


def test_shared_log_probs_equal_padded_under_a_sliding_window():
    # a later response sits further from its prompt in the packed row than in its own sequence: the window counts
    # the sequence's distance (Gemma 3: its sliding layers only; Mistral: every layer)
    b = _grouped(2)
    rows = pk.StepRows.of_mask(np.asarray(b.attention_mask), R, _shared(b))
    layout = pk.plan_chunks(rows, 8, 2)
    assert (np.asarray(layout.branch_ids) >= 2).any()
    for family in ("gemma3_text", "mistral"):
        cfg = dataclasses.replace(ModelConfig.tiny(family, vocab_size=64), sliding_window=3)
        params = init_params(cfg, jax.random.PRNGKey(0))
        kw = dict(model_cfg=cfg, temperature=1.0, compute_dtype="float32")
        want = log_probs_no_grad(params, b.input_ids, b.attention_mask, b.response_mask, micro_rows=8, **kw)
        got = log_probs_no_grad(params, b.input_ids, b.attention_mask, b.response_mask, layout, micro_rows=8, **kw)
        np.testing.assert_allclose(_masked(got, b.response_mask), _masked(want, b.response_mask), atol=1e-5)


def test_a_response_sees_its_prompt_and_not_its_siblings():
    b = _grouped(5)
    rows = pk.StepRows.of_mask(np.asarray(b.attention_mask), R, _shared(b))
    layout = jax.tree.map(lambda x: x[0], pk.plan_chunks(rows, N, 1))
    params = init_params(CFG, jax.random.PRNGKey(0))
    lp = jax.jit(lambda ids: response_log_probs(params, CFG, ids, b.attention_mask, R, packing=layout))
    base = np.asarray(lp(b.input_ids))
    resp = np.asarray(b.response_mask) > 0
    # the first response of a segment with a second one after it: changing it moves its own later
    # log-probs and none of its siblings' (which follow it in the row)
    tok, br = np.asarray(layout.token_index)[0], np.asarray(layout.branch_ids)[0]
    r, c = np.argwhere(br == 2)[0]
    row = int(tok[r][br[r] == 1][-1]) // (P + R)
    ids = np.asarray(b.input_ids).copy()
    ids[row, P:] = (ids[row, P:] + 5) % 60 + 3
    moved = np.abs(np.asarray(lp(jnp.asarray(ids))) - base) > 1e-6
    others = np.arange(N) != row
    assert moved[row][resp[row]].any() and not moved[others][resp[others]].any()
    ids = np.asarray(b.input_ids).copy()
    ids[0:GROUP, :P] = (ids[0:GROUP, :P] + 7) % 60 + 3  # the group's prompt: all its responses move
    moved = np.abs(np.asarray(lp(jnp.asarray(ids))) - base) > 1e-6
    assert all(moved[i][resp[i]].all() for i in range(GROUP))
    assert not moved[GROUP:][resp[GROUP:]].any()


# Parameters after an Adam step: shared-prompt rows have other shapes than padded ones, and on AVX2-only
# CPUs XLA's matmuls then reduce in other orders; the step turns that rounding into parameter
# differences up to ~1.2e-5 (3 of 2048 entries on an AMD EPYC; within 1e-5 on some AVX-512 machines, 3.1e-5 on a
# Sapphire Rapids one with AVX-512 FP16: 1 of 2048, 2026-12-07). A shared prompt's gradient lost or counted twice
# moves them by 1e-2 and more
PARAM_ATOL = 1e-4


def test_shared_updates_equal_padded():
    params = init_params(CFG, jax.random.PRNGKey(0))
    b = _grouped(1)
    s = dataclasses.replace(SETTINGS, loss_agg_mode="seq-mean-token-sum")
    padded = _update(update_actor, params, s, b, packed=False)[:2]
    _assert_same(padded, _update(update_actor, params, s, b, packed=True, shared=_shared(b))[:2], atol=PARAM_ATOL)
    budget, packing, _ = _budget_update(update_actor, params, s, b, budget=40, shared=_shared(b))
    _assert_same(padded, budget, atol=PARAM_ATOL)
    assert (np.asarray(packing.layout.branch_ids) >= 2).any()
    vparams = init_params(CFG, jax.random.PRNGKey(0), head="value")
    cs = CriticSpec(cliprange_value=0.5, loss_agg_mode="token-mean", compute_dtype="float32", remat="none",
                    ppo_epochs=1, shuffle=False)
    _assert_same(_update(update_critic, vparams, cs, b, packed=False)[:2],
                 _budget_update(update_critic, vparams, cs, b, budget=40, shared=_shared(b))[0])


def test_shared_budget_update_equals_padded_on_8_devices():
    # 2 row shards x 4-way tensor parallel; unshuffled, each shard's mini-batch rows are one group
    mesh = Mesh(np.array(jax.devices()).reshape(2, 1, 4), ("data", "fsdp", "tensor"))
    params = init_params(CFG, jax.random.PRNGKey(0))
    b, s = _grouped(4), dataclasses.replace(SETTINGS, shuffle=False)
    padded = _update(update_actor, params, s, b, packed=False)[:2]
    got, packing, _ = _budget_update(update_actor, params, s, b, budget=32, mesh=mesh, shared=_shared(b))
    assert (np.asarray(packing.layout.branch_ids) >= 2).any()
    _assert_same(padded, got)


def test_share_packed_prompts_key_turns_sharing_off_per_model(tmp_path):
    """`model.share_packed_prompts=False` (policy) keeps the critic's sharing and packs the policy's
    rows one sequence per segment, through the step's batching plan."""
    import tiny_runs

    from jaxrl_llm.config import resolve, validate_config

    cfg = tiny_runs.tiny_config(tmp_path, **{"actor_rollout_ref.model.share_packed_prompts": False,
                                              "algorithm.adv_estimator": "gae"})
    spec = resolve(validate_config(cfg, dp_size=1, check_paths=False), dp_size=1)
    assert not spec.model.share_packed_prompts and spec.critic_model.share_packed_prompts
    b = _grouped(2)
    rows = pk.StepRows.of_mask(np.asarray(b.attention_mask), R, _shared(b))
    batching = pk.StepBatching(dataclasses.replace(spec.plan, dp_size=1), shards=1)
    micro = MicroBatching("test", per_device=None, token_budget=None)
    policy = batching.no_grad(micro, spec.model, rows).layout
    critic = batching.no_grad(micro, spec.critic_model, rows).layout
    assert np.asarray(policy.branch_ids).max() == 1  # every segment is one prompt + one response
    assert np.asarray(critic.branch_ids).max() >= 2  # the critic's segments share their prompt