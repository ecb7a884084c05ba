"""Shared sampler-test fixtures: a tiny llama config + params (module-scoped compile reuse)."""
import pytest

from sampler_fixtures import tiny_config, tiny_params


@pytest.fixture(scope="session")
def llama_tiny():
    cfg = tiny_config("llama")
    return cfg, tiny_params(cfg)
