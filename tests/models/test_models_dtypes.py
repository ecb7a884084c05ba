"""One dtype table: names and dtypes in, `jnp.dtype` out, one error naming the accepted names."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models.dtypes import COMPUTE_DTYPES, DTYPES, as_jnp_dtype, dtype_name


@pytest.mark.parametrize("name", list(DTYPES))
def test_names_and_dtypes_round_trip(name):
    dt = as_jnp_dtype(name)
    assert dt == jnp.dtype(DTYPES[name]) and dt.name == name
    assert as_jnp_dtype(DTYPES[name]) == dt  # a jnp scalar type
    assert as_jnp_dtype(np.dtype(dt)) == dt  # a numpy dtype
    assert dtype_name(DTYPES[name]) == name


def test_compute_dtypes_are_a_subset():
    assert set(COMPUTE_DTYPES) <= set(DTYPES)
    assert as_jnp_dtype("bfloat16", allowed=COMPUTE_DTYPES) == jnp.bfloat16


@pytest.mark.parametrize("bad", ["int4", "bf16", "float64", None, jnp.int32, np.float64])
def test_unknown_dtype_error_names_the_accepted_names(bad):
    with pytest.raises(ValueError, match=r"unknown dtype .*; accepted names: float32, bfloat16, float16$"):
        as_jnp_dtype(bad)


def test_allowed_narrows_and_what_names_the_setting():
    with pytest.raises(ValueError, match=r"unknown dtype 'float16' for model\.dtype; accepted names: float32, "
                                         r"bfloat16$"):
        as_jnp_dtype("float16", allowed=COMPUTE_DTYPES, what="model.dtype")


def test_decode_weights_cast_matmul_weights_and_keep_norm_scales_and_sinks():
    """The paged engine's weight copy (models/dtypes.py): projections and embeddings in the compute dtype, the
    stacked [layers, hidden] norm scales, the sinks and a delta-net layer's decay and conv taps as the forward
    reads them (fp32)."""
    from jaxrl_llm.models.dtypes import matmul_weights_in, uncast_matmul_weights

    params = {"embedding": jnp.ones((8, 4)), "final_norm": {"scale": jnp.ones(4)},
              "layers": {"attn_norm": {"scale": jnp.full((2, 4), 1.01)}, "attn": {
                  "q_proj": {"kernel": jnp.ones((2, 4, 4)), "bias": jnp.ones((2, 4))}, "sinks": jnp.ones((2, 3))}}}
    cast = matmul_weights_in(params, "bfloat16")
    assert cast["embedding"].dtype == jnp.bfloat16 and cast["layers"]["attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    assert cast["layers"]["attn"]["q_proj"]["bias"].dtype == jnp.bfloat16  # the forward casts a bias too
    for kept in (cast["layers"]["attn_norm"]["scale"], cast["layers"]["attn"]["sinks"], cast["final_norm"]["scale"]):
        assert kept.dtype == jnp.float32
    assert len(uncast_matmul_weights(params, "bfloat16")) == 3 and not uncast_matmul_weights(cast, "bfloat16")
    # a gated delta-net layer's decay and conv taps (Qwen3.5: stacked over its layers) are read in fp32 too
    linear = {"A_log": jnp.ones((2, 4)), "dt_bias": jnp.ones((2, 4)), "conv1d": {"kernel": jnp.ones((2, 4, 8))},
              "in_proj_a": {"kernel": jnp.ones((2, 8, 4))}}
    cast = matmul_weights_in({"layers": {"linear": linear}}, "bfloat16")["layers"]["linear"]
    assert [cast[k].dtype for k in ("A_log", "dt_bias")] == [jnp.float32] * 2
    assert cast["conv1d"]["kernel"].dtype == jnp.float32 and cast["in_proj_a"]["kernel"].dtype == jnp.bfloat16
