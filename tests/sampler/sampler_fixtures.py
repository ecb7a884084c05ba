"""Tiny models and prompt batches for the sampler tests (also imported by the 2-process worker)."""
from __future__ import annotations

import jax
import numpy as np
from tiny_models import TINY_HF

from jaxrl_llm.models import ModelConfig, init_params

VOCAB = TINY_HF["vocab_size"]
PAD_ID = TINY_HF["pad_token_id"]
EOS_ID = TINY_HF["eos_token_id"]
# different lengths; a real token equal to the pad / eos id inside a prompt must not matter
PROMPTS = [[5, 17, 0, 99, 23, 2, 41, 7, 130], [12, 250, 3], [77, 0, 0, 8, 19], [200]]
# 8 prompts: divisible by every batch split of an 8-device mesh
PROMPTS8 = PROMPTS + [[9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], [31, 2], [64, 128, 192, 255],
                      [1, 2, 3, 4, 5, 6]]
MESHES = {"data2_tensor4": {"data": 2, "fsdp": 1, "tensor": 4}, "fsdp8": {"data": 1, "fsdp": 8, "tensor": 1}}


def tiny_config(family: str = "llama") -> ModelConfig:
    return ModelConfig.tiny(family)


def tiny_params(cfg: ModelConfig, seed: int = 0, scale: float = 10.0) -> dict:
    """Random params with matrices scaled up (std 0.2) so next-token logits are well separated
    (greedy decisions then do not hinge on float rounding across shardings); norms stay 1."""
    params = init_params(cfg, jax.random.key(seed))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if "norm" in jax.tree_util.keystr(path) else x * scale, params)


def hf_greedy(model, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int, eos_id, pad_id: int) -> np.ndarray:
    """transformers `generate` (do_sample=False) new tokens, right-padded with pad_id to max_new_tokens."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's OpenMP pool can stall badly on a loaded CI machine
    try:
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                                 attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id,
                                 top_k=None, top_p=None, temperature=None)
    finally:
        torch.set_num_threads(threads)
    new = out[:, ids.shape[1]:].numpy()
    padded = np.full((ids.shape[0], max_new_tokens), pad_id, np.int64)
    padded[:, :new.shape[1]] = new
    return padded
