"""`Trainer(config).fit()`: the RL loop that `launch/train.py` runs. Read `train_step` top to bottom:

    rollout (sample n responses per prompt on the policy's own params, score them)
      -> reference log-probs (only when a KL is used)
      -> old log-probs (the sampler's own when they are exact, else recomputed)
      -> critic values -> KL in reward -> advantages -> rollout correction
      -> critic update -> actor update (ppo_epochs x mini-batches x micro-batches, one jit each)
      -> metrics
"""
from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxrl_llm.config import format_batch_summary, resolve_total_steps, synthetic_data_files, validate_config
from jaxrl_llm.losses.kl import make_kl_controller
from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sharding import BATCH_AXES, batch_axis_size, initialize, make_mesh
from jaxrl_llm.trainer import checkpoint as ckpt
from jaxrl_llm.trainer.actor import ActorSettings, update_actor
from jaxrl_llm.trainer.critic import CriticSettings, update_critic
from jaxrl_llm.trainer.experience import (AdvantageSettings, advantages_and_returns, log_probs_no_grad,
                                          rollout_correction, values_no_grad)
from jaxrl_llm.trainer.metrics import Timer, data_metrics, measured_matmul_peak_flops, perf_metrics, step_flops
from jaxrl_llm.trainer.roles import copy_params, load_model, make_trained_role
from jaxrl_llm.trainer.rollout import (Rollout, concat_rollouts, generate_and_score, select_rows, to_device,
                                       to_host)
from jaxrl_llm.trainer.tracking import Tracking, dump_jsonl
from jaxrl_llm.trainer.validation import run_validation

log = logging.getLogger("jaxrl_llm")


class Trainer:
    """Builds everything a run needs from a config (validated first), then `fit()`s."""

    def __init__(self, config: ml_collections.ConfigDict):
        initialize()  # jax.distributed when several processes are configured; a no-op otherwise
        self.mesh = make_mesh(config.mesh)
        self.dp_size = batch_axis_size(self.mesh)
        cfg = validate_config(config, dp_size=self.dp_size)
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.trainer.default_local_dir)
        self.is_main = jax.process_index() == 0
        self._write_synthetic_data()

        from jaxrl_llm.data import build_dataset, make_dataloader
        from jaxrl_llm.hf import load_tokenizer
        from jaxrl_llm.rewards import build_reward_manager

        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        # Every process reads the whole global batch (prompts are small): host-side rewards and
        # metrics are then identical everywhere; device arrays take each process's own rows.
        proc = dict(process_index=0, process_count=1)
        train_set = build_dataset(cfg.data, self.tokenizer, "train")
        if cfg.trainer.total_training_steps is None or cfg.actor_rollout_ref.actor.optim.total_training_steps <= 0:
            resolve_total_steps(cfg, len(train_set))
        self.total_steps = int(cfg.trainer.total_training_steps)
        self.train_loader = make_dataloader(cfg.data, self.tokenizer, "train", dataset=train_set, **proc)
        self.val_loader = (make_dataloader(cfg.data, self.tokenizer, "val", **proc)
                           if cfg.data.val_files else None)

        arr = cfg.actor_rollout_ref
        model_cfg, params = load_model(arr.model, head="lm", mesh=self.mesh, tokenizer=self.tokenizer,
                                       seed=cfg.trainer.seed)
        longest = cfg.data.max_prompt_length + arr.rollout.response_length
        if longest > model_cfg.max_position_embeddings:
            raise ValueError(f"data.max_prompt_length + rollout.response_length = {longest} exceeds the model's "
                             f"max_position_embeddings={model_cfg.max_position_embeddings}")
        self.actor = make_trained_role(model_cfg, params, arr.actor.optim, total_steps=self.total_steps,
                                       grad_clip=arr.actor.grad_clip, head="lm")
        self.actor_settings = ActorSettings.from_config(cfg)
        self.adv_settings = AdvantageSettings.from_config(cfg)
        alg = cfg.algorithm
        self.need_ref = bool(arr.actor.use_kl_loss or alg.use_kl_in_reward or alg.trl_rloo.enable)
        self.ref_params = copy_params(params) if self.need_ref else None
        self.critic = None
        if cfg.critic.enable:
            critic_cfg, critic_params = load_model(cfg.critic.model, head="value", mesh=self.mesh,
                                                   tokenizer=self.tokenizer, seed=cfg.trainer.seed + 1,
                                                   tiny_section=arr.model.tiny)
            self.critic = make_trained_role(critic_cfg, critic_params, cfg.critic.optim,
                                            total_steps=self.total_steps, grad_clip=cfg.critic.grad_clip,
                                            head="value")
            self.critic_settings = CriticSettings.from_config(cfg)
        self.reward_manager = build_reward_manager(cfg)
        self.reward_model = None
        if cfg.reward_model.enable:
            from jaxrl_llm.rewards.reward_model import RewardModel

            self.reward_model = RewardModel.from_config(cfg, self.tokenizer)
        self.kl_ctrl = make_kl_controller(alg.kl_ctrl)
        self.train_sampling = SamplingParams.from_rollout_config(arr.rollout)
        self.val_sampling = SamplingParams.from_val_kwargs(arr.rollout)
        self.rows_sharding = NamedSharding(self.mesh, PartitionSpec(BATCH_AXES))
        self.base_rng = jax.random.PRNGKey(cfg.trainer.seed)
        self.global_step = 0
        self.store = ckpt.CheckpointStore(os.path.join(self.run_dir, "checkpoints"),
                                          max_to_keep=cfg.trainer.max_actor_ckpt_to_keep)
        self.tracker = Tracking(cfg.trainer.logger, self.run_dir, project_name=cfg.trainer.project_name,
                                experiment_name=cfg.trainer.experiment_name, config=cfg.to_dict(),
                                is_main_process=self.is_main)
        self._peak_flops: float | None = None
        self._update_fns: dict[tuple, Any] = {}
        self._started = False
        self.history: list[dict[str, float]] = []  # every logged step's metrics, for notebooks and plots
        if self.is_main:
            print(self.summary(), flush=True)

    # ------------------------------------------------------------------ set-up helpers
    def _write_synthetic_data(self) -> None:
        syn = self.cfg.data.synthetic
        if syn.task is None:
            return
        from jaxrl_llm.data.synthetic import write_synthetic_files

        train, val = synthetic_data_files(self.cfg)
        if self.is_main and not (os.path.exists(train) and os.path.exists(val)):
            write_synthetic_files(train, val, syn.task, syn.n_train, syn.n_val, difficulty=syn.difficulty,
                                  answer_format=syn.answer_format, seed=syn.seed)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("synthetic data written")

    def summary(self) -> str:
        m = self.actor.model_cfg
        mesh = dict(self.mesh.shape)
        lines = [
            f"model: {m.architecture} ({self.cfg.actor_rollout_ref.model.path}), "
            f"{self.actor.num_params / 1e6:.1f}M parameters, {m.num_hidden_layers} layers, hidden {m.hidden_size}",
            f"mesh: {mesh} over {jax.device_count()} {jax.devices()[0].platform} device(s), "
            f"{jax.process_count()} process(es)",
            format_batch_summary(self.cfg, self.dp_size),
            f"estimator: {self.cfg.algorithm.adv_estimator}; policy loss: "
            f"{self.actor_settings.loss_mode} ({self.actor_settings.loss_agg_mode}); "
            f"critic: {'on' if self.critic else 'off'}; reference: {'on' if self.need_ref else 'off'}",
            f"run dir: {self.run_dir}; {self.total_steps} steps",
        ]
        return "\n".join(lines)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Trains for `trainer.total_training_steps`; returns the last step's metrics."""
        last = self.start()
        if self.cfg.trainer.val_only:
            self.close()
            return last
        bar = tqdm(total=self.total_steps, initial=self.global_step, desc="rl steps", disable=not self.is_main)
        while self.global_step < self.total_steps:
            try:
                metrics = self.step()
            except StopIteration:
                log.info("training data exhausted after %d steps", self.global_step)
                break
            bar.set_postfix(reward=f"{metrics.get('critic/score/mean', float('nan')):.3f}")
            bar.update(1)
            last = metrics
        bar.close()
        self.finish()
        return last

    def start(self) -> dict[str, float]:
        """Resumes if asked, then validates before training when configured (`val_before_train`,
        `val_only`). `fit()` calls it; call it yourself before driving `step()` by hand."""
        if self._started:
            return {}
        self._started = True
        self._maybe_resume()
        t = self.cfg.trainer
        if (t.val_before_train or t.val_only) and self.val_loader is not None:
            val = self.validate()
            self.tracker.log(val, self.global_step)
            self.history.append({"training/global_step": float(self.global_step), **val})
            return val
        return {}

    def step(self) -> dict[str, float]:
        """One RL step on the next training batch, then validation, logging and checkpointing as
        configured for that step. Returns the step's metrics (also appended to `history`). Raises
        StopIteration when the training data is exhausted."""
        self.start()
        t = self.cfg.trainer
        batch = next(self.train_loader)
        metrics = self.train_step(batch)
        self.global_step += 1
        is_last = self.global_step >= self.total_steps
        if t.test_freq > 0 and self.val_loader is not None and (self.global_step % t.test_freq == 0 or is_last):
            metrics.update(self.validate())
        self.tracker.log(metrics, self.global_step)
        self.history.append(metrics)
        if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or is_last):
            self.save_checkpoint()
        return metrics

    def finish(self) -> None:
        """End of a run: HF export (when `trainer.export_hf`), closes the loggers and stores, plots."""
        if self.cfg.trainer.export_hf:
            self.export_hf(os.path.join(self.run_dir, "hf"))
        self.close()
        if self.is_main:  # <run_dir>/plot.png, from metrics.jsonl (jsonl logger) or else from history
            from jaxrl_llm.trainer.plot import plot_finished_run

            plot_finished_run(self.run_dir, self.history, from_file="jsonl" in self.tracker.sinks)

    def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        cfg, timer = self.cfg, Timer()
        rng = jax.random.fold_in(self.base_rng, self.global_step)
        arr, s = cfg.actor_rollout_ref, self.actor_settings
        with timer("step"):
            with timer("gen"):
                rollout, gen_metrics = self._rollout(batch, rng)
            seq = {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask}
            mask = rollout.response_mask
            rows, seq_len = rollout.num_rows, int(rollout.input_ids.shape[1])

            ref_lp = None
            if self.need_ref:
                with timer("ref"):
                    micro = self._forward_micro_rows(arr.ref, rows, seq_len, prefix="log_prob",
                                                     what="ref.log_prob_micro_batch_size_per_device")
                    ref_lp = log_probs_no_grad(self.ref_params, **seq, response_mask=mask,
                                               model_cfg=self.actor.model_cfg, temperature=s.temperature,
                                               compute_dtype=s.compute_dtype, micro_rows=micro)
            with timer("old_log_prob"):
                old_lp = rollout.rollout_log_probs
                if self._recompute_old_log_probs():
                    micro = self._forward_micro_rows(arr.rollout, rows, seq_len, prefix="log_prob",
                                                     what="rollout.log_prob_micro_batch_size_per_device")
                    old_lp = log_probs_no_grad(self.actor.params, **seq, response_mask=mask,
                                               model_cfg=self.actor.model_cfg, temperature=s.temperature,
                                               compute_dtype=s.compute_dtype, micro_rows=micro)
            values = None
            if self.critic is not None:
                with timer("values"):
                    micro = self._forward_micro_rows(cfg.critic, rows, seq_len, prefix="forward",
                                                     what="critic.forward_micro_batch_size_per_device")
                    values = values_no_grad(self.critic.params, **seq, response_mask=mask,
                                            model_cfg=self.critic.model_cfg,
                                            compute_dtype=self.critic_settings.compute_dtype, micro_rows=micro)
            with timer("adv"):
                group_ids = to_device(rollout.group_ids, self.mesh)
                baselines = self._remax_baselines(batch, rng) if cfg.algorithm.adv_estimator == "remax" else None
                kl_coef = self.kl_ctrl.value
                exp = advantages_and_returns(rollout.token_level_scores, mask, group_ids, old_lp, ref_lp, values,
                                             baselines, jnp.float32(kl_coef), s=self.adv_settings)
                extra: dict[str, float] = {}
                if "current_kl" in exp:
                    current_kl = float(exp["current_kl"])
                    self.kl_ctrl.update(current_kl, n_steps=rollout.num_rows)
                    extra.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": kl_coef})
                for k in ("trl_rlhf_reward", "trl_non_score_reward"):
                    if k in exp:
                        extra[f"critic/{k[4:]}/mean"] = float(exp[k])
                update_batch = {**seq, "response_mask": mask, "old_log_probs": old_lp,
                                "advantages": exp["advantages"], "returns": exp["returns"]}
                if ref_lp is not None:
                    update_batch["ref_log_probs"] = ref_lp
                if values is not None:
                    update_batch["values"] = values
                extra.update(self._apply_rollout_correction(update_batch, rollout))
            if self.critic is not None:
                with timer("update_critic"):
                    extra.update(self._update(self.critic, update_critic, update_batch, rng, critic=True))
            if self.global_step >= cfg.trainer.critic_warmup:
                with timer("update_actor"):
                    extra.update(self._update(self.actor, update_actor, update_batch, rng, critic=False))
                extra["actor/lr"] = float(self.actor.schedule(self.global_step))
        metrics = data_metrics(
            sequence_scores=rollout.scores, sequence_rewards=np.asarray(to_host(exp["token_level_rewards"].sum(-1))),
            response_lengths=rollout.response_lengths, prompt_lengths=rollout.prompt_lengths,
            max_response_length=arr.rollout.response_length, max_prompt_length=cfg.data.max_prompt_length,
            advantages=exp["advantages"], returns=exp["returns"], response_mask=mask, values=values)
        metrics.update(extra)
        metrics.update(gen_metrics)
        metrics.update(rollout.reward_metrics)
        metrics.update(timer.metrics())
        metrics.update(self._perf(rollout, timer.times))
        metrics["training/global_step"] = float(self.global_step + 1)
        if cfg.trainer.rollout_data_dir and self.is_main:
            self._dump_rollout(rollout)
        return metrics

    # ------------------------------------------------------------------ pieces of a step
    def _rollout(self, batch: dict[str, np.ndarray], rng: jax.Array) -> tuple[Rollout, dict[str, float]]:
        """Samples and scores; with DAPO's `filter_groups`, keeps only groups whose metric varies and
        samples further batches until `train_batch_size` groups are kept."""
        fg = self.cfg.algorithm.filter_groups
        kw = dict(params=self.actor.params, model_cfg=self.actor.model_cfg, sampling=self.train_sampling,
                  mesh=self.mesh, tokenizer=self.tokenizer, reward_manager=self.reward_manager,
                  reward_model=self.reward_model, compute_dtype=self.actor_settings.compute_dtype)
        if not fg.enable:
            return generate_and_score(batch, rng=rng, **kw), {}
        want = self.cfg.data.train_batch_size
        kept: list[Rollout] = []
        num_kept, num_gen = 0, 0
        while num_kept < want:
            if fg.max_num_gen_batches > 0 and num_gen >= fg.max_num_gen_batches:
                raise RuntimeError(
                    f"algorithm.filter_groups: only {num_kept} of {want} prompt groups had varying "
                    f"'{fg.metric}' after {num_gen} generation batches (max_num_gen_batches); "
                    "the task may be too easy or too hard for the policy")
            if num_gen > 0:
                batch = next(self.train_loader)
            r = generate_and_score(batch, rng=jax.random.fold_in(rng, num_gen), **kw)
            num_gen += 1
            metric = r.scores if fg.metric in ("seq_reward", "seq_final_reward", "score") else \
                np.asarray(r.reward_extra_info[fg.metric], np.float64)
            groups = np.unique(r.group_ids)
            varied = [g for g in groups if np.std(metric[r.group_ids == g]) > 0]
            varied = varied[: want - num_kept]
            if varied:
                kept.append(select_rows(r, np.flatnonzero(np.isin(r.group_ids, varied))))
                num_kept += len(varied)
        return concat_rollouts(kept, self.mesh), {"train/num_gen_batches": float(num_gen)}

    def _recompute_old_log_probs(self) -> bool:
        """The sampler's log-probs are the trainer's (same code, same params) in fp32; recompute when
        they may differ (bf16 compute) or when rollout correction compares the two."""
        rc = self.cfg.algorithm.rollout_correction
        corrected = (rc.rollout_is is not None or rc.rollout_rs is not None) and not rc.bypass_mode
        return corrected or self.actor_settings.compute_dtype != "float32"

    def _apply_rollout_correction(self, update_batch: dict[str, Any], rollout: Rollout) -> dict[str, float]:
        rc = self.cfg.algorithm.rollout_correction
        if rc.rollout_is is None and rc.rollout_rs is None:
            return {}
        threshold = rc.rollout_rs_threshold
        if isinstance(threshold, (list, tuple)):
            threshold = tuple(threshold)
        weights, new_mask, metrics = rollout_correction(
            update_batch["old_log_probs"], rollout.rollout_log_probs, update_batch["response_mask"],
            rollout_is=rc.rollout_is, rollout_is_threshold=float(rc.rollout_is_threshold),
            rollout_is_batch_normalize=bool(rc.rollout_is_batch_normalize), rollout_rs=rc.rollout_rs,
            rollout_rs_threshold=threshold)
        if weights is not None:
            update_batch["rollout_is_weights"] = weights
        update_batch["response_mask"] = new_mask
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def _remax_baselines(self, batch: dict[str, np.ndarray], rng: jax.Array) -> jax.Array:
        """ReMax: the greedy response's score per prompt, one per sampled row."""
        greedy = SamplingParams(max_new_tokens=self.train_sampling.max_new_tokens, do_sample=False, n=1,
                                ignore_eos=self.train_sampling.ignore_eos,
                                stop_token_ids=self.train_sampling.stop_token_ids)
        r = generate_and_score(batch, params=self.actor.params, model_cfg=self.actor.model_cfg, sampling=greedy,
                               rng=rng, mesh=self.mesh, tokenizer=self.tokenizer,
                               reward_manager=self.reward_manager, reward_model=self.reward_model,
                               compute_dtype=self.actor_settings.compute_dtype)
        return to_device(np.repeat(r.scores, self.train_sampling.n), self.mesh)

    def _micro_size(self, rows: int, seq_len: int, *, fixed: int | None, dynamic: bool | None,
                    budget: int | None, what: str) -> int:
        """Sequences per device in one micro-batch of `rows` sequences: the configured size, or with a
        dynamic batch size the most that fit the per-device token budget at this step's length."""
        per_device = rows // self.dp_size
        if dynamic:
            budget_rows = max(1, int(budget) // seq_len)
            return max(d for d in range(1, per_device + 1) if per_device % d == 0 and d <= budget_rows)
        size = min(int(fixed or per_device), per_device)
        if per_device % size:
            raise ValueError(f"{what}={size} does not divide the {per_device} sequences per device")
        return size

    def _forward_micro_rows(self, section: Any, rows: int, seq_len: int, *, prefix: str, what: str) -> int:
        """Rows (all devices) per micro-batch of a no-grad pass configured by `section.<prefix>_*`."""
        return self.dp_size * self._micro_size(
            rows, seq_len, fixed=section[f"{prefix}_micro_batch_size_per_device"],
            dynamic=section[f"{prefix}_use_dynamic_bsz"] if f"{prefix}_use_dynamic_bsz" in section
            else section.use_dynamic_bsz,
            budget=section[f"{prefix}_max_token_len_per_device"], what=what)

    def _num_micro(self, mini_rows: int, seq_len: int, *, critic: bool) -> int:
        """Micro-batches per mini-batch: fixed per-device size, or packed to the token budget
        (`use_dynamic_bsz`, `ppo_max_token_len_per_device`) for this step's sequence length."""
        section = self.cfg.critic if critic else self.cfg.actor_rollout_ref.actor
        size = self._micro_size(mini_rows, seq_len, fixed=section.ppo_micro_batch_size_per_device,
                                dynamic=section.use_dynamic_bsz, budget=section.ppo_max_token_len_per_device,
                                what=f"{'critic' if critic else 'actor'}.ppo_micro_batch_size_per_device")
        return mini_rows // self.dp_size // size

    def _update(self, role, update_fn, update_batch: dict[str, Any], rng: jax.Array, *, critic: bool) -> dict[str, float]:
        section = self.cfg.critic if critic else self.cfg.actor_rollout_ref.actor
        rows = int(update_batch["response_mask"].shape[0])
        mini_rows = min(rows, int(section.ppo_mini_batch_size) * self.cfg.actor_rollout_ref.rollout.n)
        if rows % mini_rows:
            raise ValueError(f"{rows} sequences do not split into mini-batches of {mini_rows}")
        num_micro = self._num_micro(mini_rows, int(update_batch["input_ids"].shape[1]), critic=critic)
        batch = {k: v for k, v in update_batch.items() if k != "ref_log_probs" or not critic}
        key = (critic, rows // mini_rows, num_micro)
        if key not in self._update_fns:
            # Outputs keep the params' / optimizer state's own shardings, so the next rollout and
            # update see the same layouts and reuse their compiled programs.
            self._update_fns[key] = jax.jit(
                functools.partial(update_fn, model_cfg=role.model_cfg,
                                  s=self.critic_settings if critic else self.actor_settings, tx=role.tx,
                                  num_mini_batches=rows // mini_rows, num_micro_batches=num_micro,
                                  rows_sharding=self.rows_sharding),
                out_shardings=(role.param_shardings, role.opt_state_shardings, None), donate_argnums=(0, 1))
        role.params, role.opt_state, metrics = self._update_fns[key](
            role.params, role.opt_state, batch, jax.random.fold_in(rng, 7 if critic else 11))
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def _perf(self, rollout: Rollout, times: dict[str, float]) -> dict[str, float]:
        if self._peak_flops is None:
            self._peak_flops = measured_matmul_peak_flops()
        m = self.actor.model_cfg
        prompt_tokens = int(rollout.prompt_lengths.sum())
        response_tokens = int(rollout.response_lengths.sum())
        passes = int(self.need_ref) + int(self._recompute_old_log_probs()) + int(self.critic is not None)
        train_passes = self.actor_settings.ppo_epochs + (self.critic_settings.ppo_epochs if self.critic else 0)
        flops = step_flops(num_params=self.actor.num_params, num_layers=m.num_hidden_layers,
                           hidden_size=m.hidden_size, prompt_tokens=prompt_tokens, response_tokens=response_tokens,
                           forward_passes=passes, training_passes=train_passes)
        return perf_metrics(times, total_tokens=prompt_tokens + response_tokens, flops=flops,
                            num_devices=jax.device_count(), peak_flops=self._peak_flops)

    def _dump_rollout(self, rollout: Rollout) -> None:
        rows = [{"step": self.global_step, "input": p, "output": o, "score": float(s),
                 "data_source": str(ds), "ground_truth": str(gt)}
                for p, o, s, ds, gt in zip(rollout.prompt_texts, rollout.texts, rollout.scores,
                                           rollout.meta["data_source"], rollout.meta["ground_truth"])]
        dump_jsonl(os.path.join(self.cfg.trainer.rollout_data_dir, f"{self.global_step}.jsonl"), rows)

    # ------------------------------------------------------------------ validation, checkpoints, export
    def validate(self) -> dict[str, float]:
        return run_validation(self)

    def _state(self) -> dict[str, Any]:
        state = {"actor": {"params": self.actor.params, "opt_state": self.actor.opt_state}}
        if self.critic is not None:
            state["critic"] = {"params": self.critic.params, "opt_state": self.critic.opt_state}
        return state

    def save_checkpoint(self) -> None:
        meta = {"global_step": self.global_step, "kl_coef": float(self.kl_ctrl.value),
                "model_config": self.actor.model_cfg.to_hf_config(),
                "tokenizer": str(self.cfg.data.tokenizer),
                "rng": np.asarray(jax.random.key_data(self.base_rng)).tolist(),
                "config": json.loads(self.cfg.to_json_best_effort())}
        self.store.save(self.global_step, self._state(), self.train_loader.get_state(), meta)

    def _maybe_resume(self) -> None:
        t = self.cfg.trainer
        found = ckpt.resolve_resume(t.resume_mode, self.run_dir, t.resume_from_path)
        if found is None:
            return
        directory, step = found
        store = self.store if directory == self.store.directory else ckpt.CheckpointStore(directory)
        state, data_state, meta = store.restore(step, ckpt.abstract_like(self._state()))
        # the reference policy is not saved: it is the initial policy, loaded again from model.path
        self.actor.params, self.actor.opt_state = state["actor"]["params"], state["actor"]["opt_state"]
        if self.critic is not None:
            self.critic.params, self.critic.opt_state = state["critic"]["params"], state["critic"]["opt_state"]
        self.train_loader.set_state(data_state)
        self.kl_ctrl.value = float(meta["kl_coef"])
        self.global_step = int(meta["global_step"])
        log.info("resumed from %s at step %d", directory, step)
        if self.is_main:
            print(f"resumed from {directory} step {step}", flush=True)

    def export_hf(self, out_dir: str) -> str:
        from jaxrl_llm.hf import export_hf

        params = to_host(self.actor.params)  # a collective: every process takes part
        if self.is_main:
            export_hf(self.actor.model_cfg, params, out_dir, tokenizer=self.tokenizer)
        return out_dir

    def close(self) -> None:
        self.store.close()
        self.tracker.close()
        self.reward_manager.close()
