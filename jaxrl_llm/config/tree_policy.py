"""The config tree's policy sections (actor_rollout_ref: model, actor, ref, rollout) and the optimizer and
model sections the critic shares (`optim_fields`, `model_fields`); config/tree.py joins them with the rest.
Defaults are veRL's unless a doc says otherwise (config/tree.py's module doc)."""
from __future__ import annotations

from jaxrl_llm.config import names
from jaxrl_llm.config.schema import field
from jaxrl_llm.losses.logprob import IMPLS as LOGPROB_IMPLS
from jaxrl_llm.sampler.engine.decode_state import KV_CACHE_DTYPES
from jaxrl_llm.sampler.engine.setup import ATTENTION_IMPLS, ENGINES
from jaxrl_llm.sampler.speculative import SPECULATIVE_METHODS

STR_OR_LIST = (str, list)


def optim_fields(lr: float, role: str) -> dict:
    """The `optim` section of a trained role (the actor's, the critic's): AdamW and its schedule."""
    return {
        "lr": field(lr, f"Peak learning rate of the {role}'s AdamW (optax.adamw). veRL default.", gt=0),
        "weight_decay": field(0.01, "AdamW decoupled weight decay. veRL default.", ge=0),
        "betas": field([0.9, 0.999], "AdamW (beta1, beta2). veRL optim default."),
        "eps": field(1e-8, "AdamW epsilon (torch.optim.AdamW default, which veRL uses).", gt=0),
        "lr_warmup_steps": field(-1, "Linear warmup, in training (RL) steps; < 0 means use "
                                     "lr_warmup_steps_ratio (resolved to an int once total steps are "
                                     "known). veRL."),
        "lr_warmup_steps_ratio": field(0.0, "Warmup as a fraction of total training steps, used when "
                                            "lr_warmup_steps < 0. veRL.", ge=0, le=1),
        "lr_scheduler_type": field("constant", "After warmup: 'constant', 'cosine', 'linear' (decay to "
                                              "min_lr_ratio * lr; linear is TRL's default) or 'wsd' (warmup-stable-"
                                              "decay: lr held for stable_ratio of the steps after warmup, then a "
                                              "cosine to min_lr_ratio * lr; veRL's SFT lr_scheduler: wsd). veRL "
                                              "(old name: warmup_style, an alias).",
                                              choices=names.LR_SCHEDULERS),
        "min_lr_ratio": field(0.0, "Cosine / linear floor as a fraction of lr. veRL.", ge=0, le=1),
        "num_cycles": field(0.5, "Cosine cycles over the decay phase (0.5 = half cosine, lr ends at the "
                                 "floor), as transformers' get_cosine_schedule_with_warmup. veRL.", ge=0),
        "stable_ratio": field(0.9, "lr_scheduler_type=wsd: the share of the steps after warmup held at lr (the "
                                   "rest decays). veRL get_wsd_schedule_with_warmup's stable_ratio.", ge=0, le=1),
        "total_training_steps": field(-1, "Training (RL) steps of the schedule, which steps once per "
                                          "RL step (every mini-batch and epoch of step k uses lr(k)); "
                                          "-1 = trainer.total_training_steps. veRL."),
        "moment_dtype": field("float32", f"Storage dtype of the {role}'s Adam moments (mu, nu): 'float32', or "
                                         "'bfloat16' (4 bytes a parameter instead of 8; each step still computes "
                                         "them in fp32 from the stored values and stores them rounded to bf16's "
                                         "8-bit significand, a relative error of at most 2^-8 each; the weights "
                                         "and the update's arithmetic stay fp32; docs/performance-history.md, 'TPU "
                                         "slices'). MaxText: mu_dtype.", choices=names.DTYPES),
        "offload": field(False, f"Keep the {role}'s optimizer state in pinned host memory between updates, "
                                "moved to the device for each update only (the rollout and the scoring passes "
                                "then have its bytes for the KV pool and activations; same numbers; warns and "
                                "keeps it on device where the backend has no pinned host memory). veRL's "
                                "fsdp_config.optimizer_offload is read as this key."),
    }


def model_fields(role: str, path_doc: str) -> dict:
    """The `model` keys every model role has (its path and dtypes); `path_doc` documents its path."""
    return {
        "path": field(None, path_doc, types=str),
        "dtype": field("float32", f"Compute dtype of the {role} forward/backward: 'float32' or 'bfloat16' "
                                  "(logprobs and losses are always fp32).", choices=names.DTYPES),
        "param_dtype": field("float32", f"Storage dtype of the {role} master weights: 'float32' "
                                        "(recommended) or 'bfloat16'.", choices=names.DTYPES),
        "enable_gradient_checkpointing": field(True, "Rematerialise each decoder block in the backward "
                                                     "pass (jax.checkpoint): less memory, ~30% more compute; "
                                                     "the default of the remat_policy key. veRL."),
        "use_remove_padding": field(True, f"Sequence packing for the {role}'s training forward/backward and "
                                          "no-grad passes: variable-length sequences share fixed-size rows "
                                          "(segment ids: no attention across sequences, positions restart), "
                                          "row shapes bucketed; same loss and metrics as the padded rows. "
                                          "veRL (there: remove-padding kernels)."),
        "share_packed_prompts": field(True, f"With use_remove_padding: rows of the {role} with the same prompt "
                                            "(a group's n samples) packed into one micro-batch hold that prompt "
                                            "once, each response attending to it and to itself only, so the "
                                            "prompt is computed once instead of n times; same loss, gradients "
                                            "and metrics."),
        "override_config": field({}, "Model config fields overridden at load (e.g. {rope_theta: 1e6}); "
                                     "free-form dict. veRL.", open=True),
    }


ACTOR = {
    "ppo_mini_batch_size": field(256, "Prompts per optimizer step (x rollout.n sequences); "
                                      "train_batch_size / ppo_mini_batch_size updates per ppo_epoch. veRL.", gt=0),
    "ppo_micro_batch_size_per_device": field(None, "Sequences per device per forward/backward (gradient "
                                                   "accumulation inside one lax.scan); derived: the whole "
                                                   "per-device mini-batch; 'auto' = the largest divisor of it whose "
                                                   "update fits the device memory (trainer.memory_plan). "
                                                   "veRL: ppo_micro_batch_size_per_gpu.",
                                             types=(int, str), gt=0),
    "use_dynamic_bsz": field(False, "Pack micro-batches to a token budget (ppo_max_token_len_per_device) "
                                    "instead of a fixed count; the loss stays exact. With use_remove_padding the "
                                    "micro-batches are fixed-size packed rows whose shapes only the config sets, so "
                                    "a step with new lengths compiles nothing. veRL."),
    "ppo_max_token_len_per_device": field(16384, "Token budget per device per micro-batch when "
                                                 "use_dynamic_bsz. veRL: ppo_max_token_len_per_gpu.", gt=0),
    "ppo_epochs": field(1, "Passes over each rollout batch. veRL.", gt=0),
    "shuffle": field(False, "Reshuffle sequences into new mini-batches at each ppo_epoch. veRL."),
    "num_mini_batches": field(None, "Optimizer steps per ppo_epoch, the step's sequences split into this many equal "
                                    "mini-batches, which may split a prompt's group (with shuffle: random sequences, "
                                    "as TRL's steps_per_generation takes them); ppo_mini_batch_size is then not "
                                    "read; None = train_batch_size / ppo_mini_batch_size. TRL (RLOO: "
                                    "num_mini_batches).", types=int, gt=0),
    "clip_ratio": field(0.2, "PPO clip epsilon (Schulman et al. 2017; docs/algorithms.md). veRL (TRL: cliprange).",
                        gt=0),
    "clip_ratio_low": field(None, "Lower clip epsilon: ratio >= 1 - clip_ratio_low; derived: clip_ratio. "
                                  "veRL / DAPO (Yu et al. 2025).", types=float, gt=0),
    "clip_ratio_high": field(None, "Upper clip epsilon: ratio <= 1 + clip_ratio_high; derived: clip_ratio. "
                                   "DAPO clip-higher uses 0.28. veRL.", types=float, gt=0),
    "clip_ratio_c": field(3.0, "Dual-clip constant c for negative advantages (Ye et al. 2020; "
                               "docs/algorithms.md, vanilla); must be > 1. veRL.", gt=1),
    "loss_agg_mode": field("token-mean", "Loss aggregation: token-mean | seq-mean-token-sum | "
                                         "seq-mean-token-mean | seq-mean-token-sum-norm. veRL.",
                                         choices=names.loss_agg_modes),
    "loss_scale_factor": field(None, "Denominator of seq-mean-token-sum-norm (Dr.GRPO); None = the padded "
                                     "response length. veRL.", types=float),
    "policy_loss": {
        "loss_mode": field("vanilla", "Policy loss from the losses registry: vanilla (PPO), gspo, sapo, gpg, "
                                      "reinforce, cispo, geo_mean, m2po, topr. veRL (m2po: Trinity-RFT; topr: ROLL's "
                                      "pg_variant).",
                           choices=names.policy_losses),
        "loss_agg_mode": field(None, "The policy loss's own aggregation, for every loss: None = veRL's rule "
                                     "(gspo and sapo always seq-mean-token-mean, the others actor.loss_agg_mode, "
                                     "which also aggregates the KL and entropy terms). Trinity-RFT's "
                                     "policy_loss_fn_args.loss_agg_mode (its sapo: token-mean). geo_mean takes none "
                                     "(one number per sequence).", types=str, choices=names.loss_agg_modes),
        "dual_clip": field(None, "PPO's dual clip where A < 0 (min(L, -A * clip_ratio_c)): None = the loss's own "
                                 "(vanilla on, gspo off, as veRL); true / false switch it for vanilla and gspo "
                                 "(ROLL's importance_sampling: seq with dual_clip_loss is gspo with it on). The "
                                 "other losses have none.", types=bool),
    },
    "tau_pos": field(1.0, "SAPO temperature for positive advantages (docs/algorithms.md, sapo). veRL.", gt=0),
    "tau_neg": field(1.05, "SAPO temperature for negative advantages (docs/algorithms.md, sapo). veRL.", gt=0),
    "topr_positive_weight": field(1.0, "TOPR: weight of the rows whose sequence score is > 0 (their plain -A log pi; "
                                       "docs/algorithms.md, topr). ROLL.", ge=0),
    "topr_negative_weight": field(1.0, "TOPR: weight of the other rows (-sg(clip(ratio, 0, 1)) A log pi). ROLL.",
                                  ge=0),
    "m2_threshold": field(0.04, "M2PO: bound on the mean squared log-ratio of the tokens PPO's clip would act on; "
                                "the largest are dropped from the loss until it holds, over each whole mini-batch "
                                "(docs/algorithms.md, m2po). Trinity-RFT.", ge=0),
    "entropy_coeff": field(0.0, "Entropy bonus coefficient (subtracted from the loss). veRL.", ge=0),
    "router_aux_loss_coef": field(None, "Mixture-of-experts models: coefficient of the load-balancing loss "
                                        "(transformers' load_balancing_loss_func; docs/moe.md); None = the "
                                        "model's config.json router_aux_loss_coef when its output_router_logits "
                                        "is true, else 0 (transformers' own rule). Logged as moe/aux_loss.",
                                  types=float, ge=0),
    "router_replay": field("none", "Mixture-of-experts models: 'rollout' records the experts the sampler's "
                                   "router chose for every prompt and response token, and the old log-prob pass "
                                   "and the update run those experts (the router's probabilities of them still "
                                   "weight the outputs and get gradients); in multi-turn rollouts each turn's "
                                   "prefill also replays the earlier turns' experts. 'none' lets every pass route "
                                   "by itself. Logs moe/routing_agreement (docs/moe.md). veRL: router_replay.mode R3.",
                           choices=("none", "rollout")),
    "freeze_vision_tower": field(True, "A vision-language policy's vision tower: frozen (its features computed once "
                                       "per rollout batch) or, False, trained with the text model (each row carries "
                                       "its pixels and every pass runs the tower; docs/vision.md). veRL (whose "
                                       "default is False)."),
    "router_z_loss_coef": field(0.0, "Mixture-of-experts models: coefficient of the router z-loss (ST-MoE: mean "
                                     "logsumexp(router logits)^2; docs/moe.md). Logged as moe/z_loss.", ge=0),
    "use_kl_loss": field(False, "Add a KL(policy || reference) loss term (GRPO, Shao et al. 2024; "
                                "docs/algorithms.md). veRL."),
    "kl_loss_coef": field(0.001, "Coefficient of the KL loss. veRL.", ge=0),
    "kl_loss_type": field("low_var_kl", "KL estimator of the KL loss: kl|k1, abs, mse|k2, low_var_kl|k3, "
                                        "or a base name + '+' (k2 gradient); 'full' is rejected "
                                        "(docs/algorithms.md). veRL.", choices=names.kl_names),
    "grad_clip": field(1.0, "Global-norm gradient clipping (optax.clip_by_global_norm). veRL.", gt=0),
    "remat_policy": field(None, "Rematerialisation of each decoder block in the backward pass: none, full "
                                "(recompute everything), dots_saveable (keep matmul outputs) or offload (matmul "
                                "outputs to pinned host memory; kept on device where the backend has none); "
                                "derived: full when model.enable_gradient_checkpointing, else none.",
                                types=str, choices=names.REMAT),
    "optim": optim_fields(1e-6, "actor"),
}

ROLLOUT = {
    "n": field(1, "Responses sampled per prompt. veRL (TRL: num_generations / rloo_k; ROLL: "
                  "num_return_sequences_in_group).", gt=0),
    "temperature": field(1.0, "Sampling temperature; logprobs are scored at the same temperature. veRL.", ge=0),
    "top_k": field(-1, "Top-k sampling; -1 = off. veRL.", gt=0, also=(-1,)),
    "top_p": field(1.0, "Nucleus sampling; 1.0 = off. veRL.", gt=0, le=1),
    "do_sample": field(True, "False = greedy decoding. veRL."),
    "response_length": field(None, "Tokens generated per response; derived: data.max_response_length "
                                   "(must equal it when set). veRL.", types=int),
    "ignore_eos": field(False, "Keep generating after EOS until response_length. veRL."),
    "stop_token_ids": field([], "Extra token ids that end a response (besides the tokenizer's EOS)."),
    "log_prob_micro_batch_size_per_device": field(None, "Sequences per device per old-logprob forward; "
                                                        "'auto' = the largest that fits (trainer.memory_plan); "
                                                        "derived: actor.ppo_micro_batch_size_per_device. veRL.",
                                                  types=(int, str), gt=0),
    "log_prob_use_dynamic_bsz": field(None, "Token-budget batching of the old-logprob pass; derived: "
                                            "actor.use_dynamic_bsz. veRL.", types=bool),
    "log_prob_max_token_len_per_device": field(None, "Token budget of that pass; derived: "
                                                     "actor.ppo_max_token_len_per_device. veRL.", types=int),
    "calculate_log_probs": field(False, "No effect in jaxrl_llm (a warning when set): the sampler always "
                                        "returns its per-token logprobs (rollout_log_probs). veRL."),
    "engine": field("auto", "Rollout engine: 'auto' (the default: 'paged' when response_length >= 64 or "
                            "multi_turn.enable, else 'static'), 'paged' (continuous batching over max_num_seqs "
                            "slots, one prefill per prompt, paged KV read up to each sequence's length; 7x "
                            "transformers.generate at 94% slot utilisation on RL-shaped lengths, docs/performance.md; "
                            "multi-turn rollouts stream through it; jaxrl_llm/sampler/engine) or 'static' (one padded "
                            "batch, jaxrl_llm/sampler/core.py: fewer programs to compile, the faster one for short "
                            "responses). max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, kv_cache_dtype "
                            "and paged_attention configure the paged engine.", choices=ENGINES),
    "paged_attention": field("auto", "Decode attention of the paged engine: 'auto' (the Pallas kernel on GPU / TPU, "
                                     "on CPU the C++ kernel of jaxrl_llm/sampler/native for fp32 pages where a C++ "
                                     "compiler builds it, else the length-aware XLA loop), 'pallas', 'cpu' or 'xla' "
                                     "(any backend; the fallback if a kernel does not compile). jaxrl_llm.",
                                     choices=ATTENTION_IMPLS),
    "max_num_seqs": field(1024, "Decode slots of the paged engine (capped at the power-of-two bucket of the "
                                "batch's requests). On a mesh whose batch axes (data x fsdp x expert) divide it, "
                                "the slots and the KV pages split over them: each device decodes its share "
                                "(sampler/engine/slot_shards.py); else every device decodes every slot. "
                                "veRL / vLLM.", gt=0),
    "max_num_batched_tokens": field(8192, "Prompt tokens the paged engine prefills between two decode calls "
                                          "(at least one prompt); with enable_chunked_prefill also the tokens one "
                                          "prefill step runs (its largest power of two). veRL / vLLM.", gt=0),
    "enable_chunked_prefill": field(True, "Prefill a prompt longer than max_num_batched_tokens in chunks of that "
                                          "many tokens over its growing KV cache (one compiled step of that size, "
                                          "attention [chunk, prompt]), not as one program of the whole prompt. "
                                          "veRL / vLLM.", types=bool),
    "batch_prefill": field(False, "Paged engine: the new prompts of a round that share a length bucket prefill "
                                  "in one program call (rows padded to a power of two), within "
                                  "max_num_batched_tokens. Off by default: on the 2-core CPU it measured 0.98x "
                                  "(64 prompts x 4, steady state) and compiles a program per (bucket, rows); "
                                  "to be measured on GPU / TPU, where a call's overhead weighs more."),
    "precompile_drain": field(True, "Paged engine: compile the decode program of every slot set the drain "
                                    "moves to (3/4, 1/2, 3/8, 1/4, 1/8 and 1/16 of max_num_seqs) before the first "
                                    "round, as vLLM captures its CUDA graphs at start-up: no compile stalls a "
                                    "later step. False: each compiles when a drain first reaches it (a faster "
                                    "start for short runs and tests; a run whose sequences all end together "
                                    "compiles none). jaxrl_llm-only.", types=bool),
    "cascade_attention": field("auto", "Paged engine: the n samples of a prompt read the prompt's shared full "
                                       "KV pages once per decode step (one attention over them with the n "
                                       "queries, one over each sample's own pages, the same softmax; equal to "
                                       "plain paged attention to 1e-6 in fp32). true: whenever rollout.n >= 2; "
                                       "false: once per sample; 'auto' (the default): only where decode attention "
                                       "is the TPU's Mosaic kernel (not measured yet). Off on CPU's XLA path "
                                       "(and int8 KV, paged_attention='xla') and on GPU, where it measured "
                                       "slower: SmolLM2, 64 slots x 512 tokens on the 2-core CPU, 89.6 vs "
                                       "103.8 useful tokens/s; H200, Qwen2-0.5B shape, 0.74-0.95x with "
                                       "128-2048-token prompts (docs/performance-history.md). "
                                       "jaxrl_llm (FlashInfer's cascade attention).",
                               types=(str, bool), choices=("auto",)),
    "unroll_layers": field("auto", "Paged engine: decode runs over per-layer copies of the weights, one layer "
                                   "after another, instead of a scan over the stacked layers. On XLA:CPU the scan "
                                   "copies each layer's weights out of the stack every step (SmolLM2, 12 slots: "
                                   "190 -> 134 ms per step), but each decode program compiles ~8 s longer (a "
                                   "program per drain slot set, 7 at 32 slots). On TPU a MoE model's scanned "
                                   "layer has its experts copied for XLA's ragged dot every step (Qwen3-30B-A3B on "
                                   "v5p-32: a decode "
                                   "step's 18.2 -> 10.8 GB of HBM traffic a chip unrolled, ~55 s more compile "
                                   "per program). 'auto' (the default): on when response_length >= 512 (a long "
                                   "run's rollouts repay the compile within its first steps) and decode compiles "
                                   "for a CPU, or for a TPU with routed experts; else off: a GPU, and a TPU's "
                                   "dense layers, read a scanned layer in place, so there it only lengthens the "
                                   "compile. jaxrl_llm.",
                           types=(str, bool), choices=("auto",)),
    "speculative": {
        "method": field("none", "Speculative decoding in the paged engine: num_tokens tokens are drafted per "
                                "sequence and step and verified in one forward; the kept drafts plus one token are "
                                "emitted (1 to num_tokens + 1 per step), distributed exactly as plain sampling at "
                                "any temperature / top-k / top-p, and greedy output is token-identical. 'ngram' "
                                "drafts from the sequence's own prompt and response (prompt lookup: what followed "
                                "the latest earlier occurrence of its last prompt_lookup_max..min tokens); 'draft' "
                                "runs draft_model (same vocabulary, checked at start, frozen) over its own paged "
                                "KV. 'none' (the default): one token per step; on the 2-core CPU and the H200 "
                                "speculation measured slower on SmolLM2's RL-style answers (docs/performance.md). "
                                "Needs the paged engine; not with actor.router_replay='rollout'. Logs "
                                "rollout/spec_accept_rate and rollout/tokens_per_step. vLLM: "
                                "speculative_config.method.", choices=SPECULATIVE_METHODS),
        "num_tokens": field(4, "Drafts verified per sequence and step (k). vLLM: num_speculative_tokens.", gt=0),
        "prompt_lookup_max": field(3, "Longest suffix the n-gram drafter looks up. vLLM.", gt=0),
        "prompt_lookup_min": field(1, "Shortest suffix it falls back to (<= prompt_lookup_max). vLLM.", gt=0),
        "draft_model": {
            "path": field(None, "method='draft': the draft model, an HF folder, a .gguf file, our checkpoint or "
                                "tiny:<arch> (tests); loaded in the policy's param dtype and placed like it. "
                                "vLLM: speculative_config.model.", types=str),
        },
    },
    "partial": {
        "enable": field(False, "Partial rollouts: a training step stops generating once it has its batch of "
                               "finished prompt groups; samples still running pause and resume first at the next "
                               "step on the newer policy (their tokens keep the log-probs they were sampled "
                               "with; token-level rollout correction turns on when rollout_is / rollout_rs are "
                               "unset). One loader batch is read ahead. Logs rollout/staleness, "
                               "rollout/staleness_max, rollout/partial/paused and rollout/partial/resumed. "
                               "Checkpoints keep the paused samples (a resume continues exactly). Paged engine, "
                               "synchronous schedule, single-turn, no filter_groups. slime / veRL: "
                               "partial_rollout.", types=bool),
        "max_staleness": field(1, "Most training steps between a token's sampling and its training (a group must "
                                  "finish within this many steps of its first token); 0 = nothing waits: the "
                                  "plain rollout. slime / veRL.", ge=0),
    },
    "gpu_memory_utilization": field("auto", "Fraction of device memory the run may fill: the paged engine's KV "
                                            "pool gets this fraction minus what is in use (params, optimizer "
                                            "state, reference), where the backend reports its memory (GPU / TPU; "
                                            "CPU: every slot at full length); 'auto': what is left, 0.9 of the "
                                            "memory less what is in use and the sampling step's logits buffers. "
                                            "The slots shrink to the sequences the pool holds at full length. "
                                            "veRL / vLLM (there: 0.5 / 0.9).", types=(float, str), gt=0, le=1,
                                    also=("auto",)),
    "kv_cache_dtype": field("auto", "Paged engine KV storage: 'auto' (the compute dtype) or 'int8' "
                                    "(per-token-per-head scales). vLLM.", choices=KV_CACHE_DTYPES),
    "multi_turn": {
        "enable": field(False, "Multi-turn rollouts (docs/agents.md): the model calls tools (hermes <tool_call>) "
                               "and / or talks with an interaction over several turns; tool / user tokens are "
                               "attended but masked out of the loss. Needs tool_config_path or "
                               "interaction_config_path. Training and validation both use it. veRL."),
        "max_assistant_turns": field(None, "Model turns per trajectory; None = until response_length. veRL.",
                                     types=int),
        "max_user_turns": field(None, "Tool / interaction replies per trajectory; None = unbounded. veRL.",
                                types=int),
        "tool_config_path": field(None, "Tools YAML (veRL's: tools: [{class_name, config, tool_schema}]); "
                                        "bad file or class = one error at start. veRL.", types=str),
        "interaction_config_path": field(None, "Interactions YAML (veRL's: interaction: [{name, class_name, "
                                               "config}]); rows pick one by extra_info.interaction_kwargs.name. "
                                               "veRL.", types=str),
        "max_parallel_calls": field(1, "Tool calls run at once (a thread pool over every trajectory's calls). "
                                       "veRL."),
        "max_tool_response_length": field(256, "Characters of one tool reply kept (see the truncate side). veRL."),
        "tool_response_truncate_side": field("middle", "'left' keeps the start, 'right' the end, 'middle' both "
                                                       "ends. veRL.", choices=("left", "middle", "right")),
        "format": field("hermes", "Tool-call format the model writes and the host parses; only 'hermes' "
                                  "(<tool_call>{json}</tool_call>). veRL.", choices=("hermes",)),
        "use_inference_chat_template": field(False, "False: the trained tokens are exactly the tokens the model "
                                                    "saw and produced (token in, token out). True (re-render the "
                                                    "conversation with the inference template) is not supported: "
                                                    "an error. veRL."),
        "enable_tokenization_sanity_check": field(True, "Re-render each finished conversation and count where its "
                                                        "tokenization differs from the rollout's ids "
                                                        "(multi_turn/tokenization_mismatches, first one logged). "
                                                        "veRL."),
        "tool_call_timeout_s": field(30.0, "Wall-clock limit of one tool call (the model reads a timeout error; "
                                           "counted in multi_turn/tool_timeouts). jaxrl_llm (veRL: none)."),
    },
    "val_kwargs": {
        "n": field(1, "Responses per validation prompt (reported as mean@n). veRL.", gt=0),
        "temperature": field(0.0, "Validation temperature. veRL.", ge=0),
        "top_k": field(-1, "Validation top-k; -1 = off. veRL.", gt=0, also=(-1,)),
        "top_p": field(1.0, "Validation top-p. veRL.", gt=0, le=1),
        "do_sample": field(False, "False = greedy validation. veRL."),
    },
}

REF = {
    "log_prob_micro_batch_size_per_device": field(None, "Sequences per device per reference-logprob forward; "
                                                        "'auto' = the largest that fits (trainer.memory_plan); "
                                                        "derived: actor.ppo_micro_batch_size_per_device. veRL.",
                                                  types=(int, str), gt=0),
    "log_prob_use_dynamic_bsz": field(None, "Token-budget batching of the reference pass; derived: "
                                            "actor.use_dynamic_bsz. veRL.", types=bool),
    "log_prob_max_token_len_per_device": field(None, "Token budget of that pass; derived: "
                                                     "actor.ppo_max_token_len_per_device. veRL.", types=int),
    "param_dtype": field(None, "Storage dtype of the frozen reference policy's params: 'float32' or "
                               "'bfloat16'; derived: actor_rollout_ref.model.dtype (the compute dtype, so a "
                               "bf16 run keeps a half-size reference; set float32 for an fp32 copy).",
                               types=str, choices=names.DTYPES),
    "param_offload": field(False, "Keep the reference params in pinned host memory, moved to the device only "
                                  "for the reference pass (warns and keeps them on device where the backend "
                                  "has no pinned host memory). veRL's ref.fsdp_config.param_offload is read as "
                                  "this key."),
}

MODEL = dict(
    model_fields("policy", "Policy weights: HF folder, .gguf file, our orbax checkpoint, or tiny:<arch> "
                     "(an in-process random model, dims from model.tiny). veRL."),
    lora_rank=field(0, "LoRA rank of the policy; 0 = full fine-tuning. > 0 trains only adapters (A random, B zero, "
                       "so step 0 is the base) with optimizer state for them alone; the frozen base is kept in "
                       "model.param_dtype (bfloat16 halves it; adapters stay float32), the reference policy is "
                       "the base with adapters off (no copy; ref.param_dtype / ref.param_offload do not apply) "
                       "and checkpoints hold the adapters (plus the base path). veRL."),
    lora_alpha=field(16, "LoRA scale numerator: adapters add (lora_alpha / lora_rank) * (x @ A) @ B. veRL.",
                     types=float),
    lora_dropout=field(0.0, "Dropout on the adapters' input in the update's forward (PEFT's lora_dropout: each "
                            "element dropped with this probability, the rest scaled by 1 / (1 - p); the sampler "
                            "and the no-grad passes see no dropout). PEFT / TRL.", ge=0, lt=1),
    logprob_impl=field("auto", "Fused log-prob head (jaxrl_llm/losses/logprob.py) of the policy's training, "
                               "reference and old log-prob passes: 'auto' (the Mosaic kernel on TPU where a kernel "
                               "vocab block divides the vocabulary; the chunked XLA scan on CPU, GPU (faster there "
                               "than the Triton kernel, measured on an H200) and otherwise), 'pallas' (the device's "
                               "kernel, forced: Triton on GPU), 'pallas_triton' / 'pallas_mosaic' (one kernel by name) "
                               "or 'xla' (any backend). Same values and gradients. jaxrl_llm.", choices=LOGPROB_IMPLS),
    batch_invariant=field(False, "Batch-invariant numerics (jaxrl_llm/models/invariant.py): every matmul, norm, "
                                 "attention and log-sum-exp of the policy sums a token's row in an order that does not "
                                 "depend on the batch, the sequence length or the engine's step, so in bf16 the "
                                 "rollout's log-probs equal the trainer's recomputation bit for bit "
                                 "(rollout_corr/max_abs_log_ratio 0). Costs time (docs/performance.md, 'Exact "
                                 "rollouts'); attention runs the mode's kernel on every path (GPU / TPU: Pallas, "
                                 "models/invariant_attention.py; CPU: blocked XLA), the paged engine's decode "
                                 "reading the pool in place (cascade attention cuts a slot's kernel walk at a key "
                                 "block instead of merging partial softmaxes; chunked prefill and speculative "
                                 "verification stay); mixture-of-experts layers run every token "
                                 "through fixed-tile expert blocks; packed rows (use_remove_padding) start each "
                                 "sequence at a 128-token key block and share no prompt (share_packed_prompts off). "
                                 "int8 KV is refused; Qwen3.5 runs its delta rule token by token. On a tensor "
                                 "split each device computes its GEMM output columns over the whole contraction "
                                 "(its input rows gathered; no partial sums cross devices), and the paged engine's "
                                 "decode keeps every weight split by its output columns over all devices; on an "
                                 "expert split a token's k expert outputs come home unmixed and are mixed there; a "
                                 "context split attends with gathered keys (mesh.context_attention is not used). "
                                 "veRL's vexact / vLLM's batch-invariant mode."),
    target_modules=field("all-linear", "Projections that get adapters: 'all-linear' (q/k/v/o_proj, gate/up/"
                                       "down_proj; DeepSeek's latent attention: q_a/q_b_proj, kv_a_proj_with_mqa, "
                                       "kv_b_proj) or a list of those names. veRL.", types=STR_OR_LIST),
    tiny={
        "num_hidden_layers": field(2, "Decoder blocks of a tiny:<arch> model (tests); names as "
                                      "jaxrl_llm.models.ModelConfig.tiny's overrides."),
        "hidden_size": field(64, "Hidden width of a tiny:<arch> model."),
        "num_attention_heads": field(4, "Attention heads of a tiny:<arch> model."),
        "num_key_value_heads": field(2, "Key/value heads (GQA) of a tiny:<arch> model."),
        "intermediate_size": field(128, "MLP width of a tiny:<arch> model."),
        "head_dim": field(None, "Per-head width of a tiny:<arch> model (Qwen3 and Gemma set it apart from the "
                                "hidden size); derived: hidden_size / num_attention_heads.", types=int, gt=0),
        "tie_word_embeddings": field(None, "A tiny:<arch> model's output head is its input embedding (Qwen2-0.5B "
                                           "/ 1.5B, Gemma) rather than a matrix of its own; derived: true for the "
                                           "Gemma families, else false.", types=bool),
        "vocab_size": field(None, "Vocabulary of a tiny:<arch> model; derived: the tokenizer's size.",
                            types=int),
        "max_position_embeddings": field(2048, "Context length of a tiny:<arch> model."),
        "num_experts": field(None, "Experts per layer of a tiny mixture-of-experts model (tiny:qwen3_moe, "
                                   "tiny:qwen2_moe, tiny:mixtral); derived: 8.", types=int, gt=0),
        "num_experts_per_tok": field(None, "Experts each token runs (top-k) in a tiny MoE model; derived: 2.",
                                     types=int, gt=0),
        "moe_intermediate_size": field(None, "Each expert's MLP width in a tiny MoE model; derived: 32.",
                                       types=int, gt=0),
        "seed": field(0, "Initialisation seed of a tiny:<arch> model (not a ModelConfig field)."),
    },
)
