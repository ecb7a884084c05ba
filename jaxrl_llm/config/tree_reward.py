"""The config tree's reward sections: `reward_model` (the reward manager and its shaping, a sequence-classification
reward model or a generative judge) and `custom_reward_function` (a user's scoring function, open-r1's reward
functions). Part of config/tree.py's TREE; docs/config.md is generated from it."""
from __future__ import annotations

from jaxrl_llm.config import names
from jaxrl_llm.config.schema import field

REWARD_MODEL = {
    "enable": field(False, "Score responses with a sequence-classification reward model. veRL."),
    "reward_manager": field("naive", "How rule/custom scores are computed: naive (in-process) or prime "
                                     "(process pool: also survives hard crashes and calls stuck in C code); "
                                     "DAPO shaping: reward_kwargs. veRL.", choices=names.reward_managers),
    "reward_kwargs": {
        "timeout_s": field(10.0, "Seconds per compute_score call before it scores 0, counted in "
                                 "reward/num_timeouts (naive: raised in the call, by a SIGALRM timer on the main "
                                 "thread or a watchdog elsewhere; prime: the worker is killed).", gt=0),
        "num_workers": field(4, "Processes of the prime reward manager.", gt=0),
        "max_resp_len": field(None, "Response length the overlong penalty is measured against; derived: "
                                    "data.max_response_length. veRL DAPO.", types=int),
        "overlong_buffer_cfg": {
            "enable": field(False, "DAPO soft overlong punishment (Yu et al. 2025): a penalty ramp set by "
                                   "len and penalty_factor."),
            "len": field(4096, "Buffer length: the penalty ramps linearly over the last `len` tokens "
                               "before max_resp_len. veRL DAPO default.", gt=0),
            "penalty_factor": field(1.0, "Penalty at max_resp_len (reward -= factor * overflow / len).", gt=0),
            "log": field(False, "Log the overlong penalty and flag as metrics."),
        },
    },
    "missing_eos_penalty": field(None, "Subtracted from the score of responses that end without EOS; "
                                       "None = off. TRL.", types=float),
    "model": {
        "path": field(None, "Reward model: an HF folder with a sequence-classification head (style "
                            "discriminative), or the judge's weights (style generative: HF folder, .gguf or our "
                            "checkpoint). veRL.", types=str),
        "input_tokenizer": field(None, "Tokenizer of the policy whose text is re-tokenized for the reward "
                                       "model; derived: actor_rollout_ref.model.path. veRL.", types=str),
    },
    "style": field("discriminative", "discriminative: a sequence-classification head scores each response; "
                                     "generative: a judge model reads prompt and response, writes a verdict "
                                     "(reward_model.judge), and a parser turns it into the score.",
                   choices=("discriminative", "generative")),
    "judge": {  # reward_model.style=generative (roles/judge.py)
        "template": field("Question:\n{prompt}\n\nAnswer:\n{response}\n\nIs the answer correct? Reply yes or no.",
                          "The judge's user message: {prompt} (the row's last user message), {response}, "
                          "{ground_truth} and {rubric} (rubric_key) are filled in; rendered with the judge's "
                          "chat template."),
        "system_prompt": field(None, "System message of the judge's chat.", types=str),
        "parser": field("yes_no", "Verdict -> score: number (the last number, clipped to [min_score, "
                                  "max_score] and scaled to [0, 1]), boxed (\\boxed{x}, as number), yes_no "
                                  "(1 / 0 by the first yes or no), contains_yes (1 if 'yes' appears anywhere, else "
                                  "0 if 'no' does: ROLL's LLM judge), score_tag ('Score: 7/10' -> 0.7), json_rating "
                                  "(a ```json block's \"rating\" within [min_score, max_score], scaled: Trinity's "
                                  "rubric judge), or 'file.py:fn' (fn(verdict, **row) -> float or None)."),
        "min_score": field(0.0, "number / boxed: the lowest score the template asks for."),
        "max_score": field(10.0, "number / boxed: the highest score the template asks for."),
        "default_score": field(0.0, "Score of a verdict the parser cannot read (counted in "
                                    "reward/judge_parse_failures)."),
        "max_new_tokens": field(16, "Longest verdict.", gt=0),
        "temperature": field(0.0, "Judge sampling temperature; 0 = greedy.", ge=0),
        "top_p": field(1.0, "Judge nucleus sampling (with temperature > 0); 1 = off.", gt=0, le=1),
        "top_k": field(-1, "Judge top-k sampling (with temperature > 0); -1 = off."),
        "max_prompt_length": field(512, "Longest rendered judge prompt, in tokens (a longer one keeps its last "
                                        "tokens: the response and the question after it).", gt=0),
        "combine": field("judge", "With the rule scorer: judge (the judge's score alone), sum (rule_weight * "
                                  "rule + judge_weight * judge), or fallback (the judge only where the rule "
                                  "scorer has no verdict: it returned None, or the data source has none).",
                         choices=("judge", "sum", "fallback")),
        "data_sources": field([], "The data sources whose rows the judge grades; the other rows take the rule "
                                  "scorer's score alone (a ROLL run's judge domain beside its rule domains: "
                                  "data.domains.data_sources); [] = every row.", types=list),
        "rubric_key": field(None, "The extra_info key holding each row's rubric (a list of {description, weight}, "
                                  "or its JSON), rendered into the template's {rubric} as 'Rubric i (weight: w): "
                                  "description' lines (Trinity's rubric judge); None = no rubric.", types=str),
        "chat_template_kwargs": field({}, "Keyword arguments of the judge's chat template (e.g. {enable_thinking: "
                                          "false}). veRL: apply_chat_template_kwargs.", open=True),
        "rule_weight": field(1.0, "combine=sum: weight of the rule score."),
        "judge_weight": field(1.0, "combine=sum: weight of the judge score."),
        "on_rollout_devices": field(True, "With a split mesh (mesh.rollout_devices), the judge generates on "
                                          "the rollout devices; else on the training mesh."),
    },
    "max_length": field(None, "Reward-model input token limit; derived: prompt + response lengths. veRL.",
                        types=int),
    "micro_batch_size_per_device": field(None, "Sequences per device per reward-model forward; derived: "
                                               "actor.ppo_micro_batch_size_per_device. veRL.", types=int),
}

CUSTOM_REWARD = {
    "path": field(None, "Python file defining the reward function; None = built-ins by data_source. veRL.",
                  types=str),
    "name": field("compute_score", "Function name in that file: compute_score(data_source, solution_str, "
                                   "ground_truth, extra_info=None). veRL."),
    "reward_kwargs": field({}, "Extra keyword arguments passed to the custom function. veRL.", open=True),
    "reward_funcs": field([], "open-r1's reward functions by name, summed with reward_weights (accuracy = the "
                              "row's scorer: path / name above or the data_source's built-in; format, tag_count, "
                              "reasoning_steps, cosine, repetition_penalty, length, code, binary_code, "
                              "code_format; formulas: docs/algorithms.md); [] = the scorer alone. TRL / open-r1.",
                          types=list),
    "reward_weights": field(None, "One weight per reward_funcs entry; None = 1.0 each. TRL / open-r1.", types=list),
    "openr1": {
        "cosine_min_value_wrong": field(0.0, "cosine: reward of a wrong answer of length 0 (the ends swap for wrong "
                                             "answers: longer scores closer to this). open-r1."),
        "cosine_max_value_wrong": field(-0.5, "cosine: reward of a wrong answer of cosine_max_len characters. "
                                              "open-r1."),
        "cosine_min_value_correct": field(0.5, "cosine: reward of a correct answer of cosine_max_len characters. "
                                               "open-r1."),
        "cosine_max_value_correct": field(1.0, "cosine: reward of a correct answer of length 0. open-r1."),
        "cosine_max_len": field(1000, "cosine: the length (characters) the cosine schedule spans. open-r1.", gt=0),
        "repetition_n_grams": field(3, "repetition_penalty: n-gram size (words). open-r1.", gt=0),
        "repetition_max_penalty": field(-1.0, "repetition_penalty: the reward of a response made of one repeated "
                                              "n-gram (<= 0). open-r1.", le=0),
        "code_language": field("python", "code_format: the fenced block's language. open-r1."),
    },
}
