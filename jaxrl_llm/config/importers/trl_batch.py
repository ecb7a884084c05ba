"""TRL's batch sizes and step counters -> ours (GRPOConfig and the older RLOOConfig).

GRPO: TRL counts completions per device. One optimizer step takes
`per_device_train_batch_size x devices x gradient_accumulation_steps` completions; one generation
produces `generation_batch_size` completions (default `per_device_train_batch_size x devices x
steps_per_generation`, `steps_per_generation` defaulting to `gradient_accumulation_steps`), reused
`num_iterations` times. So data.train_batch_size = generation_batch_size / num_generations prompts
and ppo_mini_batch_size = completions per optimizer step / num_generations. When a generation batch
feeds several optimizer steps TRL shuffles its completions before splitting it: actor.shuffle; when an
optimizer step is not whole groups, actor.num_mini_batches = generation / step counts the mini-batches
in sequences instead (groups split, as TRL splits them). TRL shuffles once per generation and reuses
the split for its num_iterations; ours reshuffles at each ppo_epoch. The devices are this run's
data-parallel devices (as TRL's are its processes).

RLOO (TRL's older RLOOTrainer): one batch = `per_device_train_batch_size x
gradient_accumulation_steps x num_mini_batches x devices` completions, permuted at each ppo epoch and
split into `num_mini_batches` mini-batches (actor.shuffle; actor.num_mini_batches where they split
groups), for `total_episodes` completions in all.

TRL's `max_steps`, `save_steps`, `eval_steps`, `warmup_steps` count optimizer steps (GRPO); ours count training
steps, each `train_batch_size / ppo_mini_batch_size x ppo_epochs` optimizer steps: they are divided
(rounded up). The older RLOOTrainer counts batches, as we do.
"""
from __future__ import annotations

import math
from typing import Any

from jaxrl_llm.config.importers.common import Mapper, SourceValue, int_or_error, ratio_steps

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
BATCH_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
              "generation_batch_size", "num_mini_batches")


def _int(m: Mapper, args: dict[str, Any], key: str, default: int) -> int:
    value = args.get(key)
    return default if value is None else int_or_error(m, key, value)


def map_batch(m: Mapper, args: dict[str, Any], rloo: bool) -> None:
    if not any(k in args for k in BATCH_KEYS):
        return
    per_device = _int(m, args, "per_device_train_batch_size", 8)
    accumulation = _int(m, args, "gradient_accumulation_steps", 1)
    n, dp = m.get(f"{R}.n"), m.dp()
    where = next(k for k in BATCH_KEYS if k in args)
    if rloo:
        mini_batches = _int(m, args, "num_mini_batches", 1)
        completions = per_device * accumulation * mini_batches * dp
        if completions % n:
            m.error(where, f"{per_device} x {accumulation} x num_mini_batches {mini_batches} x {dp} device(s) = "
                           f"{completions} completions is not whole groups of rloo_k={n}")
        prompts = completions // n
        mini = prompts // mini_batches if prompts % mini_batches == 0 else None
        if mini_batches > 1:  # RLOOTrainer draws a new permutation of the batch at each ppo epoch
            m.set(f"{A}.shuffle", True, "num_mini_batches")
        if mini is None:  # its mini-batches split groups: counted in sequences
            m.set(f"{A}.num_mini_batches", mini_batches, "num_mini_batches")
    else:
        step = per_device * dp * accumulation
        generation = args.get("generation_batch_size")
        if generation is None:
            generation = per_device * dp * _int(m, args, "steps_per_generation", accumulation)
        generation = int_or_error(m, "generation_batch_size", generation)
        if generation % n or generation % step:
            m.error(where, f"a generation batch of {generation} completions must be whole groups of "
                           f"num_generations={n} and a whole number of optimizer steps of {per_device} x {dp} "
                           f"device(s) x gradient_accumulation_steps {accumulation} = {step} completions (as TRL "
                           "requires)")
        prompts, mini = generation // n, (step // n if step % n == 0 else None)
        if generation > step:  # TRL shuffles the generation batch, then splits it into optimizer steps
            m.set(f"{A}.shuffle", True, where)
        if step % n:  # an optimizer step splits a prompt's group: mini-batches counted in sequences
            m.set(f"{A}.num_mini_batches", generation // step, where)
    m.set("data.train_batch_size", prompts, where)
    if mini is not None:
        m.set(f"{A}.ppo_mini_batch_size", mini, where)
    m.set(f"{A}.ppo_micro_batch_size_per_device", per_device, "per_device_train_batch_size")
    # TRL scores the reference and old log-probs in the same per-device batches it trains on
    for role in ("ref", "rollout"):
        m.set(f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_device", per_device,
              "per_device_train_batch_size")


def optimizer_steps_per_step(m: Mapper) -> int:
    split = m.settings.get(f"{A}.num_mini_batches")
    mini_batches = split if split is not None else m.get("data.train_batch_size") // m.get(f"{A}.ppo_mini_batch_size")
    return mini_batches * m.get(f"{A}.ppo_epochs")


def map_steps(m: Mapper, args: dict[str, Any], rloo: bool) -> None:
    per_step = 1 if rloo else optimizer_steps_per_step(m)
    max_steps = args.get("max_steps")
    if max_steps is not None and max_steps > 0:
        m.set("trainer.total_training_steps", ratio_steps(int_or_error(m, "max_steps", max_steps), per_step),
              "max_steps")
        if "num_train_epochs" in args:
            m.ignore("num_train_epochs", "max_steps takes precedence (as in TRL)")
    elif args.get("num_train_epochs") is not None:
        epochs = args["num_train_epochs"]
        if float(epochs) != int(epochs):
            m.error("num_train_epochs", f"{epochs!r}: fractional epochs are not available; set max_steps")
        m.set("trainer.total_epochs", int(epochs), "num_train_epochs")
    if rloo and args.get("total_episodes") is not None:
        completions = m.get("data.train_batch_size") * m.get(f"{R}.n")
        m.set("trainer.total_training_steps", math.ceil(args["total_episodes"] / completions), "total_episodes")
    warmup = args.get("warmup_steps")
    if warmup:  # our warmup counts training steps (veRL's scheduler steps once per training step)
        m.set(f"{A}.optim.lr_warmup_steps", ratio_steps(int_or_error(m, "warmup_steps", warmup), per_step),
              "warmup_steps")
    _save_eval(m, args, per_step)


def _steps(m: Mapper, key: str, value: SourceValue, per_step: int) -> int | None:
    if value is None:
        return None
    if value < 1:  # HF: a float < 1 is a fraction of the total steps
        m.ignore(f"{key}={value}", "fractions of the run are not available; give a number of steps")
        return None
    return ratio_steps(int_or_error(m, key, value), per_step)


def _save_eval(m: Mapper, args: dict[str, Any], per_step: int) -> None:
    strategy = args.get("save_strategy", "steps")
    if strategy == "steps":
        freq = _steps(m, "save_steps", args.get("save_steps"), per_step)
        if freq is not None:
            m.set("trainer.save_freq", freq, "save_steps")
    else:
        m.ignore(f"save_strategy={strategy}", "jaxrl_llm saves every trainer.save_freq steps and at the end")
    strategy = args.get("eval_strategy", args.get("evaluation_strategy"))
    if strategy == "no":
        m.set("trainer.test_freq", -1, "eval_strategy")
    elif strategy in (None, "steps"):
        value = args.get("eval_steps")
        if value is None and strategy == "steps":
            value = args.get("logging_steps", 10)  # HF: eval_steps defaults to logging_steps
        freq = _steps(m, "eval_steps", value, per_step)
        if freq is not None:
            m.set("trainer.test_freq", freq, "eval_steps")
    else:
        m.ignore(f"eval_strategy={strategy}", "jaxrl_llm validates every trainer.test_freq steps")
