"""The model half of the facade: load_model / Model.logits / load_tokenizer / export_hf."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxrl_llm as jrl
from jaxrl_llm.hf import export_hf
from jaxrl_llm.models import ModelConfig, compute_logits, init_params


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    cfg = ModelConfig.tiny("qwen2")
    params = init_params(cfg, jax.random.key(3))
    return export_hf(cfg, params, tmp_path_factory.mktemp("m") / "qwen2"), cfg, params


def test_load_model_logits_and_export(hf_folder, tmp_path):
    folder, cfg, params = hf_folder
    model = jrl.load_model(folder)
    assert isinstance(model, jrl.Model) and model.config == cfg
    ids = jnp.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    got = np.asarray(model.logits(ids, mask))
    want = np.asarray(jax.jit(compute_logits, static_argnums=1)(params, cfg, ids, mask))
    assert got.shape == (2, 5, cfg.vocab_size)
    np.testing.assert_allclose(got, want, atol=1e-5)
    jrl.export_hf(model, tmp_path / "again")
    assert jrl.load_model(tmp_path / "again").config == cfg
    assert jrl.load_model(folder, dtype="bfloat16").params["embedding"].dtype == jnp.bfloat16


def test_load_model_places_params_on_given_shardings(hf_folder):
    folder, cfg, _ = hf_folder
    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))

    def shard(path, shape, dtype):  # split the vocab of the embedding, replicate the rest
        spec = PartitionSpec("fsdp") if path == ("embedding",) else PartitionSpec()
        return NamedSharding(mesh, spec)

    model = jrl.load_model(folder, mesh=mesh, shardings=shard)
    emb = model.params["embedding"]
    assert emb.sharding.spec == PartitionSpec("fsdp") and len(emb.addressable_shards) == 2
    assert emb.addressable_shards[0].data.shape == (cfg.vocab_size // 2, cfg.hidden_size)
    # mesh alone: params are sharded by the default logical-axis rules (embedding: embed -> fsdp)
    from jaxrl_llm.sharding import make_mesh

    ruled = jrl.load_model(folder, mesh=make_mesh({"data": 1, "fsdp": 2, "tensor": 1}))
    shard_shapes = {s.data.shape for s in ruled.params["embedding"].addressable_shards}
    assert shard_shapes == {(cfg.vocab_size, cfg.hidden_size // 2)}
    np.testing.assert_allclose(np.asarray(ruled.params["embedding"]), np.asarray(emb), rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown dtype"):
        jrl.load_model(folder, dtype="int4")
