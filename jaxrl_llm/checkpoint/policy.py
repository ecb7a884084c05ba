"""A training checkpoint as a model source: its policy (LoRA adapters merged into their base, or
kept apart for a PEFT export) and `register_checkpoint_loader`, which lets `jaxrl_llm.hf.load_any`
(and so `launch/convert_to_hf.py` and `jrl.load_model`) read checkpoints like HF folders."""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxrl_llm import storage
from jaxrl_llm.arrays import DType
from jaxrl_llm.checkpoint.store import ITEMS, is_checkpoint, locate_checkpoint, read_checkpoint_meta
from jaxrl_llm.hf import load_any, register_loader
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.models.lora import LoraConfig, merge_lora, with_lora


def load_policy_checkpoint(path: Any, *, dtype: DType | None = None, **_: Any) -> tuple[Any, dict]:
    """(ModelConfig, policy params on the default device) from a training checkpoint; after
    `register_checkpoint_loader()`, `jaxrl_llm.hf.load_any` (and so `launch/convert_to_hf.py` and
    `jrl.load_model`) accepts it. A LoRA checkpoint gives its adapters merged into the base."""
    cfg, params, meta = _read_policy_state(path)
    lora = meta.get("lora")
    if lora is not None:
        params = merge_lora(with_lora(lora_base_params(meta), params["lora"], lora["alpha"] / lora["rank"]))
    if dtype is not None:
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    return cfg, params


def lora_base_params(meta: Mapping[str, Any]) -> dict:
    """The frozen base of a LoRA checkpoint (its adapters apply to it), loaded again from the base
    path in the run's model.param_dtype; a tiny:<arch> base is re-initialised from its seed."""
    base_path = meta["lora"]["base_path"]
    model = meta["config"]["actor_rollout_ref"]["model"]
    dtype = model.get("param_dtype", "float32")
    if base_path.startswith("tiny:"):
        cfg = ModelConfig.from_hf_config(meta["model_config"])
        return init_params(cfg, jax.random.PRNGKey(int(model["tiny"]["seed"])), dtype=dtype)
    return load_any(base_path, dtype=dtype)[1]


def load_lora_checkpoint(path: Any) -> tuple[Any, dict, Any, str]:
    """(ModelConfig, adapters, LoraConfig, base path) of a LoRA training checkpoint."""
    cfg, params, meta = _read_policy_state(path)
    lora = meta.get("lora")
    if lora is None:
        raise ValueError(f"checkpoint {path}: not a LoRA run (actor_rollout_ref.model.lora_rank was 0)")
    return cfg, params["lora"], LoraConfig(int(lora["rank"]), float(lora["alpha"]), tuple(lora["target_modules"]),
                                            float(lora.get("dropout", 0.0))), \
        lora["base_path"]


def _read_policy_state(path: Any) -> tuple[Any, dict, dict]:
    meta = read_checkpoint_meta(path)
    if "model_config" not in meta:
        raise ValueError(f"checkpoint {path}: its meta has no model_config (written by an older jaxrl_llm)")
    directory, step = locate_checkpoint(path)
    manager = ocp.CheckpointManager(storage.as_path(directory), item_names=ITEMS,
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    tree_meta = manager.item_metadata(step)["state"]
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree_meta)
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    manager.close()
    return ModelConfig.from_hf_config(meta["model_config"]), state["actor"]["params"], meta


def register_checkpoint_loader() -> None:
    """Let `jaxrl_llm.hf.load_any` read training checkpoints (tried before HF folders). Idempotent:
    callers that may get a checkpoint path call it before `load_any`."""
    register_loader("checkpoint", is_checkpoint, load_policy_checkpoint)
