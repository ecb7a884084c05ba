"""The default config tree: every key, its default and its one-line doc, in veRL's vocabulary.

Defaults are veRL's PPO trainer defaults (its actor, rollout, critic and algorithm sections)
unless the doc says otherwise; README.md ("veRL keys and ours") lists the renamed keys and
docs/algorithms.md what the algorithm keys compute. "Derived" defaults (None here) are
filled in by `validate_config`. Per-device sizes are `*_per_device` (veRL: `*_per_gpu`, accepted
as aliases). `docs/config.md` is generated from this file.
"""
from __future__ import annotations

from jaxrl_llm.checkpoint import RESUME_MODES
from jaxrl_llm.config import names
from jaxrl_llm.config.schema import field
from jaxrl_llm.config.tree_policy import ACTOR, MODEL, REF, ROLLOUT, STR_OR_LIST, model_fields, optim_fields
from jaxrl_llm.config.tree_reward import CUSTOM_REWARD, REWARD_MODEL
from jaxrl_llm.config.tree_sft import DPO, EVALUATION, GENERATION, SFT
from jaxrl_llm.losses.distill import SIGNALS as DISTILL_SIGNALS
from jaxrl_llm.models.families import CONTEXT_ATTENTION

DATA = {
    "train_files": field(None, "Training prompts: a path or list of paths (.parquet in veRL's row format, "
                               ".jsonl, .json, .csv). Required unless data.synthetic.task is set. veRL.",
                         types=STR_OR_LIST),
    "val_files": field(None, "Validation prompts (same formats); None = no validation set. veRL.",
                       types=STR_OR_LIST),
    "tokenizer": field(None, "Tokenizer location (HF folder or .gguf); None = actor_rollout_ref.model.path. "
                             "Required for tiny:* models. veRL.", types=str),
    "prompt_key": field("prompt", "Column holding the prompt (a chat message list or a string). veRL."),
    "messages_key": field("messages", "Column holding a chat message list for json/jsonl/csv rows that have "
                                      "no prompt_key column (ROLL-style files)."),
    "image_key": field("images", "Column holding each row's images (a list of {'bytes': ...} / {'path': ...}, PIL "
                                 "images, bytes or paths; one '<image>' placeholder in the prompt per image, checked "
                                 "when the data is read: jaxrl_llm/data/images.py). A row with images needs a "
                                 "vision-language policy. veRL.", types=str),
    "video_key": field("videos", "Column holding each row's videos: a row with any is refused (not supported). "
                                 "veRL.", types=str),
    "apply_chat_template": field(True, "Render prompts with the tokenizer's chat template "
                                       "(add_generation_prompt=True); False tokenizes the raw text."),
    "system_prompt": field(None, "A system message put first in every prompt that has none (a string prompt "
                                 "becomes [system, user]); needs apply_chat_template. TRL/open-r1 system_prompt, "
                                 "Trinity format.system_prompt.", types=str),
    "chat_template": field(None, "A Jinja chat template (the text, or a file holding it) that replaces the "
                                 "tokenizer's for prompts and multi-turn rollouts; None = the tokenizer's own. TRL "
                                 "chat_template, veRL custom_chat_template.",
                           types=str),
    "val_overrides": field({}, "data keys that differ for the validation files: prompt_key, messages_key, "
                               "ground_truth_key, system_prompt, default_data_source, apply_chat_template, "
                               "chat_template (a Jinja text or file, or 'native': the tokenizer's own where "
                               "data.chat_template replaces it for training); {} = validation reads as training "
                               "does. Trinity: eval tasksets' own format keys and use_base.", open=True),
    "ground_truth_key": field(None, "Column holding each row's reference answer; None = reward_model.ground_truth "
                                    "or a ground_truth column (veRL's row format). Trinity format.response_key.",
                              types=str),
    "extra_info_keys": field([], "Columns copied into each row's extra_info (what reward functions and "
                                 "reward_model.judge.rubric_key read), where a row has them.", types=list),
    "default_data_source": field(None, "data_source of rows without a data_source column (it picks the built-in "
                                       "scorer, e.g. openai/gsm8k); None = such rows have none.", types=str),
    "max_prompt_length": field(512, "Prompt token budget; prompts are left-padded to it. veRL.", gt=0),
    "max_response_length": field(512, "Maximum generated tokens per response. veRL.", gt=0),
    "train_batch_size": field(1024, "Prompts per training step (each sampled rollout.n times). veRL "
                                    "(TRL/ROLL: rollout_batch_size).", gt=0),
    "val_batch_size": field(None, "Prompts per validation batch; None = the whole validation set in one batch. "
                                  "veRL.", types=int, gt=0),
    "return_raw_chat": field(False, "Keep the un-templated chat messages in the batch (for reward functions "
                                    "that need them). veRL."),
    "truncation": field("error", "Over-long prompts: 'error', 'left', 'right' or 'middle'. veRL.",
                        choices=names.TRUNCATION),
    "filter_overlong_prompts": field(False, "Drop prompts longer than max_prompt_length when loading. veRL."),
    "skip_bad_rows": field(False, "Leave out the rows that cannot be read (an empty or mistyped prompt, a ground "
                                  "truth the row's scorer cannot read, a missing column, an over-long prompt with "
                                  "truncation=error) and report their count and the first one's file, row and "
                                  "reason in one warning; False = the first is a data error that stops the run."),
    "filter_overlong_prompts_workers": field(1, "Processes used to tokenize for filter_overlong_prompts. veRL.", gt=0),
    "shuffle": field(True, "Shuffle training prompts each epoch. veRL."),
    "seed": field(1, "Seed of the training-data shuffle. veRL."),
    "train_max_samples": field(-1, "Use at most this many training rows; -1 = all. veRL.", gt=0, also=(-1,)),
    "val_max_samples": field(-1, "Use at most this many validation rows; -1 = all. veRL.", gt=0, also=(-1,)),
    "dataloader_num_workers": field(0, "grain worker processes; 0 = in-process (veRL default 8 is for torch).", ge=0),
    "domains": {
        "key": field("domain", "Column naming each row's domain (ROLL: tag, mapped to domains by members)."),
        "probs": field({}, "Domain -> its share of every training batch: int(share x train_batch_size) prompts "
                           "each, the rest to the largest share; each domain walks its own "
                           "rows in its own shuffled order (data/domains.py); rows of other domains are not "
                           "sampled; {} = one stream over all rows. ROLL domain_interleave_probs.", open=True),
        "members": field({}, "Domain -> the key column's values it holds (a domain not listed holds the rows whose "
                             "value is its name). ROLL: each reward worker's tag_included.", open=True),
        "data_sources": field({}, "Domain -> the data_source of its rows that have none (it picks their built-in "
                                  "scorer; reward_model.judge.data_sources picks the rows a judge grades). ROLL: "
                                  "each domain's reward worker.", open=True),
        "ground_truth_columns": field({}, "Domain -> the columns whose dict is its rows' ground truth (ROLL's code "
                                          "rows: case_type, test_cases, test_case_function).", open=True),
    },
    "custom_cls": {
        "path": field(None, "Python file defining a custom dataset class. veRL.", types=str),
        "name": field(None, "Class name in custom_cls.path. veRL.", types=str),
    },
    "synthetic": {
        "task": field(None, "Synthetic verifiable task (jaxrl_llm.data.synthetic: add, larger, repeat, multiply, "
                            "guess) written at start to <trainer.default_local_dir>/data/{train,test}.parquet; "
                            "train_files / "
                            "val_files are derived to point there. jaxrl_llm-only.",
                            types=str, choices=names.synthetic_tasks),
        "n_train": field(512, "Synthetic training prompts.", gt=0),
        "n_val": field(64, "Synthetic validation prompts.", gt=0),
        "difficulty": field(1, "Synthetic task difficulty (digits per operand / words to repeat).", gt=0),
        "answer_format": field("strict", "Synthetic scoring: strict (the whole response is the answer), "
                                         "lenient (the last number / the words anywhere) or first (the first "
                                         "number / the response starts with the words).",
                                         choices=names.synthetic_answer_formats),
        "seed": field(0, "Seed of the synthetic task generator."),
    },
}

CRITIC = {
    "enable": field(None, "Train a value model; derived: True iff algorithm.adv_estimator == 'gae'. veRL.",
                    types=bool),
    "model": model_fields("critic", "Critic initialisation (a value head is added); derived: "
                              "actor_rollout_ref.model.path. veRL."),
    "optim": optim_fields(1e-5, "critic"),
    "ppo_mini_batch_size": field(None, "Prompts per critic optimizer step; derived: "
                                       "actor.ppo_mini_batch_size. veRL.", types=int, gt=0),
    "ppo_micro_batch_size_per_device": field(None, "Sequences per device per critic forward/backward; 'auto' = "
                                                   "the largest that fits (trainer.memory_plan); derived: "
                                                   "actor.ppo_micro_batch_size_per_device. veRL.",
                                                   types=(int, str), gt=0),
    "forward_micro_batch_size_per_device": field(None, "Sequences per device per value forward (no grad); "
                                                       "'auto' = the largest that fits (trainer.memory_plan); "
                                                       "derived: critic.ppo_micro_batch_size_per_device. veRL.",
                                                 types=(int, str), gt=0),
    "use_dynamic_bsz": field(None, "Token-budget micro-batches for the critic; derived: actor.use_dynamic_bsz. "
                                   "veRL.", types=bool),
    "ppo_max_token_len_per_device": field(32768, "Critic token budget per device per micro-batch. veRL."),
    "forward_max_token_len_per_device": field(None, "Token budget of the value forward; derived: "
                                                    "critic.ppo_max_token_len_per_device. veRL.", types=int),
    "ppo_epochs": field(None, "Critic passes per batch; derived: actor.ppo_epochs. veRL.", types=int, gt=0),
    "shuffle": field(None, "Reshuffle critic mini-batches per epoch; derived: actor.shuffle. veRL.", types=bool),
    "cliprange_value": field(0.5, "Value clipping range around the old values. veRL.", gt=0),
    "loss_agg_mode": field(None, "Value-loss aggregation; derived: actor.loss_agg_mode. veRL.",
                           types=str, choices=names.loss_agg_modes),
    "grad_clip": field(1.0, "Critic global-norm gradient clipping. veRL.", gt=0),
    "remat_policy": field(None, "Critic decoder remat: none, full, dots_saveable or offload (as "
                                "actor.remat_policy); derived: full when critic.model.enable_gradient_checkpointing, "
                                "else none.", types=str, choices=names.REMAT),
}

ALGORITHM = {
    "adv_estimator": field("gae", "Advantage estimator from the losses registry (gae, grpo, rloo, "
                                  "reinforce_plus_plus, remax, opo, gpg, ...). veRL.", choices=names.adv_estimators),
    "gamma": field(1.0, "Discount factor (GAE, REINFORCE++). veRL.", ge=0, le=1),
    "lam": field(1.0, "GAE lambda (Schulman et al. 2016; docs/algorithms.md, gae). veRL.", ge=0, le=1),
    "norm_adv_by_std_in_grpo": field(True, "Divide GRPO advantages by the group std; False = Dr.GRPO "
                                           "(Liu et al. 2025). veRL."),
    "use_kl_in_reward": field(False, "Subtract kl_ctrl.kl_coef * KL(old || ref) from token rewards. veRL."),
    "max_len_mask": field(False, "Leave the responses that reached data.max_response_length out of the loss and "
                                 "the advantage whitening (logs actor/max_len_mask_ratio, the share kept). ROLL."),
    "difficulty_mask": {
        "enable": field(False, "Keep only the prompts whose mean score over their samples lies strictly "
                               "between low_threshold and high_threshold; the others' responses leave the loss "
                               "and the whitening (logs actor/difficulty_mask_ratio). ROLL: difficulty_mask."),
        "low_threshold": field(0.0, "A prompt's mean score must be above this. ROLL: "
                                    "difficulty_low_threshold.", types=float),
        "high_threshold": field(1.0, "... and below this. ROLL: difficulty_high_threshold.", types=float),
    },
    "mask_truncated_completions": field(False, "Leave the responses that did not end with an EOS token (cut at "
                                               "data.max_response_length) out of the loss, not out of the "
                                               "advantages (their scores still count in their group); logs "
                                               "actor/truncated_frac. TRL."),
    "use_pf_ppo": field(False, "Preference-feedback PPO (gae only, as veRL): after the advantages, the step's "
                               "rows are resampled with replacement, each drawn with a weight from its score "
                               "(pf_ppo.*), and both updates train on the resampled batch (metrics describe the "
                               "batch as sampled). veRL."),
    "pf_ppo": {
        "reweight_method": field("pow", "pow: |score|^weight_pow; max_min: 1 for the step's highest and lowest "
                                        "scores, 0 for the others; max_random: 0.4 for the highest, 0.1 for the "
                                        "others (each + 1e-8). veRL.", choices=("pow", "max_min", "max_random")),
        "weight_pow": field(2.0, "The power of the pow method. veRL.", ge=0),
    },
    "norm_mean_type": field(None, "Subtract from each response's score the mean over the step's responses "
                                  "('batch') or over its prompt's ('group'), before reward_clip (ROLL's reward "
                                  "normalisation, for any estimator; grpo normalises by itself). None = off. ROLL.",
                            types=str, choices=("batch", "group")),
    "norm_std_type": field(None, "Then divide it by the standard deviation (unbiased) over the step's responses "
                                 "('batch') or its prompt's ('group'), + 1e-6. None = off. ROLL.",
                           types=str, choices=("batch", "group")),
    "reward_clip": field(None, "Clamp each response's reward to [-reward_clip, reward_clip]: for grpo its "
                               "group-normalised score, for the other estimators the raw score (before the "
                               "KL in the reward); logs critic/reward_clip_frac. None = off. ROLL.",
                         types=float, gt=0),
    "whiten_rewards": field(False, "Whiten the token rewards over the step's response tokens before the "
                                   "estimator (masked mean, unbiased variance). ROLL."),
    "whiten_advantages": field(False, "Whiten the advantages over the step's response tokens after the "
                                      "estimator (masked mean, unbiased variance). ROLL."),
    "advantage_clip": field(None, "Clamp the advantages to [-advantage_clip, advantage_clip] after whitening; "
                                  "logs critic/advantage_clip_frac (share of response tokens clipped). None = off. "
                                  "ROLL.", types=float, gt=0),
    "kl_penalty": field("kl", "KL estimator for the in-reward penalty (same names as kl_loss_type). veRL.",
                        choices=names.kl_names),
    "kl_ctrl": {
        "type": field("fixed", "KL coefficient controller: fixed or adaptive (Ziegler et al. 2019; "
                               "docs/algorithms.md). veRL.", choices=names.KL_CTRL_TYPES),
        "kl_coef": field(0.001, "(Initial) KL coefficient. veRL (TRL: kl_coef).", ge=0),
        "horizon": field(10000, "Adaptive controller horizon. veRL.", gt=0),
        "target_kl": field(0.1, "Adaptive controller target KL. veRL.", gt=0),
    },
    "filter_groups": {
        "enable": field(False, "DAPO dynamic sampling: drop groups whose metric has zero variance and keep "
                               "sampling until train_batch_size prompts remain. veRL."),
        "metric": field("seq_reward", "Per-sequence quantity tested for variance: seq_reward, "
                                      "seq_final_reward, score, or a key returned by the reward function. veRL."),
        "max_num_gen_batches": field(10, "Generation rounds per step before giving up; <= 0 = unlimited. veRL."),
    },
    "rollout_correction": {
        "rollout_is": field(None, "Importance weights for sampler/trainer mismatch: None, 'token' or "
                                  "'sequence'. veRL.", types=str, choices=names.rollout_is_levels),
        "rollout_is_threshold": field(2.0, "Upper truncation of the IS weights. veRL.", gt=0),
        "rollout_is_batch_normalize": field(False, "Normalise truncated IS weights to mean 1 over the batch. "
                                                   "veRL."),
        "rollout_rs": field(None, "Rejection sampling modes, comma-separated: token_k1|k2|k3, seq_sum_k*, "
                                  "seq_mean_k*, seq_max_k2|k3 (legacy: token, sequence, geometric). veRL.",
                            types=str),
        "rollout_rs_threshold": field(None, "Threshold per rs mode (comma-separated when several; one value "
                                            "applies to all): k1 takes a ratio range 'lo_hi' or t (= [1/t, t]), "
                                            "k2/k3 an upper bound. Required with rollout_rs. veRL.",
                                            types=(str, float)),
        "bypass_mode": field(False, "Use the sampler's logprobs as the PPO old logprobs (skip the old-logprob "
                                    "forward). veRL."),
        "loss_type": field("ppo_clip", "The policy loss of bypass mode: ppo_clip (the actor's PPO loss with the "
                                       "sampler's logprobs as the old ones; the ratio is the correction) or "
                                       "reinforce (-A * w * log pi, w = sg(pi / pi_rollout) per token or sequence "
                                       "as rollout_is says, truncated at rollout_is_threshold; none without "
                                       "rollout_is). veRL.",
                           choices=("ppo_clip", "reinforce")),
    },
    "distillation": {  # a teacher model's signal on the student's own samples (roles/teacher.py)
        "enable": field(False, "On-policy distillation from algorithm.distillation.teacher: the teacher scores "
                               "the student's sampled tokens (docs/algorithms.md, distillation)."),
        "signal": field("reverse_kl", "reverse_kl: per-token advantage -(log pi - log teacher) on the sampled "
                                      "tokens (discounted by `discount`), added to the task advantage; "
                                      "topk_forward_kl: a loss term, the forward KL over the teacher's top-k "
                                      "tokens (plus one rest-of-vocabulary bucket) at each response position.",
                        choices=DISTILL_SIGNALS),
        "coef": field(1.0, "Weight of the distillation signal (the reverse-KL advantage, or the top-k KL loss).",
                      ge=0),
        "reward_coef": field(1.0, "Weight of the task reward's advantage beside it; 0 = pure distillation (the "
                                  "task scores are still computed and logged).", ge=0),
        "discount": field(0.0, "reverse_kl: discount of later tokens' signal in a token's advantage (0 = each "
                               "token's own, as on-policy distillation).", ge=0, le=1),
        "topk": field(20, "topk_forward_kl: teacher tokens per position.", gt=0),
        "teacher": {
            "path": field(None, "Teacher weights: HF folder, .gguf file or our checkpoint; its vocabulary must be "
                                "the student's (checked at start).", types=str),
            "dtype": field(None, "Storage and compute dtype of the teacher ('float32' or 'bfloat16'); derived: "
                                 "actor_rollout_ref.model.dtype.", types=str, choices=names.DTYPES),
            "param_offload": field(False, "Keep the teacher's params in pinned host memory between teacher "
                                          "passes (as ref.param_offload)."),
            "system_prompt": field(None, "Context distillation: the teacher's prompt has this system message "
                                         "(replacing the row's own), the student's does not.", types=str),
            "prompt_template": field(None, "Context distillation: the teacher sees the row's last user message "
                                           "rendered through this text ('{prompt}' is the message).", types=str),
            "fewshot": field([], "Context distillation: chat messages ({role, content}) the teacher sees before "
                                 "the row's conversation (worked examples)."),
        },
    },
    "trl_rloo": {  # the options of adv_estimator=trl_rloo
        "token_level_kl": field(False, "adv_estimator=trl_rloo: TRL's per-token KL form (-kl_coef * KL_t "
                                       "summed over tokens; same value as the sequence form here). TRL."),
        "normalize_reward": field(False, "Standardise scores over the batch. TRL."),
        "reward_clip_range": field(10.0, "Clip (normalised) scores to +-this. TRL."),
        "normalize_advantage": field(False, "Whiten advantages over the batch. TRL."),
    },
}

TRAINER = {
    "total_epochs": field(30, "Passes over the training prompts. veRL.", gt=0),
    "total_training_steps": field(None, "Stop after this many steps; derived: epochs x batches per epoch. "
                                        "veRL.", types=int, gt=0),
    "project_name": field("jaxrl_llm", "Logger project (W&B / TensorBoard). veRL."),
    "experiment_name": field("default", "Run name (logger run, default_local_dir). veRL."),
    "logger": field(["console", "jsonl"], "Sinks: console, jsonl, tensorboard, wandb. "
                                          "<default_local_dir>/metrics.jsonl is always written. veRL."),
    "log_val_generations": field(0, "Sample generations logged as a table per validation. veRL "
                                    "(TRL: num_sample_generations).", ge=0),
    "save_freq": field(-1, "Checkpoint every N steps and at the last step; -1 = no checkpoints (a preemption "
                           "still saves one, see docs/multihost.md). veRL.", gt=0, also=(-1,)),
    "test_freq": field(-1, "Validate every N steps (and at the end); -1 = never during training. veRL.",
                       gt=0, also=(-1,)),
    "val_before_train": field(True, "Validate once before the first step. veRL."),
    "val_only": field(False, "Validate and exit. veRL."),
    "resume_mode": field("auto", "auto (latest checkpoint in default_local_dir if any), disable (an "
                                 "error if default_local_dir holds checkpoints), or resume_path. veRL.",
                                 choices=RESUME_MODES),
    "resume_from_path": field(None, "Checkpoint step folder for resume_mode=resume_path. veRL.", types=str),
    "max_actor_ckpt_to_keep": field(None, "Keep at most N checkpoints (policy and critic are saved together); "
                                          "None = all. veRL.", types=int, gt=0),
    "max_critic_ckpt_to_keep": field(None, "No effect in jaxrl_llm (a warning when set): the critic is saved in "
                                           "the actor's checkpoint, kept by max_actor_ckpt_to_keep. veRL.",
                                     types=int, gt=0),
    "default_local_dir": field(None, "Run directory (checkpoints, metrics.jsonl, hf/): a local path or a "
                                     "gs:// URL (docs/multihost.md); derived: "
                                     "checkpoints/<project_name>/<experiment_name>. veRL.", types=str),
    "critic_warmup": field(0, "Steps that update only the critic before the actor starts. veRL.", ge=0),
    "worker_timeout_s": field(30.0, "Several JAX processes: a process whose heartbeat (a watchdog thread's, "
                                    "bookkeeping/watchdog.py) has not moved for this long is lost; the others "
                                    "exit 75 at once naming it and the last committed checkpoint (jax's own "
                                    "coordination service would abort them after about a minute). jaxrl_llm.",
                             gt=0),
    "worker_hang_timeout_s": field(600.0, "Several JAX processes: a process whose main thread has stayed this "
                                          "long at a point of the step (the phase it entered) while another "
                                          "process went past it is hung (alive, but stuck: a deadlock in user "
                                          "code, a stuck device call); every process exits 75 naming it and the "
                                          "last committed checkpoint. 0 = not watched. Keep it above the longest "
                                          "host-side work one process does alone (process 0's logging, exports). "
                                          "jaxrl_llm.", ge=0),
    "max_consecutive_nonfinite": field(5, "Stop the run (one error naming the step and the first NaN/inf "
                                          "quantity) after this many optimizer updates in a row were skipped "
                                          "for a non-finite loss or gradient (counted in "
                                          "actor/num_nonfinite_skipped).", gt=0),
    "rollout_data_dir": field(None, "Dump each step's prompts/responses/scores as jsonl here. veRL.",
                              types=str),
    "validation_data_dir": field(None, "Dump validation generations as jsonl here. veRL.", types=str),
    "seed": field(1, "Seed of sampling and parameter initialisation."),
    "export_hf": field(True, "Write the final policy as a Hugging Face folder in <default_local_dir>/hf."),
    "memory_plan": field(True, "Before loading weights, compile every program of a step on abstract inputs "
                               "and print its per-device memory (XLA memory_analysis) and FLOPs; stop with one "
                               "error naming the keys to change if one does not fit (launch/train.py --plan "
                               "prints it and exits). Always on when a micro-batch size is 'auto'. jaxrl_llm-only."),
    "device_memory_gb": field(None, "Device memory (GiB per device) the memory plan checks against; None = "
                                    "the device's own limit (memory_stats bytes_limit on GPU/TPU; no limit on "
                                    "CPU). jaxrl_llm-only.", types=float, gt=0),
    "plan_topology": field(None, "TPU slice the memory plan compiles for instead of the local devices, named as "
                                 "gcloud names accelerator types (v4-8, v5litepod-8 / v5e-8, v5p-64, v6e-8) or as a "
                                 "topology (v5e:2x2): the real TPU compiler (libtpu, the tpu-plan extra) runs on "
                                 "this host, the table gives bytes per chip against the chip's HBM and times at its "
                                 "published bf16 peak, and 'auto' micro-batch sizes resolve against it. Read by "
                                 "launch/train.py --plan (--topology overrides it); a training run on other devices "
                                 "refuses it. jaxrl_llm-only.", types=str),
    "memory_levers": field(["ref_offload", "teacher_offload", "optimizer_offload", "remat"],
                           "What the memory plan may change, in this order, when a program of the step does not "
                           "fit at any micro-batch size: ref_offload / teacher_offload (frozen weights in host "
                           "memory between their passes), optimizer_offload (the optimizer state in host memory "
                           "between updates), remat (remat_policy none / dots_saveable -> full), bf16_moments "
                           "(Adam moments stored in bf16: changes the numbers, so only when listed). Each key it "
                           "sets is printed with the plan; [] = never change a key, stop with the error instead. "
                           "jaxrl_llm-only."),
    "plan_num_slices": field(1, "Slices of plan_topology (multislice: the data axis spans them). jaxrl_llm-only.",
                             gt=0),
    "compilation_cache_dir": field("auto", "Where XLA's compiled programs are kept between launches (JAX's "
                                           "persistent compilation cache): a relaunch after a preemption, a resume "
                                           "or a second run of the same config loads the step's programs instead "
                                           "of compiling them (minutes each for a large model on a TPU slice). "
                                           "'auto': $JAX_COMPILATION_CACHE_DIR when set, else xla/ under "
                                           "$JAXRL_LLM_CACHE_DIR or <$XDG_CACHE_HOME or ~/.cache>/jaxrl_llm "
                                           "(jaxrl_llm's cache root; 10 GiB at most, least "
                                           "recently used out first) in a one-process run, off with several "
                                           "processes (one process can load a program its peer compiles afresh: "
                                           "on CPU their collectives mismatched and aborted in tests); a folder or "
                                           "a gs:// URL: used by every process, at that risk; None = off. "
                                           "Programs that compile in under 1 s are not kept. Only you should be "
                                           "able to write to it (it holds code the run executes). jaxrl_llm-only "
                                           "(MaxText's jax_cache_dir).",
                                   types=str, nullable=True),
}

MESH = {
    "data": field(1, "Mesh 'data' axis: replicated params, split batch; -1 = the remaining devices."),
    "fsdp": field(-1, "Mesh 'fsdp' axis: split batch and params (ZeRO-3); -1 = the remaining devices."),
    "expert": field(1, "Mesh 'expert' axis (mixture-of-experts models): each device holds num_experts / expert of "
                       "the experts, tokens are sent to their experts and back; data parallel for every other "
                       "weight (it splits the batch). Must divide num_experts. Replaces Megatron's "
                       "expert_model_parallel_size. -1 = the remaining devices."),
    "context": field(1, "Mesh 'context' axis: context parallelism. Each sequence's tokens are split over it in the "
                        "training forward / backward and the scoring passes (activations 1/context per device); "
                        "the devices of a group share rows and params and attend as mesh.context_attention says. "
                        "For responses longer than one device holds (launch/train.py --plan --longest). veRL's "
                        "ulysses_sequence_parallel_size is read as this axis. -1 = the remaining devices."),
    "context_attention": field("ring", "How the devices of a 'context' group attend: ring (key / value blocks "
                                       "passed around the group, one query chunk at a time, blocks a device's "
                                       "rows cannot see skipped; the fastest and leanest measured), all_to_all "
                                       "(DeepSpeed Ulysses: heads split instead of tokens for the attention; "
                                       "needs the heads per device divisible by mesh.context) or gather (every "
                                       "device gathers the whole keys / values). Same numbers either way "
                                       "(docs/long_context.md). jaxrl_llm-only.",
                               choices=CONTEXT_ATTENTION),
    "tensor": field(1, "Mesh 'tensor' axis: split heads / MLP / vocab; replaces tensor_model_parallel_size."),
    "rollout_devices": field(None, "Split mesh: a device count (the last N devices) or a list of device ids that "
                                   "only generate; the rest train (data/fsdp/tensor apply to them). Weights move "
                                   "device to device every synchronizer.sync_interval steps; generation runs "
                                   "while the trainer updates (docs/async.md). None = one device set. Across "
                                   "processes, give each host the same share of both (a list of ids). "
                                   "jaxrl_llm-only.", types=(int, list)),
}

SYNCHRONIZER = {
    "sync_style": field("fixed", "Weight-sync schedule: fixed (every sync_interval steps; Trinity's other "
                                 "styles are not available). Trinity-RFT."),
    "sync_interval": field(1, "Copy the actor's weights to the rollout every N training steps; > 1 is "
                              "off-policy (docs/async.md). Trinity-RFT."),
    "sync_offset": field(0, "Rollouts for step k + offset are generated while step k trains (ROLL: "
                            "async_generation_ratio); > 0 is off-policy. The staleness bound is "
                            "sync_offset + sync_interval - 1 policy versions. Trinity-RFT."),
}

TREE = {
    "data": DATA,
    "actor_rollout_ref": {"model": MODEL, "actor": ACTOR, "ref": REF, "rollout": ROLLOUT},
    "critic": CRITIC,
    "reward_model": REWARD_MODEL,
    "custom_reward_function": CUSTOM_REWARD,
    "algorithm": ALGORITHM,
    "trainer": TRAINER,
    "mesh": MESH,
    "synchronizer": SYNCHRONIZER,
    "sft": SFT,
    "dpo": DPO,
    "generation": GENERATION,
    "evaluation": EVALUATION,
}
