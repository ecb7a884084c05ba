"""Reward shaping on top of the scorer's score (host-side numpy, per response).

- `overlong_penalty`: DAPO's soft overlong punishment, exactly as veRL's DAPO reward manager:
  with `expected = max_resp_len - buffer_len`, a response of `L` tokens gets
  `min(-(L - expected) / buffer_len * penalty_factor, 0)` (0 up to `expected`, falling linearly to
  `-penalty_factor` at `max_resp_len`).
- `missing_eos_penalty`: TRL's: `-penalty` for responses that did not end with EOS (truncated).
"""
from __future__ import annotations

import numpy as np


def overlong_penalty(response_lengths: np.ndarray, max_resp_len: int, buffer_len: int,
                     penalty_factor: float) -> np.ndarray:
    """float32[B] penalty (<= 0) for responses inside the last `buffer_len` tokens before the limit."""
    if buffer_len <= 0:
        raise ValueError(f"overlong_buffer_cfg.len must be positive when enabled, got {buffer_len}")
    if max_resp_len < buffer_len:
        raise ValueError(f"max_resp_len={max_resp_len} must be >= overlong_buffer_cfg.len={buffer_len}")
    exceed = np.asarray(response_lengths, dtype=np.float64) - (max_resp_len - buffer_len)
    return np.minimum(-exceed / buffer_len * penalty_factor, 0.0).astype(np.float32)


def missing_eos_penalty(finished_with_eos: np.ndarray, penalty: float) -> np.ndarray:
    """float32[B]: `-penalty` where the response has no EOS, else 0."""
    finished = np.asarray(finished_with_eos, dtype=bool)
    return np.where(finished, 0.0, -float(penalty)).astype(np.float32)
