"""bench/sampler_fidelity.py's statistics on a model whose distributions are known: a token-level
Markov chain (logits = a fixed table row of the previous token). Exact draws pass every check; a
sharpened sampler fails the probability integral transform and one that halves P(EOS) fails the
EOS martingale, so the bench's verdicts can be trusted both ways."""
from __future__ import annotations

import pathlib
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.append(str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from sampler_fidelity import fidelity  # noqa: E402  (bench/, beside rl_step.py)

VOCAB, EOS, CAP = 16, 0, 24


class MarkovModel:
    """logits[t] = TABLE[ids[t]]: the next token's distribution depends on the current token only."""

    def __init__(self, seed: int) -> None:
        self.table = torch.tensor(np.random.default_rng(seed).normal(0.0, 1.5, (VOCAB, VOCAB)), dtype=torch.float32)

    def __call__(self, ids):
        return types.SimpleNamespace(logits=self.table[ids])

    def probs(self, token: int) -> np.ndarray:
        return torch.softmax(self.table[token].double(), -1).numpy()


def sample(model: MarkovModel, count: int, seed: int, temperature: float = 1.0, eos_scale: float = 1.0):
    """`count` (prompt, response, log-probs) drawn from the chain, optionally distorted: probabilities
    to the power 1 / temperature, P(EOS) times eos_scale (renormalised). Log-probs are the model's."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        prompt = rng.integers(1, VOCAB, size=int(rng.integers(2, 6))).tolist()
        response, log_probs, last = [], [], prompt[-1]
        while len(response) < CAP:
            p = model.probs(last)
            q = p ** (1.0 / temperature)
            q[EOS] *= eos_scale
            token = int(rng.choice(VOCAB, p=q / q.sum()))
            response.append(token)
            log_probs.append(float(np.log(p[token])))
            last = token
            if token == EOS:
                break
        out.append((prompt, response, log_probs))
    return out


def test_exact_draws_pass_every_check():
    model = MarkovModel(0)
    r = fidelity(model, sample(model, 400, seed=1), [EOS])
    assert r["responses"] == 400 and r["tokens"] > 2000
    assert abs(r["pit_mean"] - 0.5) < 4 * r["pit_se"]
    assert r["pit_ks_p"] > 1e-3
    assert abs(r["eos_z"]) < 4
    assert r["logprob_max_err"] < 1e-6  # the stored log-probs are the model's own
    assert abs(r["pit_deciles"].sum() - 1) < 1e-12


def test_a_sharpened_sampler_fails_the_integral_transform():
    model = MarkovModel(0)
    r = fidelity(model, sample(model, 400, seed=1, temperature=0.7), [EOS])
    assert r["pit_ks_p"] < 1e-6
    assert r["pit_mean"] < 0.5 - 8 * r["pit_se"]  # the head drawn too often: u concentrates near 0


def test_a_sampler_that_stops_too_rarely_fails_the_eos_check():
    model = MarkovModel(0)
    r = fidelity(model, sample(model, 400, seed=1, eos_scale=0.5), [EOS])
    assert r["eos_z"] < -4
    assert r["eos_stops"] < r["eos_expected"]
