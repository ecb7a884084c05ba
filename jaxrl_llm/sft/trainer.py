"""`SftTrainer(config).fit()`: supervised fine-tuning on the RL stack (`launch/sft.py` runs it).

    rows (sft/data.py: prompt + response, or conversations; loss on the assistant tokens)
      -> batches of data.train_batch_size sequences (sft/batch.py)
      -> one optimizer step each: micro-batches (or token-budget packs) accumulated (sft/loss.py)
      -> validation loss every trainer.test_freq steps, checkpoints every trainer.save_freq steps,
         the HF folder at the end (trainer.export_hf)

The policy is the RL actor (`roles/trained.py`: the same loading, LoRA, optimizer, shardings), its
checkpoints hold `{"actor": params, opt_state}` as RL's do, so an RL run starts from one with
`actor_rollout_ref.model.path=<run>/checkpoints`. The RL batch keys an SFT run reuses are derived from
the `sft` section first (`sft_view`).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
from tqdm.auto import tqdm

from jaxrl_llm import checkpoint as ckpt
from jaxrl_llm import storage
from jaxrl_llm.batching import StepBatching
from jaxrl_llm.batching.batch_plan import BatchPlan
from jaxrl_llm.bookkeeping.closing import close_all
from jaxrl_llm.bookkeeping.metrics import Timer
from jaxrl_llm.bookkeeping.nonfinite import NonFiniteGuard, assert_finite_state
from jaxrl_llm.bookkeeping.preemption import Preempted, PreemptionGuard
from jaxrl_llm.bookkeeping.tracking import Tracking
from jaxrl_llm.config import ConfigError, resolve, resolve_data, resolve_synthetic, validate_config
from jaxrl_llm.config.checks import check_context
from jaxrl_llm.config.resolve import resolve_sft
from jaxrl_llm.data.synthetic import write_synthetic_data
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.planning.preflight import run_tokenizer
from jaxrl_llm.platform.compile_cache import use_compilation_cache
from jaxrl_llm.roles.export import export_policy
from jaxrl_llm.roles.trained import load_model, make_trained_role, packing_for
from jaxrl_llm.sft.batch import HostBatch, SftLoader, eval_batches
from jaxrl_llm.sft.data import read_sft_examples
from jaxrl_llm.sft.loss import METRIC_PREFIX, batch_nll
from jaxrl_llm.sft.steps import sft_batch_plan, sft_step, sft_update_fn, sft_view
from jaxrl_llm.sharding import batch_axes, batch_axis_size, initialize, on_own_mesh, to_device
from jaxrl_llm.sharding.split import make_split_meshes


class SftTrainer:
    """An SFT run: its spec, mesh, tokenizer, examples, policy, batching, checkpoints and loggers, and
    the loop (`fit`)."""

    def __init__(self, config: ml_collections.ConfigDict, *, dry_run: bool = False):
        """dry_run: stop once every row is read and tokenized (`--dry_run`: no weight loads, nothing written
        but a synthetic task's files)."""
        initialize()
        self.mesh, _ = make_split_meshes(config.mesh)
        dp = batch_axis_size(self.mesh)
        self.is_main = jax.process_index() == 0
        view = sft_view(config)
        checked = validate_config(view, dp_size=dp)
        use_compilation_cache(checked.trainer.compilation_cache_dir)  # before the first compile
        self.checked = checked
        self.sft = resolve_sft(checked)
        data = resolve_data(checked)
        self.data = data
        self.tokenizer = run_tokenizer(data)
        write_synthetic_data(resolve_synthetic(checked), is_main=self.is_main)
        assert data.train_files is not None  # validate_config requires them (or derives a synthetic task's)
        self.train_examples = self.read_rows(data.train_files, data.train_max_samples)
        self.val_examples = self.read_rows(data.val_files, data.val_max_samples) if data.val_files else []
        self.spec = resolve(checked, dp_size=dp, num_train_samples=len(self.train_examples))
        t = self.spec.trainer
        assert t.total_steps is not None
        self.total_steps = int(t.total_steps)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.loader = self.make_loader(self.train_examples, int(checked.data.train_batch_size))
        if dry_run:
            return
        # where a resume comes from, checked before the weights load
        self.resume_point = ckpt.find_resume(t.resume_mode, t.run_dir, t.resume_from_path)
        model_cfg, params = load_model(self.spec.model, head="lm", mesh=self.mesh, tokenizer=self.tokenizer,
                                       seed=t.seed)
        check_context(model_cfg, self.max_length)
        self.spec = dataclasses.replace(self.spec, model=packing_for(self.spec.model, model_cfg))
        plan = self.batch_plan(dp)
        self.batching = StepBatching(plan, dp)
        self.policy = make_trained_role("actor", model_cfg, params, self.spec.actor_optim,
                                        self.update_fn(model_cfg), lora=self.spec.model.lora, seed=t.seed,
                                        model=self.spec.model, settings=self.spec.actor, batch=plan.actor)
        self.after_policy(params)
        self.rows_sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(batch_axes(self.mesh)))
        self.base_rng = jax.random.PRNGKey(t.seed)
        self.store = ckpt.CheckpointStore(storage.join(t.run_dir, "checkpoints"), max_to_keep=t.max_ckpt_to_keep)
        self.tracker = Tracking(list(t.logger), t.run_dir, project_name=t.project_name,
                                experiment_name=t.experiment_name, config=json.loads(self.spec.config_json),
                                is_main_process=self.is_main)
        self.nonfinite = NonFiniteGuard(t.max_consecutive_nonfinite)
        self.global_step = 0
        self.history: list[dict[str, float]] = []
        if self.is_main:
            print(self.summary(), flush=True)

    # ------------------------------------------------------------------ what a subclass (DPO) replaces
    kind = "sft"  # the checkpoint meta's `kind`, the progress bar's name
    loss_key = f"{METRIC_PREFIX}/loss"

    @property
    def max_length(self) -> int:
        return self.sft.max_length

    def read_rows(self, files: Sequence[str], max_samples: int) -> list[Any]:
        """The training (or validation) items of `files`: here SFT examples."""
        return read_sft_examples(files, self.data, self.sft, self.tokenizer, max_samples)

    def make_loader(self, items: list[Any], batch_size: int) -> SftLoader:
        return SftLoader(items, batch_size, shuffle=self.data.shuffle, seed=self.data.seed, pad_id=self.pad_id)

    def batch_plan(self, dp: int) -> BatchPlan:
        s, rows = self.sft, self.loader.batch_size
        if not s.use_dynamic_bsz and rows % (s.micro_batch_size_per_device * dp):
            raise ConfigError(f"sft.micro_batch_size_per_device={s.micro_batch_size_per_device} x {dp} devices does "
                              f"not divide data.train_batch_size={rows}")
        return sft_batch_plan(rows, dp, s, self.loader.longest())

    def update_fn(self, model_cfg: ModelConfig) -> Any:
        return sft_update_fn(model_cfg, self.spec)

    def after_policy(self, params: dict) -> None:
        """Called once the policy is built (DPO builds its reference here)."""

    def train_step(self, host: HostBatch, rng: jax.Array) -> dict[str, float]:
        return sft_step(self.policy, host, self.batching, rng, lr_step=self.global_step,
                        rows_sharding=self.rows_sharding)

    def rows_summary(self) -> str:
        """What --dry_run prints after the resolved tree: the rows read and the step arithmetic."""
        tokens = sum(int(e.loss_mask.sum()) for e in self.loader.rows(self.train_examples))
        return (f"{self.kind}: {len(self.train_examples)} train / {len(self.val_examples)} val items, {tokens} "
                f"trained tokens; {self.loader.batch_size} per step -> {self.loader.batches_per_epoch} steps per "
                f"epoch; {self.total_steps} steps")

    def summary(self) -> str:
        p, s = self.policy, self.sft
        micro = (f"token budget {s.max_token_len_per_device}/device" if s.use_dynamic_bsz
                 else f"{s.micro_batch_size_per_device} sequences/device")
        return "\n".join([
            f"sft: {self.spec.model.path} ({p.model_cfg.architecture}, {p.num_params / 1e6:.1f}M params, "
            f"{p.num_trainable_params / 1e6:.2f}M trained{', LoRA' if self.spec.model.lora else ''})",
            f"data: {len(self.train_examples)} train / {len(self.val_examples)} val sequences "
            f"({'conversations' if s.multiturn else 'prompt + response'}), <= {s.max_length} tokens",
            f"batch: {self.loader.batch_size} sequences per step, micro-batches of {micro}; "
            f"{self.total_steps} steps ({self.loader.batches_per_epoch} per epoch)",
            f"mesh: {dict(self.mesh.shape)}"])

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Trains for trainer.total_training_steps; returns the last step's metrics."""
        finished = False
        try:
            last = self._loop()
            finished = True
            return last
        finally:
            self.close(quiet=not finished)

    def _loop(self) -> dict[str, float]:
        t = self.spec.trainer
        last: dict[str, float] = {}
        with PreemptionGuard() as guard:
            self._maybe_resume()
            if (t.val_before_train or t.val_only) and self.val_examples:
                last = self.validate()
                self.tracker.log(last, self.global_step)
                self.history.append({"training/global_step": float(self.global_step), **last})
                if t.val_only:
                    return last
            bar = tqdm(total=self.total_steps, initial=self.global_step, desc=f"{self.kind} steps",
                       disable=not self.is_main)
            try:
                while self.global_step < self.total_steps:
                    last = self.step()
                    bar.set_postfix(loss=f"{last[self.loss_key]:.4f}")
                    bar.update(1)
                    if self.global_step < self.total_steps and guard.stop_requested(self.global_step):
                        bar.close()
                        self._stop_preempted(guard.reason)
            finally:
                bar.close()
        if t.export_hf:
            self.export_hf(storage.join(self.spec.trainer.run_dir, "hf"))
        return last

    @on_own_mesh
    def step(self) -> dict[str, float]:
        """One optimizer step on the next batch, then validation, logging and checkpointing as configured."""
        self.store.check()  # a failed async save stops the run now
        t, timer = self.spec.trainer, Timer()
        with timer("step"):
            host = self.loader.next()
            metrics = self.train_step(host, jax.random.fold_in(self.base_rng, self.global_step))
        metrics.update(timer.metrics())
        metrics["perf/throughput"] = host.num_tokens / max(timer.times["step"], 1e-9)
        self.global_step += 1
        metrics["training/global_step"] = float(self.global_step)
        metrics["training/epoch"] = float(self.loader.epoch)
        self.nonfinite.check(self.global_step, metrics, lambda: "the SFT batch")
        is_last = self.global_step >= self.total_steps
        if t.test_freq > 0 and self.val_examples and (self.global_step % t.test_freq == 0 or is_last):
            metrics.update(self.validate())
        self.tracker.log(metrics, self.global_step)
        self.history.append(metrics)
        if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or is_last):
            self.save_checkpoint()
        return metrics

    @on_own_mesh
    def validate(self) -> dict[str, float]:
        """val/loss: the token-mean negative log-likelihood over every validation sequence."""
        dp = batch_axis_size(self.mesh)
        size = dp * self.sft.micro_batch_size_per_device  # veRL: the micro-batch size is the val batch size
        total, count = 0.0, 0.0
        params = self.policy.model_params
        for host in eval_batches(self.val_examples, size, self.pad_id):
            fields = to_device(host.device_fields(), self.mesh)
            nll, n = batch_nll(params, fields["input_ids"], fields["attention_mask"], fields["response_mask"],
                               model_cfg=self.policy.model_cfg, compute_dtype=self.spec.actor.compute_dtype,
                               logprob_impl=self.spec.actor.logprob_impl)
            total, count = total + float(nll), count + float(n)
        return {"val/loss": total / max(count, 1.0)}

    # ------------------------------------------------------------------ checkpoints, export
    def state(self) -> dict[str, Any]:
        return {"actor": {"params": self.policy.params, "opt_state": self.policy.opt_state}}

    def save_checkpoint(self) -> None:
        assert_finite_state(self.state(), self.global_step)
        meta: dict[str, Any] = {"global_step": self.global_step, "kind": self.kind,
                                "model_config": self.policy.model_cfg.to_hf_config(),
                                "tokenizer": str(self.spec.data.tokenizer),
                                "config": json.loads(self.spec.config_json)}
        lora = self.spec.model.lora
        if lora is not None:
            meta["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.targets),
                            "dropout": lora.dropout, "base_path": self.spec.model.path}
        self.tracker.flush()
        self.store.save(self.global_step, self.state(), self.loader.state(), meta)

    def _maybe_resume(self) -> None:
        point = self.resume_point
        if point is None:
            self.tracker.rewind(None)
            return
        step, state, data_state, meta = ckpt.restore_resume_point(self.store, point, ckpt.abstract_like(self.state()))
        self.policy.params, self.policy.opt_state = state["actor"]["params"], state["actor"]["opt_state"]
        self.loader.set_state(data_state)
        self.global_step = int(meta["global_step"])
        ckpt.warn_config_changes(meta.get("config"), json.loads(self.spec.config_json),
                                 where=f"{point.directory}/{step}")
        self.tracker.rewind(self.global_step)
        if self.is_main:
            print(f"resumed from {point.directory} step {step}", flush=True)

    def _stop_preempted(self, reason: str) -> None:
        if self.global_step not in self.store.all_steps():
            self.save_checkpoint()
        self.store.wait()
        self.close()
        print(f"preempted at step {self.global_step}; checkpoint saved", flush=True)
        raise Preempted(self.global_step, reason)

    def export_hf(self, out_dir: str) -> str:
        """The policy as an HF folder (LoRA: merged, and a PEFT folder beside it)."""
        return export_policy(self.policy, self.spec.model, self.tokenizer, out_dir, is_main=self.is_main)

    def close(self, *, quiet: bool = False) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        close_all((self.store.close, self.tracker.close), quiet=quiet)
