"""Validation: one pass over the validation prompts with `rollout.val_kwargs` sampling (greedy by
default), scored by the training reward manager, reported per data source as veRL does:
`val-core/<data_source>/reward/mean@<n>` plus `val-aux/<data_source>/<extra key>/mean@<n>`.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import jax
import numpy as np

from jaxrl_llm.rollout.generator import RolloutGenerator
from jaxrl_llm.sampler import SamplingParams


def run_validation(generator: RolloutGenerator, batches: Iterable[dict[str, np.ndarray]], params: dict,
                   sampling: SamplingParams, rng: jax.Array) -> tuple[dict[str, float], list[dict]]:
    """(metrics, samples): one {input, output, score, ground_truth, data_source} dict per response."""
    scores: list[np.ndarray] = []
    sources: list[np.ndarray] = []
    extras: dict[str, list[np.ndarray]] = defaultdict(list)
    samples: list[dict] = []
    for i, batch in enumerate(batches):
        r = generator.generate(batch, params, sampling, jax.random.fold_in(rng, i))
        scores.append(r.scores)
        sources.append(np.asarray([str(s) for s in r.meta["data_source"]]))
        for key, value in r.reward_extra_info.items():
            value = np.asarray(value)
            if key != "score" and value.dtype.kind in "biuf":
                extras[key].append(value.astype(np.float64))
        for prompt, text, score, gt, source in zip(r.prompt_texts, r.texts, r.scores, r.meta["ground_truth"],
                                                   r.meta["data_source"]):
            samples.append({"input": prompt, "output": text, "score": float(score), "ground_truth": str(gt),
                            "data_source": str(source)})
    all_scores = np.concatenate(scores)
    all_sources = np.concatenate(sources)
    n = sampling.n
    metrics: dict[str, float] = {}
    for source in sorted(set(all_sources)):
        sel = all_sources == source
        metrics[f"val-core/{source}/reward/mean@{n}"] = float(all_scores[sel].mean())
        for key, parts in extras.items():
            values = np.concatenate(parts)
            if values.shape == all_scores.shape:
                metrics[f"val-aux/{source}/{key}/mean@{n}"] = float(values[sel].mean())
    return metrics, samples
