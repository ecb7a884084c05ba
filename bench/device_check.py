"""The device kit: one call that checks and measures what a lent GPU (or TPU) host can tell us.

    python bench/device_check.py --out runs/device_check          # on the device (scripts/device/run.sh)
    python bench/device_check.py --tiny --out /tmp/dc             # CPU rehearsal: same sections, tiny shapes,
                                                                  # kernels interpreted (CI runs this)

Each section runs in its own process with a deadline (a hang or a crash costs that section only),
writes <out>/<section>.json and prints one summary line:

1. env      versions, device, the chip table's peak, a large bf16 matmul's measured FLOP/s, a
            device-to-device copy's GB/s (the bandwidth ceiling for decode);
2. kernels  the fused log-prob kernel vs the XLA path (values and gradients, fp32 and bf16, times)
            at (H, V) = (896, 151936) and (4096, 151936), with the naive head's temporaries; paged
            decode attention kernel vs XLA at 64 and 256 slots, KV GB/s against the copy ceiling, with
            Qwen2-0.5B's heads and with DeepSeek-V3's latent pool (128 heads over one 576-wide kv head);
3. step     a GRPO step of a Qwen2-0.5B-shaped bf16 model (random weights): update MFU, reference
            pass, paged decode tokens/s, the memory plan's peak against the measured one;
4. tests    a pytest subset on the device with jax_default_matmul_precision=highest;
5. decode   (not in the default run: `--sections decode`, a call of its own) the paged engine's rollout
            rows on the Qwen2-0.5B-shaped bf16 model: 64 prompts x n=4, 256 new tokens, at 64 and 256
            slots with cascade attention off and on, and at 64 slots with n-gram and draft-model
            speculation (the draft: the model's first quarter of layers): useful tokens/s, decode steps,
            and the bytes a step reads (weights + KV) per second of decode step. Random weights: the
            speculative rows measure the drafting / verification overhead, not a real acceptance rate;
6. cascade  (on request too: `--sections cascade`) cascade attention off and on with long shared
            prompts: 16 prompts of 2048, then 1024 tokens, x n=8, 64 slots, 64 new tokens;
7. profile  (on request: `--sections profile`) where a decode step's time goes: decode's plain and n-gram
            rows at 64 slots (32 prompts of 128 tokens x n=2, 64 new tokens), each timed run under
            `jax.profiler`; per row the op families (bench/trace_ops.py) in ms per decode step, and the
            trace itself (<out>/trace_<row>/, when under 30 MB). Traced runs are slower: the tokens/s
            of these rows are not the decode section's. Then where the update's time goes: the step
            section's GRPO run, its second actor update under `jax.profiler`, op families in ms per
            update beside the memory plan's roofline estimate of it (row `update`).

8. exact    (on request: `--sections exact`) exact rollouts (model.batch_invariant) off and on: the rollout,
            scoring and update-shaped passes of bench/exact_rollouts.py on the Qwen2-0.5B-shaped bf16 model
            (16 prompts x 128 new tokens, static and paged engines), exactness (max |trainer - rollout|
            log-prob, equal-token fraction) and seconds; then a small GRPO step off and on, its
            rollout_corr/ metrics and timings.

A section a deadline stops keeps the rows it wrote (decode and cascade write their JSON after every row).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = ("env", "kernels", "step", "tests")  # the default run; "decode" on request
# seconds each section may take, as shares of --budget_s (normalised over the sections run)
SHARES = {"env": 0.1, "kernels": 0.3, "step": 0.4, "tests": 0.2, "decode": 1.0, "cascade": 1.0, "profile": 1.0,
          "exact": 1.0}


def _write_json(path: pathlib.Path, result: dict) -> None:
    """`result` as JSON at `path`, whole or not at all: a section killed at its deadline while writing
    leaves its previous file, which the kit then reads."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


def _timed(fn, *args, repeats: int = 3) -> float:
    """Best wall time of `fn(*args)` in seconds, blocked on (compiled by a first call)."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def section_env(tiny: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.bookkeeping.metrics import device_peak_flops, measured_matmul_peak_flops

    device = jax.devices()[0]
    n = 256 if tiny else 8192
    measured = measured_matmul_peak_flops(n=n, repeats=3, dtype="bfloat16", chain=4)
    peak, source = device_peak_flops(device, "bfloat16")
    size = (1 << 20) if tiny else (1 << 28)  # fp32 elements: 4 MiB / 1 GiB
    x = jnp.ones((size,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # reads and writes every byte once
    seconds = _timed(copy, x)
    return {"jax": jax.__version__, "backend": jax.default_backend(), "device_kind": device.device_kind,
            "devices": jax.device_count(), "bf16_matmul_tflops": measured / 1e12, "peak_tflops": peak / 1e12,
            "peak_source": source, "matmul_vs_peak": measured / peak, "copy_gbps": 2 * 4 * size / seconds / 1e9,
            "summary": f"{device.device_kind}: bf16 matmul {measured / 1e12:.1f} TFLOP/s "
                       f"({measured / peak:.0%} of {peak / 1e12:.0f}), copy {2 * 4 * size / seconds / 1e9:.0f} GB/s"}


def _head_case(hidden: int, vocab: int, dtype, tiny: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.losses.logprob import token_logprobs

    rows = 128 if tiny else 4096
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    h = (jax.random.normal(k[0], (rows, hidden)) * 0.5).astype(dtype)
    w = (jax.random.normal(k[1], (hidden, vocab)) / np.sqrt(hidden)).astype(dtype)
    t = jax.random.randint(k[2], (rows,), 0, vocab)
    interpret = tiny  # CPU rehearsal: the kernel interpreted

    def loss(impl):
        def f(h, w):
            lp, ent = token_logprobs(h, w, t, return_entropy=True, impl=impl, interpret=interpret)
            return jnp.sum(lp) + 0.1 * jnp.sum(ent), (lp, ent)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

    kernel_impl = "pallas_triton" if tiny else "pallas"
    (_, (lp_k, ent_k)), g_k = loss(kernel_impl)(h, w)
    (_, (lp_x, ent_x)), g_x = loss("xla")(h, w)
    def naive_loss(h, w):  # the same objective through [rows, V] fp32 logits
        logp = jax.nn.log_softmax((h @ w).astype(jnp.float32), -1)
        lp = jnp.take_along_axis(logp, t[:, None], -1)[:, 0]
        return jnp.sum(lp) - 0.1 * jnp.sum(jnp.exp(logp) * logp)

    naive = jax.jit(jax.value_and_grad(naive_loss, argnums=(0, 1)))
    err = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))  # noqa: E731
    return {"hidden": hidden, "vocab": vocab, "dtype": jnp.dtype(dtype).name,
            "max_abs_err_logprob": err(lp_k, lp_x), "max_abs_err_entropy": err(ent_k, ent_x),
            "max_abs_err_grad_h": err(g_k[0], g_x[0]), "max_abs_err_grad_w": err(g_k[1], g_x[1]),
            "kernel_s": _timed(loss(kernel_impl), h, w), "xla_s": _timed(loss("xla"), h, w),
            # value and gradient temporaries, both ways
            "naive_temp_bytes": int(naive.lower(h, w).compile().memory_analysis().temp_size_in_bytes),
            "fused_temp_bytes": int(loss(kernel_impl).lower(h, w).compile().memory_analysis().temp_size_in_bytes)}


def _paged_case(slots: int, tiny: bool, latent: bool = False) -> dict:
    """Paged decode attention, kernel vs XLA, at Qwen2-0.5B's heads, or with `latent` DeepSeek-V3's latent pool
    (128 query heads over one kv head of 512 + 64, read as keys and values, Triton in two pieces)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.sampler.paged_attention import paged_decode_attention_xla
    from jaxrl_llm.sampler.paged_attention_pallas import paged_decode_attention_pallas

    kv, heads, hd, page_size = (2, 4, 16, 8) if tiny else (2, 14, 64, 16)  # Qwen2-0.5B: 14 q / 2 kv heads
    if latent:
        kv, heads, hd = (1, 16, 48) if tiny else (1, 128, 576)
    context = 64 if tiny else 2048
    per_slot = context // page_size
    pages = slots * per_slot + 1
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((kv, pages, page_size, hd)), jnp.bfloat16)
    v = k if latent else jnp.asarray(rng.standard_normal((kv, pages, page_size, hd)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((slots, heads, hd)), jnp.bfloat16)
    lengths = jnp.full((slots,), context, jnp.int32)
    table = jnp.asarray(rng.permutation(pages - 1)[: slots * per_slot].reshape(slots, per_slot) + 1, jnp.int32)
    kernel = jax.jit(lambda *a: paged_decode_attention_pallas(*a, interpret=tiny, variant="triton" if tiny else None,
                                                              values_are_keys=latent))
    xla = jax.jit(paged_decode_attention_xla)
    out_k, out_x = kernel(q, k, v, lengths, table), xla(q, k, v, lengths, table)
    kv_bytes = (1 if latent else 2) * slots * context * kv * hd * 2
    t_k, t_x = _timed(kernel, q, k, v, lengths, table), _timed(xla, q, k, v, lengths, table)
    return {"slots": slots, "context": context, "latent": latent, "max_abs_err": float(jnp.max(jnp.abs(
        out_k.astype(jnp.float32) - out_x.astype(jnp.float32)))), "kernel_s": t_k, "xla_s": t_x,
        "kernel_kv_gbps": kv_bytes / t_k / 1e9, "xla_kv_gbps": kv_bytes / t_x / 1e9}


def section_kernels(tiny: bool) -> dict:
    import jax.numpy as jnp

    shapes = [(48, 640)] if tiny else [(896, 151936), (4096, 151936)]
    heads = [_head_case(h, v, dt, tiny) for h, v in shapes for dt in (jnp.float32, jnp.bfloat16)]
    paged = [_paged_case(s, tiny) for s in ((4, 8) if tiny else (64, 256))]
    paged += [_paged_case(s, tiny, latent=True) for s in ((4,) if tiny else (64, 256))]
    worst = max(c["max_abs_err_logprob"] for c in heads if c["dtype"] == "float32")
    return {"logprob": heads, "paged_attention": paged,
            "summary": f"log-prob kernel fp32 max err {worst:.1e}, "
                       + ", ".join(f"{c['hidden']}x{c['vocab']} {c['dtype']} {c['xla_s'] / c['kernel_s']:.2f}x XLA"
                                   for c in heads)
                       + "; paged " + ", ".join(f"{c['slots']} slots{' MLA' if c['latent'] else ''} "
                                                f"{c['kernel_kv_gbps']:.0f} GB/s "
                                                f"({c['xla_s'] / c['kernel_s']:.2f}x XLA)" for c in paged)}


def _step_overrides(tiny: bool) -> dict:
    """The step section's run (configs/tiny.py with these keys): a GRPO step of Qwen2-0.5B's shape."""
    # the second step is the timed one: every decode program compiled before it (configs/tiny.py, for tests,
    # compiles a drain set's when first reached)
    overrides = {"trainer.total_training_steps": 2, "trainer.memory_plan": True,
                 "actor_rollout_ref.model.dtype": "bfloat16", "actor_rollout_ref.rollout.engine": "paged",
                 "actor_rollout_ref.rollout.precompile_drain": True}
    if not tiny:  # Qwen2-0.5B's shape, random weights; GRPO 8 samples of 16 prompts, 512 new tokens
        overrides.update({"actor_rollout_ref.model.path": "tiny:qwen2",
                          **{f"actor_rollout_ref.model.tiny.{k}": v for k, v in dict(
                              num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                              intermediate_size=4864, max_position_embeddings=4096).items()},
                          "data.max_prompt_length": 256, "data.max_response_length": 512,
                          "data.train_batch_size": 16, "actor_rollout_ref.rollout.n": 8,
                          "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
                          "actor_rollout_ref.rollout.ignore_eos": True, "data.synthetic.n_train": 64})
    return overrides


def section_step(tiny: bool, out: pathlib.Path) -> dict:
    import jax

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_runs import read_metrics, tiny_config

    from jaxrl_llm.trainer import Trainer

    # the run's own files stay out of <out>: the device tool brings back 8 files at most
    with tempfile.TemporaryDirectory(prefix="device_check_step_") as run_dir:
        trainer = Trainer(tiny_config(run_dir, **_step_overrides(tiny)))
        trainer.fit()
        last = read_metrics(run_dir)[-1]
    planned = max(p.total_bytes for p in trainer.memory_plan.programs) if trainer.memory_plan else None
    stats = jax.devices()[0].memory_stats() or {}
    measured = stats.get("peak_bytes_in_use")
    keys = ("perf/mfu", "perf/throughput", "timing_s/gen", "timing_s/ref", "timing_s/update_actor",
            "timing_s/step", "response_length/mean")
    result = {k: last.get(k) for k in keys}
    gen_tokens = last.get("response_length/mean", 0) * 16 * 8 if not tiny else None
    result.update({"planned_peak_bytes": planned, "measured_peak_bytes": measured,
                   "decode_tokens_per_s": (gen_tokens / last["timing_s/gen"]) if gen_tokens else None})
    result["summary"] = (f"step {last.get('timing_s/step', 0):.2f} s, MFU {last.get('perf/mfu', 0):.1%}, "
                         f"plan {planned} B vs measured {measured} B")
    return result


def section_tests(tiny: bool, out: pathlib.Path) -> dict:
    # the CPU rehearsal checks the plumbing (a pytest run, its log and summary) on the chip table's tests, which the
    # suite runs anyway; the device runs the kernels' and the platform's files
    paths = ["tests/platform/test_platform_chips.py", "-k", "chip_table or fp32_peaks"] if tiny else [
        "tests/losses/test_losses_logprob.py", "tests/sampler/test_paged_attention_pallas.py",
        "tests/platform", "tests/models/test_attention.py"]
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
    if not tiny:
        # the accelerator first (the default backend; conftest defaults to cpu), and the CPU beside it:
        # the kernels' interpret-mode tests run their bodies through callbacks on a CPU device
        env["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "cuda") + ",cpu"
    # not -x: one run on a lent device should show every failure; the kit's own CPU rehearsals
    # (tests/platform/test_device_kit.py) are not run inside the kit. The log is written as the tests
    # run, so a section stopped at its deadline still tells how far it got.
    log = out / "tests_log.txt"
    with open(log, "w") as sink:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *paths,
                               *([] if tiny else ["-k", "not test_device_check_tiny_"])],
                              cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
    tail = log.read_text().strip().splitlines()[-15:]
    return {"returncode": proc.returncode, "tail": tail, "summary": tail[-1] if tail else "no output",
            "status": "ok" if proc.returncode == 0 else "failed"}


def _decode_model(tiny: bool):
    """(config, bf16 random params) of the decode rows: Qwen2-0.5B's shape, or a tiny qwen2."""
    import jax

    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.models.param_init import init_params

    shape = {} if tiny else dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                                 max_position_embeddings=4096, tie_word_embeddings=True)
    cfg = ModelConfig.tiny("qwen2", **shape)
    return cfg, init_params(cfg, jax.random.PRNGKey(0), dtype="bfloat16")


def _model_line(cfg) -> str:
    return f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, bf16 random weights"


def _decode_row(cfg, params, prompts: list, slots: int, new_tokens: int, n: int, options: dict,
                draft_params=None, trace_dir: pathlib.Path | None = None) -> dict:
    """One engine row: a warm-up run (compiles), then the timed run of the same shapes, other seed
    (with `trace_dir`: under `jax.profiler`, its trace written there)."""
    import contextlib

    import jax
    import numpy as np

    from jaxrl_llm.sampler import SamplingParams
    from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=n, seed=0)
    # EOS: a token no prompt uses and random weights rarely pick, so lengths stay near the limit
    settings, knobs = sp.compile_args([cfg.eos_token_id], cfg.pad_token_id, vocab_size=cfg.vocab_size,
                                      compute_dtype="bfloat16")
    opts = EngineOptions(max_num_seqs=slots, **options)
    run = lambda seed: sample_paged(params, cfg, prompts, jax.random.key(seed), knobs,  # noqa: E731
                                    settings=settings, opts=opts, draft_params=draft_params)
    start = time.perf_counter()
    jax.block_until_ready(run(0)[0].lengths)
    warm_s = time.perf_counter() - start
    from trace_ops import ops_only_trace  # bench/trace_ops.py, beside this script

    tracing = contextlib.nullcontext() if trace_dir is None else ops_only_trace(trace_dir)
    with tracing:
        start = time.perf_counter()
        out, stats = run(1)
        jax.block_until_ready(out.lengths)
        wall = time.perf_counter() - start
    useful = int(np.asarray(out.lengths).sum())
    # bytes a decode step reads without cascade: every weight once, and each live slot's KV up to its
    # position (on average its prompt and half its response)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # bf16 K + V
    live = stats.useful_token_steps / max(1, stats.decode_steps)  # mean live slots per step
    context = float(np.mean([len(p) for p in prompts])) + useful / (len(prompts) * n) / 2
    step_s = wall / max(1, stats.decode_steps)
    spec = options.get("speculative")
    row = {"slots": slots, "cascade_attention": options.get("cascade_attention", "auto"),
           "speculative": None if spec is None else f"{spec.method}, {spec.num_tokens} drafts", "useful_tokens": useful,
           "wall_s": wall, "warmup_s": warm_s, "tokens_per_s": useful / wall, "decode_steps": stats.decode_steps,
           "step_ms": 1e3 * step_s, "mean_live_slots": live,
           "read_gbps": (weight_bytes + live * context * kv_token) / step_s / 1e9,
           "utilisation": stats.utilisation, "peak_cascade_groups": stats.peak_cascade_groups}
    row.update(stats.speculative_metrics())
    return row


def _write_rows(out: pathlib.Path, name: str, result: dict, label) -> None:
    """`result` with its rows' summary (`label(row)` names a row) to <out>/<name>.json, marked partial."""
    result["summary"] = ", ".join(f"{label(r)} {r['tokens_per_s']:.0f} tok/s {r['read_gbps']:.0f} GB/s"
                                  for r in result["rows"])
    _write_json(out / f"{name}.json", {**result, "status": "partial"})


def section_decode(tiny: bool, out: pathlib.Path) -> dict:
    """The paged engine's decode rows (module doc, 5.), each written to <out>/decode.json as it ends."""
    import numpy as np
    from rollout import layer_draft  # bench/rollout.py, beside this script

    from jaxrl_llm.sampler.speculative import SpeculativeSpec

    cfg, params = _decode_model(tiny)
    # prompts of whole KV pages (16 tokens each), which a group's samples share: cascade has rows to take
    prompt_len, new_tokens, num_prompts, n = (40, 8, 4, 2) if tiny else (128, 256, 64, 4)
    small, large = (2, None) if tiny else (64, 256)  # the CPU rehearsal: one slot count (each compiles anew)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, prompt_len)] for _ in range(num_prompts)]
    draft_cfg, draft_params = layer_draft(cfg, params, max(1, cfg.num_hidden_layers // 4))
    plans = [(name, slots, {"cascade_attention": name == "cascade"}) for slots in (small, large) if slots
             for name in ("plain", "cascade")]
    plans += [("ngram", small, {"speculative": SpeculativeSpec("ngram", num_tokens=4)}),
              ("draft", small, {"speculative": SpeculativeSpec("draft", num_tokens=4, draft_cfg=draft_cfg)})]
    result: dict = {"model": _model_line(cfg), "prompts": num_prompts, "n": n, "prompt_tokens": prompt_len,
                    "new_tokens": new_tokens, "rows": []}
    for name, slots, options in plans:
        row = _decode_row(cfg, params, prompts, slots, new_tokens, n, options,
                          draft_params if name == "draft" else None)
        result["rows"].append({"name": name, **row})
        _write_rows(out, "decode", result, lambda r: f"{r['name']}@{r['slots']}")
    return result


def section_cascade(tiny: bool, out: pathlib.Path) -> dict:
    """Cascade attention off and on where it has the most to save (module doc, 6.): long prompts shared
    by n = 8 samples, so a plain decode step reads mostly prompt KV. Rows to <out>/cascade.json."""
    import numpy as np

    cfg, params = _decode_model(tiny)
    # the CPU rehearsal takes the decode section's shapes (its plain and cascade rows' programs, compiled already)
    lengths, new_tokens, num_prompts, n, slots = ((40,), 8, 4, 2, 2) if tiny else ((2048, 1024), 64, 16, 8, 64)
    rng = np.random.default_rng(0)
    result: dict = {"model": _model_line(cfg), "prompts": num_prompts, "n": n, "slots": slots,
                    "new_tokens": new_tokens, "rows": []}
    for prompt_len in lengths:
        prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, prompt_len)] for _ in range(num_prompts)]
        for name in ("plain", "cascade"):
            row = _decode_row(cfg, params, prompts, slots, new_tokens, n, {"cascade_attention": name == "cascade"})
            result["rows"].append({"name": name, "prompt_tokens": prompt_len, **row})
            _write_rows(out, "cascade", result, lambda r: f"{r['name']}@{r['prompt_tokens']}p")
    return result


def section_profile(tiny: bool, out: pathlib.Path) -> dict:
    """Where a decode step's time goes (module doc, 7.): traced plain and n-gram rows, their op
    families in ms per decode step, to <out>/profile.json after each row."""
    import shutil

    import numpy as np
    from trace_ops import by_family, newest_trace, op_families, traced_steps  # bench/trace_ops.py, beside this script

    from jaxrl_llm.sampler.speculative import SpeculativeSpec

    cfg, params = _decode_model(tiny)
    prompt_len, new_tokens, num_prompts, n, slots = (40, 8, 4, 2, 2) if tiny else (128, 64, 32, 2, 64)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, prompt_len)] for _ in range(num_prompts)]
    result: dict = {"model": _model_line(cfg), "prompts": num_prompts, "n": n, "slots": slots,
                    "new_tokens": new_tokens, "rows": []}
    for name, options in (("plain", {}), ("ngram", {"speculative": SpeculativeSpec("ngram", num_tokens=4)})):
        trace = out / f"trace_{name}"
        shutil.rmtree(trace, ignore_errors=True)
        row = _decode_row(cfg, params, prompts, slots, new_tokens, n, options, trace_dir=trace)
        # per decode step the trace holds (a bounded number of events: a long run's first steps only)
        exact = op_families(trace, exact=True)  # the trace read once
        row["traced_steps"] = steps = traced_steps(exact, cfg.num_hidden_layers, max(1, row["decode_steps"]))
        for key, ops in (("ops_ms_per_step", by_family(exact)), ("ops_exact_ms_per_step", exact)):
            row[key] = [{**op, "ms": op["ms"] / steps} for op in ops[:40]]
        if newest_trace(trace).stat().st_size > 30 * 2**20:  # too large to bring back: the tables stay
            shutil.rmtree(trace)
        result["rows"].append({"name": name, **row})
        _write_rows(out, "profile", result, lambda r: f"{r['name']} (traced)")
    result["update"] = _profile_update(tiny, out / "trace_update")
    result["summary"] += f", update {result['update']['update_s']:.2f} s traced"
    return result


def _profile_update(tiny: bool, trace: pathlib.Path) -> dict:
    """The step section's run with its second actor update traced (the first compiles): the update's
    wall time under the profiler, its op families in ms, and the memory plan's roofline estimate of it
    (planning/roofline.py) at this device's figures."""
    import shutil

    import jax
    from trace_ops import by_family, newest_trace, op_families

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_runs import tiny_config

    from jaxrl_llm.planning.memory import plan_memory
    from jaxrl_llm.roles.trained import TrainedRole
    from jaxrl_llm.trainer import Trainer

    shutil.rmtree(trace, ignore_errors=True)
    real, seen, timed = TrainedRole.update, [], {}

    def update(self, *args, **kwargs):
        seen.append(self.name)
        if self.name != "actor" or seen.count("actor") != 2:
            return real(self, *args, **kwargs)
        jax.block_until_ready((self.params, self.opt_state, args, kwargs))  # the work before it, done untraced
        with jax.profiler.trace(str(trace), create_perfetto_trace=True):
            start = time.perf_counter()
            metrics = jax.block_until_ready(real(self, *args, **kwargs))
            timed["update_s"] = time.perf_counter() - start
        return metrics

    TrainedRole.update = update
    try:
        # the run's own plan would compile every program again: the one below costs the update only
        with tempfile.TemporaryDirectory(prefix="device_check_profile_") as run_dir:
            trainer = Trainer(tiny_config(run_dir, **{**_step_overrides(tiny), "trainer.memory_plan": False}))
            trainer.fit()
    finally:
        TrainedRole.update = real
    # the update's cost only (its compile with the layer twice per scan trip): the other programs' are not reported
    plan = plan_memory(trainer.spec, trainer.mesh, trainer.tokenizer, check=False, costs=("update_actor",))
    estimate = plan.roofline(plan.program("update_actor"))
    ops = by_family(op_families(trace, exact=True))
    if newest_trace(trace).stat().st_size > 30 * 2**20:
        shutil.rmtree(trace)
    return {**timed, "ops_ms": ops[:40],
            "estimate": None if estimate is None else {"seconds": estimate.seconds, "bound": estimate.bound,
                                                       "compute_s": estimate.compute_s, "hbm_s": estimate.hbm_s,
                                                       "link_s": estimate.link_s}}


def _exact_step(tiny: bool, on: bool) -> dict:
    """The step section's GRPO run (bf16, paged engine, packed rows) with model.batch_invariant `on`: the
    second step's timings and its rollout_corr/ exactness metrics."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_runs import read_metrics, tiny_config

    from jaxrl_llm.trainer import Trainer

    overrides = {**_step_overrides(tiny), "trainer.memory_plan": False, "actor_rollout_ref.model.batch_invariant": on}
    if not tiny:  # smaller than the step section's: two runs share this section's minutes
        overrides.update({"data.max_response_length": 256, "data.train_batch_size": 8,
                          "actor_rollout_ref.actor.ppo_mini_batch_size": 8, "actor_rollout_ref.rollout.n": 4})
    with tempfile.TemporaryDirectory(prefix="device_check_exact_") as run_dir:
        Trainer(tiny_config(run_dir, **overrides)).fit()
        last = read_metrics(run_dir)[-1]
    keys = ("timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor",
            "rollout_corr/max_abs_log_ratio", "rollout_corr/exact_token_frac", "rollout_corr/kl")
    return {"batch_invariant": on, **{k: last.get(k) for k in keys}}


def section_exact(tiny: bool, out: pathlib.Path) -> dict:
    """Exact rollouts (model.batch_invariant) off and on: bench/exact_rollouts.py's rows (static and paged
    engines; Qwen2-0.5B's shape in bf16, 16 prompts x 128 new tokens; tiny: its tiny model), then the GRPO
    step off and on (`_exact_step`). Each row is written to <out>/exact.json as it ends."""
    import dataclasses

    sys.path.insert(0, str(ROOT / "bench"))
    import exact_rollouts

    cfg, params, prompts, pad = (exact_rollouts.tiny_model() if tiny else exact_rollouts.qwen2_random(16))
    new_tokens = 16 if tiny else 128
    result: dict = {"model": "tiny" if tiny else _model_line(cfg), "new_tokens": new_tokens, "rows": [], "steps": []}

    def write() -> None:
        parts = [f"{r['engine']}{'+inv' if r['batch_invariant'] else ''} max|dlogp| {r['max_abs_log_ratio']:.2g} "
                 f"rollout {r['rollout_s']:.2f}s" for r in result["rows"]]
        parts += [f"step{'+inv' if r['batch_invariant'] else ''} {r['timing_s/step'] or 0:.2f}s max|dlogp| "
                  f"{r['rollout_corr/max_abs_log_ratio']}" for r in result["steps"]]
        result["summary"] = ", ".join(parts)
        _write_json(out / "exact.json", {**result, "status": "partial"})

    for engine in ("static", "paged"):
        for on in (False, True):
            result["rows"].append(exact_rollouts.run_row(dataclasses.replace(cfg, batch_invariant=on), params, prompts,
                                                         pad, engine=engine, new_tokens=new_tokens))
            write()
    for on in (False, True):
        result["steps"].append(_exact_step(tiny, on))
        write()
    return result


def run_section(name: str, tiny: bool, out: pathlib.Path) -> dict:
    fns = {"env": section_env, "kernels": section_kernels, "tests": lambda tiny: section_tests(tiny, out),
           "step": lambda tiny: section_step(tiny, out), "decode": lambda tiny: section_decode(tiny, out),
           "cascade": lambda tiny: section_cascade(tiny, out), "profile": lambda tiny: section_profile(tiny, out),
           "exact": lambda tiny: section_exact(tiny, out)}
    result = fns[name](tiny)
    result.setdefault("status", "ok")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal: tiny shapes, kernels interpreted")
    parser.add_argument("--out", default="runs/device_check")
    parser.add_argument("--budget_s", type=float, default=480.0, help="seconds for all sections together")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        try:
            result = run_section(args.section, args.tiny, out)
        except Exception as err:  # reported in the section's JSON, the kit goes on
            result = {"status": "error", "error": f"{type(err).__name__}: {err}"[:2000], "summary": str(err)[:200]}
        _write_json(out / f"{args.section}.json", result)
        return 0 if result["status"] == "ok" else 1
    failed = 0
    names = args.sections.split(",")
    unknown = [name for name in names if name not in SHARES]
    if unknown:
        parser.error(f"--sections: unknown {unknown}; known: {list(SHARES)}")
    for name in names:
        deadline = SHARES[name] / sum(SHARES[s] for s in names) * args.budget_s
        start = time.perf_counter()
        cmd = [sys.executable, __file__, "--section", name, "--out", str(out)] + (["--tiny"] if args.tiny else [])
        try:
            subprocess.run(cmd, timeout=deadline, check=False)
        except subprocess.TimeoutExpired:  # what it wrote so far stays (decode's finished rows)
            path = out / f"{name}.json"
            partial = json.loads(path.read_text()) if path.exists() else {}
            _write_json(path, {**partial, "status": "timeout", "deadline_s": deadline})
        path = out / f"{name}.json"
        result = json.loads(path.read_text()) if path.exists() else {"status": "crashed"}
        failed += result.get("status") != "ok"
        print(f"[{name}] {result.get('status')} in {time.perf_counter() - start:.0f} s: "
              f"{result.get('summary', result.get('error', ''))}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
