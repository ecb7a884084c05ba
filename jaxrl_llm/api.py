"""The small public facade for notebooks: load, logits, generate, export, train.

    import jaxrl_llm as jrl
    model = jrl.load_model(path, mesh=None)      # HF folder or .gguf (or a registered checkpoint kind)
    tok = jrl.load_tokenizer(path)
    logits = model.logits(input_ids, attention_mask)   # [B, T, V] float32
    out = jrl.generate(model, ["What is 2 + 2?"], jrl.SamplingParams(temperature=0.0, max_new_tokens=32),
                       tokenizer=tok)
    jrl.export_hf(model, out_dir, tokenizer=tok)
    jrl.Trainer(config).fit()                    # the loop launch/train.py runs

`Model` stays a plain (config, params[, mesh]) holder; sampling lives in `jaxrl_llm.sampler`,
training in `jaxrl_llm.trainer`.
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
from jaxrl_llm.sampler import GenerationResult, SamplingParams
from jaxrl_llm.sampler import generate as _generate
from jaxrl_llm.trainer import checkpoint as _checkpoint  # noqa: F401  (lets load_any read training checkpoints)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_logits = jax.jit(compute_logits, static_argnums=1)


@dataclasses.dataclass
class Model:
    """A loaded model: its `ModelConfig` and plain params dict (see `jaxrl_llm.models.model`)."""

    config: ModelConfig
    params: dict
    mesh: Any = None

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
    """Load an HF folder, a .gguf file or a training checkpoint as a `Model` with params of `dtype`.

    Placement: `shardings` (a params-shaped pytree of `jax.sharding.Sharding`, or a callable
    `(path, shape, dtype) -> Sharding`) puts every tensor straight onto its target devices while
    loading. With only `mesh`, the params are sharded by the default logical-axis rules after
    loading (`jaxrl_llm.sharding`).
    """
    cfg, params = load_any(path, dtype=_dtype(dtype), shardings=shardings)
    if mesh is not None and shardings is None:
        from jaxrl_llm.models import param_logical_axes
        from jaxrl_llm.sharding import shard_params

        head = "score" if "score" in params else "value" if "value_head" in params else "lm"
        params = shard_params(params, param_logical_axes(cfg, head=head), mesh)
    return Model(cfg, params, mesh)


def load_tokenizer(path: str | pathlib.Path) -> Any:
    """A transformers tokenizer from an HF folder or a .gguf file (chat template included)."""
    return _load_tokenizer(path)


def export_hf(model: Model, out_dir: str | pathlib.Path, tokenizer: Any = None, **kw: Any
              ) -> pathlib.Path:
    """Write `model` as an HF folder loadable by `transformers.AutoModelForCausalLM`."""
    return _export_hf(model.config, model.params, out_dir, tokenizer=tokenizer, **kw)


def generate(model: Model, prompts: Any, sampling_params: SamplingParams | None = None, *,
             tokenizer: Any = None) -> GenerationResult:
    """Sample from `model` (strings, chat message lists or token ids); see `jaxrl_llm.sampler`."""
    return _generate(model, prompts, sampling_params or SamplingParams(), tokenizer=tokenizer, mesh=model.mesh)


def __getattr__(name: str) -> Any:
    if name == "Trainer":  # the trainer pulls in data / rewards: import it only when asked for
        from jaxrl_llm.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'jaxrl_llm.api' has no attribute {name!r}")
