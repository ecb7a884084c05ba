"""`Trainer(config).fit()`: the RL loop that `launch/train.py` runs. Read `train_step` top to bottom:

    rollout (sample n responses per prompt on the policy's own params, score them; with a
             `synchronizer` offset / interval, prepared ahead on a weight copy: rollout/sources.py)
      -> reference log-probs (only when a KL is used)
      -> old log-probs (the sampler's own when they are exact, else recomputed)
      -> teacher log-probs (on-policy distillation: roles/teacher.py)
      -> critic values -> `make_experience` (KL in reward, advantages, rollout correction)
      -> critic update -> actor update (ppo_epochs x mini-batches x micro-batches, one jit each)
      -> metrics

The config is resolved once into a frozen `RunSpec` (jaxrl_llm/config/spec.py); every size below
comes from it, and every batch split from its `BatchPlan`.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm.auto import tqdm

from jaxrl_llm import storage
from jaxrl_llm.batching import NO_PADS, StepRows, update_metrics
from jaxrl_llm.batching.batch_plan import MicroBatching
from jaxrl_llm.batching.ops import run_no_grad_pass
from jaxrl_llm.bookkeeping.closing import close_all
from jaxrl_llm.bookkeeping.metrics import Timer, data_metrics, device_peak_flops
from jaxrl_llm.bookkeeping.nonfinite import assert_finite_state, first_nonfinite
from jaxrl_llm.bookkeeping.preemption import Preempted, PreemptionGuard
from jaxrl_llm.bookkeeping.tracking import dump_jsonl
from jaxrl_llm.bookkeeping.watchdog import WorkerWatchdog
from jaxrl_llm.config.spec import ModelSpec, RolloutCorrectionSpec
from jaxrl_llm.losses.advantages import ADV_ESTIMATORS
from jaxrl_llm.losses.policy import POLICY_LOSSES
from jaxrl_llm.losses.shaping import sample_mask, truncated_rows
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.roles.actor import OLD_LOG_PROBS
from jaxrl_llm.roles.experience import (
    Experience,
    log_probs_no_grad,
    make_experience,
    pad_experience,
    pf_ppo_resample,
    rollout_correction,
    rollout_mismatch,
    values_no_grad,
)
from jaxrl_llm.roles.export import export_policy
from jaxrl_llm.roles.trained import TrainedRole
from jaxrl_llm.roles.update import TOKEN_OUTPUT
from jaxrl_llm.rollout.batch import Rollout, rollout_dump_rows
from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sharding import on_own_mesh, to_device, to_host
from jaxrl_llm.trainer.build import Run, build_run
from jaxrl_llm.trainer.checkpointing import checkpoint_meta, restore_trained, trained_state
from jaxrl_llm.trainer.perf import step_perf_metrics
from jaxrl_llm.trainer.validation import run_validation

log = logging.getLogger("jaxrl_llm")


class Trainer(Run):
    """A run (`build_run`: everything it holds, trainer/build.py) and its loop: `fit()`, `step()`,
    `train_step()`, validation, checkpoints."""

    def __init__(self, config: ml_collections.ConfigDict):
        run = build_run(config)
        super().__init__(**{f.name: getattr(run, f.name) for f in dataclasses.fields(run)})
        self.global_step = 0
        self._peak_flops: float | None = None
        self._started = False
        self.history: list[dict[str, float]] = []  # every logged step's metrics, for notebooks and plots
        # several processes (started by fit): a lost or hung peer ends this one (exit 75, naming it and the last
        # checkpoint); `_mark` tells it which phase this process's main thread is in
        self._watchdog = WorkerWatchdog(self.spec.trainer.worker_timeout_s, lambda: str(self.store.latest_step()),
                                        hang_timeout_s=self.spec.trainer.worker_hang_timeout_s)
        if self.is_main:
            print(self.summary(), flush=True)

    def summary(self) -> str:
        """The start-of-run summary (model, mesh, batch plan, algorithm, engine, schedule)."""
        from jaxrl_llm.trainer.summary import run_summary

        plan = self.spec.plan
        engine = self.generator.describe_engine(plan.prompts * plan.n, plan.max_prompt_length, plan.response_length,
                                                plan.n)
        return run_summary(self.spec, actor=self.actor, critic=self.critic, reference=self.reference, mesh=self.mesh,
                           engine=engine, total_steps=self.total_steps,
                           schedule=None if self.rollout_source.synchronous else self.rollout_source.describe(),
                           teacher=None if self.teacher is None else self.teacher.describe(),
                           reward=None if self.judge is None else self.judge.describe(),
                           vision=None if self.generator.vision is None else self.generator.vision.describe())

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Trains for `trainer.total_training_steps`; returns the last step's metrics. Whatever
        happens, async saves are waited for and the sinks and reward workers closed."""
        finished = False
        self._watchdog.start()
        try:
            last = self._fit_loop()
            finished = True
            return last
        except storage.StorageError as err:  # the run dir refuses a write (launch/train.py: one line, exit 74)
            raise storage.StorageError(f"{err}; the last committed checkpoint is step {self._last_committed()}") \
                from err
        except Exception:
            # a collective that failed for a lost peer (a step's: JaxRuntimeError; orbax's in an async save:
            # CheckpointSaveError; a host-side gloo all-reduce: ValueError "Gloo all-reduce failed"): the
            # watchdog's verdict (exit 75 naming it) comes first; with one process this returns at once
            self._watchdog.wait_for_verdict()
            raise
        finally:
            self.close(quiet=not finished)  # after an error: close what can be closed, keep that error

    def _last_committed(self) -> str:
        """The last committed step once the saves under way have ended (for an error's line)."""
        try:
            self.store.wait()
        except Exception:  # a save that failed too: what was committed before it still stands
            pass
        try:
            return str(self.store.latest_step())
        except Exception as err:  # the storage may be what failed
            return f"unknown ({storage.reason(err)})"

    def _fit_loop(self) -> dict[str, float]:
        with PreemptionGuard() as guard:  # SIGTERM / SIGINT: finish the step, checkpoint, exit 75
            last = self.start()  # resume and the first validation: a signal there stops before training
            if guard.stop_requested(self.global_step):
                self._stop_before_training(guard.reason)
            if self.spec.trainer.val_only:
                return last
            bar = tqdm(total=self.total_steps, initial=self.global_step, desc="rl steps", disable=not self.is_main)
            try:
                while self.global_step < self.total_steps:
                    try:
                        metrics = self.step()
                    except StopIteration:
                        log.info("training data exhausted after %d steps", self.global_step)
                        break
                    bar.set_postfix(reward=f"{metrics.get('critic/score/mean', float('nan')):.3f}")
                    bar.update(1)
                    last = metrics
                    if self.global_step < self.total_steps and guard.stop_requested(self.global_step):
                        bar.close()
                        self._stop_preempted(guard.reason)
            finally:
                bar.close()  # before any error's line: that line is the run's last
        self.finish()
        return last

    def start(self) -> dict[str, float]:
        """Resumes if asked, then validates before training when configured (`val_before_train`,
        `val_only`). `fit()` calls it; `step()` calls it once when you drive the loop by hand."""
        if self._started:
            return {}
        self._started = True
        self._watchdog.mark("resume")
        self._maybe_resume()
        t = self.spec.trainer
        if self.resume_point is None and self.spec.sft_warmup is not None and not t.val_only:
            self._sft_warmup()
        if (t.val_before_train or t.val_only) and self.val_loader is not None:
            self._watchdog.mark("the first validation")
            val = self.validate()
            self.tracker.log(val, self.global_step)
            self.history.append({"training/global_step": float(self.global_step), **val})
            return val
        return {}

    @on_own_mesh
    def _sft_warmup(self) -> None:
        """Trinity's SFT warm-up: `sft.warmup_steps` SFT steps on the policy before the first RL step
        (sft/warmup.py); its summary is logged at step 0."""
        from jaxrl_llm.sft.warmup import run_sft_warmup

        assert self.spec.sft_warmup is not None
        metrics = run_sft_warmup(self.actor, self.spec, self.spec.sft_warmup, self.tokenizer, self.rows_sharding,
                                 jax.random.fold_in(self.base_rng, 20_000_000), is_main=self.is_main)
        self.tracker.log(metrics, 0)
        self.history.append({"training/global_step": 0.0, **metrics})

    def step(self) -> dict[str, float]:
        """One RL step on the next training batch, then validation, logging and checkpointing as
        configured for that step. Returns the step's metrics (also appended to `history`). Raises
        StopIteration when the training data is exhausted."""
        self.start()
        self.store.check()  # an earlier async save that failed stops the run now, not at the next save
        t = self.spec.trainer
        metrics = self.train_step()  # its batch and rollout come from the synchronizer's schedule
        self.global_step += 1
        is_last = self.global_step >= self.total_steps
        if t.test_freq > 0 and self.val_loader is not None and (self.global_step % t.test_freq == 0 or is_last):
            self._mark("validation")
            metrics.update(self.validate())
        self._mark("logging")
        self.tracker.log(metrics, self.global_step)
        self.history.append(metrics)
        if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or is_last):
            self._mark("save")
            self.save_checkpoint()
        return metrics

    def _mark(self, phase: str) -> None:
        """This process's main thread enters `phase` of the step under way (the watchdog compares processes'
        places to find a hung one; bookkeeping/watchdog.py)."""
        step = self.global_step + 1
        self._watchdog.mark(f"step {step}" if phase == "step" else f"{phase} of step {step}")

    def finish(self) -> None:
        """End of a run: HF export (when `trainer.export_hf`), closes the loggers and stores, plots."""
        if self.spec.trainer.export_hf:
            self.export_hf(storage.join(self.run_dir, "hf"))
        self.close()
        if self.is_main:  # <run_dir>/plot.png, from metrics.jsonl (the run's record)
            from jaxrl_llm.bookkeeping.plot import plot_finished_run

            plot_finished_run(self.run_dir, self.history, from_file=True)

    @on_own_mesh  # every program of the step is traced on the training mesh (expert parallelism reads it)
    def train_step(self, batch: dict[str, np.ndarray] | None = None) -> dict[str, float]:
        """One RL step on `batch`, sampled now on the actor's params; batch None: the next batch and
        its rollout from the run's rollout source (rollout/sources.py; `timing_s/gen` is then the
        time this step waited for it)."""
        spec, plan, timer = self.spec, self.spec.plan, Timer(on_enter=self._mark)
        rng = jax.random.fold_in(self.base_rng, self.global_step)
        with timer("step"):
            with timer("gen"):
                if batch is None:
                    batch, rollout, gen_metrics = self.rollout_source.take(self.global_step)
                else:
                    rollout, gen_metrics = self.rollout_source.sample(batch, rng)
            seq = {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask}
            mask, mask_metrics = rollout.response_mask, {}
            if spec.advantage.masks_samples:  # ROLL's sample-level masks: the left-out rows leave loss and advantages
                keep, mask_metrics = sample_mask(
                    rollout.scores, rollout.response_lengths, rollout.group_ids,
                    max_response_length=plan.response_length, max_len_mask=spec.advantage.max_len_mask,
                    difficulty=spec.advantage.difficulty_mask)
                mask = mask * to_device(keep[:, None], self.mesh)
            # the step's rows as the host knows them (lengths, prompt groups): every pass plans its
            # micro-batches and packed layouts from these, no device array is read (jaxrl_llm/batching)
            rows = self.batching.rows_of(rollout)

            ref_lp = None
            if self.reference is not None:
                with timer("ref") as span:
                    ref_lp = span.wait(self.log_probs(self.reference.device_params(), rollout, plan.ref_log_prob,
                                                       rows, model=self.reference.model,
                                                       model_cfg=self.reference.model_cfg))
            with timer("old_log_prob") as span:
                old_lp = rollout.rollout_log_probs
                if spec.recompute_old_log_probs:
                    old_lp = span.wait(self.log_probs(self.actor.model_params, rollout, plan.old_log_prob, rows))
                    if not spec.rollout_correction.enabled:  # (with it, rollout_corr/* come with the correction)
                        mask_metrics.update(self._mismatch_metrics(old_lp, rollout))
            distill, distill_metrics, teacher_rollout = None, {}, None
            if self.teacher is not None:  # the teacher scores the student's tokens (roles/teacher.py)
                with timer("teacher") as span:
                    teacher_rollout = self.teacher.rollout_for(rollout, self.mesh)  # its own prompts, if any
                    distill, distill_metrics = self.teacher.signal(
                        teacher_rollout, old_lp, batching=self.batching, micro=plan.ref_log_prob,
                        temperature=spec.actor.temperature, logprob_impl=spec.actor.logprob_impl, mesh=self.mesh)
                    span.wait(distill_metrics)
            values = None
            if self.critic is not None:
                assert plan.values is not None  # planned whenever there is a critic
                with timer("values") as span:
                    how = self.batching.no_grad(plan.values, self.critic.model, rows)
                    values = span.wait(run_no_grad_pass(
                        values_no_grad, self.critic.params, rollout.input_ids, rollout.attention_mask, mask, how,
                        images=rollout.images, model_cfg=self.critic.model_cfg,
                        compute_dtype=self.critic.settings.compute_dtype))
            with timer("adv") as span:
                baselines = (self._remax_baselines(batch, rng) if ADV_ESTIMATORS.capability(
                    spec.advantage.adv_estimator, "needs_reward_baselines") else None)
                kl_coef = self.kl_ctrl.value
                exp, token_rewards, exp_metrics = make_experience(
                    **seq, response_mask=mask, token_level_scores=rollout.token_level_scores,
                    rollout_log_probs=rollout.rollout_log_probs, group_ids=to_device(rollout.group_ids, self.mesh),
                    old_log_probs=old_lp, ref_log_probs=ref_lp, values=values, reward_baselines=baselines,
                    kl_coef=kl_coef, advantage=spec.advantage, correction=self._experience_correction,
                    routing=rollout.routing, distill=distill, images=rollout.images)
                span.wait(exp)
                extra = self._experience_metrics(jax.device_get(exp_metrics), kl_coef, rows.num_rows)
                extra.update(mask_metrics)
                extra.update({k: float(v) for k, v in jax.device_get(distill_metrics).items()})
            if spec.advantage.mask_truncated:  # TRL: the advantages keep every row, the loss only the finished
                exp, extra["actor/truncated_frac"] = self._mask_truncated(exp, rollout)
            if POLICY_LOSSES.capability(spec.actor.loss_mode, "needs_scores"):  # TOPR splits the rows by score
                exp = dataclasses.replace(exp, sequence_scores=to_device(np.asarray(rollout.scores, np.float32),
                                                                         self.mesh))
            # pf-PPO: both updates train on the rows resampled by score (the metrics describe the batch as sampled)
            train_exp, train_rows = exp, rows
            if spec.advantage.pf_ppo is not None:
                train_exp, train_rows, extra["actor/pf_ppo_distinct_rows"] = pf_ppo_resample(
                    exp, rows, rollout.scores, spec.advantage.pf_ppo, seed=(spec.trainer.seed, self.global_step))
            if self.critic is not None:
                with timer("update_critic"):
                    extra.update(self._update(self.critic, train_exp, jax.random.fold_in(rng, 7), train_rows)[0])
            if self.global_step >= self.actor.lr_offset:  # the actor starts after trainer.critic_warmup steps
                with timer("update_actor"):
                    actor_metrics, tokens = self._update(self.actor, train_exp, jax.random.fold_in(rng, 11),
                                                         train_rows)
                    extra.update(actor_metrics)
                if spec.actor.rollout_is_in_loss:  # the loss took the IS weights; the diagnostics from its log-probs
                    extra.update(self._correction_metrics(tokens[OLD_LOG_PROBS], rollout))
                elif OLD_LOG_PROBS in tokens:  # old log-probs from the update: its forward was the recomputation
                    extra.update(self._mismatch_metrics(tokens[OLD_LOG_PROBS], rollout))
        metrics = data_metrics(
            sequence_scores=rollout.scores, sequence_rewards=np.asarray(to_host(token_rewards.sum(-1))),
            response_lengths=rollout.response_lengths, prompt_lengths=rollout.prompt_lengths,
            max_response_length=plan.response_length, max_prompt_length=plan.max_prompt_length,
            advantages=exp.advantages, returns=exp.returns, response_mask=mask, values=values)
        metrics.update(extra)
        metrics.update(gen_metrics)
        metrics.update(rollout.reward_metrics)
        metrics.update(timer.metrics())
        if self._peak_flops is None:
            self._peak_flops, _ = device_peak_flops(self.mesh.devices.flat[0], spec.actor.compute_dtype)
        metrics.update(step_perf_metrics(spec, rollout, timer.times, actor=self.actor, teacher=self.teacher,
                                         teacher_rollout=teacher_rollout, judge=self.judge,
                                         peak_flops=self._peak_flops))
        metrics["training/global_step"] = float(self.global_step + 1)
        # skipped non-finite updates: counted, and K in a row stop the run (bookkeeping/nonfinite.py)
        self.nonfinite.check(self.global_step + 1, metrics, lambda: first_nonfinite(rollout, exp))
        if spec.trainer.rollout_data_dir and self.is_main:
            dump_jsonl(storage.join(spec.trainer.rollout_data_dir, f"{self.global_step}.jsonl"),
                       rollout_dump_rows(rollout, self.global_step))
        return metrics

    # ------------------------------------------------------------------ pieces of a step
    @on_own_mesh
    def log_probs(self, params: dict, rollout: Rollout, micro: MicroBatching | None = None,
                  rows: StepRows | None = None, *, model: ModelSpec | None = None,
                  model_cfg: ModelConfig | None = None) -> jax.Array:
        """Response log-probs [N, R] of `rollout` under `params` of the model `model` / `model_cfg`
        (default: the policy's; the reference passes its own), as a step computes them: in `micro`'s
        micro-batches (default: the old-log-prob pass's), packed as the model spec says."""
        micro = self.spec.plan.old_log_prob if micro is None else micro
        rows = self.batching.rows_of(rollout) if rows is None else rows
        how = self.batching.no_grad(micro, self.spec.model if model is None else model, rows)
        # the policy's own passes replay the sampler's routing; the reference routes by itself
        replay = rollout.routing if model_cfg is None else None
        return run_no_grad_pass(log_probs_no_grad, params, rollout.input_ids, rollout.attention_mask,
                                rollout.response_mask, how, replay, images=rollout.images,
                                model_cfg=self.actor.model_cfg if model_cfg is None else model_cfg,
                                temperature=self.spec.actor.temperature, compute_dtype=self.spec.actor.compute_dtype,
                                logprob_impl=self.spec.actor.logprob_impl, mesh=self.mesh)

    def _mask_truncated(self, exp: Experience, rollout: Rollout) -> tuple[Experience, float]:
        """`exp` with the responses that did not end with EOS out of the loss (TRL's
        mask_truncated_completions); the fraction of them."""
        prompt_cols = int(rollout.input_ids.shape[1]) - int(rollout.response_mask.shape[1])
        lengths = np.asarray(rollout.response_lengths)
        # each row's last response token, gathered on the devices (not the whole [N, P + R] to the host)
        last = np.asarray(to_host(_tokens_at(rollout.input_ids, (prompt_cols + np.maximum(lengths - 1, 0)).astype(
            np.int32))))
        truncated = truncated_rows(last, lengths, self.generator.eos_ids)
        keep = to_device((~truncated).astype(np.float32)[:, None], self.mesh)
        return dataclasses.replace(exp, response_mask=exp.response_mask * keep), float(truncated.mean())

    def _experience_metrics(self, exp_metrics: dict[str, Any], kl_coef: float, rows: int) -> dict[str, float]:
        """Host metrics of `make_experience`; steps the KL controller on the in-reward KL."""
        out: dict[str, float] = {}
        if "current_kl" in exp_metrics:
            current_kl = float(exp_metrics.pop("current_kl"))
            self.kl_ctrl.update(current_kl, n_steps=rows)
            out.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": kl_coef})
        out.update({k: float(v) for k, v in exp_metrics.items()})  # rollout correction, trl_rloo's rewards
        return out

    def _remax_baselines(self, batch: dict[str, np.ndarray], rng: jax.Array) -> jax.Array:
        """ReMax: the greedy response's score per prompt, one per sampled row."""
        train = self.spec.train_sampling
        greedy = SamplingParams(max_new_tokens=train.max_new_tokens, do_sample=False, n=1,
                                ignore_eos=train.ignore_eos, stop_token_ids=train.stop_token_ids)
        r = self.generator.generate(batch, self.actor.model_params, greedy, rng)
        return to_device(np.repeat(r.scores, train.n), self.mesh)

    @property
    def _experience_correction(self) -> RolloutCorrectionSpec:
        """The rollout correction `make_experience` applies: none where the actor's loss takes it."""
        rc = self.spec.rollout_correction
        return dataclasses.replace(rc, rollout_is=None) if self.spec.actor.rollout_is_in_loss else rc

    def _mismatch_metrics(self, trainer_log_probs: jax.Array, rollout: Rollout) -> dict[str, float]:
        """rollout_corr/max_abs_log_ratio and exact_token_frac of the trainer's log-probs of the rollout's
        tokens ([N, R'] with R' >= R) against the sampler's, on every step that recomputes them."""
        r = rollout.response_mask.shape[1]
        metrics = rollout_mismatch(trainer_log_probs[:, :r], rollout.rollout_log_probs, rollout.response_mask)
        return {f"rollout_corr/{k}": float(v) for k, v in jax.device_get(metrics).items()}

    def _correction_metrics(self, update_log_probs: jax.Array, rollout: Rollout) -> dict[str, float]:
        """rollout_corr/* of the step from the update's own log-probs ([N, R'] with R' >= R: the token
        budget pads the columns), as a separate pass's would give (RunSpec.rollout_is_in_update, which
        `resolve` turns into the actor's `rollout_is_in_loss`)."""
        r = rollout.response_mask.shape[1]
        _, _, metrics = rollout_correction(update_log_probs[:, :r], rollout.rollout_log_probs,
                                           rollout.response_mask, s=self.spec.rollout_correction)
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def _update(self, role: TrainedRole, exp: Experience, rng: jax.Array, rows: StepRows
                ) -> tuple[dict[str, float], dict[str, jax.Array]]:
        """The role's update over the step: its split (and packed layouts, with the shuffle drawn on the
        host) from its own batch plan and model spec; its LR step counts from its `lr_offset`.
        Returns its metrics and its per-token outputs (update.py TOKEN_OUTPUT, on device)."""
        split = self.batching.update(role.batch, role.model, rows, rng, epochs=role.settings.ppo_epochs,
                                     shuffle=role.settings.shuffle)
        if split.pads != NO_PADS:  # token budget: the config's longest shapes, the same program at every step
            exp = pad_experience(exp, *split.pads)
        metrics = role.update(exp, rng, lr_step=self.global_step - role.lr_offset, num_mini_batches=split.num_mini,
                              num_micro_batches=split.num_micro, rows_sharding=self.rows_sharding,
                              packing=split.layout)
        tokens = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith(TOKEN_OUTPUT)]}
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if split.layout is not None and role.name == "actor":  # perf/packing/* describe the policy's update
            out.update(update_metrics(split.layout.layout))
        return out, tokens

    # ------------------------------------------------------------------ validation, checkpoints, export
    def validate(self) -> dict[str, float]:
        """One validation pass; logs its generations table and dump as configured; returns the metrics."""
        if self.val_loader is None:
            raise ValueError("validate: the run has no validation data (data.val_files)")
        self.val_loader.reset()
        rng = jax.random.fold_in(self.base_rng, 10_000_000 + self.global_step)
        metrics, samples = run_validation(self.generator, self.val_loader, self.actor.model_params,
                                          self.spec.val_sampling, rng)
        t = self.spec.trainer
        if t.log_val_generations > 0:
            self.tracker.log_generations("val/generations", samples[: t.log_val_generations], self.global_step)
        if t.validation_data_dir and self.is_main:
            dump_jsonl(storage.join(t.validation_data_dir, f"{self.global_step}.jsonl"), samples)
        return metrics

    def state(self) -> dict[str, Any]:
        """The trained state a checkpoint holds: each trained role's params and optimizer state."""
        return trained_state(self)

    def save_checkpoint(self) -> None:
        assert_finite_state(self.state(), self.global_step)  # a NaN checkpoint must never replace a good one
        meta = checkpoint_meta(self, self.global_step)
        self.tracker.flush()  # the record is durable up to the step the checkpoint holds
        # the loader as of the first untrained batch: a resume generates in-flight rollouts again, on
        # the weights they were launched with (saved by version)
        record, rollout_weights = self.rollout_source.checkpoint_weights(self.global_step)
        self.store.save(self.global_step, self.state(), self.rollout_source.loader_state(self.global_step),
                        {**meta, **record}, rollout=rollout_weights)

    def _stop_preempted(self, reason: str) -> None:
        """Checkpoints this step (unless `save_freq` just did), waits until the save is committed,
        closes the run and raises `Preempted` (exit code 75); see bookkeeping/preemption.py."""
        if self.global_step not in self.store.all_steps():
            self.save_checkpoint()
        self.store.wait()
        self.close()
        message = f"preempted at step {self.global_step}; checkpoint saved"
        log.warning("%s (%s)", message, reason)
        print(message, flush=True)
        raise Preempted(self.global_step, reason)

    def _stop_before_training(self, reason: str) -> None:
        """A signal during the resume or the first validation: nothing was trained, so nothing is saved (the
        latest checkpoint is this launch's starting point); closes the run and raises `Preempted` (exit 75)."""
        self.close()
        stopped = Preempted(self.global_step, reason, saved=False)
        log.warning("%s", stopped)
        print(stopped, flush=True)
        raise stopped

    def _maybe_resume(self) -> None:
        point, t = self.resume_point, self.spec.trainer
        if point is None:
            if not t.val_only:
                self.tracker.rewind(None)  # a fresh start: records of an earlier, never-saved attempt go
            return
        step, self.global_step = restore_trained(self, point)  # trainer/checkpointing.py
        if not t.val_only:
            self.tracker.rewind(self.global_step)  # the steps after the checkpoint are computed again
        log.info("resumed from %s at step %d", point.directory, step)
        if self.is_main:
            print(f"resumed from {point.directory} step {step}", flush=True)

    def export_hf(self, out_dir: str) -> str:
        """The policy as an HF folder at `out_dir` (roles/export.py; every process calls it)."""
        return export_policy(self.actor, self.spec.model, self.tokenizer, out_dir, is_main=self.is_main,
                             vision=self.generator.vision)

    def close(self, *, quiet: bool = False) -> None:
        """Waits for async saves, then closes the store, the sinks and the reward workers; each is
        closed even when another fails. Idempotent. quiet: log failures instead of raising."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        source = getattr(self, "rollout_source", None)
        closers = (source.close,) if source is not None else ()
        close_all(closers + (self.store.close, self.tracker.close, self.reward_manager.close), quiet=quiet)


@jax.jit
def _tokens_at(ids: jax.Array, cols: jax.Array) -> jax.Array:
    """`ids[i, cols[i]]` for each row i."""
    return jnp.take_along_axis(ids, cols[:, None], axis=1)[:, 0]
