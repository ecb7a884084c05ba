"""The small public facade for notebooks: load, logits, generate, export, train.

    import jaxrl_llm as jrl
    model = jrl.load_model(path, mesh=None)      # HF folder, .gguf or training checkpoint
    model.tokenizer                              # the model's own tokenizer (None when it has none)
    logits = model.logits(input_ids, attention_mask)   # [B, T, V] float32
    out = jrl.generate(model, "What is 2 + 2?")  # a user message, chat template, SamplingParams()
    out = jrl.generate(model, ["Hi", "Hello"], jrl.SamplingParams(temperature=0.0, max_new_tokens=32))
    out = jrl.generate(vl_model, [{"role": "user", "content": [{"type": "image", "image": pil_or_path},
                                                               {"type": "text", "text": "What is it?"}]}])
    jrl.export_hf(model, out_dir)                # writes the attached tokenizer too
    jrl.Trainer(config).fit()                    # the loop launch/train.py runs

`Model` stays a plain (config, params[, mesh, tokenizer]) holder; sampling lives in
`jaxrl_llm.sampler`, training in `jaxrl_llm.trainer`.
"""
from __future__ import annotations

import dataclasses
import pathlib
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm import checkpoint as _checkpoint
from jaxrl_llm.arrays import DType, ShardingTree
from jaxrl_llm.data.images import count_placeholders
from jaxrl_llm.data.vision_prompts import chat_with_images
from jaxrl_llm.hf import export_hf as _export_hf
from jaxrl_llm.hf import load_any
from jaxrl_llm.hf import load_tokenizer as _load_tokenizer
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models import ModelConfig, compute_logits
from jaxrl_llm.models.dtypes import as_jnp_dtype
from jaxrl_llm.roles.vision import VisionTower, vision_tower_of
from jaxrl_llm.sampler import GenerationResult, SamplingParams
from jaxrl_llm.sampler import generate as _generate
from jaxrl_llm.sharding import mesh_context

_logits = jax.jit(compute_logits, static_argnums=1)


@dataclasses.dataclass
class Model:
    """A loaded model: its `ModelConfig`, plain params dict (see `jaxrl_llm.models.model`), the mesh
    its params are sharded on (or None) and its tokenizer (or None)."""

    config: ModelConfig
    params: dict
    mesh: Mesh | None = None
    tokenizer: Tokenizer | None = dataclasses.field(default=None, repr=False)  # a transformers tokenizer or None
    # a vision-language model's tower (a Qwen2.5-VL / Qwen3-VL folder's; roles/vision.py): `generate` takes images
    vision: VisionTower | None = dataclasses.field(default=None, repr=False)

    def logits(self, input_ids: Any, attention_mask: Any = None) -> jax.Array:
        """[B, T, V] float32 logits (jitted; left padding allowed, defined by the mask)."""
        ids = jnp.asarray(input_ids, jnp.int32)
        mask = jnp.ones_like(ids) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
        with mesh_context(self.mesh):  # a MoE model's experts split over the mesh's `expert` axis
            return _logits(self.params, self.config, ids, mask)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def find_tokenizer(path: str | pathlib.Path) -> str | None:
    """Where the tokenizer of the model at `path` is: the .gguf file itself, an HF folder holding
    tokenizer files, or for a training checkpoint the tokenizer its run used (`meta["tokenizer"]`).
    None when there is none (a checkpoint naming a tokenizer that no longer exists warns)."""
    p = pathlib.Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return str(p)
    if _checkpoint.is_checkpoint(p) and not (p / "config.json").is_file():
        named = _checkpoint.read_checkpoint_meta(p).get("tokenizer")
        if not named or named == "None":
            return None
        if not pathlib.Path(named).exists():
            warnings.warn(f"checkpoint {str(p)!r} names tokenizer {named!r}, which does not exist; "
                          "the model is loaded without a tokenizer (pass tokenizer=...)", stacklevel=3)
            return None
        return str(named)
    if p.is_dir() and any((p / name).is_file() for name in _TOKENIZER_FILES):
        return str(p)
    return None


def load_model(path: str | pathlib.Path, dtype: DType = "float32", mesh: Mesh | None = None, *,
               shardings: ShardingTree | None = None, tokenizer: Tokenizer | None = None) -> Model:
    """Load an HF folder, a .gguf file or a training checkpoint as a `Model` with params of `dtype`.

    Placement: `shardings` (a params-shaped pytree of `jax.sharding.Sharding`, or a callable
    `(path, shape, dtype) -> Sharding`) puts every tensor straight onto its target devices while
    loading. With only `mesh`, the params are sharded by the default logical-axis rules after
    loading (`jaxrl_llm.sharding`).

    Tokenizer (`model.tokenizer`): by default the model's own (`find_tokenizer`; None when it has
    none); `tokenizer=` overrides it with a tokenizer object or a path to load one from, and
    `tokenizer=False` loads none.
    """
    if tokenizer is None:
        source = find_tokenizer(path)
        tok = None if source is None else _load_tokenizer(source)
    elif tokenizer is False:
        tok = None
    elif isinstance(tokenizer, (str, pathlib.Path)):
        tok = _load_tokenizer(tokenizer)
    else:
        tok = tokenizer
    _checkpoint.register_checkpoint_loader()  # `path` may be one of our training checkpoints
    cfg, params = load_any(path, dtype=as_jnp_dtype(dtype), shardings=shardings)
    if mesh is not None and shardings is None:
        from jaxrl_llm.models import param_logical_axes
        from jaxrl_llm.sharding import shard_params

        head = "score" if "score" in params else "value" if "value_head" in params else "lm"
        params = shard_params(params, param_logical_axes(cfg, head=head), mesh)
    # a Qwen2.5-VL / Qwen3-VL folder: its tower too
    vision = None if tok is None else vision_tower_of(str(path), cfg, tok, mesh=mesh, compute_dtype="float32", seed=0)
    return Model(cfg, params, mesh, tok, vision)


def load_tokenizer(path: str | pathlib.Path) -> Tokenizer:
    """A transformers tokenizer from an HF folder or a .gguf file (chat template included)."""
    return _load_tokenizer(path)


def export_hf(model: Model, out_dir: str | pathlib.Path, tokenizer: Tokenizer | Literal[False] | None = None,
              **kw: Any) -> pathlib.Path:
    """Write `model` as an HF folder loadable by `transformers.AutoModelForCausalLM`, with
    `tokenizer` (default: the model's own; `False`: none) written beside it."""
    if tokenizer is None:
        tokenizer = model.tokenizer
    return _export_hf(model.config, model.params, out_dir, tokenizer=None if tokenizer is False else tokenizer,
                      **kw)


def _is_text_prompts(prompts: Any) -> tuple[bool, bool]:
    """(any prompt is a string, the prompts are one unwrapped prompt)."""
    if isinstance(prompts, str):
        return True, True
    if isinstance(prompts, (list, tuple)):
        return any(isinstance(p, str) for p in prompts), False
    return False, False


def generate(model: Model, prompts: Any, sampling_params: SamplingParams | None = None, *,
             tokenizer: Tokenizer | None = None, chat: bool | None = None,
             images: Sequence[Sequence[Any]] | None = None, engine: str | None = None) -> GenerationResult:
    """Sample from `model` (default `SamplingParams()`); see `jaxrl_llm.sampler.facade`.

    Prompts: a string or a list of strings, chat message lists (`[{"role": "user", "content":
    ...}]`) or token-id lists. A string is one user message rendered with the chat template when
    the tokenizer has one (`chat=None`, the default, or `chat=True`), else (`chat=False`, or no
    template) raw text. The tokenizer is `tokenizer=` or else the model's own (`model.tokenizer`).
    A vision-language model (`model.vision`) also takes HF content lists (`{"type": "image", "image":
    PIL-or-path-or-bytes}`, `{"type": "text", "text": ...}`) and `<image>` placeholders, whose images are
    `images` (per prompt, in order). engine: 'auto' (default), 'static' or 'paged' (`jaxrl_llm.sampler.facade`).
    """
    tok = tokenizer if tokenizer is not None else model.tokenizer
    if model.vision is not None and tok is not None:
        chats = _chat_prompts(prompts)
        if chats is not None and (images is not None or any(count_placeholders(c) for c in chats)):
            rows = [chat_with_images(c, model.vision.tokens, tok, () if images is None else images[i],
                                     where=f"prompt {i}") for i, c in enumerate(chats)]
            return _generate(model, [ids.tolist() for ids, _ in rows], sampling_params or SamplingParams(),
                             tokenizer=tok, mesh=model.mesh, images=[pictures for _, pictures in rows],
                             vision=model.vision, engine=engine)
    if images is not None:
        raise ValueError("jrl.generate(images=...): the model reads text only (model.vision is None: not a "
                         "vision-language model, or loaded without a tokenizer)")
    has_text, single = _is_text_prompts(prompts)
    if has_text and tok is None:
        raise ValueError("jrl.generate: text prompts need a tokenizer and this model has none (jrl.load_model "
                         "found none beside its weights). Pass tokenizer=jrl.load_tokenizer(path), load it with "
                         "jrl.load_model(path, tokenizer=...), or give token ids.")
    if has_text and (chat if chat is not None else bool(getattr(tok, "chat_template", None))):
        if chat and not getattr(tok, "chat_template", None):
            raise ValueError("jrl.generate(chat=True): the tokenizer has no chat template")
        as_chat = lambda p: [{"role": "user", "content": p}] if isinstance(p, str) else p  # noqa: E731
        prompts = [as_chat(prompts)] if single else [as_chat(p) for p in prompts]
    return _generate(model, prompts, sampling_params or SamplingParams(), tokenizer=tok, mesh=model.mesh,
                     engine=engine)


def _chat_prompts(prompts: Any) -> list[list[dict[str, Any]]] | None:
    """`prompts` as chat message lists (a string: one user message; content lists kept), or None when they are
    token ids."""
    def as_chat(p: Any) -> list[dict[str, Any]] | None:
        if isinstance(p, str):
            return [{"role": "user", "content": p}]
        if isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) for m in p):
            return list(p)
        return None

    one = as_chat(prompts)
    if one is not None:
        return [one]
    if not isinstance(prompts, (list, tuple)):
        return None
    chats = [as_chat(p) for p in prompts]
    return None if any(c is None for c in chats) else [c for c in chats if c is not None]


def __getattr__(name: str) -> Any:
    if name == "Trainer":  # the trainer pulls in data / rewards: import it only when asked for
        from jaxrl_llm.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'jaxrl_llm.api' has no attribute {name!r}")
