"""One decode step's token choice: temperature, top-k, top-p, greedy, and the chosen token's logprob.

Works on [B, V] fp32 logits only (never [B, T, V]). The reported logprob is always that of the
full softmax of `logits / temperature` (no top-k / top-p truncation), the quantity the trainer
scores (`jaxrl_llm.losses.logprob.token_logprobs(..., temperature=T)`), computed from the very
logits the token was sampled from. Greedy decoding reports it at temperature 1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.models import invariant
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings

Array = jax.Array


def filtered_logits(scaled: Array, top_k: int, use_top_p: bool, top_p: Array) -> tuple[Array, Array | None]:
    """Candidate logits after top-k then top-p (on the top-k-renormalised distribution, as HF / vLLM).

    Returns (candidate logits [B, C], candidate token ids [B, C] or None when C == V and the
    candidates are the vocabulary itself). Dropped candidates are -inf. Only top-p without top-k
    sorts the whole vocabulary.
    """
    if not top_k and not use_top_p:
        return scaled, None
    k = top_k or scaled.shape[-1]
    vals, ids = lax.top_k(scaled, k)  # sorted, largest first
    if use_top_p:
        probs = jax.nn.softmax(vals, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        vals = jnp.where(mass_before < top_p, vals, -jnp.inf)  # the top token always survives
    return vals, ids


DRAW_BLOCK = 256  # candidates per block of the two-level inverse-CDF draw (`draw_from`)


def _first_above(cdf: Array, target: Array, mass: Array) -> Array:
    """Per row: the first index whose cumulative mass `cdf` exceeds `target`, clipped to the last
    index of non-zero `mass` (guards a target that rounds up to the row's total); int32."""
    pick = jnp.sum((cdf <= target[:, None]).astype(jnp.int32), axis=-1)
    last_nz = mass.shape[-1] - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1)
    return jnp.minimum(pick, last_nz).astype(jnp.int32)


def row_uniforms(keys: Array) -> Array:
    """One fp32 uniform in [0, 1) per PRNG key of keys [B] (a row's draw from its own key)."""
    return jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)


def draw_from(probs: Array, u: Array, block: int = DRAW_BLOCK) -> Array:
    """Inverse-CDF draw: per row of probs [B, C] (unnormalised, >= 0) the first index whose cumulative
    mass exceeds u [B] (uniforms in [0, 1)) times the row's total; int32 [B]. Always an index of
    non-zero mass. (`draw_with_total` also returns the row totals.)"""
    return draw_with_total(probs, u, block)[0]


def draw_with_total(probs: Array, u: Array, block: int = DRAW_BLOCK) -> tuple[Array, Array]:
    """(`draw_from`'s indices, each row's total mass [B]): the total the draw sums anyway, for a
    caller that needs it too (the log-partition of `choose_per_row`).

    Two levels when C > 2 * block: the block of the draw from the blocks' total masses, then the
    index inside that block. A cumulative sum over a whole 49k vocabulary row is a log-depth tree of
    passes over it on CPU; this reads the row once (the block sums) and sums `block` entries of one
    block."""
    b, c = probs.shape
    if c <= 2 * block:
        cdf = jnp.cumsum(probs, axis=-1)
        return _first_above(cdf, u * cdf[:, -1], probs), cdf[:, -1]
    num_blocks = -(-c // block)
    blocks = jnp.pad(probs, ((0, 0), (0, num_blocks * block - c))).reshape(b, num_blocks, block)
    block_mass = jnp.sum(blocks, axis=-1)  # [B, blocks]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    total = block_cdf[:, -1]
    target = u * total
    chosen = _first_above(block_cdf, target, block_mass)  # [B]
    # mass before each block: the block cdf's previous entry exactly (so <= target for the chosen one)
    starts = jnp.pad(block_cdf[:, :-1], ((0, 0), (1, 0)))
    before = jnp.take_along_axis(starts, chosen[:, None], axis=-1)[:, 0]
    inside = jnp.take_along_axis(blocks, chosen[:, None, None], axis=1)[:, 0]  # [B, block]
    offset = _first_above(jnp.cumsum(inside, axis=-1), target - before, inside)
    return chosen * block + offset, total


def choose_tokens(logits: Array, key: Array, knobs: SampleKnobs, settings: SampleSettings
                  ) -> tuple[Array, Array]:
    """(token ids [B] int32, their logprobs [B] fp32) from next-token logits [B, V] (fp32)."""
    logits = logits.astype(jnp.float32)
    scaled = logits / knobs.temperature  # temperature is 1.0 when greedy (see SampleKnobs)
    if settings.greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        cand, cand_ids = filtered_logits(scaled, settings.top_k, settings.use_top_p, knobs.top_p)
        pick = jax.random.categorical(key, cand, axis=-1)
        tokens = pick if cand_ids is None else jnp.take_along_axis(cand_ids, pick[:, None], axis=-1)[:, 0]
    tokens = tokens.astype(jnp.int32)
    chosen = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    if settings.batch_invariant:  # the trainer's batch-invariant log-prob, chunk for chunk (models/invariant.py)
        return tokens, invariant.token_log_prob(logits, tokens, knobs.temperature)
    return tokens, chosen - jax.nn.logsumexp(scaled, axis=-1)
