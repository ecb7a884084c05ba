"""The `sft`, `dpo`, `generation` and `evaluation` sections of the config tree: supervised fine-tuning
(`launch/sft.py`) and Trinity-RFT's SFT warm-up before RL, preference training (`launch/dpo.py`), batch
generation and offline evaluation (`launch/generate.py`, `launch/evaluate.py`). The rest of such a run
reads the keys RL reads: `data.*` (files, batch size, prompt column, chat template, truncation, shuffle),
`actor_rollout_ref.model.*` (path, LoRA, gradient checkpointing), `actor_rollout_ref.actor.optim.*` and
`grad_clip`, `actor_rollout_ref.rollout.*` (sampling), `trainer.*` and `mesh.*`. veRL's / TRL's names for
each key: docs/sft_dpo_eval.md.
"""
from __future__ import annotations

from jaxrl_llm.config.schema import field

SFT = {
    "prompt_key": field(None, "Column holding the prompt of a single-turn row; None = data.prompt_key (an RL run's "
                              "SFT warm-up may read other columns than its prompts). Trinity-RFT "
                              "sft_warmup_dataset.format.prompt_key.", types=str),
    "messages_key": field(None, "Column holding a conversation (sft.multiturn); None = data.messages_key. Trinity-RFT "
                                "sft_warmup_dataset.format.messages_key.", types=str),
    "response_key": field("response", "Column holding the response of a single-turn row (a string). veRL SFT "
                                      "data.response_key."),
    "prompt_dict_keys": field(None, "Keys read in turn inside the prompt column (a dict column: "
                                    "row[prompt_key][k1][k2]...); None = the column itself. veRL SFT "
                                    "data.prompt_dict_keys.", types=list),
    "response_dict_keys": field(None, "Keys read in turn inside the response column (e.g. ['ground_truth'] with "
                                      "response_key=reward_model reads veRL's RL rows). veRL SFT "
                                      "data.response_dict_keys.", types=list),
    "multiturn": field(False, "Rows are conversations (data.messages_key: a list of chat messages); the loss "
                              "covers every assistant turn. veRL SFT data.multiturn.enable (the engine trainer "
                              "reads messages always)."),
    "tools_key": field("tools", "Column holding a conversation's tool schemas (OpenAI format), rendered by the "
                                "chat template. veRL SFT data.tools_key."),
    "enable_thinking_key": field("enable_thinking", "Column holding a conversation's enable_thinking flag, "
                                                    "passed to the chat template. veRL SFT "
                                                    "data.enable_thinking_key."),
    "apply_chat_template_kwargs": field({}, "Extra keyword arguments of every apply_chat_template call (e.g. "
                                            "{enable_thinking: false}). veRL SFT data.apply_chat_template_kwargs.",
                                        open=True),
    "max_length": field(1024, "Token budget of one sequence (prompt + response, or a whole conversation); "
                              "longer rows follow data.truncation (error / left / right / middle). veRL SFT "
                              "data.max_length.", gt=1),
    "micro_batch_size_per_device": field(4, "Sequences per device per forward / backward (gradient accumulation "
                                            "over the rest of data.train_batch_size). veRL SFT "
                                            "data.micro_batch_size_per_gpu.", gt=0),
    "use_dynamic_bsz": field(False, "Micro-batches packed to max_token_len_per_device tokens instead of a fixed "
                                    "number of sequences (needs model.use_remove_padding). veRL SFT "
                                    "data.use_dynamic_bsz."),
    "max_token_len_per_device": field(8192, "Token budget of a dynamic micro-batch per device. veRL SFT "
                                            "data.max_token_len_per_gpu.", gt=0),
    "warmup_steps": field(0, "RL runs (launch/train.py): SFT steps on the policy before the first RL step, on "
                             "sft.warmup_files with the keys above (one optimizer step per data.train_batch_size "
                             "sequences, at actor.optim.lr without its schedule). Trinity-RFT "
                             "buffer.trainer_input.sft_warmup_steps.", ge=0),
    "warmup_files": field(None, "RL runs: the SFT rows of the warm-up (same formats as data.train_files). "
                                "Trinity-RFT buffer.trainer_input.sft_warmup_dataset.", types=(str, list)),
}

# `dpo`: preference training (`launch/dpo.py`). A DPO run reads the keys an SFT run reads (data files,
# data.prompt_key, data.truncation, model, optimizer, trainer, mesh); data.train_batch_size counts pairs.
DPO = {
    "chosen_key": field("chosen", "Column holding the preferred response (a string, or chat messages whose last "
                                  "assistant turn is it). TRL / veRL preference rows."),
    "rejected_key": field("rejected", "Column holding the dispreferred response (as chosen_key). TRL / veRL."),
    "loss_type": field("sigmoid", "sigmoid (DPO), ipo (on length-averaged log-probs, as TRL) or hinge (SLiC). TRL "
                                  "DPOConfig.loss_type.", choices=("sigmoid", "ipo", "hinge")),
    "beta": field(0.1, "Strength of the implicit KL to the reference (IPO: its tau). TRL DPOConfig.beta.", gt=0),
    "label_smoothing": field(0.0, "cDPO / robust DPO: the assumed probability that a pair's labels are flipped "
                                  "(sigmoid loss only). TRL DPOConfig.label_smoothing.", ge=0, lt=0.5),
    "reference_free": field(False, "Take the reference's log-probs as 0 (no reference model). TRL "
                                   "DPOConfig.reference_free."),
    "ref_chosen_key": field("ref_chosen_logps", "Column of precomputed reference log-probs of the chosen response; "
                                                "used when the rows have it and ref_rejected_key (TRL's "
                                                "precompute_ref_log_probs writes these), else the frozen reference "
                                                "(actor_rollout_ref.ref.*) scores every batch."),
    "ref_rejected_key": field("ref_rejected_logps", "Column of precomputed reference log-probs of the rejected "
                                                    "response (see ref_chosen_key)."),
    "max_length": field(1024, "Token budget of prompt + response; longer pairs follow data.truncation (left: the "
                              "prompt's start is cut, the same for both; right: the responses' ends). TRL "
                              "DPOConfig.max_length.", gt=1),
    "micro_batch_size_per_device": field(2, "Pairs per device per forward / backward (2 sequences each). veRL / TRL "
                                            "per_device_train_batch_size.", gt=0),
}

# `generation` (`launch/generate.py`): a prompt file -> the same rows with n sampled responses each, as veRL's
# main_generation. The prompts are read as RL prompts are (data.prompt_key, chat template, system prompt,
# data.max_prompt_length / truncation); sampling follows actor_rollout_ref.rollout.* (temperature, top_p,
# top_k, do_sample, engine), data.max_response_length new tokens at most; the model is
# actor_rollout_ref.model.path (an HF folder, .gguf, one of our checkpoints or tiny:<arch>).
GENERATION = {
    "input_path": field(None, "The prompt file (parquet / jsonl / json / csv, veRL's row layout). veRL generation "
                              "data.path.", types=str),
    "output_path": field(None, "Where the rows with their responses are written (.parquet or .jsonl); finished "
                               "batches wait in <output_path>.parts/ until the end, so a killed run resumes "
                               "there. veRL generation data.output_path.", types=str),
    "n_samples": field(1, "Responses per prompt. veRL generation data.n_samples.", gt=0),
    "batch_size": field(128, "Prompts per engine call (and per resumable part). veRL generation data.batch_size.",
                        gt=0),
    "response_key": field("responses", "The column the responses are written to (a list of n strings)."),
}

# `evaluation` (`launch/evaluate.py`): a file of responses -> scores per data source, as veRL's main_eval
# (evaluation.yaml), with custom_reward_function.* choosing the scorer (default: the built-in scorers).
EVALUATION = {
    "path": field(None, "The responses file; None = generation.output_path. veRL evaluation data.path.", types=str),
    "response_key": field("responses", "Column of each row's responses (a list of strings, or one string). veRL "
                                       "evaluation data.response_key."),
    "data_source_key": field("data_source", "Column naming the scorer / grouping of a row. veRL evaluation "
                                            "data.data_source_key."),
    "reward_model_key": field("reward_model", "Column holding {ground_truth: ...}. veRL evaluation "
                                              "data.reward_model_key."),
    "output_path": field(None, "The JSON report; None = <path without its suffix>.eval.json.", types=str),
    "correct_threshold": field(0.0, "A response counts as correct for pass@k when its score is above this.",
                               types=float),
}
