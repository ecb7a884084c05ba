"""The small public facade for notebooks (model half): load, logits, tokenizer, export.

    import jaxrl_llm as jrl
    model = jrl.load_model(path)                 # HF folder or .gguf (or a registered checkpoint kind)
    tok = jrl.load_tokenizer(path)
    logits = model.logits(input_ids, attention_mask)   # [B, T, V] float32
    jrl.export_hf(model, out_dir, tokenizer=tok)

Sampling (`generate`, `SamplingParams`) and training (`Trainer`) are added here by their own
components; `Model` stays a plain (config, params) holder.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.hf import export_hf as _export_hf
from jaxrl_llm.hf import load_any
from jaxrl_llm.hf import load_tokenizer as _load_tokenizer
from jaxrl_llm.models import ModelConfig, compute_logits

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_logits = jax.jit(compute_logits, static_argnums=1)


@dataclasses.dataclass
class Model:
    """A loaded model: its `ModelConfig` and plain params dict (see `jaxrl_llm.models.model`)."""

    config: ModelConfig
    params: dict

    def logits(self, input_ids: Any, attention_mask: Any = None) -> jax.Array:
        """[B, T, V] float32 logits (jitted; left padding allowed, defined by the mask)."""
        ids = jnp.asarray(input_ids, jnp.int32)
        mask = jnp.ones_like(ids) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
        return _logits(self.params, self.config, ids, mask)


def _dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


def load_model(path: str | pathlib.Path, dtype: Any = "float32", mesh: Any = None, *,
               shardings: Any = None) -> Model:
    """Load an HF folder or a .gguf file as a `Model` with params of `dtype`.

    Placement: `shardings` (a params-shaped pytree of `jax.sharding.Sharding`, or a callable
    `(path, shape, dtype) -> Sharding`) puts every tensor straight onto its target devices while
    loading. `mesh` is accepted for the facade's signature; turning a mesh into `shardings` is the
    sharding component's job, so passing a mesh without `shardings` is an error here.
    """
    if mesh is not None and shardings is None:
        raise ValueError("load_model(mesh=...) needs `shardings` built from the mesh "
                         "(see jaxrl_llm.sharding); pass shardings= explicitly")
    cfg, params = load_any(path, dtype=_dtype(dtype), shardings=shardings)
    return Model(cfg, params)


def load_tokenizer(path: str | pathlib.Path) -> Any:
    """A transformers tokenizer from an HF folder or a .gguf file (chat template included)."""
    return _load_tokenizer(path)


def export_hf(model: Model, out_dir: str | pathlib.Path, tokenizer: Any = None, **kw: Any
              ) -> pathlib.Path:
    """Write `model` as an HF folder loadable by `transformers.AutoModelForCausalLM`."""
    return _export_hf(model.config, model.params, out_dir, tokenizer=tokenizer, **kw)
