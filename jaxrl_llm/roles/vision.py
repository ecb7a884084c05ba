"""A vision-language policy's vision tower (docs/vision.md): frozen, run once per rollout batch over its prompts'
images; the features go into the sampler's prefill and, row by row, into every pass of the step that reads the
policy (`RowImages`), so the sampler and the trainer see the same embeddings.

What makes a policy vision-language here: a Qwen2.5-VL, Qwen3-VL, Gemma 3 or Gemma 4 folder
(`Qwen2_5_VLForConditionalGeneration`, `Qwen3VLForConditionalGeneration`, `Gemma3ForConditionalGeneration`,
`Gemma4ForConditionalGeneration` with a vision tower; its text model is what `load_model` loads) or
`tiny:qwen2_5_vl` (a random tiny Qwen2.5-VL for tests and CI: the tiny text dims with M-RoPE, a 2-block tower, and
the tokenizer given the vision tokens it lacks).
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.config import ConfigError
from jaxrl_llm.config.checks import TINY_VISION_LANGUAGE, reads_images
from jaxrl_llm.config.spec import RunSpec
from jaxrl_llm.data.vision_prompts import ImageTokens
from jaxrl_llm.hf.hf_folder import read_hf_config
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.hf.vision import folder_vision_language, vision_language_config
from jaxrl_llm.hf.vision import load_vision_tower as load_folder_tower
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.dtypes import COMPUTE_DTYPES, as_jnp_dtype
from jaxrl_llm.models.vision.gemma4_vit import Gemma4VisionConfig, init_gemma4_vision_params
from jaxrl_llm.models.vision.qwen3_vit import Qwen3VisionConfig, init_qwen3_vision_params
from jaxrl_llm.models.vision.qwen_vit import VisionConfig, init_vision_params
from jaxrl_llm.models.vision.qwen_vl import (
    QWEN_IMAGE_TOKEN_ID,
    ImagePrompt,
    TowerConfig,
    VisionLanguage,
    feature_bucket,
    image_prompt,
)
from jaxrl_llm.models.vision.siglip import SiglipVisionConfig, init_siglip_params
from jaxrl_llm.models.vision.tower_lora import merged_tower
from jaxrl_llm.models.vision.tower_rows import prompt_tower_rows

TINY_VL = TINY_VISION_LANGUAGE
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def with_vision_tokens(path: str | None, tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` for the policy at `path`: tiny:qwen2_5_vl's gains the vision tokens it lacks (a copy: loaded
    tokenizers are shared); any other policy's as it is."""
    missing = [t for t in _VISION_TOKENS if t not in tokenizer.get_vocab()]
    if path != TINY_VL or not missing:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    return tokenizer


def image_tokens_of(path: str | None, tokenizer: Tokenizer) -> ImageTokens | None:
    """How the policy at `path` reads images (None: a text policy), checked against `tokenizer`: its image token
    must be the model's image token id."""
    if not reads_images(path):
        return None
    assert path is not None
    if path == TINY_VL:
        return ImageTokens(image_token_id=int(tokenizer.convert_tokens_to_ids(ImageTokens.pad_text)))
    config = read_hf_config(path)
    if config.get("model_type") == "gemma4":
        return _gemma4_image_tokens(path, config, tokenizer)
    gemma = config.get("model_type") == "gemma3"
    pad_text = "<image_soft_token>" if gemma else ImageTokens.pad_text
    token_id = tokenizer.convert_tokens_to_ids(pad_text)
    model_token = int(config.get("image_token_id", config.get("image_token_index", 262144 if gemma
                                                                  else QWEN_IMAGE_TOKEN_ID)))
    if token_id != model_token:
        raise ConfigError(f"actor_rollout_ref.model.path={path!r}: the tokenizer's {pad_text!r} is id {token_id}, the "
                          f"model's image token is {model_token} (config.json image_token_id): data.tokenizer "
                          "must be the model's own")
    vision = config.get("vision_config") or {}
    if gemma:  # every image one square: the tower's image_size, then the folder's preprocessor_config.json
        return ImageTokens.gemma3(model_token, int(config.get("mm_tokens_per_image", 256)),
                                  int(vision.get("image_size", 896))).with_preprocessor(path)
    # the tower's own patch sizes (Qwen3-VL's 16 pixels, Qwen2.5-VL's 14), then the folder's preprocessor_config.json
    tokens = ImageTokens(image_token_id=model_token)
    tokens = dataclasses.replace(tokens, patch_size=int(vision.get("patch_size", tokens.patch_size)),
                                 temporal_patch_size=int(vision.get("temporal_patch_size", tokens.temporal_patch_size)),
                                 merge_size=int(vision.get("spatial_merge_size", tokens.merge_size)))
    return tokens.with_preprocessor(path)


def _gemma4_image_tokens(path: str, config: dict[str, Any], tokenizer: Tokenizer) -> ImageTokens:
    """Gemma 4's image tokens: the tokenizer's strings of the model's begin-of-image, image and end-of-image ids
    (each must read back as its id), the folder's processor sizes."""
    ids = {"boi_token_id": int(config.get("boi_token_id", 255999)),
           "image_token_id": int(config.get("image_token_id", 258880)),
           "eoi_token_id": int(config.get("eoi_token_id", 258882))}
    texts = {}
    for key, token_id in ids.items():
        text = tokenizer.convert_ids_to_tokens(token_id) if token_id < len(tokenizer) else None
        if not isinstance(text, str) or tokenizer.convert_tokens_to_ids(text) != token_id:
            raise ConfigError(f"actor_rollout_ref.model.path={path!r}: config.json {key}={token_id} is not a token of "
                              "the tokenizer: data.tokenizer must be the model's own")
        texts[key] = text
    vision = folder_vision_language(path).vision
    assert isinstance(vision, Gemma4VisionConfig)
    tokens = ImageTokens.gemma4(ids["image_token_id"], texts["boi_token_id"], texts["image_token_id"],
                                texts["eoi_token_id"], patch_size=vision.patch_size,
                                max_soft_tokens=vision.max_soft_tokens, pooling_kernel_size=vision.pooling_kernel_size)
    return tokens.with_preprocessor(path)


def tiny_mrope_section(head_dim: int) -> tuple[int, int, int]:
    """M-RoPE's (temporal, height, width) frequency split of a tiny text model, Qwen2.5-VL's 1/4, 3/8, 3/8 shares
    of head_dim / 2 (its 128-wide heads: 16, 24, 24)."""
    half = head_dim // 2
    side = (half - half // 4) // 2
    return half - 2 * side, side, side


@dataclasses.dataclass(eq=False)
class VisionTower:
    """The policy's frozen tower: what its prompts' images become (`prompt`)."""

    path: str  # the policy's (actor_rollout_ref.model.path)
    vl: VisionLanguage
    params: dict[str, Any]  # fp32 on the mesh (`tower_shardings`)
    tokens: ImageTokens
    hf_config: dict[str, Any]  # the config.json an export writes (the source folder's; tiny:qwen2_5_vl's built)
    compute_dtype: str = "float32"
    # actor.freeze_vision_tower=False: the tower is the actor's params["vision"], trained with the text model; each
    # row then carries its pixels (models/vision/tower_rows.py) and `params` here are only the initial ones
    trained: bool = False

    def describe(self) -> str:
        """The run summary's line: the tower, frozen, and how images become tokens."""
        v = self.vl.vision
        size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))
        state = ("trained with the text model (actor.freeze_vision_tower=False: each row carries its pixels)"
                 if self.trained else "frozen (actor.freeze_vision_tower=True; veRL trains it by default)")
        return (f"vision tower: {v.depth} blocks, hidden {v.hidden_size}, {size / 1e6:.1f}M parameters, {state}; "
                f"{self.tokens.describe()}")

    def prompt(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, images: Sequence[Sequence[Any]],
               params: dict[str, Any] | None = None) -> ImagePrompt:
        """The `ImagePrompt` of a left-padded prompt batch whose row b holds images[b] (encoded, as the data keeps
        them): the tower run once over all of them, with `params` (a trained tower's current ones; default the
        loaded ones). A trained tower's prompt also carries each prompt's pixels (`tower_rows`)."""
        flat = [image for row in images for image in row]
        if not flat:
            raise ValueError("a vision-language prompt batch without images")
        pixels, grids = self.tokens.pixels(flat)
        prompt = image_prompt(self.params if params is None else params, self.vl, prompt_ids, prompt_mask, pixels,
                              grids, compute_dtype=as_jnp_dtype(self.compute_dtype, allowed=COMPUTE_DTYPES,
                                                                what="actor.compute_dtype"))
        if not self.trained:
            return prompt
        counts = [len(row) for row in images]
        room = feature_bucket(int((np.asarray(prompt.slots) >= 0).sum(axis=1).max()))
        return prompt._replace(tower_rows=prompt_tower_rows(self.vl.vision, pixels, grids, counts, room),
                               vision=self.vl)


def load_vision_tower(path: str, model_cfg: ModelConfig, tokens: ImageTokens, tokenizer: Tokenizer, *,
                      mesh: Mesh | None, compute_dtype: str, seed: int, trained: bool = False) -> VisionTower:
    """The tower of the policy at `path` (whose text model is `model_cfg`) on `mesh` (None: the default device):
    replicated when frozen, split over 'fsdp' when `trained` (`tower_shardings`). tiny:qwen2_5_vl's is random from
    `seed` (the run's: a checkpoint's tower is the run's own)."""
    if path == TINY_VL:
        if not model_cfg.mrope_section:
            raise ConfigError(f"{TINY_VL}: the text model has no mrope_section")
        vl = VisionLanguage(vision=VisionConfig.tiny(model_cfg.hidden_size), image_token_id=tokens.image_token_id,
                            vision_start_token_id=int(tokenizer.convert_tokens_to_ids(tokens.start_text)))
        params = init_tower(vl.vision, jax.random.fold_in(jax.random.PRNGKey(seed), 0x7157))
        hf_config = vision_language_config(
            model_cfg, vl, vision_end_token_id=int(tokenizer.convert_tokens_to_ids("<|vision_end|>")),
            video_token_id=int(tokenizer.convert_tokens_to_ids("<|video_pad|>")))
    else:
        vl, params = load_folder_tower(path)
        hf_config = read_hf_config(path)
        if vl.vision.out_hidden_size != model_cfg.hidden_size:
            raise ConfigError(f"actor_rollout_ref.model.path={path!r}: the tower's out_hidden_size "
                              f"{vl.vision.out_hidden_size} is not the text model's hidden_size "
                              f"{model_cfg.hidden_size}")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    if mesh is not None:
        params = jax.device_put(params, tower_shardings(params, mesh, trained=trained))
    return VisionTower(path=path, vl=vl, params=params, tokens=tokens, hf_config=hf_config,
                       compute_dtype=compute_dtype, trained=trained)


def tower_shardings(params: Any, mesh: Mesh, *, trained: bool) -> Any:
    """Where a tower's params live: a frozen tower replicated (it runs once per rollout batch; its 4 bytes a
    parameter are small beside the text model's); a trained one as the text model's weights are, ZeRO-3 style: each
    matrix split over 'fsdp' along its last axis that 'fsdp' divides (a block stack [depth, in, out]: out, else in;
    the patch and position tables alike), vectors replicated, so its Adam moments and gradients split with it (a
    trained Qwen2.5-VL-7B tower: 670M parameters x 16 bytes, 10.7 GB per chip replicated). Each block's weights
    are gathered inside the tower's scan as the text model's layers' are."""
    replicated = NamedSharding(mesh, PartitionSpec())
    split = mesh.shape.get("fsdp", 1)

    def place(x: Any) -> NamedSharding:
        shape = np.shape(x)
        if not trained or split == 1 or len(shape) < 2:
            return replicated
        for axis in (len(shape) - 1, len(shape) - 2):
            if shape[axis] % split == 0:
                spec: list[str | None] = [None] * len(shape)
                spec[axis] = "fsdp"
                return NamedSharding(mesh, PartitionSpec(*spec))
        return replicated

    return jax.tree.map(place, params)


def vision_tower_of(path: str, model_cfg: ModelConfig, tokenizer: Tokenizer, *, mesh: Mesh | None,
                    compute_dtype: str, seed: int) -> VisionTower | None:
    """The tower of the policy at `path` read with `tokenizer` (`image_tokens_of`, `load_vision_tower`), or None
    for a text policy."""
    tokens = image_tokens_of(path, tokenizer)
    if tokens is None:
        return None
    return load_vision_tower(path, model_cfg, tokens, tokenizer, mesh=mesh, compute_dtype=compute_dtype, seed=seed)


def check_vision_run(spec: RunSpec) -> None:
    """A ConfigError naming the key for each part of a vision-language policy's run that does not read images
    yet (docs/vision.md): a critic of another model, a distillation teacher, a draft model."""
    arr = "actor_rollout_ref"
    refused = {
        # a critic reads the rows' features: its folder must be the policy's (the same frozen tower's features)
        f"critic.model.path={None if spec.critic_model is None else spec.critic_model.path!r} (a critic of another "
        "model than the policy's folder)": spec.critic is not None and (
            spec.critic_model is None or spec.critic_model.path != spec.model.path),
        "algorithm.distillation.enable=True": spec.distillation is not None,
        # n-gram drafts verify with the policy's own forward (its images read); a draft model reads text only
        f"{arr}.rollout.speculative.method='draft'": (spec.rollout_engine.speculative is not None
                                                       and spec.rollout_engine.speculative.uses_draft_model),
    }
    for key, on in refused.items():
        if on:
            raise ConfigError(f"{key}: a vision-language policy ({spec.model.path}) runs without a critic of "
                              "another model, a teacher or a draft model for now (docs/vision.md)")
    if spec.actor.freeze_vision_tower:
        return
    trained = {  # what a trained tower does not go with yet
        "critic.enable=True (the critic's tower would be the policy's trained one)": spec.critic is not None,
        "algorithm.filter_groups.enable=True (joined rollouts' pixels)": spec.filter_groups.enable,
    }
    for key, on in trained.items():
        if on:
            raise ConfigError(f"{arr}.actor.freeze_vision_tower=False with {key}: not supported yet; keep the tower "
                              "frozen (docs/vision.md)")


def tower_for_export(source: str, model_cfg: ModelConfig) -> VisionTower | None:
    """The tower an export of `source` writes beside its text model `model_cfg` (launch/convert_to_hf.py): a
    vision-language folder's own, or for a training checkpoint its run's policy's (a folder's as loaded,
    tiny:qwen2_5_vl's drawn again from the run's seed; with LoRA on the tower, its adapters merged; a fully trained
    tower is in the checkpoint's params instead); None for a text model."""
    from jaxrl_llm import checkpoint as ckpt
    from jaxrl_llm.hf import load_tokenizer

    seed, tokenizer_path, checkpoint = 0, source, None
    if ckpt.is_checkpoint(source):
        checkpoint, meta = source, ckpt.read_checkpoint_meta(source)
        run = meta["config"]
        source, seed = run["actor_rollout_ref"]["model"]["path"], run["trainer"]["seed"]
        tokenizer_path = meta["tokenizer"]
        checkpoint = checkpoint if meta.get("lora") else None
    if not reads_images(source):
        return None
    tokenizer = with_vision_tokens(source, load_tokenizer(tokenizer_path))
    tower = vision_tower_of(source, model_cfg, tokenizer, mesh=None, compute_dtype="float32", seed=seed)
    if tower is not None and checkpoint is not None:  # a LoRA run's checkpoint: its tower adapters, if any
        from jaxrl_llm.checkpoint.policy import load_lora_checkpoint

        _, adapters, lora, _ = load_lora_checkpoint(checkpoint)
        if "vision" in adapters:
            tower.params = merged_tower(tower.params, adapters["vision"], lora.scale)
    return tower


def vision_config_of(path: str, model_cfg: ModelConfig) -> TowerConfig:
    """The tower's config of the policy at `path` (no weight read): tiny:qwen2_5_vl's, or a folder's config.json."""
    return vision_language_of(path, model_cfg).vision


def vision_language_of(path: str, model_cfg: ModelConfig) -> VisionLanguage:
    """The `VisionLanguage` of the policy at `path` (no weight read; tiny:qwen2_5_vl's token ids are its
    tokenizer's, not known here: 0)."""
    if path == TINY_VL:
        return VisionLanguage(vision=VisionConfig.tiny(model_cfg.hidden_size), image_token_id=0,
                              vision_start_token_id=0)
    return folder_vision_language(path)


def _largest_image_rows(cfg: Any, prompt_length: int, room: int) -> Any:
    """A `TowerRows` of one prompt with one image as large as `prompt_length` image tokens allow (the plan's
    worst case): host arrays whose shapes the plan's rows take."""
    if isinstance(cfg, SiglipVisionConfig):
        pixels, grid = np.zeros((1, cfg.in_channels, cfg.image_size, cfg.image_size), np.float32), np.ones((1, 3))
    elif isinstance(cfg, Gemma4VisionConfig):  # every image's pixels are the budget's patches
        side = cfg.pooling_kernel_size
        pixels, grid = np.zeros((1, cfg.max_patches, cfg.patch_dim), np.float32), np.array([[1, side, side]])
    else:
        side = cfg.spatial_merge_size
        blocks = max(1, prompt_length)
        grid = np.array([[1, side, side * blocks]], np.int64)
        pixels = np.zeros((side * side * blocks, cfg.patch_dim), np.float32)
    rows = prompt_tower_rows(cfg, pixels, grid, [1], room)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), rows)


def init_tower(cfg: TowerConfig, rng: jax.Array) -> dict[str, Any]:
    """Random tower params of any kind."""
    if isinstance(cfg, Gemma4VisionConfig):
        return init_gemma4_vision_params(cfg, rng)
    if isinstance(cfg, SiglipVisionConfig):
        return init_siglip_params(cfg, rng)
    return init_qwen3_vision_params(cfg, rng) if isinstance(cfg, Qwen3VisionConfig) else init_vision_params(cfg, rng)


def vision_step_state(path: str, model_cfg: ModelConfig, mesh: Mesh, *, rows: int, prompt_length: int,
                      response_length: int, compute_dtype: str = "float32", trained: bool = False) -> dict[str, Any]:
    """The abstract arrays (sharded `ShapeDtypeStruct`s) a vision-language policy's step holds beside its programs
    (the memory plan's state): the tower (`tower_shardings`) and the step's `RowImages`, worst case (every prompt
    token an image token: K = its feature room for `prompt_length` tokens; the features in the policy's
    `compute_dtype`, as the rollout keeps them). `trained` (actor.freeze_vision_tower=False): the tower split over
    'fsdp', and the rows also carry their pixels (`TowerRows`; planned as one image per row, the largest the prompt
    length allows), and "vision" is the tower's config their passes read."""
    from jaxrl_llm.sharding import batch_sharding

    vision = vision_config_of(path, model_cfg)
    dtype = as_jnp_dtype(compute_dtype, allowed=COMPUTE_DTYPES, what="actor.compute_dtype")
    tower = jax.eval_shape(lambda: init_tower(vision, jax.random.PRNGKey(0)))
    columns = prompt_length + response_length
    room = feature_bucket(prompt_length)
    rows_of = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape)))  # noqa: E731
    image_rows: dict[str, Any] = {"positions": rows_of((rows, 3, columns), jnp.int32),  # `RowImages`' fields
                  "slots": rows_of((rows, columns), jnp.int32),
                  "features": rows_of((rows, room, model_cfg.hidden_size), dtype)}
    if isinstance(vision, Qwen3VisionConfig) and vision.deepstack_visual_indexes:  # a feature per deepstack layer
        image_rows["deepstack"] = rows_of((rows, len(vision.deepstack_visual_indexes), room, model_cfg.hidden_size),
                                          dtype)
    if trained:
        image_rows["tower"] = jax.tree.map(lambda x: rows_of((rows, *x.shape[1:]), x.dtype),
                                           _largest_image_rows(vision, prompt_length, room))
        image_rows["vision"] = vision_language_of(path, model_cfg)
    placed = tower_shardings(tower, mesh, trained=trained)
    return {"vision_tower": jax.tree.map(lambda x, at: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=at), tower,
                                         placed),
            "image_rows": image_rows}
