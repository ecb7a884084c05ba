"""The chip table, accelerator-type names, and the FLOPs that MFU divides (no compile here)."""
import numpy as np
import pytest
from tiny_runs import tiny_config

from jaxrl_llm.bookkeeping.metrics import (
    device_peak_flops,
    forward_pass_flops,
    rollout_context,
    rollout_step_flops,
    step_flops,
)
from jaxrl_llm.config import ConfigError
from jaxrl_llm.platform import (
    TpuPlanError,
    accelerator_chip,
    chip_for,
    parse_accelerator_type,
    peak_flops_of,
    tpu_target,
)
from jaxrl_llm.platform import tpu as tpu_module


@pytest.mark.parametrize("kind,name,bf16_tflops,hbm_gib", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989, 74.5), ("NVIDIA H200", "H200", 989, 131.3),
    ("NVIDIA B200", "B200", 2250, 167.6), ("TPU v4", "TPU v4", 275, 32), ("TPU v5 lite", "TPU v5e", 197, 16),
    ("TPU v5", "TPU v5p", 459, 95), ("TPU v6 lite", "TPU v6e", 918, 32)])
def test_chip_table_by_device_kind(kind, name, bf16_tflops, hbm_gib):
    chip = chip_for(kind)
    assert chip.name == name and chip.bf16_flops == bf16_tflops * 1e12
    assert chip.hbm_bytes / (1 << 30) == pytest.approx(hbm_gib, abs=0.1)
    assert peak_flops_of(kind, "bfloat16") == bf16_tflops * 1e12


def test_fp32_peaks_and_unknown_devices():
    assert peak_flops_of("NVIDIA H100 80GB HBM3", "float32") == 67e12  # not the TF32 tensor-core rate
    assert peak_flops_of("TPU v5 lite", "float32") == 197e12  # default precision: one bf16 pass
    assert chip_for("cpu") is None and peak_flops_of("Tesla T4", "float32") is None


def test_cpu_peak_is_measured():
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip(f"the {jax.default_backend()} run reads the chip table (test_peak_table_*)")
    flops, source = device_peak_flops(jax.devices()[0], "float32")
    assert "measured" in source and 1e8 < flops < 1e14


@pytest.mark.parametrize("name,topology,devices,chip", [
    ("v5p-64", "v5p:2x4x4", 32, "TPU v5p"), ("v4-8", "v4:2x2x1", 4, "TPU v4"), ("v5litepod-8", "v5e:2x4", 8, "TPU v5e"),
    ("v5e-4", "v5e:2x2", 4, "TPU v5e"), ("v6e-8", "v6e:2x4", 8, "TPU v6e"), ("v6e:2x2", "v6e:2x2", 4, "TPU v6e"),
    ("tpu7x-8", "tpu7x:2x2x1", 8, "TPU7x"), ("tpu7x:2x2x1", "tpu7x:2x2x1", 8, "TPU7x")])
def test_accelerator_type_names(name, topology, devices, chip):
    # devices: JAX devices (a TPU7x chip is two, one per TensorCore)
    assert parse_accelerator_type(name) == (topology, devices)
    assert accelerator_chip(name).name == chip


@pytest.mark.parametrize("name", ["v5p-3", "v7-8", "h100-8", "v5e:2y2", "tpu7x-3"])
def test_bad_accelerator_type_names(name):
    with pytest.raises(TpuPlanError, match=name.replace(":", ":")):
        parse_accelerator_type(name)


def test_libtpu_missing_names_the_extra(monkeypatch):
    monkeypatch.setattr(tpu_module, "libtpu_installed", lambda: False)
    with pytest.raises(TpuPlanError, match=r"needs libtpu: pip install 'jaxrl_llm\[tpu-plan\]'"):
        tpu_target("v5e-4")


def test_plan_topology_is_validated_and_refused_by_a_run(tmp_path):
    from jaxrl_llm.config import validate_config
    from jaxrl_llm.trainer import Trainer

    with pytest.raises(ConfigError, match="trainer.plan_topology: .*v9-8"):
        validate_config(tiny_config(tmp_path, **{"trainer.plan_topology": "v9-8"}), num_devices=8)
    with pytest.raises(ConfigError, match="trainer.plan_topology=v5e-8 is for launch/train.py --plan"):
        Trainer(tiny_config(tmp_path, **{"trainer.plan_topology": "v5e-8"}))


def test_step_flops_count_a_shared_prompt_once():
    common = dict(num_params=1000, num_layers=1, hidden_size=8, response_tokens=40, forward_passes=1,
                  training_passes=1)
    every_row = step_flops(prompt_tokens=80, **common)
    shared = step_flops(prompt_tokens=80, prefill_prompt_tokens=20, pass_prompt_tokens=20, **common)
    per_token = (every_row - 0) / ((40 + 80) * (1 + 1 + 3))  # gen + 1 scoring + 1 fwd/bwd (x3) over 120 tokens
    # generation computes 40 + 20 tokens, scoring and training 40 + 20 each
    assert shared == pytest.approx(per_token * (60 + 60 + 3 * 60))


def test_rollout_step_flops_take_each_groups_prompt_once_where_it_is_shared():
    # two groups of two rows: prompts of 10 and 30 tokens, responses of 5, 6, 7 and 8
    rows = {"prompt_lengths": np.array([10, 10, 30, 30]), "response_lengths": np.array([5, 6, 7, 8]),
            "group_ids": np.array([4, 4, 9, 9])}
    # a token attends to the keys up to its own: 1 + ... + T per row of T tokens
    context = sum(t * (t + 1) / 2 for t in (15, 16, 37, 38)) / (15 + 16 + 37 + 38)
    assert rollout_context(np.array([15, 16, 37, 38])) == pytest.approx(context, rel=1e-12)
    common = dict(num_params=1000, num_layers=2, hidden_size=8, forward_passes=2, training_passes=1,
                  mean_context=context)
    flops, tokens = rollout_step_flops(rows, paged_prefill=True, shared_prompts=False,
                                       **{k: v for k, v in common.items() if k != "mean_context"})
    assert tokens == 80 + 26
    assert flops == pytest.approx(step_flops(prompt_tokens=80, response_tokens=26, prefill_prompt_tokens=40,
                                             **common), rel=1e-12)
    # attention: 4 * layers * hidden * context per token forward, 2N the rest
    no_attention = step_flops(prompt_tokens=80, response_tokens=26, prefill_prompt_tokens=40,
                              **{**common, "mean_context": 0.0})
    assert flops / no_attention == pytest.approx((2 * 1000 + 4 * 2 * 8 * context) / (2 * 1000), rel=1e-12)
    kw = dict(num_params=1000, num_layers=2, hidden_size=8, forward_passes=2, training_passes=1)
    plain, _ = rollout_step_flops(rows, paged_prefill=False, shared_prompts=False, **kw)
    both, _ = rollout_step_flops(rows, paged_prefill=True, shared_prompts=True, **kw)
    assert plain == pytest.approx(step_flops(prompt_tokens=80, response_tokens=26, **common), rel=1e-12)
    assert plain > flops > both
    assert both == pytest.approx(step_flops(prompt_tokens=80, response_tokens=26, prefill_prompt_tokens=40,
                                            pass_prompt_tokens=40, **common), rel=1e-12)
    # a teacher's pass over the same rows: one scoring pass of the step's formula, with its own size
    size = dict(num_params=5000, num_layers=3, hidden_size=16)
    for shared in (False, True):
        counts = dict(prompt_tokens=80, response_tokens=26, pass_prompt_tokens=40 if shared else None,
                      mean_context=context)
        one_pass = (step_flops(forward_passes=1, training_passes=0, **counts, **size)
                    - step_flops(forward_passes=0, training_passes=0, **counts, **size))
        assert forward_pass_flops(rows, shared_prompts=shared, **size) == pytest.approx(one_pass, rel=1e-12)


def test_logprob_impl_key_reaches_the_actor_and_is_validated(tmp_path):
    from jaxrl_llm.config import resolve, validate_config

    cfg = validate_config(tiny_config(tmp_path, **{"actor_rollout_ref.model.logprob_impl": "pallas"}), num_devices=8)
    assert resolve(cfg, dp_size=8).actor.logprob_impl == "pallas"
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.logprob_impl"):
        validate_config(tiny_config(tmp_path, **{"actor_rollout_ref.model.logprob_impl": "triton"}), num_devices=8)


def test_a_tpu7x_plan_with_the_libtpu_that_crashes_says_which_one_compiles():
    from jaxrl_llm.platform.tpu import tpu7x_libtpu_warning

    warning = tpu7x_libtpu_warning("tpu7x:2x2x1", "0.0.42.1", None)
    assert warning is not None and "libtpu 0.0.42.1 crashes" in warning and "libtpu==0.0.45" in warning
    assert "TPU_LIBRARY_PATH=" in warning
    assert tpu7x_libtpu_warning("tpu7x:2x2x1", "0.0.45", None) is None
    assert tpu7x_libtpu_warning("tpu7x:2x2x1", "0.0.42.1", "/opt/libtpu/libtpu.so") is None  # chosen by hand
    assert tpu7x_libtpu_warning("v6e:2x4", "0.0.42.1", None) is None
