"""Reward and advantage shaping around the estimator, as ROLL does it (`get_sample_level_mask`,
`reward_postprocess` and `compute_advantage` in its roll/utils/functionals.py; docs/algorithms.md,
"Shaping around the estimator"): sample-level masks, reward clipping, whitening of rewards or
advantages over the step's response tokens, advantage clipping. Each clip also returns the fraction
it clipped, for ROLL's metrics."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.losses.masked import dense_group_index, group_count, group_sum, masked_whiten

Array = jax.Array


@jax.jit  # traced, masked_whiten yields NaN (not an error) for <= 1 token, which the `where` drops
def whiten_tokens(x: Array, mask: Array) -> Array:
    """`x` whitened over the batch's response tokens (losses/masked.py `masked_whiten`), zero off the
    mask. Left as it is where the batch holds at most one response token (ROLL skips whitening an
    empty mask)."""
    mask = jnp.asarray(mask, jnp.float32)
    return jnp.where(jnp.sum(mask) > 1, masked_whiten(x, mask), x) * mask


def clip_symmetric(x: Array, limit: float, counted: Array) -> tuple[Array, Array]:
    """(`x` clamped to [-limit, limit], the fraction of the `counted` entries that were outside)."""
    counted = jnp.asarray(counted, jnp.float32)
    outside = (jnp.abs(x) > limit).astype(jnp.float32) * counted
    return jnp.clip(x, -limit, limit), jnp.sum(outside) / jnp.maximum(jnp.sum(counted), 1.0)


def _with_sequence_scores(token_level_scores: Array, mask: Array, score: Array, new: Array) -> Array:
    """The token scores with each row's sum moved from `score` to `new`: the difference goes to its last
    response token (where the reward manager places a score), the row's other token scores stay."""
    width = mask.shape[1]
    last = width - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=-1)  # a multi-turn row's mask has holes
    moved = jnp.where(jnp.arange(width) == last[:, None], (new - score)[:, None], 0.0)
    return token_level_scores + moved * mask


def clip_sequence_scores(token_level_scores: Array, response_mask: Array, limit: float) -> tuple[Array, Array]:
    """Each response's score (its token scores' sum, placed on its last response token as the reward
    manager places it) clamped to [-limit, limit]; the fraction of responses clipped."""
    mask = jnp.asarray(response_mask, jnp.float32)
    score = jnp.sum(token_level_scores * mask, axis=-1)
    clipped, frac = clip_symmetric(score, limit, jnp.any(mask > 0, axis=-1))
    return _with_sequence_scores(token_level_scores, mask, score, clipped), frac


def normalize_scores(token_level_scores: Array, response_mask: Array, group_ids: Array, *,
                     mean_type: str | None, std_type: str | None) -> Array:
    """ROLL's `reward_norm` of each response's score: minus the mean over the step's responses ('batch') or
    over its prompt's ('group'), then divided by the standard deviation (unbiased, about its own mean, as
    torch.std) over the batch or the group, + 1e-6; None: that step is skipped."""
    mask = jnp.asarray(response_mask, jnp.float32)
    score = jnp.sum(token_level_scores * mask, axis=-1)
    seg = dense_group_index(group_ids)
    n = score.shape[0]

    def mean_std(kind: str) -> tuple[Array, Array]:
        if kind == "group":
            count = group_count(seg)
            mean = group_sum(score, seg) / count
            return mean, jnp.sqrt(group_sum((score - mean) ** 2, seg) / jnp.maximum(count - 1, 1))
        mean = jnp.mean(score)
        return mean, jnp.sqrt(jnp.sum((score - mean) ** 2) / max(n - 1, 1))

    stats = {kind: mean_std(kind) for kind in {mean_type, std_type} if kind}  # once per kind
    new = score - stats[mean_type][0] if mean_type else score
    if std_type:
        new = new / (stats[std_type][1] + 1e-6)
    return _with_sequence_scores(token_level_scores, mask, score, new)


def sample_mask(scores: np.ndarray, response_lengths: np.ndarray, group_ids: np.ndarray, *,
                max_response_length: int, max_len_mask: bool = False,
                difficulty: tuple[float, float] | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """ROLL's sample-level masks (`get_sample_level_mask`), host side: 1.0 for each response the loss and
    the advantages keep, 0.0 for one left out, and ROLL's metrics (each `*_ratio` the share kept).
    `max_len_mask`: leave out responses that reached `max_response_length` tokens. `difficulty` (low,
    high): keep only the prompts whose mean score over their samples lies strictly between the two.
    Where every response would be left out, all are kept (as ROLL does)."""
    rows = len(scores)
    keep = np.ones(rows, np.float32)
    metrics = {"actor/max_len_mask_ratio": 1.0, "actor/difficulty_mask_ratio": 1.0}
    if max_len_mask:
        kept = (np.asarray(response_lengths) != max_response_length).astype(np.float32)
        keep *= kept
        metrics["actor/max_len_mask_ratio"] = float(kept.mean())
    if difficulty is not None:
        low, high = difficulty
        groups, index = np.unique(np.asarray(group_ids), return_inverse=True)
        means = np.bincount(index, weights=scores, minlength=len(groups)) / np.bincount(index, minlength=len(groups))
        kept = ((means[index] > low) & (means[index] < high)).astype(np.float32)
        keep *= kept
        metrics["actor/difficulty_mask_ratio"] = float(kept.mean())
    if not keep.any():
        keep[:] = 1.0
    metrics.update({"actor/final_mask_ratio": float(keep.mean()), "actor/samples_used": float(keep.sum()),
                    "actor/samples_total": float(rows)})
    return keep, metrics


def pf_ppo_weights(scores: np.ndarray, method: str, weight_pow: float) -> np.ndarray:
    """veRL's pf-PPO resampling weight of each row from its sequence score: `pow` |s|^weight_pow,
    `max_min` 1 at the step's highest and lowest scores and 0 elsewhere, `max_random` 0.4 at the highest
    and 0.1 elsewhere; then + 1e-8 (at least 1e-8), so every row can be drawn."""
    s = np.asarray(scores, np.float64)
    if method == "pow":
        w = np.abs(s) ** weight_pow
    elif method == "max_min":
        w = ((s == s.max()) | (s == s.min())).astype(np.float64)
    elif method == "max_random":
        w = np.where(s == s.max(), 0.4, 0.1)
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method={method!r}: one of pow, max_min, max_random")
    return np.maximum(w + 1e-8, 1e-8)


def pf_ppo_rows(scores: np.ndarray, method: str, weight_pow: float, seed: int | tuple[int, ...]) -> np.ndarray:
    """As many row indices as rows, drawn with replacement in proportion to `pf_ppo_weights` (veRL's
    torch.multinomial; here numpy's generator seeded by the step, the same on every process)."""
    w = pf_ppo_weights(scores, method, weight_pow)
    return np.random.default_rng(seed).choice(len(w), size=len(w), replace=True, p=w / w.sum())


def truncated_rows(last_tokens: np.ndarray, response_lengths: np.ndarray, eos_ids: tuple[int, ...]) -> np.ndarray:
    """TRL's truncated completions: the rows whose response does not end with an EOS token (cut at the
    response length), or is empty. `last_tokens` [N]: each row's last response token."""
    lengths = np.asarray(response_lengths)
    return (lengths == 0) | ~np.isin(np.asarray(last_tokens), np.asarray(eos_ids))
