"""`BatchPlan`: every batch and micro-batch size of a step, derived once from the config.

The printed summary (`BatchPlan.summary()`, shown by `--dry_run` and at the start of training) and
the run itself (`update_split`, `forward_micro_rows`) read the same numbers.

Sizes are per step: `data.train_batch_size` prompts x `rollout.n` samples = `sequences`, split over
the data-parallel size `dp_size` (mesh data x fsdp x expert). Each trained role (actor, critic) runs
`epochs` x `mini_batches` optimizer steps, each over `micro` micro-batches (gradient accumulation).
No-grad passes (reference log-probs, old log-probs, critic values) run in micro-batches too.
A micro-batch is either a fixed number of sequences per device, or, with a dynamic batch size, as
many sequences as fit a per-device token budget at this step's (bucketed) sequence length, or
`auto`: the largest divisor of the per-device rows whose program fits the device memory, which the
memory plan (planning/memory.py) picks before any weight is loaded (`with_micro` below).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MicroBatching:
    """How one pass splits a device's rows into micro-batches."""

    key: str  # the config key that sets it (named in errors)
    per_device: int | None  # fixed sequences per device; None = all of them (or dynamic)
    token_budget: int | None  # dynamic batch size: tokens per device per micro-batch
    auto: bool = False  # 'auto': not known until the memory plan resolves it

    def sequences_per_device(self, rows_per_device: int, seq_len: int) -> int:
        """Sequences per device in one micro-batch of a pass over `rows_per_device` rows of `seq_len` tokens."""
        if self.auto:
            raise ValueError(f"{self.key}=auto is resolved by the memory plan (planning/memory.py), "
                             "which has not run")
        if self.token_budget is not None:
            fit = max(1, self.token_budget // seq_len)
            return max(d for d in range(1, rows_per_device + 1) if rows_per_device % d == 0 and d <= fit)
        size = min(self.per_device or rows_per_device, rows_per_device)
        if rows_per_device % size:
            raise ValueError(f"{self.key}={size} does not divide the {rows_per_device} sequences per device")
        return size

    def describe(self) -> str:
        if self.auto:
            return "auto (largest that fits)"
        if self.token_budget is not None:
            return f"dynamic (<= {self.token_budget} tokens/device)"
        return f"{self.per_device}/device" if self.per_device else "whole batch"


@dataclasses.dataclass(frozen=True)
class RoleBatch:
    """Batch arithmetic of one trained role (actor or critic), per training step."""

    mini_batch_prompts: int | float  # a fraction when actor.num_mini_batches splits groups
    mini_batch_sequences: int
    mini_batches: int  # per ppo_epoch
    epochs: int
    per_device: int  # sequences of one mini-batch on one device
    micro: MicroBatching

    @property
    def optimizer_steps(self) -> int:
        return self.mini_batches * self.epochs

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches per optimizer step (None with a dynamic batch size: it depends on the length)."""
        if self.micro.token_budget is not None or self.micro.auto:
            return None
        return self.per_device // self.micro.sequences_per_device(self.per_device, 1)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    prompts: int
    n: int
    dp_size: int
    max_prompt_length: int
    response_length: int
    actor: RoleBatch
    critic: RoleBatch | None
    ref_log_prob: MicroBatching
    old_log_prob: MicroBatching
    values: MicroBatching | None

    @property
    def sequences(self) -> int:
        return self.prompts * self.n

    @property
    def sequences_per_device(self) -> int:
        return self.sequences // self.dp_size

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.max_prompt_length + self.response_length

    @property
    def max_tokens_per_step(self) -> int:
        return self.sequences * self.max_tokens_per_sequence

    def update_split(self, role: RoleBatch, rows: int, seq_len: int) -> tuple[int, int]:
        """(mini-batches, micro-batches per mini-batch) of one role's update over `rows` sequences."""
        mini_rows = min(rows, role.mini_batch_sequences)
        if rows % mini_rows:
            raise ValueError(f"{rows} sequences do not split into mini-batches of {mini_rows}")
        per_device = mini_rows // self.dp_size
        return rows // mini_rows, per_device // role.micro.sequences_per_device(per_device, seq_len)

    def forward_micro_rows(self, micro: MicroBatching, rows: int, seq_len: int) -> int:
        """Rows (all devices) per micro-batch of a no-grad pass over `rows` sequences."""
        return self.dp_size * micro.sequences_per_device(rows // self.dp_size, seq_len)

    @property
    def auto_passes(self) -> tuple[str, ...]:
        """The passes whose micro-batch is 'auto' (names as `with_micro` takes them)."""
        passes = {"actor": self.actor.micro, "critic": self.critic.micro if self.critic else None,
                  "ref_log_prob": self.ref_log_prob, "old_log_prob": self.old_log_prob, "values": self.values}
        return tuple(name for name, m in passes.items() if m is not None and m.auto)

    def micro_of(self, name: str) -> MicroBatching:
        """The micro-batching of a pass: actor | critic | ref_log_prob | old_log_prob | values."""
        if name in ("actor", "critic"):
            return getattr(self, name).micro
        return getattr(self, name)

    def with_micro(self, name: str, per_device: int) -> "BatchPlan":
        """This plan with the pass `name` (see `micro_of`) fixed to `per_device` sequences per device."""
        micro = dataclasses.replace(self.micro_of(name), per_device=int(per_device), token_budget=None, auto=False)
        if name in ("actor", "critic"):
            return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), micro=micro)})
        return dataclasses.replace(self, **{name: micro})

    def summary(self, total_steps: int | None = None, total_epochs: int | None = None) -> str:
        lines = [
            f"batch: {self.prompts} prompts x n={self.n} = {self.sequences} sequences per step; data-parallel size "
            f"{self.dp_size} -> {self.sequences_per_device} sequences/device",
            _role_line("actor", self.actor),
        ]
        if self.critic is not None:
            lines.append(_role_line("critic", self.critic))
        passes = [("reference log-probs", self.ref_log_prob), ("old log-probs", self.old_log_prob)]
        if self.values is not None:
            passes.append(("critic values", self.values))
        lines.append("no-grad micro-batches: " + "; ".join(f"{name} {m.describe()}" for name, m in passes))
        lines.append(f"tokens: <= {self.max_tokens_per_sequence} per sequence ({self.max_prompt_length} prompt + "
                     f"{self.response_length} response), <= {self.max_tokens_per_step} per step")
        if total_steps is not None or total_epochs is not None:
            lines.append(f"steps: {total_steps if total_steps is not None else 'derived from the dataset size'} "
                         f"(total_epochs={total_epochs})")
        return "\n".join(lines)


def _role_line(name: str, rb: RoleBatch) -> str:
    accumulation = rb.accumulation_steps
    micro = (f"{'micro-batch' if rb.micro.auto else 'dynamic micro-batches'} ({rb.micro.describe()})"
             if accumulation is None else
             f"micro-batch {rb.micro.sequences_per_device(rb.per_device, 1)}/device -> "
             f"{accumulation} accumulation step(s)")
    prompts = (f"{rb.mini_batch_prompts} prompts = " if float(rb.mini_batch_prompts).is_integer() else
               "whole groups or not (actor.num_mini_batches): ")
    return (f"{name}: {rb.mini_batches} mini-batch(es) of {prompts}"
            f"{rb.mini_batch_sequences} sequences ({rb.per_device}/device) x {rb.epochs} epoch(s) = "
            f"{rb.optimizer_steps} optimizer step(s); {micro}")
