"""Batch generation (`launch/generate.py`; veRL's main_generation): a prompt file -> the same rows with
`generation.n_samples` sampled responses each, through the paged engine (or the one the rollout keys
choose), on the policy's mesh.

Prompts are read as RL prompts are (data/prompts.py: the chat template, system prompt, max prompt length
and truncation; a bad row is a `data error:` naming it). They go to the engine `generation.batch_size` at
a time; each finished batch is written at once, atomically, to `<output_path>.parts/<index>.parquet`, and a
relaunch skips the parts already there, so a killed run resumes where it stopped and no row is generated
twice (batch k samples with seed trainer.seed + k: a resumed run gives the rows an uninterrupted one would).
At the end the parts are joined into `output_path` (atomically) and removed.
"""
from __future__ import annotations

import copy
import dataclasses
import glob
import os
from types import SimpleNamespace
from typing import Any

import jax
import ml_collections
import numpy as np
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from jaxrl_llm import storage
from jaxrl_llm.config import ConfigError, resolve, validate_config
from jaxrl_llm.config.derive import without_rl_step
from jaxrl_llm.config.spec import RunSpec
from jaxrl_llm.data.prompts import records_from_rows
from jaxrl_llm.data.sources import read_files
from jaxrl_llm.data.synthetic import write_rows
from jaxrl_llm.planning.preflight import run_tokenizer
from jaxrl_llm.platform.compile_cache import use_compilation_cache
from jaxrl_llm.roles.trained import load_model
from jaxrl_llm.sampler.facade import generate
from jaxrl_llm.sharding.split import make_split_meshes

PARTS = ".parts"


def generation_view(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` validated as a run whose training prompts are generation.input_path (no RL step)."""
    g = config.generation
    for key in ("input_path", "output_path"):
        if g[key] is None:
            raise ConfigError(f"generation.{key}=None: set the {'prompt file' if key == 'input_path' else 'output'}")
    if os.path.splitext(g.output_path)[1].lower() not in (".parquet", ".jsonl"):
        raise ConfigError(f"generation.output_path={g.output_path!r}: write a .parquet or .jsonl file")
    cfg = without_rl_step(copy.deepcopy(config))
    cfg.data.synthetic.task = None
    cfg.data.train_files = g.input_path
    cfg.data.val_files = None
    # no training step: a batch the RL checks accept on any number of devices
    cfg.data.train_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size = jax.device_count()
    cfg.actor_rollout_ref.rollout.n = int(g.n_samples)
    return cfg


class BatchGenerator:
    """One generation run (module doc): `run()` writes the output file and returns its path."""

    def __init__(self, config: ml_collections.ConfigDict):
        view = generation_view(config)
        self.mesh, _ = make_split_meshes(view.mesh)
        checked = validate_config(view, num_devices=jax.device_count())
        use_compilation_cache(checked.trainer.compilation_cache_dir)  # before the first compile
        self.spec: RunSpec = resolve(checked, dp_size=jax.device_count(), num_train_samples=jax.device_count())
        g = checked.generation
        self.output_path, self.batch_size, self.response_key = g.output_path, int(g.batch_size), g.response_key
        self.tokenizer = run_tokenizer(self.spec.data)
        self.rows, refs = read_files([g.input_path])
        # the prompts as RL reads them (every row checked before anything loads)
        self.records = records_from_rows(self.rows, refs, self.tokenizer, self.spec.data)
        if len(self.records) != len(self.rows):
            raise ConfigError("data.filter_overlong_prompts drops rows: generation writes every row (use "
                              "data.truncation instead)")
        self.sampling = dataclasses.replace(self.spec.train_sampling, n=int(g.n_samples))
        self.model: Any = None

    @property
    def parts_dir(self) -> str:
        return self.output_path + PARTS

    def _part(self, index: int) -> str:
        return os.path.join(self.parts_dir, f"{index:06d}.parquet")

    def _load(self) -> Any:
        if self.model is None:
            cfg, params = load_model(self.spec.model, head="lm", mesh=self.mesh, tokenizer=self.tokenizer,
                                     seed=self.spec.trainer.seed)
            self.model = SimpleNamespace(config=cfg, params=params, tokenizer=self.tokenizer, mesh=self.mesh)
        return self.model

    def run(self) -> str:
        """Generates every batch not written yet, then joins the parts into `output_path`."""
        batches = range(0, len(self.rows), self.batch_size)
        todo = [i for i, _ in enumerate(batches) if not os.path.exists(self._part(i))]
        if len(todo) < len(batches):
            print(f"generation: {len(batches) - len(todo)} of {len(batches)} batches already written in "
                  f"{self.parts_dir}; resuming", flush=True)
        for index in tqdm(todo, desc="generating", unit="batch"):
            self._generate_batch(index, batches[index])
        rows = []
        for index in range(len(batches)):
            rows.extend(pq.read_table(self._part(index)).to_pylist())
        write_rows(rows, self.output_path)
        for part in glob.glob(os.path.join(self.parts_dir, "*.parquet")):
            os.remove(part)
        os.rmdir(self.parts_dir)
        return self.output_path

    def _generate_batch(self, index: int, start: int) -> None:
        model, n = self._load(), self.sampling.n
        chunk = self.records[start:start + self.batch_size]
        ids = [np.asarray(r["input_ids"]).tolist() for r in chunk]
        sampling = dataclasses.replace(self.sampling, seed=self.spec.trainer.seed + index)
        result = generate(model, ids, sampling, tokenizer=self.tokenizer, mesh=self.mesh,
                          compute_dtype=self.spec.actor.compute_dtype, engine=self.spec.rollout_engine)
        assert result.texts is not None
        rows = [{**self.rows[start + i], self.response_key: result.texts[i * n:(i + 1) * n]}
                for i in range(len(chunk))]
        storage.makedirs(self.parts_dir)
        write_rows(rows, self._part(index))  # atomic: a killed run leaves whole parts only
