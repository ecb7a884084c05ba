"""Shared pieces of tiny end-to-end runs: `configs/tiny.py` with dotted-key overrides, and a toy
update batch / loss for exercising `trainer.update.run_update_epochs` without a model."""
from __future__ import annotations

import importlib.util
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_config(run_dir: Any, **overrides: Any) -> Any:
    """configs/tiny.py (a random 2-layer Llama, synthetic task) writing to `run_dir`, with
    `{"a.b.c": value}` overrides applied."""
    spec = importlib.util.spec_from_file_location("tiny_config", ROOT / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.trainer.default_local_dir = str(run_dir)
    for key, value in overrides.items():
        section = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            section = section[p]
        section[leaf] = value
    return cfg


class ToyBatch(NamedTuple):
    """A linear-regression 'experience': rows with a response mask, like `Experience`."""

    x: jax.Array
    y: jax.Array
    response_mask: jax.Array


def toy_loss(params: dict, mb: ToyBatch, denoms: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    err = (mb.x @ params["w"] + params["b"] - mb.y) * mb.response_mask
    loss = jnp.sum(err ** 2) / denoms.num_tokens
    return loss, {"toy/loss": loss}
