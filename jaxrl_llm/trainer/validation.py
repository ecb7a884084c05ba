"""Validation: one pass over `data.val_files` with `rollout.val_kwargs` (greedy by default), scored by
the same reward manager, reported per data source as veRL does:
`val-core/<data_source>/reward/mean@<n>` plus `val-aux/<data_source>/<extra key>/mean@<n>`.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxrl_llm.trainer.rollout import generate_and_score
from jaxrl_llm.trainer.tracking import dump_jsonl

if TYPE_CHECKING:
    from jaxrl_llm.trainer.trainer import Trainer


def run_validation(trainer: "Trainer") -> dict[str, float]:
    loader = trainer.val_loader
    loader.reset()
    sampling = trainer.val_sampling
    scores: list[np.ndarray] = []
    sources: list[np.ndarray] = []
    extras: dict[str, list[np.ndarray]] = defaultdict(list)
    samples: list[dict] = []
    rng = jax.random.fold_in(trainer.base_rng, 10_000_000 + trainer.global_step)
    for i, batch in enumerate(loader):
        r = generate_and_score(batch, params=trainer.actor.params, model_cfg=trainer.actor.model_cfg,
                               sampling=sampling, rng=jax.random.fold_in(rng, i), mesh=trainer.mesh,
                               tokenizer=trainer.tokenizer, reward_manager=trainer.reward_manager,
                               reward_model=trainer.reward_model, compute_dtype=trainer.actor_settings.compute_dtype)
        scores.append(r.scores)
        sources.append(np.asarray([str(s) for s in r.meta["data_source"]]))
        for key, value in r.reward_extra_info.items():
            value = np.asarray(value)
            if key != "score" and value.dtype.kind in "biuf":
                extras[key].append(value.astype(np.float64))
        for prompt, text, score, gt in zip(r.prompt_texts, r.texts, r.scores, r.meta["ground_truth"]):
            samples.append({"input": prompt, "output": text, "score": float(score), "ground_truth": str(gt)})
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
    t = trainer.cfg.trainer
    if t.log_val_generations > 0:
        trainer.tracker.log_generations("val/generations", samples[: t.log_val_generations], trainer.global_step)
    if t.validation_data_dir and trainer.is_main:
        dump_jsonl(os.path.join(t.validation_data_dir, f"{trainer.global_step}.jsonl"), samples)
    return metrics
