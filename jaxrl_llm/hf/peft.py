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
import tempfile
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from jaxrl_llm import storage
from jaxrl_llm.hf.export import staged_folder
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.lora import LoraConfig, group_layer_ids

PREFIX = "base_model.model.model.layers.{i}."
_HF_GROUP = {"attn": "self_attn", "mlp": "mlp", "shared_expert": "mlp.shared_expert",  # models/lora.py groups
             "attn_full": "self_attn", "kv": "self_attn", "kv_full": "self_attn", "mlp_wide": "mlp",
             "linear": "linear_attn"}


def peft_tensors(cfg: ModelConfig, adapters: dict) -> dict[str, np.ndarray]:
    """{PEFT name: fp32 array in PEFT's layout} for adapters as `init_lora` lays them out."""
    out: dict[str, np.ndarray] = {}
    for group, mods in adapters["layers"].items():
        for module, ad in mods.items():
            a, b = np.asarray(ad["A"], np.float32), np.asarray(ad["B"], np.float32)
            rank = a.shape[-1]
            for row, i in enumerate(group_layer_ids(cfg, group)):
                hf_group = "mlp.shared_experts" if group == "shared_expert" and not cfg.shared_expert_gated else \
                    _HF_GROUP[group]  # DeepSeek's shared experts
                name = PREFIX.format(i=i) + f"{hf_group}.{module}."
                out[name + "lora_A.weight"] = np.ascontiguousarray(a[row].reshape(-1, rank).T)
                out[name + "lora_B.weight"] = np.ascontiguousarray(b[row].reshape(rank, -1).T)
    return out


def adapter_config(lora: LoraConfig, base_model_name_or_path: str | None,
                   targets: list[str] | None = None) -> dict[str, Any]:
    """PEFT's adapter_config.json; `targets`: the projections that have adapters (default lora.targets)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "target_modules": list(lora.targets) if targets is None else targets,
        "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }


def export_peft(cfg: ModelConfig, adapters: dict, lora: LoraConfig, out_dir: str | pathlib.Path, *,
                base_model_name_or_path: str | None = None) -> Any:
    """Write the PEFT adapter folder at `out_dir` (a local path or a bucket URL); returns its path."""
    if storage.is_url(out_dir):
        url = storage.normalize(out_dir)
        with tempfile.TemporaryDirectory(prefix="jaxrl_llm-peft-") as local:
            export_peft(cfg, adapters, lora, pathlib.Path(local) / "peft",
                        base_model_name_or_path=base_model_name_or_path)
            storage.remove_tree(url)
            storage.upload_dir(str(pathlib.Path(local) / "peft"), url, last=("adapter_config.json",))
        return storage.as_path(url)
    out_dir = pathlib.Path(out_dir)
    with staged_folder(out_dir) as tmp:
        save_file(peft_tensors(cfg, adapters), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        # 'all-linear' on a mixture-of-experts model: the projections that exist there (models/lora.py)
        present = [m for m in lora.targets if any(m in mods for mods in adapters["layers"].values())]
        config = adapter_config(lora, base_model_name_or_path, present)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
