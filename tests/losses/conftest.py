"""Shared batch for the losses tests: ragged masks with holes, leading zeros, junk padding, groups."""
import numpy as np
import pytest

B, T = 8, 7
# Interleaved groups of 3, 3 and two singletons.
GROUP_IDS = np.array([3, 7, 3, 9, 7, 3, 7, 11], np.int32)


def make_mask():
    m = np.zeros((B, T), np.float32)
    m[0, :5] = 1  # plain right padding
    m[1, 2:6] = 1  # leading zeros
    m[2, :] = 1  # full row
    m[3, [0, 1, 4, 5]] = 1  # hole (multi-turn)
    m[4, :1] = 1  # single token
    m[5, 1:7] = 1
    m[5, 3] = 0  # leading zero and a hole
    m[6, :3] = 1
    m[7, :6] = 1
    return m


@pytest.fixture
def batch():
    rng = np.random.default_rng(0)
    m = make_mask()
    junk = rng.uniform(-50, 50, (B, T)).astype(np.float32)
    last = np.array([np.nonzero(row)[0].max() for row in m])
    outcome = np.zeros((B, T), np.float32)
    outcome[np.arange(B), last] = rng.choice([0.0, 1.0, 0.5, -1.0], B)
    token_rewards = np.where(m > 0, rng.normal(size=(B, T)), 0.0).astype(np.float32)
    values = np.where(m > 0, rng.normal(size=(B, T)), junk).astype(np.float32)
    old = np.where(m > 0, -rng.uniform(0.1, 3, (B, T)), junk).astype(np.float32)
    lp = np.where(m > 0, old + rng.normal(0, 0.3, (B, T)), junk).astype(np.float32)
    adv = np.where(m > 0, rng.normal(size=(B, T)), junk).astype(np.float32)
    return dict(mask=m, outcome=outcome, token_rewards=token_rewards, values=values, old=old, lp=lp, adv=adv,
                group_ids=GROUP_IDS, junk=junk, rng=rng)
