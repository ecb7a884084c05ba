"""The models a run trains or reads, placed on the mesh: policy (actor + its sampler), reference,
critic. Each trained role carries its params, optimizer and optimizer state.

The sampler reads `policy.params` directly: the arrays the optimizer updates are the arrays the
next rollout generates with (no weight sync, no copy).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxrl_llm.models import ModelConfig, init_params, param_logical_axes
from jaxrl_llm.sharding import logical_to_sharding, optimizer_state_sharding
from jaxrl_llm.trainer.optim import make_optimizer
from jaxrl_llm.trainer.scoring import compute_dtype_of

log = logging.getLogger("jaxrl_llm")
TINY_PREFIX = "tiny:"


@dataclasses.dataclass
class TrainedRole:
    model_cfg: ModelConfig
    params: dict
    tx: optax.GradientTransformation
    schedule: Callable[[jax.Array], jax.Array]
    opt_state: Any
    head: str
    param_shardings: Any
    opt_state_shardings: Any

    @property
    def num_params(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self.params))


def _param_shardings(model_cfg: ModelConfig, head: str, mesh: Mesh, dtype: Any) -> Any:
    abstract = jax.eval_shape(lambda: init_params(model_cfg, jax.random.PRNGKey(0), head=head, dtype=dtype))
    return logical_to_sharding(param_logical_axes(model_cfg, head=head), abstract, mesh)


def load_model(model_section: Any, *, head: str, mesh: Mesh, tokenizer: Any, seed: int,
               tiny_section: Any = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params placed on the mesh) for `model.path`: an HF folder, a .gguf file, or
    `tiny:<family>` (a random model with the dims in `tiny_section`, i.e.
    `actor_rollout_ref.model.tiny`, for tests)."""
    path = model_section.path
    dtype = compute_dtype_of(model_section.param_dtype)
    if path is None:
        raise ValueError("actor_rollout_ref.model.path is not set")
    if str(path).startswith(TINY_PREFIX):
        tiny = dict(tiny_section if tiny_section is not None else model_section.tiny)
        tiny_seed = tiny.pop("seed", 0)
        if tiny.get("vocab_size") is None:
            tiny["vocab_size"] = len(tokenizer)
        heads = tiny["num_attention_heads"]
        tiny.setdefault("head_dim", tiny["hidden_size"] // heads)
        special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                       else tokenizer.eos_token_id)
        model_cfg = ModelConfig.tiny(str(path)[len(TINY_PREFIX):], **{**tiny, **special})
        shardings = _param_shardings(model_cfg, head, mesh, dtype)
        init = jax.jit(lambda key: init_params(model_cfg, key, head=head, dtype=dtype), out_shardings=shardings)
        return model_cfg, init(jax.random.PRNGKey(tiny_seed))
    from jaxrl_llm.hf import load_any  # the HF bridge reads folders and GGUF files

    # A value head on a causal-LM checkpoint is initialised fresh from `seed`.
    model_cfg, params = load_any(str(path), dtype=dtype, head=head, rng=jax.random.PRNGKey(seed))
    return model_cfg, jax.device_put(params, _param_shardings(model_cfg, head, mesh, dtype))


def make_trained_role(model_cfg: ModelConfig, params: dict, optim_section: Any, *, total_steps: int,
                      grad_clip: float | None, head: str) -> TrainedRole:
    tx, schedule = make_optimizer(optim_section, total_steps, grad_clip=grad_clip)
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    abstract_state = jax.eval_shape(tx.init, params)
    state_shardings = optimizer_state_sharding(abstract_state, param_shardings)
    opt_state = jax.jit(tx.init, out_shardings=state_shardings)(params)
    return TrainedRole(model_cfg, params, tx, schedule, opt_state, head, param_shardings, state_shardings)


def copy_params(params: dict) -> dict:
    """A separate copy (same shardings) for the frozen reference policy."""
    return jax.jit(lambda p: jax.tree.map(jnp.copy, p))(params)

