"""bf16 rollout/trainer numerics (docs/performance.md, "Rollout/trainer numerics").

The policy (models/numerics.py): fp32-accumulated, fp32-returned matmuls, attention probabilities
times V through two bf16 terms. With row-independent matmul kernels the bf16 sampler and the bf16
trainer then compute bit-identical log-probs; XLA CPU's default kernels (YNNPACK / XNNPACK,
multi-threaded Eigen) are not row-independent, so the end-to-end check runs in a fresh process
with those switched off (`ROW_INVARIANT_XLA_FLAGS`)."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models.numerics import probs_times_values

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROW_INVARIANT_XLA_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_xnnpack=false "
                           "--xla_cpu_multi_thread_eigen=false")


def _cpu_has(flag: str) -> bool:
    try:
        return flag in pathlib.Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def test_probs_times_values_two_bf16_terms_match_fp32():
    k1, k2 = jax.random.split(jax.random.key(0))
    probs = jax.nn.softmax(3.0 * jax.random.normal(k1, (2, 3, 5, 40)), axis=-1)
    v = jax.random.normal(k2, (2, 3, 40, 16)).astype(jnp.bfloat16)
    spec = "bkqs,bksd->bkqd"
    exact = np.einsum(spec, np.asarray(probs, np.float64), np.asarray(v.astype(jnp.float32), np.float64))
    got = np.asarray(probs_times_values(spec, probs, v))
    one_term = np.asarray(jnp.einsum(spec, probs.astype(jnp.bfloat16), v, preferred_element_type=jnp.float32))
    err, err_one = np.abs(got - exact).max(), np.abs(one_term - exact).max()
    assert got.dtype == np.float32
    assert err < 2e-5 and err < err_one / 50, (err, err_one)
    # fp32 V: one plain fp32 matmul (fp32 results are unchanged by the policy)
    v32 = v.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(probs_times_values(spec, probs, v32)),
                                  np.asarray(jnp.einsum(spec, probs, v32, preferred_element_type=jnp.float32)))


@pytest.mark.usefixtures("smollm2_gguf")  # the tiny trainer config uses SmolLM2's tokenizer
def test_bf16_sampler_and_paged_engine_follow_the_trainer_and_rollout_kl_vanishes(tmp_path):
    env = {**os.environ, "XLA_FLAGS": ROW_INVARIANT_XLA_FLAGS, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "models" / "bf16_parity_worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    pair = result["sampler_vs_trainer"]
    assert pair["tokens"] >= 100
    assert pair["trainer_mean_abs_err_vs_fp32"] > 1e-3  # it really ran in bf16
    if _cpu_has("avx512f"):  # bit-identical in bf16 where measured (AVX-512 kernels)
        assert pair["max_abs_dlogp"] == 0.0 and pair["kl"] == 0.0, pair
    else:
        # AVX2-only CPUs: XLA's kernels reduce the sampler's and the trainer's row counts in other lane
        # orders, so a log-prob differs by fp32 rounding at most (4.8e-7 measured on an AMD EPYC): over
        # 1000x below the bf16 error itself, and the rollout KL stays at ~1e-9
        assert pair["max_abs_dlogp"] <= 2e-6 and abs(pair["kl"]) <= 1e-7, pair
        assert pair["max_abs_dlogp"] * 1000 < pair["trainer_mean_abs_err_vs_fp32"], pair
    # The paged engine runs the same decoder and the trainer's softmax / probs x V operation for
    # operation; only the summation order over its key blocks differs (measured on the AVX2 EPYC:
    # 90% of log-probs bit-equal, log_ppl_abs_diff 1.4e-5, kl -1.4e-5; before the one decoder its
    # bf16 residual stream and online softmax gave 64%, 2.5e-4 and -1.8e-5).
    paged = result["paged_vs_trainer"]
    assert paged["tokens"] == pair["tokens"] and paged["trainer_mean_abs_err_vs_fp32"] > 1e-3, paged
    for engine in (pair, paged):  # one bound for both engines
        assert engine["log_ppl_abs_diff"] <= 5e-5 and abs(engine["kl"]) <= 5e-5, (pair, paged)
        assert engine["frac_exact"] >= 0.8, (pair, paged)
    step = result["step"]
    assert abs(step["rollout_corr/kl"]) <= 1e-5, step
    # logged with every rollout correction (and on every step that recomputes the log-probs)
    assert 0 <= step["rollout_corr/max_abs_log_ratio"] <= 1e-3 and 0 <= step["rollout_corr/exact_token_frac"] <= 1
    assert step["rollout_corr/log_ppl_abs_diff"] <= 1e-5, step
    # The step scores packed rows (model.use_remove_padding, the default), whose matmuls see other
    # row counts than the sampler's: a rare single bf16 flip remains (measured IS min 0.9998).
    assert 0.999 <= step["rollout_corr/rollout_is_min"] <= step["rollout_corr/rollout_is_max"] <= 1.001, step


QA = [("What is the capital of France?", "The capital of France is Paris, a city on the Seine."),
      ("Name three primary colours.", "Red, yellow and blue are the three primary colours."),
      ("How many legs does a spider have?", "A spider has eight legs, two more than an insect."),
      ("What is 12 times 7?", "Twelve times seven is eighty-four.")]


@pytest.mark.slow
@pytest.mark.optimized_xla  # real SmolLM2 forwards: running, not compiling
def test_smollm2_bf16_scoring_close_to_fp32(smollm2_gguf):
    """The trainer's bf16 scoring of real answers against its fp32 scoring: the policy halves the
    bf16 error (mean |Δ logp| 0.025 -> 0.012 measured on these 46 tokens)."""
    from jaxrl_llm.hf import load_gguf, load_tokenizer
    from jaxrl_llm.roles.forward import response_log_probs
    from jaxrl_llm.sampler import left_pad

    cfg, params = load_gguf(smollm2_gguf)
    tok = load_tokenizer(smollm2_gguf)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q, _ in QA]
    answers = [tok(a)["input_ids"] for _, a in QA]
    r = max(map(len, answers))
    ids, mask = left_pad(prompts, 0)
    resp, rmask = np.zeros((len(QA), r), np.int32), np.zeros((len(QA), r), np.int32)
    for i, a in enumerate(answers):
        resp[i, :len(a)], rmask[i, :len(a)] = a, 1
    full = jnp.asarray(np.concatenate([ids, resp], 1))
    full_mask = jnp.asarray(np.concatenate([mask, rmask], 1))
    score = jax.jit(response_log_probs, static_argnums=(1, 4), static_argnames=("compute_dtype",))
    lp16 = np.asarray(score(params, cfg, full, full_mask, r, compute_dtype="bfloat16"))
    lp32 = np.asarray(score(params, cfg, full, full_mask, r, compute_dtype="float32"))
    err = np.abs(lp16 - lp32)[rmask > 0]
    assert err.size > 40 and np.all(np.isfinite(err))
    assert 1e-3 < err.mean() < 0.018, err.mean()  # bf16 for real; 0.025 before the policy
