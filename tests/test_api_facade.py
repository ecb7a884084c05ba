"""The notebook facade: load (optionally sharded on a mesh) -> generate -> export, and Trainer."""
import jax
import numpy as np

import jaxrl_llm as jrl
from jaxrl_llm.hf import export_hf
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sharding import make_mesh


def test_facade_generate_sharded_equals_single_device(tmp_path):
    cfg = ModelConfig.tiny("llama")
    export_hf(cfg, init_params(cfg, jax.random.PRNGKey(0)), tmp_path / "m")
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    params = jrl.SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    single = jrl.generate(jrl.load_model(tmp_path / "m"), prompts, params)
    mesh = make_mesh({"data": 2, "fsdp": 1, "tensor": 4})
    sharded_model = jrl.load_model(tmp_path / "m", mesh=mesh)
    assert sharded_model.params["embedding"].sharding.mesh.shape["tensor"] == 4
    sharded = jrl.generate(sharded_model, prompts, params)
    np.testing.assert_array_equal(single.tokens, sharded.tokens)
    assert single.tokens.shape == (2, 6)


def test_facade_exposes_trainer():
    from jaxrl_llm.trainer import Trainer

    assert jrl.Trainer is Trainer


def test_facade_names_in_all_resolve_to_the_api():
    # __all__ is written out for type checkers; every name in it resolves lazily to jaxrl_llm.api's
    import jaxrl_llm.api as api

    names = [n for n in jrl.__all__ if n != "__version__"]
    assert names and all(getattr(jrl, n) is getattr(api, n) for n in names)
