"""One process of the 2-process sampler test (run by tests/sampler/test_sampler_sharding.py).

Joins the distributed runtime from the harness's env vars, shards the tiny model over a global
8-device mesh, and generates greedily: (data 2, tensor 4) through the raw jitted `sample` on a
global batch built from this process's rows, (fsdp 8) through the `generate` facade. Prints one
JSON line with the full (gathered) outputs.
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: tiny_models

from jaxrl_llm import sharding

assert sharding.initialize(), "expected a multi-process run"

import jax  # noqa: E402  (after initialize: nothing may touch the backend before it)
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from sampler_fixtures import MESHES, PAD_ID, PROMPTS8, tiny_config, tiny_params  # noqa: E402

from jaxrl_llm.models import param_logical_axes  # noqa: E402
from jaxrl_llm.sampler import SamplingParams, generate, left_pad, sample  # noqa: E402

R = 8
cfg = tiny_config("llama")
host_params = tiny_params(cfg)
sp = SamplingParams(max_new_tokens=R, do_sample=False)
results = {"process_index": jax.process_index(), "global_devices": jax.device_count()}

mesh = sharding.make_mesh(MESHES["data2_tensor4"])
params = sharding.shard_params(host_params, param_logical_axes(cfg), mesh)
ids, mask = left_pad(PROMPTS8, PAD_ID)
rows = sharding.process_slice(len(PROMPTS8), mesh)
batch = sharding.host_local_to_global((ids[rows], mask[rows]), mesh)
settings, knobs = sp.compile_args(cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
out = sample(params, cfg, *batch, jax.random.key(0), knobs, settings=settings, mesh=mesh)
tokens, logps = multihost_utils.process_allgather((out.tokens, out.log_probs), tiled=True)
results["data2_tensor4"] = {"rows": [rows.start, rows.stop], "tokens": np.asarray(tokens).tolist(),
                            "log_probs": np.asarray(logps).tolist()}


class Model:  # what the facade needs: .config, .params, .mesh
    config = cfg
    mesh = sharding.make_mesh(MESHES["fsdp8"])
    params = sharding.shard_params(host_params, param_logical_axes(cfg), mesh)


res = generate(Model(), PROMPTS8, sp, engine="paged")
results["fsdp8"] = {"tokens": res.tokens.tolist(), "log_probs": res.log_probs.tolist()}
print(json.dumps(results))
