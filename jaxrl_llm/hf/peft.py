"""Export LoRA adapters (models/lora.py) as a PEFT adapter folder that `peft.PeftModel.from_pretrained`
loads onto the base model with the same logits.

Writes `adapter_config.json` (PEFT's LoraConfig: r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with PEFT's names and torch `nn.Linear` layouts:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]

(ours: A [L, in..., r], B [L, r, out...], so lora_A = A[i].reshape(in, r).T and lora_B =
B[i].reshape(r, out).T; PEFT's scaling alpha / r is the one `models.lora` uses). The folder is
built beside `out_dir` and renamed into place; a bucket URL gets it built locally, then uploaded.
"""
from __future__ import annotations

import json
import pathlib
import re
import tempfile
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from jaxrl_llm import storage
from jaxrl_llm.hf.export import staged_folder
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.lora import LoraConfig, group_layer_ids

PREFIX = "base_model.model.model.layers.{i}."
VL_PREFIX = "base_model.model.model.language_model.layers.{i}."  # transformers 5's VL models: the text layers
_HF_GROUP = {"attn": "self_attn", "mlp": "mlp", "shared_expert": "mlp.shared_expert",  # models/lora.py groups
             "attn_full": "self_attn", "kv": "self_attn", "kv_full": "self_attn", "mlp_wide": "mlp",
             "linear": "linear_attn"}


def peft_tensors(cfg: ModelConfig, adapters: dict, prefix: str = PREFIX) -> dict[str, np.ndarray]:
    """{PEFT name: fp32 array in PEFT's layout} for adapters as `init_lora` lays them out; `prefix`: layer i's
    module path (a vision-language model's text layers: `VL_PREFIX`)."""
    out: dict[str, np.ndarray] = {}
    for group, mods in adapters["layers"].items():
        for module, ad in mods.items():
            a, b = np.asarray(ad["A"], np.float32), np.asarray(ad["B"], np.float32)
            rank = a.shape[-1]
            for row, i in enumerate(group_layer_ids(cfg, group)):
                hf_group = "mlp.shared_experts" if group == "shared_expert" and not cfg.shared_expert_gated else \
                    _HF_GROUP[group]  # DeepSeek's shared experts
                name = prefix.format(i=i) + f"{hf_group}.{module}."
                out[name + "lora_A.weight"] = np.ascontiguousarray(a[row].reshape(-1, rank).T)
                out[name + "lora_B.weight"] = np.ascontiguousarray(b[row].reshape(rank, -1).T)
    return out


def tower_peft_tensors(tower: Any, adapters: dict) -> dict[str, np.ndarray]:
    """{PEFT name: fp32 array} of LoRA on a vision tower (models/vision/tower_lora.py: A [depth, in, r], B [depth, r,
    out] per block kernel) under transformers 5's module paths of the tower `tower` (its config); a fused kernel
    (SigLIP's qkv) gives each of its Linears the shared A and its own columns of B, which is the same delta."""
    prefix, linears = _tower_linears(tower)
    out: dict[str, np.ndarray] = {}
    for ours, ad in adapters["blocks"].items():
        a, b = np.asarray(ad["A"], np.float32), np.asarray(ad["B"], np.float32)
        for i in range(a.shape[0]):
            for module, start, stop in linears[ours]:
                name = f"base_model.model.{prefix.format(i=i)}{module}."
                out[name + "lora_A.weight"] = np.ascontiguousarray(a[i].T)
                out[name + "lora_B.weight"] = np.ascontiguousarray(b[i][:, start:stop].T)
    return out


def _tower_linears(tower: Any) -> tuple[str, dict[str, tuple[tuple[str, int, int | None], ...]]]:
    from jaxrl_llm.models.vision import gemma4_vit, qwen3_vit, qwen_vit, siglip

    if isinstance(tower, gemma4_vit.Gemma4VisionConfig):
        return gemma4_vit.BLOCK_MODULES, gemma4_vit.gemma4_block_linears(tower)
    if isinstance(tower, siglip.SiglipVisionConfig):
        return siglip.BLOCK_MODULES, siglip.siglip_block_linears(tower)
    if isinstance(tower, qwen3_vit.Qwen3VisionConfig):
        return qwen3_vit.BLOCK_MODULES, qwen3_vit.qwen3_block_linears(tower)
    return qwen_vit.BLOCK_MODULES, qwen_vit.block_linears(tower)


def adapter_config(lora: LoraConfig, base_model_name_or_path: str | None,
                   targets: list[str] | str | None = None) -> dict[str, Any]:
    """PEFT's adapter_config.json; `targets`: the projections that have adapters (default lora.targets), or a
    regex PEFT matches whole module paths with."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "target_modules": list(lora.targets) if targets is None else targets,
        "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }


def export_peft(cfg: ModelConfig, adapters: dict, lora: LoraConfig, out_dir: str | pathlib.Path, *,
                base_model_name_or_path: str | None = None, tower: Any = None) -> Any:
    """Write the PEFT adapter folder at `out_dir` (a local path or a bucket URL); returns its path. `tower`: a
    vision-language policy's tower config: the adapters then name transformers 5's VL module paths (the text layers
    under `model.language_model`, LoRA on the tower under the tower's), and `target_modules` is the regex of exactly
    those modules (PEFT's full match), so no other Linear of the model gains an adapter."""
    if storage.is_url(out_dir):
        url = storage.normalize(out_dir)
        with tempfile.TemporaryDirectory(prefix="jaxrl_llm-peft-") as local:
            export_peft(cfg, adapters, lora, pathlib.Path(local) / "peft",
                        base_model_name_or_path=base_model_name_or_path, tower=tower)
            storage.remove_tree(url)
            storage.upload_dir(str(pathlib.Path(local) / "peft"), url, last=("adapter_config.json",))
        return storage.as_path(url)
    out_dir = pathlib.Path(out_dir)
    if tower is None and "vision" in adapters:
        raise ValueError("export_peft: the adapters hold LoRA on a vision tower; pass the tower's config (tower=)")
    tensors = peft_tensors(cfg, adapters, PREFIX if tower is None else VL_PREFIX)
    if tower is not None and "vision" in adapters:
        tensors.update(tower_peft_tensors(tower, adapters["vision"]))
    with staged_folder(out_dir) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        # 'all-linear' on a mixture-of-experts model: the projections that exist there (models/lora.py)
        present: list[str] | str = [m for m in lora.targets if any(m in mods for mods in adapters["layers"].values())]
        if tower is not None:  # the exact modules: a VL model's tower has Linears of the text targets' names too
            modules = sorted({name[len("base_model.model."):-len(".lora_A.weight")] for name in tensors
                              if name.endswith(".lora_A.weight")})
            present = "|".join(re.escape(m) for m in modules)
        config = adapter_config(lora, base_model_name_or_path, present)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
