"""Step metrics under veRL's names (`critic/score/mean`, `response_length/clip_ratio`, ...),
throughput and model-FLOPs utilisation.

The batch statistics are computed on the host from arrays the step already fetched (scores,
lengths) plus device-side masked reductions (advantages, returns, values), so no `[B, T]` array is
copied to the host just for logging.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.platform.chips import Device, chip_for, peak_flops_of


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


@jax.jit
def masked_stats(x: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """mean / max / min of `x` over valid tokens (a batch with no valid token gives zeros)."""
    mask = mask.astype(bool)
    count = jnp.maximum(mask.sum(), 1)
    has = mask.any()
    mean = jnp.where(mask, x, 0.0).sum() / count
    hi = jnp.where(has, jnp.where(mask, x, -jnp.inf).max(), 0.0)
    lo = jnp.where(has, jnp.where(mask, x, jnp.inf).min(), 0.0)
    return {"mean": mean, "max": hi, "min": lo}


def data_metrics(
    *,
    sequence_scores: np.ndarray,
    sequence_rewards: np.ndarray,
    response_lengths: np.ndarray,
    prompt_lengths: np.ndarray,
    max_response_length: int,
    max_prompt_length: int,
    advantages: jax.Array,
    returns: jax.Array,
    response_mask: jax.Array,
    values: jax.Array | None = None,
) -> dict[str, float]:
    out: dict[str, float] = {}
    out.update(_stats("critic/score", sequence_scores))
    out.update(_stats("critic/rewards", sequence_rewards))
    for name, arr in (("advantages", advantages), ("returns", returns), ("values", values)):
        if arr is not None:
            stats = jax.device_get(masked_stats(arr, response_mask))
            out.update({f"critic/{name}/{k}": float(v) for k, v in stats.items()})
    out.update(_stats("response_length", response_lengths))
    out["response_length/clip_ratio"] = float(np.mean(response_lengths >= max_response_length))
    out.update(_stats("prompt_length", prompt_lengths))
    out["prompt_length/clip_ratio"] = float(np.mean(prompt_lengths >= max_prompt_length))
    return out


@functools.lru_cache(maxsize=None)
def measured_matmul_peak_flops(n: int = 1024, repeats: int = 3, dtype: str = "float32", chain: int = 4) -> float:
    """FLOP/s of one device on large matmuls of `dtype` operands (fp32 accumulation): the best of
    `repeats` calls, each `chain` dependent [n, n] x [n, n] matmuls in one program (so dispatch and
    launch overhead are spread over them), blocked on before the clock stops. A ceiling for MFU
    where the chip table has no row (CPU); `device_peak_flops` prefers the table. [1024, 1024] operands
    measure the ceiling [2048, 2048] ones do (2-core host: 194 vs 192 GFLOP/s) in a tenth of the time
    (0.25 s vs 2.4 s, paid by every launch on a CPU)."""
    a = jnp.ones((n, n), jnp.dtype(dtype)) / n
    b = jnp.ones((n, n), jnp.dtype(dtype))

    def matmuls(a, b):
        def one(i, acc):  # each product reads the last one's result: nothing is hoisted or merged
            lhs = (a * (1 + acc[0, 0] * 1e-9)).astype(a.dtype)
            return acc + jnp.dot(lhs, b, preferred_element_type=jnp.float32)
        return jax.lax.fori_loop(0, chain, one, jnp.zeros((n, n), jnp.float32))

    f = jax.jit(matmuls)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 * chain / best


def device_peak_flops(device: Device, dtype: str) -> tuple[float, str]:
    """(matmul peak FLOP/s of one `device` for `dtype` compute, where it comes from): the published
    figure of its chip (platform/chips.py: H100, H200, B200, TPU v4 / v5e / v5p / v6e), else (CPUs,
    unknown chips) a measured matmul ceiling of this host's device."""
    published, chip = peak_flops_of(device, dtype), chip_for(device)
    if published is not None and chip is not None:
        return published, f"the published {dtype} peak of {chip.name}"
    return measured_matmul_peak_flops(dtype=dtype), f"the measured {dtype} matmul peak"


def step_flops(
    *,
    num_params: int,
    num_layers: int,
    hidden_size: int,
    prompt_tokens: int,
    response_tokens: int,
    forward_passes: int,
    training_passes: int,
    prefill_prompt_tokens: int | None = None,
    pass_prompt_tokens: int | None = None,
    mean_context: float = 0.0,
) -> float:
    """Model FLOPs of one RL step as computed: generation (2N per generated token plus attention
    over the context), `forward_passes` scoring passes (ref / old logprobs / values) and
    `training_passes` forward+backward passes (6N per token) over prompt+response tokens.
    Attention adds 4 * layers * hidden * `mean_context` per token forward (scores and values over
    the keys a token attends to, on average; `rollout_context` computes it from the rows).
    `prompt_tokens` counts every row's prompt; a prompt its n samples share is computed once by the
    paged engine's prefill (`prefill_prompt_tokens`) and by shared-prompt packing
    (`pass_prompt_tokens`): those counts, where given, replace it (MFU then never credits work
    that was not done)."""
    per_token_fwd = per_token_forward_flops(num_params, num_layers, hidden_size, mean_context)
    prefill = prompt_tokens if prefill_prompt_tokens is None else prefill_prompt_tokens
    scored = response_tokens + (prompt_tokens if pass_prompt_tokens is None else pass_prompt_tokens)
    gen = (response_tokens + prefill) * per_token_fwd
    score = forward_passes * scored * per_token_fwd
    train = training_passes * 3.0 * scored * per_token_fwd
    return gen + score + train


def per_token_forward_flops(num_params: int, num_layers: int, hidden_size: int, mean_context: float) -> float:
    """Forward FLOPs per token: 2N, plus attention scores and values over `mean_context` keys."""
    return 2.0 * num_params + 4.0 * num_layers * hidden_size * mean_context


def rollout_context(row_tokens: np.ndarray) -> float:
    """The mean number of keys a token of these causal rows (`row_tokens` long each) attends to: a row
    of T tokens attends to 1 + 2 + ... + T = T (T + 1) / 2 keys, so sum(T (T + 1)) / (2 sum(T))."""
    t = np.asarray(row_tokens, np.float64)
    return float((t * (t + 1)).sum() / (2.0 * t.sum())) if t.sum() > 0 else 0.0


def _token_counts(rows: Mapping[str, np.ndarray]) -> tuple[int, int, int, float]:
    """(prompt, response, one-prompt-per-group tokens, `rollout_context`) of rows' `prompt_lengths`,
    `response_lengths` and `group_ids`."""
    prompt_lengths = np.asarray(rows["prompt_lengths"])
    response_lengths = np.asarray(rows["response_lengths"])
    _, first_rows = np.unique(np.asarray(rows["group_ids"]), return_index=True)
    return (int(prompt_lengths.sum()), int(response_lengths.sum()), int(prompt_lengths[first_rows].sum()),
            rollout_context(prompt_lengths + response_lengths))


def rollout_step_flops(rollout_rows: Mapping[str, np.ndarray], *, num_params: int, num_layers: int,
                       hidden_size: int, forward_passes: int, training_passes: int, paged_prefill: bool,
                       shared_prompts: bool) -> tuple[float, int]:
    """(`step_flops`, prompt + response tokens) of a step's rollout, from its rows' `prompt_lengths`,
    `response_lengths` and `group_ids`: a group's prompt counts once where the paged engine's prefill
    (`paged_prefill`) or shared-prompt packing (`shared_prompts`) computes it once."""
    prompt_tokens, response_tokens, group_prompt_tokens, context = _token_counts(rollout_rows)
    flops = step_flops(num_params=num_params, num_layers=num_layers, hidden_size=hidden_size,
                       prompt_tokens=prompt_tokens, response_tokens=response_tokens, forward_passes=forward_passes,
                       training_passes=training_passes,
                       prefill_prompt_tokens=group_prompt_tokens if paged_prefill else None,
                       pass_prompt_tokens=group_prompt_tokens if shared_prompts else None, mean_context=context)
    return flops, prompt_tokens + response_tokens


def forward_pass_flops(rows: Mapping[str, np.ndarray], *, num_params: int, num_layers: int, hidden_size: int,
                       shared_prompts: bool) -> float:
    """FLOPs of one scoring forward over `rows` (as `rollout_step_flops` reads them) by another model
    than the policy: a distillation teacher's pass. A group's prompt counts once with shared-prompt
    packing."""
    prompt_tokens, response_tokens, group_prompt_tokens, context = _token_counts(rows)
    scored = response_tokens + (group_prompt_tokens if shared_prompts else prompt_tokens)
    return scored * per_token_forward_flops(num_params, num_layers, hidden_size, context)


def perf_metrics(
    timings: Mapping[str, float], *, total_tokens: int, flops: float, num_devices: int, peak_flops: float
) -> dict[str, float]:
    step_time = max(timings.get("step", 0.0), 1e-9)
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": step_time,
        "perf/throughput": total_tokens / step_time / num_devices,
        "perf/mfu": flops / step_time / (peak_flops * num_devices),
    }


class Timer:
    """Wall time per name, honest about async JAX work:

        with timer("ref") as span:
            ref = span.wait(log_probs_no_grad(...))   # blocks on `ref` before the clock stops

    A span blocks on every value passed to `wait` before it stops, so `timing_s/*` measure the
    device work, not its dispatch. `on_enter(name)` runs as each span starts (the trainer tells its
    worker watchdog which phase the main thread is in)."""

    def __init__(self, on_enter: Callable[[str], None] | None = None) -> None:
        self.times: dict[str, float] = {}
        self.on_enter = on_enter

    def __call__(self, name: str) -> "_Span":
        return _Span(self, name)

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.times.items()}


class _Span:
    def __init__(self, timer: Timer, name: str):
        self.timer, self.name = timer, name
        self.pending: list = []

    def wait(self, value):
        """Registers `value` (any pytree of arrays) to block on when the span ends; returns it."""
        self.pending.append(value)
        return value

    def __enter__(self) -> "_Span":
        if self.timer.on_enter is not None:
            self.timer.on_enter(self.name)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            jax.block_until_ready(self.pending)
        self.pending = []
        self.timer.times[self.name] = self.timer.times.get(self.name, 0.0) + time.perf_counter() - self.start
