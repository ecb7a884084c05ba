"""Sequence packing (model.use_remove_padding, batching/plan.py): packed updates and no-grad
passes equal the padded ones, attention stays inside a sequence, positions restart, shapes come
from buckets (no recompile across steps with other lengths), dynamic micro-batches fill the budget."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tiny_models import random_rollout

from jaxrl_llm import batching as pk
from jaxrl_llm.batching.batch_plan import MicroBatching
from jaxrl_llm.config import ActorSpec, CriticSpec
from jaxrl_llm.models import ModelConfig, forward_hidden, init_params
from jaxrl_llm.models.cache import segment_positions
from jaxrl_llm.roles.actor import update_actor
from jaxrl_llm.roles.critic import update_critic
from jaxrl_llm.roles.experience import Experience, log_probs_no_grad, pad_experience, values_no_grad
from jaxrl_llm.roles.forward import response_log_probs

CFG = ModelConfig.tiny("llama", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)
N, P, R = 16, 7, 9
SETTINGS = ActorSpec(loss_mode="vanilla", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                     clip_ratio_c=3.0, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                     kl_loss_type="low_var_kl", temperature=0.7, compute_dtype="float32", remat="none",
                     loss_scale_factor=None, loss_kwargs=(), ppo_epochs=2, shuffle=True)
ROWS_SPEC = PartitionSpec(("data", "fsdp"))


def _batch(seed=0, max_prompt=P, max_resp=R):
    rng = np.random.default_rng(seed)
    ids, mask, resp_mask, _, _ = random_rollout(rng, N, P, R, min_prompt=1, max_prompt=max_prompt,
                                                max_response=max_resp)
    return Experience(
        input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(mask),
        response_mask=jnp.asarray(resp_mask, jnp.float32),
        old_log_probs=jnp.asarray(rng.normal(-3.0, 0.3, (N, R)), jnp.float32),
        ref_log_probs=jnp.asarray(rng.normal(-3.0, 0.3, (N, R)), jnp.float32),
        advantages=jnp.asarray(rng.normal(size=(N, R)), jnp.float32),
        values=jnp.asarray(rng.normal(size=(N, R)), jnp.float32),
        returns=jnp.asarray(rng.normal(size=(N, R)), jnp.float32))


def _masked(x, mask):
    return np.asarray(x) * np.asarray(mask)


def _place(b, mesh):
    if mesh is None:
        return b, None, 1
    rows = lambda v: NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (v.ndim - 1))))  # noqa: E731
    b = jax.tree.map(lambda v: jax.device_put(v, rows(v)), b)
    return b, NamedSharding(mesh, ROWS_SPEC), mesh.shape["data"] * mesh.shape["fsdp"]


def _update(update_fn, params, s, b, packed, mesh=None, num_micro=2, shared=None):
    tx = optax.sgd(0.5)
    b, sharding, shards = _place(b, mesh)
    rng = jax.random.PRNGKey(1)
    packing = None
    if packed:
        rows = pk.StepRows.of_mask(np.asarray(b.attention_mask), R, shared)
        packing, num_micro = pk.plan_update(rows, rng, epochs=s.ppo_epochs, shuffle=s.shuffle, num_mini=2,
                                            num_micro=num_micro, shards=shards)
    fn = jax.jit(functools.partial(update_fn, model_cfg=CFG, s=s, tx=tx, num_mini_batches=2,
                                   num_micro_batches=num_micro, rows_sharding=sharding))
    new, _, metrics = fn(params, tx.init(params), b, rng, None, packing)
    return jax.device_get(new), jax.device_get(metrics), fn


def _assert_same(a, b, atol=1e-5):
    (pa, ma), (pb, mb) = a, b
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=atol, rtol=1e-5), pa, pb)
    assert set(ma) == set(mb)
    for k in ma:
        np.testing.assert_allclose(ma[k], mb[k], atol=1e-5, rtol=1e-5, err_msg=k)


def test_packed_actor_update_equals_padded():
    params = init_params(CFG, jax.random.PRNGKey(0))
    s = dataclasses.replace(SETTINGS, loss_agg_mode="seq-mean-token-sum")
    padded = _update(update_actor, params, s, _batch(), packed=False)[:2]
    packed = _update(update_actor, params, s, _batch(), packed=True)[:2]
    _assert_same(padded, packed)
    assert padded[1]["actor/grad_norm"] > 0
    moved = jax.tree.map(lambda x, y: float(np.abs(x - y).max()), params, padded[0])
    assert max(jax.tree.leaves(moved)) > 1e-4  # the update did change the params


def test_packed_actor_update_equals_padded_on_8_devices():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
    params = init_params(CFG, jax.random.PRNGKey(0))
    padded = _update(update_actor, params, SETTINGS, _batch(), packed=False)[:2]
    packed8 = _update(update_actor, params, SETTINGS, _batch(), packed=True, mesh=mesh, num_micro=1)[:2]
    _assert_same(padded, packed8)


def test_packed_critic_update_equals_padded():
    params = init_params(CFG, jax.random.PRNGKey(0), head="value")
    s = CriticSpec(cliprange_value=0.5, loss_agg_mode="token-mean", compute_dtype="float32", remat="none",
                   ppo_epochs=1, shuffle=False)
    _assert_same(_update(update_critic, params, s, _batch(1), packed=False)[:2],
                 _update(update_critic, params, s, _batch(1), packed=True)[:2])


def test_no_grad_passes_equal_padded():
    b = _batch(2)
    mask = np.asarray(b.attention_mask)
    layout = pk.plan_chunks(pk.StepRows.of_mask(mask, R), micro_rows=8, shards=2)
    params = init_params(CFG, jax.random.PRNGKey(0))
    kw = dict(model_cfg=CFG, temperature=0.7, compute_dtype="float32", micro_rows=8)
    want = log_probs_no_grad(params, b.input_ids, b.attention_mask, b.response_mask, **kw)
    got = log_probs_no_grad(params, b.input_ids, b.attention_mask, b.response_mask, layout, **kw)
    np.testing.assert_allclose(_masked(got, b.response_mask), _masked(want, b.response_mask), atol=1e-5)
    assert np.all(np.asarray(got)[np.asarray(b.response_mask) == 0] == 0)
    vparams = init_params(CFG, jax.random.PRNGKey(0), head="value")
    kw = dict(model_cfg=CFG, compute_dtype="float32", micro_rows=8)
    want = values_no_grad(vparams, b.input_ids, b.attention_mask, b.response_mask, **kw)
    got = values_no_grad(vparams, b.input_ids, b.attention_mask, b.response_mask, layout, **kw)
    np.testing.assert_allclose(_masked(got, b.response_mask), _masked(want, b.response_mask), atol=1e-5)


def test_attention_does_not_cross_sequences_and_positions_restart():
    b = _batch(3)
    mask = np.asarray(b.attention_mask)
    layout = pk.plan_chunks(pk.StepRows.of_mask(mask, R), micro_rows=N, shards=1)
    row = int(np.argmax(np.asarray(layout.segment_ids)[0, 0].max(-1)))  # the row with most sequences
    seg = np.asarray(layout.segment_ids)[0, 0, row]
    assert seg.max() >= 2  # this row packs several sequences
    params = init_params(CFG, jax.random.PRNGKey(0))
    one = jax.tree.map(lambda x: x[0], layout)
    lp = jax.jit(lambda ids: response_log_probs(params, CFG, ids, b.attention_mask, R, packing=one))
    base = np.asarray(lp(b.input_ids))
    # change every token of the row's first sequence: only that sequence's log-probs move
    first = int(np.asarray(layout.token_index)[0, 0, row, 0]) // (P + R)
    ids = np.asarray(b.input_ids).copy()
    ids[first] = (ids[first] + 5) % 60 + 3
    changed = np.asarray(lp(jnp.asarray(ids)))
    resp = np.asarray(b.response_mask) > 0
    others = np.ones(N, bool)
    others[first] = False
    np.testing.assert_array_equal(changed[others], base[others])
    assert np.abs(changed[first][resp[first]] - base[first][resp[first]]).max() > 1e-3
    # positions restart at 0 at each segment start
    pos = np.asarray(segment_positions(jnp.asarray(seg[None])))[0]
    starts = np.flatnonzero(np.diff(np.concatenate([[-1], seg])) != 0)
    assert np.all(pos[starts] == 0) and np.all(np.diff(pos)[np.diff(seg) == 0] == 1)


def test_segment_hidden_equals_separate_sequences():
    params = init_params(CFG, jax.random.PRNGKey(0))
    a, c = np.arange(3, 8), np.arange(10, 13)
    packed = jnp.asarray(np.concatenate([a, c, [0, 0]])[None], jnp.int32)
    seg = jnp.asarray([[1] * 5 + [2] * 3 + [0, 0]], jnp.int32)
    h, _ = forward_hidden(params, CFG, packed, (seg > 0).astype(jnp.int32), segment_ids=seg)
    ha, _ = forward_hidden(params, CFG, jnp.asarray(a[None]), jnp.ones((1, 5), jnp.int32))
    hc, _ = forward_hidden(params, CFG, jnp.asarray(c[None]), jnp.ones((1, 3), jnp.int32))
    np.testing.assert_allclose(np.asarray(h[0, :5]), np.asarray(ha[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(h[0, 5:8]), np.asarray(hc[0]), atol=1e-5)


def test_no_recompile_across_steps_with_other_lengths():
    params = init_params(CFG, jax.random.PRNGKey(0))
    tx = optax.sgd(0.5)
    fn = jax.jit(functools.partial(update_actor, model_cfg=CFG, s=SETTINGS, tx=tx, num_mini_batches=2,
                                   num_micro_batches=2))
    real = set()
    # three steps, three length mixes of similar size (a much lighter mix packs into a smaller row
    # bucket, another program: seed 5's 266 real tokens fit 3 rows instead of 4)
    for seed in (4, 6, 7):
        b = _batch(seed)
        packing, _ = pk.plan_update(pk.StepRows.of_mask(np.asarray(b.attention_mask), R), jax.random.PRNGKey(seed),
                                    epochs=2, shuffle=True, num_mini=2, num_micro=2, shards=1)
        real.add(pk.packing_stats(packing.layout)["real_tokens"])
        fn(params, tx.init(params), b, jax.random.PRNGKey(seed), None, packing)
    assert len(real) == 3  # the steps really had different length mixes
    assert fn._cache_size() == 1  # ... and all ran the one compiled update program


def test_buckets():
    assert [pk.bucket(x) for x in (1, 8, 9, 11, 17, 33, 100)] == [1, 8, 10, 12, 20, 40, 112]
    assert pk.row_width(5) == 8 and pk.row_width(100) == 128 and pk.row_width(700) == 768
    assert pk.row_width(1100) == 1280


def test_row_width_picked_for_fewest_computed_tokens():
    # 1632 real tokens: the narrowest width (512, bucket of the longest 388) needs 4 rows = 2048
    # computed tokens; 896-wide rows hold them in 2 rows = 1792, so the layout takes 896
    lengths = np.array([211, 250, 388, 297, 260, 226])
    mask = (np.arange(400)[None] >= 400 - lengths[:, None]).astype(np.int32)
    layout = pk.build_layout(pk.StepRows.of_mask(mask, 8), np.arange(6).reshape(1, 1, 6))
    assert layout.segment_ids.shape == (1, 1, 2, 896)
    stats = pk.packing_stats(layout)
    assert stats == {"computed_tokens": 1792, "real_tokens": int(lengths.sum())}
    # 100 + 250 tokens: two 256-wide rows (512) or one 384-wide row (384); once one row holds them
    # all, wider candidates only add padding and are not tried
    two = (np.arange(400)[None] >= 400 - np.array([[100], [250]])).astype(np.int32)
    small = pk.build_layout(pk.StepRows.of_mask(two, 8), np.arange(2).reshape(1, 1, 2))
    assert small.segment_ids.shape == (1, 1, 1, 384)
    # a tie (211 + 250: two 256-wide rows or one 512-wide row) keeps the narrower width
    tie = pk.build_layout(pk.StepRows.of_mask(mask[:2], 8), np.arange(2).reshape(1, 1, 2))
    assert tie.segment_ids.shape == (1, 1, 2, 256)


def test_aligned_segments_start_at_key_blocks():
    """Batch-invariant packing (`StepRows.aligned`): every sequence starts at a multiple of the attention's key
    block and is its own segment (no shared prompt), in fixed-size and token-budget layouts alike; first-fit
    counts each sequence as its length rounded up to the multiple, so a row still holds every token it gets."""
    lengths = np.array([211, 250, 388, 297, 260, 226, 40, 90])
    mask = (np.arange(400)[None] >= 400 - lengths[:, None]).astype(np.int32)
    rows = pk.StepRows.of_mask(mask, 8, prompt_groups=np.zeros(8, np.int32)).aligned(128)
    assert rows.prompt_groups is None and rows.segment_align == 128
    for layout in (pk.build_layout(rows, np.arange(8).reshape(1, 1, 8)), pk.plan_capacity_chunks(rows, 1, 2048)):
        seg = np.asarray(layout.segment_ids)
        seg = seg.reshape(-1, seg.shape[-1])
        starts = np.nonzero(np.diff(seg, axis=1, prepend=0) > 0)[1]
        assert len(starts) == 8 and starts.max() > 0 and np.all(starts % 128 == 0), starts
        assert pk.packing_stats(layout)["real_tokens"] == lengths.sum()
    # the same rows back to back: some sequence starts mid-block
    seg = np.asarray(pk.build_layout(dataclasses.replace(rows, segment_align=1), np.arange(8).reshape(1, 1, 8))
                     .segment_ids)[0, 0]
    assert np.any(np.nonzero(np.diff(seg, axis=1, prepend=0) > 0)[1] % 128)


def test_balanced_orders_even_out_micro_batches_within_mini_batches():
    # consecutive rows are one prompt's samples: in order, micro-batch 0 would hold all the long ones
    length = np.array([300, 290, 280, 270, 20, 30, 40, 50])
    orders = np.arange(8)[None]
    out = pk.balanced_orders(length, orders, num_mini=2, bins=2)
    for b in range(2):  # each mini-batch keeps its rows; its 2 micro-batches of 2 hold ~equal tokens
        assert sorted(out[0, 4 * b:4 * b + 4]) == list(range(4 * b, 4 * b + 4))
    assert [int(length[out[0, i:i + 2]].sum()) for i in range(0, 8, 2)] == [570, 570, 70, 70]
    assert np.array_equal(pk.balanced_orders(length, orders, num_mini=2, bins=1), orders)
    # through plan_update (1 mini-batch, 2 micro-batches): the consecutive order would put 1140 tokens
    # in micro-batch 0 and 140 in 1, both shaped 2 rows x 640; balanced, each holds 640 in 1 x 640
    mask = (np.arange(300)[None] >= 300 - length[:, None]).astype(np.int32)
    consecutive = pk.build_layout(pk.StepRows.of_mask(mask, 8), np.arange(8).reshape(1, 1, 2, 1, 4))
    assert pk.packing_stats(consecutive)["computed_tokens"] == 2 * 2 * 640
    packing, _ = pk.plan_update(pk.StepRows.of_mask(mask, 8), jax.random.PRNGKey(0), epochs=1, shuffle=False,
                                num_mini=1, num_micro=2, shards=1)
    assert sorted(packing.order[0].tolist()) == list(range(8))
    assert pk.packing_stats(packing.layout) == {"computed_tokens": 2 * 640, "real_tokens": 1280}


def _budget_update(update_fn, params, s, b, budget, mesh=None, fn=None, shared=None):
    tx = optax.sgd(0.5)
    b, sharding, shards = _place(b, mesh)
    rng = jax.random.PRNGKey(1)
    rows = pk.StepRows.of_mask(np.asarray(b.attention_mask), b.response_mask.shape[1], shared)
    packing, num_micro = pk.plan_update(rows, rng, epochs=s.ppo_epochs, shuffle=s.shuffle, num_mini=2, num_micro=None,
                                        shards=shards, token_budget=budget)
    assert packing.by_budget and num_micro == 1
    fn = fn or jax.jit(functools.partial(update_fn, model_cfg=CFG, s=s, tx=tx, num_mini_batches=2,
                                         num_micro_batches=1, rows_sharding=sharding))
    new, _, metrics = fn(params, tx.init(params), b, rng, None, packing)
    return (jax.device_get(new), jax.device_get(metrics)), packing, fn


def test_token_budget_layout_fills_fixed_micro_batches():
    b = _batch(8)
    mask = np.asarray(b.attention_mask)
    _, length = pk.sequence_spans(mask)
    budget, shards = 48, 2
    packing, _ = pk.plan_update(pk.StepRows.of_mask(mask, R), jax.random.PRNGKey(0), epochs=1, shuffle=False,
                                num_mini=1, num_micro=None, shards=shards, token_budget=budget)
    seg = np.asarray(packing.layout.segment_ids)
    # rows of the width bucket of P + R = 16 tokens, budget // 16 = 3 rows per micro-batch, and
    # enough micro-batches for 8 sequences per shard alone in their rows: ceil(8 / 3) = 3
    assert seg.shape == (1, 1, 3, shards, 3, 16)
    assert pk.capacity_shape(P + R, budget, N // shards) == (3, 3, 16)
    real = (seg > 0).sum((-1, -2))  # [.., micro, shard] real tokens
    assert real.max() <= budget and real.sum() == length.sum()
    # every sequence is packed exactly once: its token indices (relative to its shard) all appear
    tok = np.asarray(packing.layout.token_index)
    for s in range(shards):
        got = np.sort(tok[0, 0, :, s][seg[0, 0, :, s] > 0])
        rows = np.arange(N).reshape(shards, -1)[s]
        want = np.sort(np.concatenate([i * (P + R) + np.flatnonzero(mask[r]) for i, r in enumerate(rows)]))
        np.testing.assert_array_equal(got, want)
    # the shapes come from the config alone: shorter sequences give the same shapes
    short = np.asarray(_batch(9, max_prompt=2, max_resp=2).attention_mask)
    again, _ = pk.plan_update(pk.StepRows.of_mask(short, R), jax.random.PRNGKey(0), epochs=1, shuffle=False,
                              num_mini=1, num_micro=None, shards=shards, token_budget=budget)
    assert again.layout.segment_ids.shape == seg.shape
    assert (np.asarray(again.layout.segment_ids).reshape(3, -1) > 0).any(1).tolist() == [True, False, False]


def test_token_budget_update_equals_padded():
    params = init_params(CFG, jax.random.PRNGKey(0))
    s = dataclasses.replace(SETTINGS, loss_agg_mode="seq-mean-token-mean")
    padded = _update(update_actor, params, s, _batch(), packed=False)[:2]
    budget, packing, _ = _budget_update(update_actor, params, s, _batch(), budget=40)
    _assert_same(padded, budget)
    seg = np.asarray(packing.layout.segment_ids)
    used = (seg > 0).any((-1, -2, -3))  # [epochs, mini, micro]
    assert used.sum(-1).min() >= 2 and not used.all()  # several micro-batches, and skipped empty ones


def test_token_budget_update_equals_padded_on_8_devices():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
    params = init_params(CFG, jax.random.PRNGKey(0))
    padded = _update(update_actor, params, SETTINGS, _batch(), packed=False)[:2]
    _assert_same(padded, _budget_update(update_actor, params, SETTINGS, _batch(), budget=32, mesh=mesh)[0])
    vparams = init_params(CFG, jax.random.PRNGKey(0), head="value")
    s = CriticSpec(cliprange_value=0.5, loss_agg_mode="token-mean", compute_dtype="float32", remat="none",
                   ppo_epochs=1, shuffle=False)
    _assert_same(_update(update_critic, vparams, s, _batch(1), packed=False)[:2],
                 _budget_update(update_critic, vparams, s, _batch(1), budget=32, mesh=mesh)[0])


def test_token_budget_update_shapes_do_not_follow_lengths():
    """Steps whose prompt / response buckets and length mixes differ, padded to the config's longest
    shapes (`pad_experience`), run one compiled update program per response-slot size (2 at most)."""
    params = init_params(CFG, jax.random.PRNGKey(0))
    fn, real, slots = None, set(), set()
    for seed, prompt_len, resp_len in ((4, P, R), (6, 5, 6), (7, 3, 9)):
        b = _batch(seed)
        cut = Experience(  # a step with a smaller prompt and response bucket
            input_ids=b.input_ids[:, P - prompt_len:P + resp_len],
            attention_mask=b.attention_mask[:, P - prompt_len:P + resp_len],
            **{f: getattr(b, f)[:, :resp_len] for f in ("response_mask", "old_log_probs", "ref_log_probs",
                                                         "advantages", "values", "returns")})
        padded = pad_experience(cut, P - prompt_len, R - resp_len)
        assert padded.input_ids.shape == (N, P + R) and padded.response_mask.shape == (N, R)
        _, packing, fn = _budget_update(update_actor, params, SETTINGS, padded, budget=40, fn=fn)
        real.add(pk.packing_stats(packing.layout)["real_tokens"])
        slots.add(packing.layout.response_src.shape[-1])
    assert len(real) == 3
    # one program: the response slots are every token a micro-batch computes (2 x 16)
    assert slots == {32} and fn._cache_size() == 1


def test_lm_head_skips_slot_blocks_past_the_filled_ones(monkeypatch):
    """The token-budget update through an LM head run in blocks of 8 response slots (most of the
    capacity unfilled, so blocks are skipped) still equals the padded update."""
    from jaxrl_llm.losses import logprob
    monkeypatch.setattr(logprob, "ROW_BLOCK", 8)
    params = init_params(CFG, jax.random.PRNGKey(0))
    padded = _update(update_actor, params, SETTINGS, _batch(), packed=False)[:2]
    budget, packing, _ = _budget_update(update_actor, params, SETTINGS, _batch(), budget=40)
    _assert_same(padded, budget)
    filled = np.asarray(pk.filled_slots(packing.layout, N // 2, R))
    assert (~filled.reshape(-1, 8).any(-1)).any()  # some block of 8 slots holds no response token


def test_token_budget_no_grad_passes_equal_padded():
    b = _batch(2)
    layout = pk.plan_capacity_chunks(pk.StepRows.of_mask(np.asarray(b.attention_mask), R), shards=2, token_budget=40)
    assert (np.asarray(layout.segment_ids) > 0).any((1, 2, 3)).sum() >= 2
    params = init_params(CFG, jax.random.PRNGKey(0))
    kw = dict(model_cfg=CFG, temperature=0.7, compute_dtype="float32")
    want = log_probs_no_grad(params, b.input_ids, b.attention_mask, b.response_mask, micro_rows=8, **kw)
    got = log_probs_no_grad(params, b.input_ids, b.attention_mask, b.response_mask, layout, micro_rows=0, **kw)
    np.testing.assert_allclose(_masked(got, b.response_mask), _masked(want, b.response_mask), atol=1e-5)
    vparams = init_params(CFG, jax.random.PRNGKey(0), head="value")
    kw = dict(model_cfg=CFG, compute_dtype="float32")
    want = values_no_grad(vparams, b.input_ids, b.attention_mask, b.response_mask, micro_rows=8, **kw)
    got = values_no_grad(vparams, b.input_ids, b.attention_mask, b.response_mask, layout, micro_rows=0, **kw)
    np.testing.assert_allclose(_masked(got, b.response_mask), _masked(want, b.response_mask), atol=1e-5)


@pytest.mark.usefixtures("smollm2_gguf")
def test_trainer_step_same_with_and_without_packing(tmp_path):
    """One PPO step (critic: value pass + update, reference KL loss, shuffled) gives the same
    metrics packed and padded: the same trainer runs the step twice from the same state."""
    import tiny_runs

    from jaxrl_llm.trainer import Trainer

    cfg = tiny_runs.tiny_config(tmp_path / "run", **{
        "trainer.total_training_steps": 1, "trainer.test_freq": -1, "data.max_response_length": 16,
        "algorithm.adv_estimator": "gae", "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.shuffle": True})
    trainer = Trainer(cfg)
    assert trainer.spec.model.use_remove_padding and trainer.spec.critic_model.use_remove_padding  # the default
    state = jax.tree.map(jnp.copy, trainer.state())  # the update donates params and optimizer state
    loader_state, kl_coef = trainer.train_loader.get_state(), trainer.kl_ctrl.value

    def step(packs: bool):
        metrics = trainer.train_step(next(trainer.train_loader))
        assert ("perf/packing/real_tokens" in metrics) == packs  # the step really ran (un)packed
        return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/"))}

    def configure(spec):  # the run's spec where each pass reads it: the batching plan and the roles
        from jaxrl_llm.batching import StepBatching

        trainer.spec, trainer.batching = spec, StepBatching(spec.plan, trainer.dp_size)
        trainer.actor.model, trainer.actor.batch = spec.model, spec.plan.actor
        trainer.critic.model, trainer.critic.batch = spec.critic_model, spec.plan.critic

    def reset():
        for role in ("actor", "critic"):
            getattr(trainer, role).params = jax.tree.map(jnp.copy, state[role]["params"])
            getattr(trainer, role).opt_state = jax.tree.map(jnp.copy, state[role]["opt_state"])
        trainer.train_loader.set_state(loader_state)
        trainer.kl_ctrl.value = kl_coef

    packed = step(packs=True)
    reset()
    spec = trainer.spec
    configure(dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, use_remove_padding=False),
        critic_model=dataclasses.replace(spec.critic_model, use_remove_padding=False)))
    padded = step(packs=False)
    # and packed to a token budget (use_dynamic_bsz) in every pass: rows padded to the config's
    # longest shapes, several fixed-size micro-batches per mini-batch
    reset()
    budget = MicroBatching("ppo_max_token_len_per_device", None, 96)
    plan = spec.plan
    configure(dataclasses.replace(spec, plan=dataclasses.replace(
        plan, actor=dataclasses.replace(plan.actor, micro=budget),
        critic=dataclasses.replace(plan.critic, micro=budget),
        ref_log_prob=budget, values=budget)))
    by_budget = step(packs=True)
    trainer.close()
    assert by_budget.keys() == packed.keys()
    for key in padded:
        np.testing.assert_allclose(by_budget[key], padded[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert padded.keys() == packed.keys()
    assert "actor/kl_loss" in padded  # 0 here: the first update's policy is the reference
    # pg_loss is rounding noise here (one mini-batch at ratio 1 averages whitened advantages: their
    # mean, ~1e-8, exactly 0 on some CPUs), so the advantages' spread shows the actor's input is real
    assert abs(padded["actor/pg_loss"]) < 1e-6 and padded["critic/advantages/max"] > 0.1
    for key in ("actor/grad_norm", "actor/entropy", "critic/vf_loss", "critic/values/mean"):
        assert key in padded and padded[key] != 0, key
    for key in padded:
        np.testing.assert_allclose(packed[key], padded[key], rtol=1e-5, atol=1e-5, err_msg=key)
