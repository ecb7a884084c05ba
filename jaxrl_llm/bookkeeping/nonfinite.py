"""Non-finite guards: what a run does when a reward, log-prob, loss or gradient is NaN / inf.

- Rewards (rule scorer, custom function, reward model, after shaping) go through
  `sanitize_scores` in the rollout: a non-finite score is counted in `reward/num_nonfinite` and
  replaced by 0, so one bad row cannot poison its group's advantages. When no row of a batch has
  a finite reward the batch carries no learning signal: the scores are left as they are, the
  advantages become non-finite and every update of the step is skipped (below), so a reward
  function that always fails stops the run instead of training on zeros.
- Updates (roles/update.py): a mini-batch whose loss or gradient norm is non-finite skips its
  optimizer update, params and optimizer state unchanged (veRL's actor skips `optimizer.step()`
  on a non-finite grad norm). `update_flags_metrics` counts skips in
  `actor/num_nonfinite_skipped` and `critic/num_nonfinite_skipped`.
- `NonFiniteGuard` (host) counts consecutive skipped updates per role across steps; at
  `trainer.max_consecutive_nonfinite` it raises one `NonFiniteError` naming the step and the first
  non-finite quantity of that step in pipeline order (reward, log-prob, value, advantage, loss,
  grad). The count starts again from 0 after a resume.
- The adaptive KL controller ignores a non-finite KL (losses/kl.py).
- `assert_finite_state` refuses to write a checkpoint whose params or optimizer state hold a
  non-finite value, so keep-N never deletes a good checkpoint for a poisoned one.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.arrays import ArrayTree

log = logging.getLogger("jaxrl_llm")
Array = jax.Array

# Per-update counters that travel with a role's update metrics to `NonFiniteGuard.check`, which
# removes them before the metrics are logged.
_NUM_UPDATES, _TRAILING, _LOSS = "_num_updates", "_trailing_skipped", "_nonfinite_loss"


class NonFiniteError(RuntimeError):
    """Training produced non-finite values too often to go on, or a state to save is non-finite."""


class UpdateFlags(NamedTuple):
    """Per optimizer update (shape [epochs, mini-batches]), from `run_update_epochs`."""

    skipped: Array  # bool: loss or grad norm non-finite, update not applied
    loss_nonfinite: Array  # bool: the loss itself was non-finite


def update_flags_metrics(prefix: str, flags: UpdateFlags) -> dict[str, Array]:
    """`<prefix>/num_nonfinite_skipped` and the guard's counters (jittable)."""
    skipped = flags.skipped.reshape(-1).astype(jnp.float32)  # in update order: epoch-major
    trailing = jnp.sum(jnp.cumprod(skipped[::-1]))  # skips at the end of this call, in a row
    return {f"{prefix}/num_nonfinite_skipped": skipped.sum(),
            f"{prefix}/{_NUM_UPDATES}": jnp.float32(skipped.size),
            f"{prefix}/{_TRAILING}": trailing,
            f"{prefix}/{_LOSS}": flags.loss_nonfinite.astype(jnp.float32).sum()}


def sanitize_scores(scores: np.ndarray) -> tuple[np.ndarray, int]:
    """(scores with non-finite entries set to 0, how many there were). All non-finite: unchanged,
    so the step's updates are skipped (module docstring)."""
    scores = np.asarray(scores, np.float32)
    bad = ~np.isfinite(scores)
    count = int(bad.sum())
    if 0 < count < scores.size:
        scores = np.where(bad, np.float32(0.0), scores)
    return scores, count


@jax.jit
def _nonfinite_counts(arrays: dict[str, Array], mask: Array) -> dict[str, Array]:
    """Non-finite entries of each [N, R] array at valid response tokens."""
    valid = mask > 0
    return {k: jnp.sum(valid & ~jnp.isfinite(v)) for k, v in arrays.items()}


# What a step feeds its updates, in pipeline order: (label, Rollout field) then (label, Experience field).
_FROM_ROLLOUT = (("reward", "token_level_scores"), ("log-prob (sampler)", "rollout_log_probs"))
_FROM_EXPERIENCE = (("log-prob (old policy)", "old_log_probs"), ("log-prob (reference)", "ref_log_probs"),
                    ("value", "values"), ("advantage", "advantages"), ("return", "returns"))


def first_nonfinite(rollout: Any, exp: Any) -> str | None:
    """The first input of a step's updates (reward, log-probs, values, advantages) holding a
    non-finite value at a valid response token, as '<label> (<k> values)'; None when all are finite."""
    arrays = {label: getattr(rollout, f) for label, f in _FROM_ROLLOUT}
    arrays.update({label: getattr(exp, f) for label, f in _FROM_EXPERIENCE if getattr(exp, f) is not None})
    counts = jax.device_get(_nonfinite_counts(arrays, rollout.response_mask))
    for label in arrays:  # dicts keep insertion (pipeline) order
        if int(counts[label]):
            return f"{label} ({int(counts[label])} values)"
    return None


class NonFiniteGuard:
    """Counts consecutive skipped optimizer updates per role across steps (module docstring)."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = int(max_consecutive)
        self.consecutive: dict[str, int] = {}

    def check(self, step: int, metrics: dict[str, float], describe: Callable[[], str | None]) -> None:
        """Removes the update counters from `metrics` (a step's host metrics), warns when updates
        were skipped and raises `NonFiniteError` once a role has skipped `max_consecutive` updates
        in a row. `step` is the 1-based step as logged; `describe` names the first non-finite input
        (`first_nonfinite`), called only when something was skipped."""
        for role in ("actor", "critic", "train"):  # train: an SFT run's policy (sft/loss.py)
            if f"{role}/{_NUM_UPDATES}" not in metrics:
                continue
            total = int(metrics.pop(f"{role}/{_NUM_UPDATES}"))
            trailing = int(metrics.pop(f"{role}/{_TRAILING}"))
            loss_bad = int(metrics.pop(f"{role}/{_LOSS}"))
            skipped = int(metrics[f"{role}/num_nonfinite_skipped"])
            run = self.consecutive.get(role, 0)
            run = run + trailing if trailing == total else trailing
            self.consecutive[role] = run
            if not skipped:
                continue
            first = describe() or ("loss" if loss_bad else "grad")
            log.warning("step %d: %d of %d %s optimizer updates skipped (non-finite loss or gradient); "
                        "first non-finite quantity: %s", step, skipped, total, role, first)
            if run >= self.max_consecutive:
                raise NonFiniteError(
                    f"step {step}: the {role} skipped {run} optimizer updates in a row because their loss or "
                    f"gradient was non-finite (trainer.max_consecutive_nonfinite={self.max_consecutive}); "
                    f"first non-finite quantity at step {step}: {first}. No non-finite weights were applied "
                    "or saved: check the reward function and data, or lower the learning rate, then resume "
                    "from the last checkpoint.")


@jax.jit
def _leaf_nonfinite(tree: ArrayTree) -> ArrayTree:
    def bad(x: Array) -> Array:
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.bool_(False)
        return jnp.any(~jnp.isfinite(x))

    return jax.tree.map(bad, tree)


def nonfinite_leaves(tree: ArrayTree) -> list[str]:
    """Paths of the leaves of `tree` (device arrays, possibly sharded) holding a NaN / inf."""
    flags = jax.device_get(_leaf_nonfinite(tree))
    leaves, _ = jax.tree_util.tree_flatten_with_path(flags)
    return [jax.tree_util.keystr(path) for path, flag in leaves if bool(flag)]


def assert_finite_state(state: ArrayTree, step: int) -> None:
    """Raises `NonFiniteError` when a train state to checkpoint holds a non-finite value."""
    bad = nonfinite_leaves(state)
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise NonFiniteError(
            f"step {step}: refusing to save a checkpoint: {bad[0]}{more} holds NaN/inf values; the previous "
            "checkpoints are kept. Resume from the last one (trainer.resume_mode=auto).")
