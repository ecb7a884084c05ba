"""Shared sampler-test fixtures: a tiny llama config + params (module-scoped compile reuse), and
SmolLM2's greedy transformers reference (loaded once for the static sampler and the engine)."""
import dataclasses

import pytest
from sampler_fixtures import hf_greedy, tiny_config, tiny_params


@pytest.fixture(scope="session")
def llama_tiny():
    cfg = tiny_config("llama")
    return cfg, tiny_params(cfg)


@dataclasses.dataclass
class GreedyCase:
    cfg: object
    params: dict
    prompts: list
    pad_id: int
    eos_id: int
    new_tokens: int
    expected: object  # transformers' greedy tokens [rows, new_tokens]


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2_gguf) -> GreedyCase:
    """SmolLM2 (GGUF) in ours and in transformers, two chat prompts, and transformers' greedy answer."""
    import torch
    import transformers

    from jaxrl_llm.hf import load_gguf
    from jaxrl_llm.sampler import left_pad

    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    cfg, params = load_gguf(smollm2_gguf)
    chats = [[{"role": "user", "content": "What is 2+3?"}],
             [{"role": "user", "content": "Name a colour of the sky on a clear day, in one word."}]]
    prompts = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for c in chats]
    pad, eos, new = tok.pad_token_id, tok.eos_token_id, 16
    hf_ids, hf_mask = left_pad(prompts, pad, length=max(map(len, prompts)))
    return GreedyCase(cfg, params, prompts, pad, eos, new, hf_greedy(torch_model, hf_ids, hf_mask, new, eos, pad))
