"""SamplingParams: what to generate (user-facing), and its split into static settings + runtime knobs.

`SamplingParams` is the one object users and the trainer build (directly, or through
`jaxrl_llm.config.resolve` from `actor_rollout_ref.rollout` and its `val_kwargs`).
`SamplingParams.compile_args` turns it into the two things the jitted core takes:

- `SampleSettings` (hashable, a static jit argument): everything that changes shapes or the
  program's structure: max_new_tokens, n, greedy, top_k (a `lax.top_k` size), whether top-p is on,
  compute dtype. A change here compiles a new program (jit keys its cache on it).
- `SampleKnobs` (a pytree of arrays, traced): temperature, top_p, EOS ids, stop ids, pad id. These
  can change between calls without recompiling and are never frozen into a compiled function.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.dtypes import COMPUTE_DTYPES, dtype_name

# Token-id tables are padded with this id (matches no token) to a multiple of _ID_TABLE_BUCKET,
# so a different number of EOS / stop ids rarely changes a shape (and never silently drops one).
NO_TOKEN = -1
_ID_TABLE_BUCKET = 4


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample responses (veRL / vLLM vocabulary).

    Greedy when `do_sample=False` or `temperature == 0`. `top_k` <= 0 and `top_p` >= 1 are off.
    `ignore_eos=True` keeps generating through EOS (extra `stop_token_ids` still stop).
    """

    max_new_tokens: int = 512
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_new_tokens, (int, np.integer)) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: must be an int >= 1")
        if not isinstance(self.n, (int, np.integer)) or self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n!r}: must be an int >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, (int, np.integer)):
            raise ValueError(f"SamplingParams.top_k={self.top_k!r}: must be an int (-1 or 0 = off)")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids={self.stop_token_ids}: ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return (not self.do_sample) or self.temperature == 0

    # ------------------------------------------------------------------ to the jitted core
    def compile_args(self, eos_token_ids: Sequence[int] | int | None, pad_token_id: int, *,
                     vocab_size: int, compute_dtype: str = "float32"
                     ) -> tuple["SampleSettings", "SampleKnobs"]:
        """(static settings, traced knobs) for `jaxrl_llm.sampler.sample`.

        `eos_token_ids`: the model's EOS id(s) (`ModelConfig.eos_token_ids`, plus the tokenizer's
        if it differs); ignored when `ignore_eos`. `pad_token_id` fills the response after it ends.
        """
        compute_dtype = dtype_name(compute_dtype, allowed=COMPUTE_DTYPES, what="compute_dtype")
        top_k = int(self.top_k) if 0 < self.top_k < vocab_size else 0
        settings = SampleSettings(max_new_tokens=int(self.max_new_tokens), n=int(self.n),
                                  greedy=self.greedy, top_k=0 if self.greedy else top_k,
                                  use_top_p=(not self.greedy) and self.top_p < 1.0,
                                  compute_dtype=compute_dtype)
        eos = () if self.ignore_eos else _ids(eos_token_ids)
        for name, ids in (("eos_token_ids", eos), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} {bad} out of range for vocab_size={vocab_size}")
        if not 0 <= pad_token_id < vocab_size:
            raise ValueError(f"pad_token_id={pad_token_id} out of range for vocab_size={vocab_size}")
        knobs = SampleKnobs(
            temperature=jnp.float32(1.0 if self.greedy else self.temperature),
            top_p=jnp.float32(self.top_p), eos_ids=id_table(eos), stop_ids=id_table(self.stop_token_ids),
            pad_id=jnp.int32(pad_token_id))
        return settings, knobs


@dataclasses.dataclass(frozen=True)
class SampleSettings:
    """Static (hashable) part of a sampling call: shapes and program structure.

    `greedy=True` reports log-probs at temperature 1 (the plain model distribution).
    `top_k=0` is off; `use_top_p` switches the nucleus filter on (its threshold is a knob).
    """

    max_new_tokens: int
    n: int = 1
    greedy: bool = False
    top_k: int = 0
    use_top_p: bool = False
    compute_dtype: str = "float32"
    # a mixture-of-experts policy's routing recorded per token (SampleOutput.routing) for routing replay
    record_routing: bool = False
    # the model's batch-invariant numerics (ModelConfig.batch_invariant): log-probs by the trainer's
    # chunked log-sum-exp (models/invariant.py); the samplers set it from the model config
    batch_invariant: bool = False


class SampleKnobs(NamedTuple):
    """Traced (runtime) part of a sampling call; changing these never recompiles."""

    temperature: jax.Array  # f32 scalar; 1.0 when greedy (the temperature of the reported logprobs)
    top_p: jax.Array  # f32 scalar
    eos_ids: jax.Array  # int32 [E], NO_TOKEN-padded
    stop_ids: jax.Array  # int32 [S], NO_TOKEN-padded
    pad_id: jax.Array  # int32 scalar


def id_table(ids: Sequence[int]) -> jax.Array:
    """int32 table of `ids` padded with NO_TOKEN to a multiple of 4 (at least 4 slots)."""
    ids = list(ids)
    size = max(_ID_TABLE_BUCKET, -(-len(ids) // _ID_TABLE_BUCKET) * _ID_TABLE_BUCKET)
    return jnp.asarray(ids + [NO_TOKEN] * (size - len(ids)), jnp.int32)


def _ids(value: Sequence[int] | int | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    return tuple(dict.fromkeys(int(v) for v in value))
