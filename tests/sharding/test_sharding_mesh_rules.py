"""Mesh construction from config, logical-axis rules -> PartitionSpecs, the replication fallback."""
import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from sharding_fixtures import logical_axes, make_params

from jaxrl_llm import sharding


@pytest.mark.parametrize("cfg, shape", [
    (None, (1, 8, 1, 1, 1)),
    ({}, (1, 8, 1, 1, 1)),
    ({"data": 2, "fsdp": 1, "tensor": 4}, (2, 1, 1, 1, 4)),
    ({"data": 2, "tensor": 2}, (2, 2, 1, 1, 2)),
    ({"data": -1, "fsdp": 1, "tensor": 2}, (4, 1, 1, 1, 2)),
    ({"data": 1, "fsdp": 2, "tensor": -1}, (1, 2, 1, 1, 4)),
    ({"data": 8, "fsdp": 1}, (8, 1, 1, 1, 1)),
    ({"data": 1, "fsdp": 1, "tensor": 1}, (1, 1, 1, 1, 1)),  # a 1-device mesh on the first device
    ({"data": 2, "fsdp": 1, "expert": 4}, (2, 1, 1, 4, 1)),
    ({"fsdp": 2, "expert": -1}, (1, 2, 1, 4, 1)),
    ({"data": 2, "fsdp": 1, "context": 4}, (2, 1, 4, 1, 1)),
    ({"fsdp": 1, "context": -1}, (1, 1, 8, 1, 1)),
])
def test_mesh_shapes(cfg, shape):
    mesh = sharding.make_mesh(cfg)
    assert mesh.axis_names == ("data", "fsdp", "context", "expert", "tensor")
    assert tuple(mesh.devices.shape) == shape
    assert len({d.id for d in mesh.devices.flat}) == mesh.devices.size


def test_mesh_from_config_dict():
    cfg = ml_collections.ConfigDict({"data": 2, "fsdp": -1, "tensor": 2})
    assert dict(sharding.make_mesh(cfg).shape) == {"data": 2, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}


@pytest.mark.parametrize("cfg, message", [
    ({"data": 3, "fsdp": 1, "tensor": 1}, "mesh.data=3 does not divide the 8"),
    ({"data": 2, "fsdp": -1, "tensor": 3}, "mesh.tensor=3 does not divide"),
    ({"data": 4, "fsdp": 1, "tensor": 4},
     "mesh.data=4 x mesh.fsdp=1 x mesh.context=1 x mesh.expert=1 x mesh.tensor=4 = 16 does not divide"),
    ({"data": -1, "fsdp": -1}, "mesh.fsdp=-1: only one mesh axis may be -1"),
    ({"data": 0}, "mesh.data=0: must be a positive int or -1"),
    ({"tensor": 2.0}, "mesh.tensor=2.0"),
    ({"expert": 3}, "mesh.expert=3 does not divide the 8"),
    ({"pipeline": 2}, "mesh.pipeline: unknown mesh axis"),
])
def test_mesh_errors_name_the_key(cfg, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sharding.make_mesh(cfg)


def test_param_specs_data2_tensor4():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 4})
    specs = jax.tree.map(lambda s: s.spec, sharding.logical_to_sharding(logical_axes(), make_params(), mesh))
    assert specs == {
        "embed": P("tensor", "fsdp"),
        "layers": {
            "wq": P(None, "fsdp", "tensor", None),
            "wk": P(None, "fsdp", None, None),  # kv_heads=1 cannot split 4 ways: replicated
            "wo": P(None, "tensor", None, "fsdp"),
            "up": P(None, "fsdp", "tensor"),
            "down": P(None, "tensor", "fsdp"),
            "norm": P(None, "fsdp"),
        },
        "lm_head": P("fsdp", None),  # vocab 98 is not divisible by 4: replicated
        "final_norm": P("fsdp"),
        "scale": P(),
    }


def test_param_specs_fsdp8():
    mesh = sharding.make_mesh({"fsdp": 8})
    specs = jax.tree.map(lambda s: s.spec, sharding.logical_to_sharding(logical_axes(), make_params(), mesh))
    assert specs["embed"] == P("tensor", "fsdp")
    assert specs["layers"]["wq"] == P(None, "fsdp", "tensor", None)
    assert specs["layers"]["down"] == P(None, "tensor", "fsdp")
    assert specs["lm_head"] == P("fsdp", "tensor")  # tensor has size 1 here, so 98 divides
    # params already on devices (another mesh) are resharded
    on_devices = sharding.shard_params(make_params(), logical_axes(), sharding.make_mesh({"data": 2, "tensor": 4}))
    params = sharding.shard_params(on_devices, logical_axes(), mesh)
    np.testing.assert_array_equal(params["embed"], make_params()["embed"])
    # each device holds 1/8 of every embed-sharded weight
    assert params["embed"].addressable_shards[0].data.shape == (256, 8)
    assert params["layers"]["up"].addressable_shards[0].data.shape == (2, 8, 128)


def test_indivisible_and_reused_axes_replicate():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    assert sharding.logical_to_spec(("vocab", "embed"), (49154, 64), mesh) == P(None, "fsdp")
    assert sharding.logical_to_spec(("embed",), (7,), mesh) == P(None)
    # batch over (data, fsdp, expert): 6 rows split over data=1 x fsdp=2 x expert=1; tokens over context (1)
    assert sharding.logical_to_spec(("batch", "length"), (6, 5), mesh) == P(("data", "fsdp", "expert"), "context")
    mesh8 = sharding.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    # 6 rows: data=2 divides, data x fsdp = 8 does not -> 'data' (and expert, of size 1)
    assert sharding.logical_to_spec(("batch", None), (6, 5), mesh8) == P(("data", "expert"), None)
    # a mesh axis is used once per spec: the second 'tensor' dim replicates
    assert sharding.logical_to_spec(("heads", "mlp"), (4, 8), mesh) == P("tensor", None)


def test_custom_rules_and_bad_axes():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 4})
    rules = dict(sharding.DEFAULT_RULES, embed="tensor", vocab=None)
    assert sharding.logical_to_spec(("vocab", "embed"), (256, 64), mesh, rules) == P(None, "tensor")
    with pytest.raises(ValueError, match=r"layers/wq: logical axis 'hedas' has no sharding rule"):
        bad = logical_axes()
        bad["layers"]["wq"] = ("layers", "embed", "hedas", "head_dim")
        sharding.logical_to_sharding(bad, make_params(), mesh)
    with pytest.raises(ValueError, match=r"lm_head: logical axes \('embed',\) name 1 dims but the shape is \(64, 98\)"):
        bad = logical_axes()
        bad["lm_head"] = ("embed",)
        sharding.logical_to_sharding(bad, make_params(), mesh)
    with pytest.raises(ValueError, match="logical axes tree does not match the param tree"):
        bad = logical_axes()
        del bad["final_norm"]
        sharding.logical_to_sharding(bad, make_params(), mesh)
    with pytest.raises(ValueError, match="appears twice"):
        sharding.rules_dict([("embed", "fsdp"), ("embed", None)])


def test_batch_sharding_and_shard_batch():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert sharding.batch_sharding(mesh, 3).spec == P(("data", "fsdp", "expert"), None, None)
    batch = sharding.shard_batch({"ids": jax.numpy.zeros((8, 5)), "mask": jax.numpy.ones((8,))}, mesh)
    assert batch["ids"].sharding.spec == P(("data", "fsdp", "expert"), None)
    assert batch["ids"].addressable_shards[0].data.shape == (2, 5)
    want = r"batch\[ids\]: leading dim of shape \(6, 5\) must be divisible by the data x fsdp x expert mesh size 4"
    with pytest.raises(ValueError, match=want):
        sharding.shard_batch({"ids": jax.numpy.zeros((6, 5))}, mesh)
    assert sharding.process_slice(8) == slice(0, 8)
    assert sharding.process_slice(8, mesh) == slice(0, 8)
    with pytest.raises(ValueError, match="global batch size 6 is not divisible by the data x fsdp x expert mesh size"):
        sharding.process_slice(6, mesh)
