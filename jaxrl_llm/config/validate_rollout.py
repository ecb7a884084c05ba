"""`validate_config`'s checks of the rollout's options and the algorithm knobs that depend on them: rollout
correction and the policy losses that read the sampler's log-probs, the synchronizer, multi-turn, speculative
decoding, partial rollouts and the batch-invariant mode (config/validate.py runs them after the names)."""
from __future__ import annotations

import os

import ml_collections

from jaxrl_llm.config import names
from jaxrl_llm.config.schema import ConfigError, require

ARR = "actor_rollout_ref"
ACTOR, ROLLOUT = f"{ARR}.actor", f"{ARR}.rollout"


def check_rollout_options(cfg: ml_collections.ConfigDict) -> None:
    """Each check below; the first problem raises a `ConfigError` naming its key."""
    _check_rollout_correction(cfg)
    _check_synchronizer(cfg)
    _check_multi_turn(cfg)
    _check_speculative(cfg)
    _check_partial(cfg)
    _check_batch_invariant(cfg)


def _check_synchronizer(cfg: ml_collections.ConfigDict) -> None:
    require(cfg.synchronizer.sync_style == "fixed", "synchronizer.sync_style", cfg,
             "only the fixed schedule (sync every sync_interval steps) is available; Trinity-RFT's dynamic styles "
             "are not")
    require(cfg.synchronizer.sync_interval >= 1, "synchronizer.sync_interval", cfg, "must be >= 1")
    require(cfg.synchronizer.sync_offset >= 0, "synchronizer.sync_offset", cfg, "must be >= 0")
    rd = cfg.mesh.rollout_devices
    if rd is not None:
        require((rd >= 1) if isinstance(rd, int) else (len(rd) >= 1 and all(isinstance(i, int) for i in rd)),
                 "mesh.rollout_devices", cfg, "expected a device count >= 1 or a list of device ids")


def _check_multi_turn(cfg: ml_collections.ConfigDict) -> None:
    mt, key = cfg.actor_rollout_ref.rollout.multi_turn, f"{ROLLOUT}.multi_turn"
    if not mt.enable:
        return
    require(not mt.use_inference_chat_template, f"{key}.use_inference_chat_template", cfg,
             "re-rendering the conversation with the inference template would train on tokens the model did not "
             "see; jaxrl_llm trains on the rollout's own tokens (token in, token out): set it False")
    require(mt.tool_config_path is not None or mt.interaction_config_path is not None, f"{key}.enable", cfg,
             f"needs {key}.tool_config_path and / or {key}.interaction_config_path")
    for name in ("tool_config_path", "interaction_config_path"):
        path = mt[name]
        if path is not None and not os.path.isfile(os.path.expanduser(path)):
            raise ConfigError(f"{key}.{name}={path!r}: no such file")
    for name in ("max_assistant_turns", "max_user_turns"):
        require(mt[name] is None or mt[name] >= 1, f"{key}.{name}", cfg, "must be >= 1 or None")
    for name in ("max_parallel_calls", "max_tool_response_length"):
        require(mt[name] >= 1, f"{key}.{name}", cfg, "must be >= 1")
    require(mt.tool_call_timeout_s > 0, f"{key}.tool_call_timeout_s", cfg, "must be > 0")
    require(not cfg.reward_model.enable, f"{key}.enable", cfg,
             "a model-based reward (reward_model.enable) is not supported with multi-turn rollouts (the scorer, "
             "tools' calc_reward and interaction rewards are)")
    require(bool(cfg.data.apply_chat_template), f"{key}.enable", cfg,
             "multi-turn rollouts render turns through the chat template: data.apply_chat_template must be True")
    require("chat_template" not in cfg.data.val_overrides, "data.val_overrides", cfg,
             "multi-turn rollouts render every turn with the run's one chat template (data.chat_template)")


def _check_partial(cfg: ml_collections.ConfigDict) -> None:
    rollout, key = cfg.actor_rollout_ref.rollout, f"{ROLLOUT}.partial"
    if not rollout.partial.enable:
        return
    why = "paused samples resume in the paged engine at the next synchronous step"
    require(rollout.engine != "static", f"{ROLLOUT}.engine", cfg, f"{key}.enable: {why}")
    require(not rollout.multi_turn.enable, f"{ROLLOUT}.multi_turn.enable", cfg,
             f"{key}.enable is for single-turn rollouts")
    require(cfg.actor_rollout_ref.actor.router_replay != "rollout", f"{ACTOR}.router_replay", cfg,
             f"{key}.enable: a resumed sample's earlier experts are not replayed")
    require(not cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable", cfg,
             f"{key}.enable: the group filter samples further batches itself; use one or the other")
    sync = cfg.synchronizer
    require(sync.sync_interval == 1 and sync.sync_offset == 0 and cfg.mesh.get("rollout_devices") is None,
             f"{key}.enable", cfg, f"{why}: set synchronizer.sync_interval=1, sync_offset=0 and no "
             "mesh.rollout_devices")


def _check_speculative(cfg: ml_collections.ConfigDict) -> None:
    rollout, key = cfg.actor_rollout_ref.rollout, f"{ROLLOUT}.speculative"
    spec = rollout.speculative
    if spec.method == "none":
        return
    require(rollout.engine != "static", f"{ROLLOUT}.engine", cfg,
             f"{key}.method={spec.method!r} runs in the paged engine: set engine to 'paged' or 'auto'")
    require(cfg.actor_rollout_ref.actor.router_replay != "rollout", f"{key}.method", cfg,
             f"recording the experts per token ({ACTOR}.router_replay='rollout') needs one token per decode step: "
             f"set {key}.method='none'")
    require(spec.prompt_lookup_min <= spec.prompt_lookup_max, f"{key}.prompt_lookup_min", cfg,
             f"must be <= {key}.prompt_lookup_max={spec.prompt_lookup_max}")
    require(spec.method != "draft" or spec.draft_model.path is not None, f"{key}.draft_model.path", cfg,
             f"required when {key}.method='draft' (HF folder, .gguf, checkpoint or tiny:<arch>)")


def _check_batch_invariant(cfg: ml_collections.ConfigDict) -> None:
    """What model.batch_invariant (models/invariant.py) does not cover yet, refused by name."""
    if not cfg.actor_rollout_ref.model.get("batch_invariant", False):
        return
    why = f"{ARR}.model.batch_invariant=True "
    require(cfg.actor_rollout_ref.rollout.kv_cache_dtype == "auto", f"{ROLLOUT}.kv_cache_dtype", cfg,
             why + "reads compute-dtype pages (int8 pages are dequantised in another order): set it to 'auto'")


def _check_rollout_correction(cfg: ml_collections.ConfigDict) -> None:
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    if rc.loss_type == "reinforce":
        if not rc.bypass_mode:
            raise ConfigError(f"{key}.loss_type='reinforce' is bypass mode's loss: set {key}.bypass_mode=true "
                              "(the sampler's log-probs as the old ones), or leave loss_type at ppo_clip")
        if rc.rollout_rs is not None:
            raise ConfigError(f"{key}.rollout_rs={rc.rollout_rs!r} with loss_type='reinforce': the update takes each "
                              "micro-batch's IS weights from its own forward, and rejection sampling needs the "
                              "whole batch first; use rollout_is with rollout_is_threshold")
        mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
        if mode != "vanilla":
            raise ConfigError(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r} with {key}.loss_type="
                              "'reinforce': bypass mode's loss replaces the policy loss (as in veRL); leave it "
                              "at vanilla")
    actor = cfg.actor_rollout_ref.actor
    if actor.policy_loss.loss_mode == "m2po":
        if not rc.bypass_mode:
            raise ConfigError(f"{ACTOR}.policy_loss.loss_mode='m2po' bounds the ratio to the sampler's policy: set "
                              f"{key}.bypass_mode=true (the sampler's log-probs as the old ones; Trinity-RFT's "
                              "bypass_old_logprobs)")
        if cfg.actor_rollout_ref.model.get("lora_dropout", 0.0):
            raise ConfigError(f"actor_rollout_ref.model.lora_dropout={cfg.actor_rollout_ref.model.lora_dropout}: "
                              "m2po selects its tokens in a pre-pass over the mini-batch, which dropout would make "
                              "differ from the update's forward (Trinity-RFT refuses it too); set it to 0")
    if actor.policy_loss.dual_clip is not None and actor.policy_loss.loss_mode not in ("vanilla", "gspo"):
        raise ConfigError(f"{ACTOR}.policy_loss.dual_clip={actor.policy_loss.dual_clip}: policy loss "
                          f"{actor.policy_loss.loss_mode!r} has no dual clip (vanilla and gspo have one); leave it "
                          "None")
    if actor.policy_loss.loss_agg_mode is not None and actor.policy_loss.loss_mode == "geo_mean":
        raise ConfigError(f"{ACTOR}.policy_loss.loss_agg_mode={actor.policy_loss.loss_agg_mode!r}: geo_mean's loss is "
                          "one number per sequence (their mean over rows); leave it None")
    if rc.rollout_rs is None:
        return
    modes = [m.strip() for m in rc.rollout_rs.split(",")]
    valid = names.rollout_rs_modes()
    for mode in modes:
        if mode not in valid:
            raise ConfigError(f"{key}.rollout_rs: unknown mode {mode!r}; valid: {', '.join(valid)}")
    if rc.rollout_rs_threshold is None:
        raise ConfigError(f"{key}.rollout_rs_threshold=None: required when rollout_rs={rc.rollout_rs!r}")
    try:  # the losses package parses the thresholds exactly as the trainer will
        from jaxrl_llm.losses.rollout_correction import parse_rejection_rules
    except ImportError:
        return
    try:
        parse_rejection_rules(rc.rollout_rs, rc.rollout_rs_threshold)
    except ValueError as err:
        raise ConfigError(f"{key}.rollout_rs_threshold={rc.rollout_rs_threshold!r}: {err}") from None
