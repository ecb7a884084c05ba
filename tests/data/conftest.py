"""Fixtures for the data tests: a tiny char-level chat tokenizer and the real SmolLM2 tokenizer."""
import pytest
from tiny_models import make_char_tokenizer


@pytest.fixture(scope="session")
def char_tok():
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def smollm2_tok(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
