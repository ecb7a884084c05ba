"""The same outputs on 1 device, on 8 devices as (data 2, tensor 4) and (fsdp 8), and on 2 processes."""
import pathlib
import sys

import jax
import numpy as np
import pytest
from sampler_fixtures import MESHES, PAD_ID, PROMPTS8

from jaxrl_llm import sharding
from jaxrl_llm.models import param_logical_axes
from jaxrl_llm.sampler import SamplingParams, left_pad, sample

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from multiprocess_util import run_processes

WORKER = pathlib.Path(__file__).with_name("mp_sampler_worker.py")
R = 8
GREEDY = SamplingParams(max_new_tokens=R, do_sample=False)
SAMPLED = SamplingParams(max_new_tokens=R, temperature=1.0, top_k=40, seed=5)


def run(cfg, params, sp, mesh=None):
    settings, knobs = sp.compile_args(cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
    ids, mask = left_pad(PROMPTS8, PAD_ID)
    if mesh is not None:
        params = sharding.shard_params(params, param_logical_axes(cfg), mesh)
        ids, mask = sharding.shard_batch((ids, mask), mesh)
    out = sample(params, cfg, ids, mask, jax.random.key(sp.seed), knobs, settings=settings, mesh=mesh)
    return out, params


@pytest.fixture(scope="module")
def single_device(llama_tiny):
    cfg, params = llama_tiny
    one = jax.devices()[0]
    params = jax.device_put(params, one)
    return {name: jax.device_get(run(cfg, params, sp)[0]) for name, sp in
            (("greedy", GREEDY), ("sampled", SAMPLED))}


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_outputs_match_one_device(llama_tiny, single_device, mesh_name):
    cfg, params = llama_tiny
    mesh = sharding.make_mesh(MESHES[mesh_name])
    # sampled draws too (on one mesh, to keep compiles down): the rng does not depend on sharding
    runs = (("greedy", GREEDY), ("sampled", SAMPLED)) if mesh_name == "fsdp8" else (("greedy", GREEDY),)
    for name, sp in runs:
        out, placed = run(cfg, params, sp, mesh)
        ref = single_device[name]
        # the outputs really are split over the batch axes; heads follow the params' shardings
        assert out.tokens.sharding.spec[0] is not None
        if mesh_name == "data2_tensor4":
            assert placed["layers"]["attn"]["q_proj"]["kernel"].sharding.spec[2] == "tensor"
        np.testing.assert_array_equal(np.asarray(out.tokens), ref.tokens, err_msg=name)
        np.testing.assert_array_equal(np.asarray(out.lengths), ref.lengths, err_msg=name)
        np.testing.assert_allclose(np.asarray(out.log_probs), ref.log_probs, atol=1e-5, err_msg=name)


def test_two_processes_match_one_device(single_device):
    """2 processes x 4 CPU devices (gloo): raw `sample` on (data 2, tensor 4) and the `generate`
    facade on (fsdp 8) both reproduce the single-device greedy outputs."""
    results = [r.json for r in run_processes(WORKER, num_processes=2, devices_per_process=4, timeout=240)]
    ref = single_device["greedy"]
    assert [r["process_index"] for r in results] == [0, 1]
    assert all(r["global_devices"] == 8 for r in results)
    assert results[0]["data2_tensor4"]["rows"] == [0, 4] and results[1]["data2_tensor4"]["rows"] == [4, 8]
    for res in results:
        for name in MESHES:
            np.testing.assert_array_equal(np.array(res[name]["tokens"]), ref.tokens, err_msg=name)
            np.testing.assert_allclose(np.array(res[name]["log_probs"]), ref.log_probs, atol=1e-5,
                                       err_msg=name)
