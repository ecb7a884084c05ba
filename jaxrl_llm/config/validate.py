"""`validate_config`: every check that can fail before anything is compiled, each failure a single
`ConfigError` whose message starts with the offending key.

Order: unknown / aliased / torch-only keys -> types -> names -> ranges -> mesh -> batch
divisibility -> derived values -> run names, filter metric, override_config (config/checks.py)
-> lengths vs model context -> paths -> what the paths hold (model architecture and weights,
tokenizer files, custom reward / dataset code imported; config/checks.py).
"""
from __future__ import annotations

import copy
import importlib.util
import os
import string

import ml_collections

from jaxrl_llm import storage
from jaxrl_llm.config import names
from jaxrl_llm.config.checks import check_inputs, check_sources, reads_images
from jaxrl_llm.config.derive import AUTO, AUTO_KEYS, resolve_defaults, resolve_total_steps
from jaxrl_llm.config.overrides import FIELDS, normalize_config
from jaxrl_llm.config.schema import ConfigError, check_type, get_path, require, set_path
from jaxrl_llm.config.validate_rollout import ACTOR, ARR, ROLLOUT, check_rollout_options
from jaxrl_llm.models.lora import parse_target_modules
from jaxrl_llm.platform.tpu import parse_accelerator_type
from jaxrl_llm.rewards.judge_parsers import JUDGE_FIELDS, JUDGE_PARSERS, parser_file


def _check_types(cfg: ml_collections.ConfigDict) -> None:
    for key, f in FIELDS.items():
        value = get_path(cfg, key)
        checked = check_type(key, value, f)
        if checked is not value:
            set_path(cfg, key, checked)
        if isinstance(checked, str) and key in AUTO_KEYS and checked != AUTO:
            raise ConfigError(f"{key}={checked!r}: expected an int or 'auto'")


def _check_declared(cfg: ml_collections.ConfigDict) -> None:
    """The choices and bounds each key declares on its Field (config/tree.py)."""
    for key, f in FIELDS.items():
        f.check_value(key, get_path(cfg, key))


def _check_names(cfg: ml_collections.ConfigDict) -> None:
    for key in (f"{ACTOR}.kl_loss_type", "algorithm.kl_penalty"):
        # the step scores tokens by log-probs only; the exact KL needs both models' full logits
        require(get_path(cfg, key) != "full", key, cfg,
                 "the exact vocabulary KL is not available in the training step (it would need the reference's "
                 "logits at every token); use low_var_kl / k3 or a '+' form (jaxrl_llm.losses.token_kl_full "
                 "computes it from hidden states outside the trainer)")
    for lever in cfg.trainer.memory_levers:
        if lever not in names.MEMORY_LEVERS:
            raise ConfigError(f"trainer.memory_levers: unknown lever {lever!r}; valid: "
                              f"{', '.join(names.MEMORY_LEVERS)}")
    _check_reward_funcs(cfg.custom_reward_function)
    for sink in cfg.trainer.logger:
        if sink not in names.LOGGERS:
            raise ConfigError(f"trainer.logger: unknown sink {sink!r}; valid: {', '.join(names.LOGGERS)}")
        module = {"wandb": "wandb", "tensorboard": "tensorboardX"}.get(sink)
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(f"trainer.logger: {sink!r} needs the {module} package (pip install {module})")
    path = cfg.actor_rollout_ref.model.path
    if path is not None and path.startswith("tiny:") and path[5:] not in names.TINY_ARCHS:
        raise ConfigError(f"{ARR}.model.path={path!r}: unknown tiny architecture; valid: "
                          + ", ".join(f"tiny:{a}" for a in names.TINY_ARCHS))
    tiny = cfg.actor_rollout_ref.model.tiny
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if tiny[key] is not None and not (path or "").startswith(tuple(f"tiny:{a}" for a in names.TINY_MOE_ARCHS)):
            raise ConfigError(f"{ARR}.model.tiny.{key}={tiny[key]}: only a tiny mixture-of-experts model reads it "
                              f"(model.path={path!r}; valid: " + ", ".join(f"tiny:{a}" for a in names.TINY_MOE_ARCHS)
                              + ")")
    check_rollout_options(cfg)  # config/validate_rollout.py


def _check_ranges(cfg: ml_collections.ConfigDict) -> None:
    """Range rules across keys or on list items (a single key's bounds are on its Field)."""
    if cfg.trainer.plan_topology is not None:
        try:  # the name only: libtpu is needed when the plan runs, not to validate the config
            parse_accelerator_type(cfg.trainer.plan_topology)
        except ValueError as err:
            raise ConfigError(f"trainer.plan_topology: {err}") from None
    for role in (ACTOR, "critic"):
        o = f"{role}.optim"
        betas = get_path(cfg, f"{o}.betas")
        require(len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas),
                 f"{o}.betas", cfg, "expected [beta1, beta2] with 0 <= beta < 1")
    _check_lora(cfg)
    for tok in cfg.actor_rollout_ref.rollout.stop_token_ids:
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ConfigError(f"{ROLLOUT}.stop_token_ids: {tok!r} is not a token id (non-negative int)")


def _check_lora(cfg: ml_collections.ConfigDict) -> None:
    model = cfg.actor_rollout_ref.model
    rank = model.lora_rank
    require(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0, f"{ARR}.model.lora_rank", cfg,
             "must be an int >= 0 (0 = full fine-tuning)")
    if rank > 0:
        require(isinstance(model.lora_alpha, (int, float)) and model.lora_alpha > 0, f"{ARR}.model.lora_alpha",
                 cfg, "must be > 0")
        try:
            parse_target_modules(model.target_modules, f"{ARR}.model.target_modules")
        except ValueError as err:
            raise ConfigError(str(err)) from None


def mesh_dp_size(cfg: ml_collections.ConfigDict, num_devices: int) -> int:
    """Data-parallel size (mesh 'data' x 'fsdp' x 'expert', the axes that split the batch) on `num_devices`,
    resolved exactly as `sharding.make_mesh` will build the mesh."""
    from jaxrl_llm.sharding.mesh import MESH_AXES, resolve_mesh_shape
    from jaxrl_llm.sharding.split import num_training_devices

    try:  # a split mesh trains on the devices mesh.rollout_devices leaves
        num_devices = num_training_devices(cfg.mesh.get("rollout_devices"), num_devices)
        sizes = resolve_mesh_shape({k: cfg.mesh[k] for k in MESH_AXES}, num_devices)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return sizes["data"] * sizes["fsdp"] * sizes["expert"]


def _check_batches(cfg: ml_collections.ConfigDict, dp: int, before_derive: bool) -> None:
    data, actor, rollout, critic = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.critic
    n, prompts = rollout.n, data.train_batch_size
    sequences = prompts * n
    roles = [(ACTOR, actor)] + ([("critic", critic)] if critic.enable and not before_derive else [])
    for role, sec in roles:
        split = sec.get("num_mini_batches")
        if split is not None:  # the sequences in equal mini-batches, groups split or not
            if sequences % split:
                raise ConfigError(f"{role}.num_mini_batches={split}: must divide the step's {prompts} x rollout.n={n} "
                                  f"= {sequences} sequences")
            mini_sequences, what = sequences // split, f"{role}.num_mini_batches={split}: {sequences} / {split}"
        else:
            mini = sec.ppo_mini_batch_size
            if prompts % mini:
                raise ConfigError(f"{role}.ppo_mini_batch_size={mini}: must divide data.train_batch_size={prompts}")
            mini_sequences, what = mini * n, f"{role}.ppo_mini_batch_size={mini}: {mini} prompts x rollout.n={n}"
        if mini_sequences % dp:
            raise ConfigError(f"{what} = {mini_sequences} sequences do not split over the data-parallel size {dp}")
        if before_derive or sec.use_dynamic_bsz:
            continue
        micro = sec.ppo_micro_batch_size_per_device
        if micro != AUTO and (mini_sequences // dp) % micro:
            raise ConfigError(f"{role}.ppo_micro_batch_size_per_device={micro}: must divide the per-device "
                              f"mini-batch {mini_sequences} / {dp} = {mini_sequences // dp} sequences")
    if before_derive:
        return
    per_device = sequences // dp
    forward = [(f"{ARR}.ref.log_prob_micro_batch_size_per_device", cfg.actor_rollout_ref.ref),
               (f"{ROLLOUT}.log_prob_micro_batch_size_per_device", rollout)]
    for key, sec in forward:
        if not sec.log_prob_use_dynamic_bsz and get_path(cfg, key) != AUTO and per_device % get_path(cfg, key):
            raise ConfigError(f"{key}={get_path(cfg, key)}: must divide the per-device batch "
                              f"{prompts} x {n} / {dp} = {per_device} sequences")
    checks = []
    if critic.enable and not critic.use_dynamic_bsz:
        checks.append("critic.forward_micro_batch_size_per_device")
    if cfg.reward_model.enable:
        checks.append("reward_model.micro_batch_size_per_device")
    for key in checks:
        if get_path(cfg, key) != AUTO and per_device % get_path(cfg, key):
            raise ConfigError(f"{key}={get_path(cfg, key)}: must divide the per-device batch {per_device}")
    longest = data.max_prompt_length + rollout.response_length
    for key, dynamic in ((f"{ACTOR}.ppo_max_token_len_per_device", actor.use_dynamic_bsz),
                         ("critic.ppo_max_token_len_per_device", critic.enable and critic.use_dynamic_bsz)):
        if dynamic and get_path(cfg, key) < longest:
            raise ConfigError(f"{key}={get_path(cfg, key)}: smaller than one sequence "
                              f"(max_prompt_length + response_length = {longest})")


def _check_algorithm(cfg: ml_collections.ConfigDict) -> None:
    alg, n = cfg.algorithm, cfg.actor_rollout_ref.rollout.n
    if alg.adv_estimator in names.adv_estimators(needs_group_ids=True) and n < 2:
        raise ConfigError(f"{ROLLOUT}.n={n}: algorithm.adv_estimator={alg.adv_estimator!r} compares samples "
                          "of the same prompt and needs n >= 2")
    if alg.filter_groups.enable and n < 2:
        raise ConfigError(f"{ROLLOUT}.n={n}: algorithm.filter_groups needs n >= 2 samples per prompt")
    if alg.use_pf_ppo and alg.adv_estimator != "gae":
        raise ConfigError(f"algorithm.use_pf_ppo=True with adv_estimator={alg.adv_estimator!r}: veRL resamples the "
                          "rows after GAE only (its other estimators ignore the key); use gae or drop use_pf_ppo")
    difficulty = alg.difficulty_mask
    if difficulty.enable and n < 2:
        raise ConfigError(f"{ROLLOUT}.n={n}: algorithm.difficulty_mask needs n >= 2 samples per prompt (it "
                          "reads a prompt's mean score over its samples)")
    if difficulty.enable and not difficulty.low_threshold < difficulty.high_threshold:
        raise ConfigError(f"algorithm.difficulty_mask.low_threshold={difficulty.low_threshold}: must be below "
                          f"high_threshold={difficulty.high_threshold} (no prompt would be kept)")
    if alg.adv_estimator == "trl_rloo" and alg.use_kl_in_reward:
        raise ConfigError("algorithm.use_kl_in_reward=True: adv_estimator='trl_rloo' folds the KL into the "
                          "sequence score itself (TRL's RLOO); set use_kl_in_reward=False")
    if alg.adv_estimator in names.adv_estimators(needs_values=True) and not cfg.critic.enable:
        raise ConfigError(f"critic.enable=False: algorithm.adv_estimator={alg.adv_estimator!r} needs a critic")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_from_path=None: required when trainer.resume_mode='resume_path'")
    if cfg.trainer.val_only and cfg.data.val_files is None:
        raise ConfigError("data.val_files=None: trainer.val_only needs validation files")
    ob = cfg.reward_model.reward_kwargs
    if ob.overlong_buffer_cfg.enable:
        require(ob.overlong_buffer_cfg.len < ob.max_resp_len, "reward_model.reward_kwargs.overlong_buffer_cfg.len",
                 cfg, f"must be shorter than max_resp_len={ob.max_resp_len}")
    if cfg.reward_model.enable and cfg.reward_model.model.path is None:
        raise ConfigError("reward_model.model.path=None: required when reward_model.enable")
    _check_distillation(cfg)
    _check_judge(cfg)


def _check_distillation(cfg: ml_collections.ConfigDict) -> None:
    distill = cfg.algorithm.distillation
    if not distill.enable:
        return
    key = "algorithm.distillation"
    if distill.teacher.path is None:
        raise ConfigError(f"{key}.teacher.path=None: required when {key}.enable (HF folder, .gguf or checkpoint)")
    if distill.coef == 0 and distill.reward_coef == 0:
        raise ConfigError(f"{key}.coef=0 and {key}.reward_coef=0: nothing would train the policy")
    template = distill.teacher.prompt_template
    if template is not None and "{prompt}" not in template:
        raise ConfigError(f"{key}.teacher.prompt_template={template!r}: has no '{{prompt}}' for the row's message")
    for i, message in enumerate(distill.teacher.fewshot):
        if not (isinstance(message, dict) and set(message) >= {"role", "content"}):
            raise ConfigError(f"{key}.teacher.fewshot[{i}]={message!r}: expected a {{role, content}} message")
    context = template is not None or distill.teacher.system_prompt is not None or len(distill.teacher.fewshot) > 0
    if context and not cfg.data.apply_chat_template:
        raise ConfigError(f"{key}.teacher: a teacher prompt of its own (system_prompt, prompt_template, fewshot) "
                          "is rendered from the row's chat: it needs data.apply_chat_template=True")


def _check_judge(cfg: ml_collections.ConfigDict) -> None:
    rm = cfg.reward_model
    if not (rm.enable and rm.style == "generative"):
        return
    judge, key = rm.judge, "reward_model.judge"
    if "{response}" not in judge.template:
        raise ConfigError(f"{key}.template: has no '{{response}}' (the judge would not see the answer)")
    unknown = {name for _, name, _, _ in string.Formatter().parse(judge.template) if name} - JUDGE_FIELDS
    if unknown:
        raise ConfigError(f"{key}.template: unknown field(s) {sorted(unknown)}; valid: {sorted(JUDGE_FIELDS)}")
    if "{rubric}" in judge.template and judge.rubric_key is None:
        raise ConfigError(f"{key}.template: names {{rubric}} but {key}.rubric_key (the extra_info key holding each "
                          "row's rubric) is not set")
    if judge.max_score <= judge.min_score:
        raise ConfigError(f"{key}.max_score={judge.max_score}: must exceed min_score={judge.min_score}")
    parser = judge.parser
    if parser not in JUDGE_PARSERS and parser_file(parser) is None:
        raise ConfigError(f"{key}.parser={parser!r}: one of {', '.join(JUDGE_PARSERS)} or 'file.py:function'")


def _check_lengths(cfg: ml_collections.ConfigDict, model_max_positions: int | None) -> None:
    model = cfg.actor_rollout_ref.model
    if model_max_positions is None and model.path is not None and model.path.startswith("tiny:"):
        model_max_positions = model.tiny.max_position_embeddings
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    if model_max_positions is not None and total > model_max_positions:
        raise ConfigError(f"data.max_prompt_length={cfg.data.max_prompt_length}: prompt + response "
                          f"({cfg.data.max_prompt_length} + {cfg.data.max_response_length} = {total}) exceeds the "
                          f"model context of {model_max_positions} positions")


def _existing(key: str, path: str, what: str, *, url_ok: bool = False) -> None:
    """`path` exists; a bucket URL only where the code reads through jaxrl_llm/storage.py (`url_ok`)."""
    if storage.is_url(path):
        if not url_ok:
            raise ConfigError(f"{key}={path!r}: the {what} must be a local path (copy it from the bucket first)")
        reason = storage.unavailable_reason(path, checkpoints=key == "trainer.resume_from_path")
        if reason is not None:
            raise ConfigError(f"{key}={path!r}: {reason}")
        if not storage.exists(path):
            raise ConfigError(f"{key}={path!r}: {what} not found")
        return
    if not os.path.exists(os.path.expanduser(path)):
        raise ConfigError(f"{key}={path!r}: {what} not found (local paths only; jaxrl_llm never downloads)")


def _check_storage(cfg: ml_collections.ConfigDict) -> None:
    """Where the run writes: a local path, or a URL that an installed back-end opens (no network)."""
    for key in ("trainer.default_local_dir", "trainer.rollout_data_dir", "trainer.validation_data_dir"):
        value = get_path(cfg, key)
        if value is None:
            continue
        reason = storage.unavailable_reason(value, checkpoints=key == "trainer.default_local_dir")
        if reason is not None:
            raise ConfigError(f"{key}={value!r}: {reason}")


def _check_required(cfg: ml_collections.ConfigDict) -> None:
    if cfg.data.system_prompt is not None and not cfg.data.apply_chat_template:
        raise ConfigError("data.system_prompt needs data.apply_chat_template=True (a system message is a chat "
                          "message; raw-text prompts have none)")
    data, model = cfg.data, cfg.actor_rollout_ref.model
    if model.path is None:
        raise ConfigError(f"{ARR}.model.path=None: set the policy (HF folder, .gguf file, checkpoint or tiny:<arch>)")
    if data.train_files is None:
        raise ConfigError("data.train_files=None: set training files or data.synthetic.task")
    if model.path.startswith("tiny:") and data.tokenizer is None:
        raise ConfigError(f"data.tokenizer=None: a {model.path} model needs a tokenizer path")
    if data.synthetic.task == "shapes" and not reads_images(model.path):  # its rows hold pictures
        raise ConfigError(f"data.synthetic.task='shapes': its prompts are pictures, and the policy ({model.path}) "
                          "reads text only (vision-language policies: a Qwen2.5-VL / Qwen3-VL folder, "
                          "tiny:qwen2_5_vl)")
    sft = cfg.sft
    if sft.warmup_steps and not sft.warmup_files:
        raise ConfigError(f"sft.warmup_steps={sft.warmup_steps}: set sft.warmup_files, the SFT rows of the warm-up")
    if sft.warmup_files and not sft.warmup_steps:
        raise ConfigError(f"sft.warmup_files={sft.warmup_files!r}: set sft.warmup_steps (> 0) to run the warm-up")


def check_input_paths(cfg: ml_collections.ConfigDict) -> None:
    """The files and model folders a run reads exist (ConfigError naming the key otherwise)."""
    data, model = cfg.data, cfg.actor_rollout_ref.model
    if data.synthetic.task is None:  # synthetic files are written by the trainer at start
        for key in ("data.train_files", "data.val_files"):
            files = get_path(cfg, key)
            for path in [files] if isinstance(files, str) else (files or []):
                _existing(key, path, "data file", url_ok=True)
    warmup = cfg.sft.warmup_files
    for path in [warmup] if isinstance(warmup, str) else (warmup or []):
        _existing("sft.warmup_files", path, "data file", url_ok=True)
    if not model.path.startswith("tiny:"):
        _existing(f"{ARR}.model.path", model.path, "model")
    optional = [("data.tokenizer", "tokenizer"), ("custom_reward_function.path", "reward function file"),
                ("data.custom_cls.path", "dataset class file")]
    if cfg.critic.enable and not cfg.critic.model.path.startswith("tiny:"):
        optional.append(("critic.model.path", "critic model"))
    if cfg.reward_model.enable:
        optional.append(("reward_model.model.path", "reward model"))
    if cfg.algorithm.distillation.enable:
        optional.append(("algorithm.distillation.teacher.path", "teacher model"))
    if cfg.trainer.resume_mode == "resume_path":
        optional.append(("trainer.resume_from_path", "checkpoint"))
    for key, what in optional:
        value = get_path(cfg, key)
        if value is not None and not value.startswith("tiny:"):
            _existing(key, value, what, url_ok=key == "trainer.resume_from_path")


def validate_config(cfg: ml_collections.ConfigDict, *, model_max_positions: int | None = None,
                    dp_size: int | None = None, num_devices: int | None = None,
                    num_train_samples: int | None = None, check_paths: bool = True) -> ml_collections.ConfigDict:
    """Checks `cfg` and returns a resolved copy (derived values filled in).

    dp_size: the data-parallel size the batch is split over; default: mesh data x fsdp x expert on
      `num_devices` (default: jax.device_count()).
    model_max_positions: the policy's context length when known (tiny:* models: from model.tiny).
    num_train_samples: training prompts, when known, to derive total steps (else the trainer
      calls `resolve_total_steps` after loading the data).
    check_paths: check that files and model paths exist (off for config-shape tests).
    Raises ConfigError (a ValueError) naming the key on the first problem.
    """
    cfg = normalize_config(copy.deepcopy(cfg))
    _check_types(cfg)
    _check_declared(cfg)
    _check_names(cfg)
    _check_ranges(cfg)
    if dp_size is None:
        if num_devices is None:
            import jax  # only here: validation itself needs no accelerator

            num_devices = jax.device_count()
        dp_size = mesh_dp_size(cfg, num_devices)
    elif num_devices is not None:
        mesh_dp_size(cfg, num_devices)
    _check_batches(cfg, dp_size, before_derive=True)
    resolve_defaults(cfg, dp_size)
    _check_batches(cfg, dp_size, before_derive=False)
    _check_algorithm(cfg)
    check_inputs(cfg)
    _check_lengths(cfg, model_max_positions)
    _check_required(cfg)
    _check_storage(cfg)
    if check_paths:
        check_input_paths(cfg)
        check_sources(cfg)
    if num_train_samples is not None and cfg.data.synthetic.task is None:
        resolve_total_steps(cfg, num_train_samples)
    return cfg


def _check_reward_funcs(custom: ml_collections.ConfigDict) -> None:
    """custom_reward_function.reward_funcs / reward_weights as rewards/named.py's `NamedRewards` checks them
    (known names, each once, one weight each), the weights numbers."""
    from jaxrl_llm.rewards.named import NamedRewards

    funcs, weights = tuple(custom.reward_funcs), custom.reward_weights
    if weights is not None and not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
        raise ConfigError(f"custom_reward_function.reward_weights={list(weights)}: numbers expected")
    try:
        NamedRewards(funcs, tuple(float(w) for w in (weights or [1.0] * len(funcs))))  # its own checks
    except ValueError as err:
        raise ConfigError(str(err)) from None
