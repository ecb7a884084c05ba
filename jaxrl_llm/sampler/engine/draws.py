"""A token's draw per slot row: its PRNG key from the request alone, the draw itself, and whether
the token ends the sequence (shared by `insert`, plain decode steps and speculative verification)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models import invariant
from jaxrl_llm.sampler.core import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sampler.sampling import choose_tokens, draw_with_total, filtered_logits, row_uniforms

Array = jax.Array


def request_keys(rng: Array, request: Array, token_index: Array) -> Array:
    """One PRNG key per row from (prompt index, sample index, token index) only."""
    one = lambda r, t: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, r[0]), r[1]), t)  # noqa: E731
    return jax.vmap(one)(request, token_index)


def choose_per_row(logits: Array, keys: Array, knobs: SampleKnobs, settings: SampleSettings
                   ) -> tuple[Array, Array]:
    """(tokens [S], log-probs [S]) with one key per row (a row's draw does not depend on its
    neighbours); the same distribution and log-probs as `choose_tokens`.

    Sampling is by inverse CDF: one uniform per row against the cumulative candidate
    probabilities. The Gumbel-max draw of `jax.random.categorical` needs one random number per
    vocabulary entry (49k for SmolLM2), which on CPU cost ~3/4 of the sampling step and a third
    of a whole 16-slot decode step; this needs S numbers (tests/sampler/test_engine_sampling.py)."""
    if settings.greedy:
        one = lambda lg, key: choose_tokens(lg[None], key, knobs, settings)  # noqa: E731
        tok, lp = jax.vmap(one)(logits, keys)
        return tok[:, 0], lp[:, 0]
    scaled = logits.astype(jnp.float32) / knobs.temperature
    cand, cand_ids = filtered_logits(scaled, settings.top_k, settings.use_top_p, knobs.top_p)
    # the softmax's weights, unnormalised (the draw scales u by the total); dropped candidates -> 0
    peak = jnp.max(cand, axis=-1)
    weights = jnp.exp(cand - peak[:, None])
    pick, total = draw_with_total(weights, row_uniforms(keys))
    if settings.batch_invariant:  # the trainer's batch-invariant log-prob (models/invariant.py)
        tok = pick if cand_ids is None else jnp.take_along_axis(cand_ids, pick[:, None], axis=-1)[:, 0]
        tok = tok.astype(jnp.int32)
        return tok, invariant.token_log_prob(logits, tok, knobs.temperature)
    if cand_ids is None:  # the candidates are the vocabulary: the draw's total gives the log-partition too
        tok, log_total = pick, peak + jnp.log(total)
    else:
        tok, log_total = jnp.take_along_axis(cand_ids, pick[:, None], axis=-1)[:, 0], jax.nn.logsumexp(scaled, axis=-1)
    tok = tok.astype(jnp.int32)
    chosen = jnp.take_along_axis(scaled, tok[:, None], axis=-1)[:, 0]
    return tok, chosen - log_total


def is_eos(tok: Array, knobs: SampleKnobs) -> Array:
    """Whether each token (any shape) is an EOS id."""
    return jnp.any(tok[..., None] == knobs.eos_ids, axis=-1)


def ends_sequence(tok: Array, knobs: SampleKnobs) -> Array:
    """Whether each token (any shape) ends its sequence: an EOS or a stop id."""
    return is_eos(tok, knobs) | jnp.any(tok[..., None] == knobs.stop_ids, axis=-1)


def finish_codes(tok: Array, num_gen: Array, knobs: SampleKnobs, max_new: Array) -> tuple[Array, Array]:
    """(ends [S] bool, reason [S]) after a slot emitted `tok` as its `num_gen`-th token (`max_new`:
    each slot's budget)."""
    eos = is_eos(tok, knobs)
    is_stop = ~eos & ends_sequence(tok, knobs)
    reason = jnp.where(eos, FINISH_EOS, jnp.where(is_stop, FINISH_STOP, FINISH_LENGTH))
    return eos | is_stop | (num_gen >= max_new), reason
