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
