"""ROLL's reward workers (`rewards.<domain>` of an RLVR config) -> our scoring: each rule worker's domain
scores with the built-in scorer of its formula (data.domains.data_sources; the code domain's rows with
their test-case columns as ground truth); one LLMJudgeRewardWorker becomes our generative reward model, on
its own domain's rows (docs/importing.md, ROLL)."""
from __future__ import annotations

import ast
import os
import pathlib
from typing import Any

from jaxrl_llm.config.importers.common import Mapper, Source

# ROLL's GeneratingArguments defaults (roll/configs/generating_args.py): ROLL samples unless told not to
ROLL_SAMPLING = {"do_sample": True, "temperature": 0.95, "top_p": 0.7, "top_k": 50}

PROMPTS_FILE = "roll/utils/prompt.py"  # ROLL's judge prompts by name (its prompt_maps)
JUDGE = "reward_model.judge"


# ROLL's rule reward workers (class name) -> the built-in scorer (data_source) their domain's rows get
RULE_SOURCES = {
    "MathRuleRewardWorker": "lighteval/MATH",
    "CrossThinkQARuleRewardWorker": "crossthinkqa",
    "GeneralRuleRewardWorker": "ifeval",
}
CODE_COLUMNS = ("case_type", "test_cases", "test_case_function")  # what ROLL's code worker reads of a row
JUDGE_SOURCE = "llm_judge"  # the data_source of a judge domain's rows (reward_model.judge.data_sources)
# a worker's keys that do nothing here: where it runs, and the tokenizer it decodes with (ours: the policy's)
WORKER_PLACEMENT = ("world_size", "infer_batch_size", "device_mapping", "num_gpus_per_worker", "system_envs",
                    "model_args", "data_args", "strategy_args", "use_local", "code_url", "tag_included",
                    "worker_cls")


def import_rewards(m: Mapper, src: Source) -> dict[str, list[str]]:
    """ROLL's reward workers, one per domain (`rewards.<domain>`): each rule worker's rows get the data_source
    of our built-in scorer with its formula (data.domains.data_sources, by the rows' tag through each worker's
    tag_included: data.domains.members); one LLMJudgeRewardWorker becomes our generative reward model, grading
    its domain's rows only when there are others. Returns each domain's tags."""
    workers = src.take("rewards") or {}
    judges = [name for name, worker in workers.items() if _class(worker) == "LLMJudgeRewardWorker"]
    if len(judges) > 1:
        m.error(f"rewards.{judges[1]}", f"a second LLM judge (beside {judges[0]!r}): jaxrl_llm runs one judge model")
    members: dict[str, list[str]] = {}
    sources: dict[str, str] = {}
    code_columns: dict[str, list[str]] = {}
    for name, worker in workers.items():
        where, worker = f"rewards.{name}", worker or {}
        kind = _class(worker)
        if kind == "LLMJudgeRewardWorker":
            _llm_judge(m, where, worker)
            if len(workers) > 1:
                sources[name] = JUDGE_SOURCE
                m.set(f"{JUDGE}.data_sources", [JUDGE_SOURCE], f"{where}.tag_included")
        elif kind in RULE_SOURCES:
            sources[name] = RULE_SOURCES[kind]
            _rule_worker(m, where, worker, kind)
        elif kind == "CodeSandboxRewardWorker":  # its rows' test-case columns as the code scorer's ground truth
            sources[name] = "code"
            code_columns[name] = list(CODE_COLUMNS)  # use_local or code_url: the same tests, in our sandbox
        else:
            m.error(f"{where}.worker_cls", f"{worker.get('worker_cls')!r}: no built-in counterpart (jaxrl_llm's: "
                                           f"{', '.join(RULE_SOURCES)}, CodeSandboxRewardWorker, LLMJudgeRewardWorker)")
        members[name] = [str(tag) for tag in worker.get("tag_included") or []]
        m.ignore(f"{where}.{{{','.join(k for k in WORKER_PLACEMENT if k in worker)}}}",
                 "where ROLL runs the worker (or its code sandbox) and the tokenizer it decodes with (jaxrl_llm "
                 "scores the decoded responses in the trainer)")
    if sources:
        m.set("data.domains.key", "tag", "rewards.*.tag_included")
        m.set("data.domains.members", {k: v for k, v in members.items() if v}, "rewards.*.tag_included")
        m.set("data.domains.data_sources", sources, "rewards.*.worker_cls")
        if code_columns:
            m.set("data.domains.ground_truth_columns", code_columns, "rewards.*.worker_cls")
        math = [name for name, source in sources.items() if source == RULE_SOURCES["MathRuleRewardWorker"]]
        if math:  # ROLL puts a row whose tag no worker lists in math_rule
            m.set("data.default_data_source", sources[math[0]], f"rewards.{math[0]}.worker_cls")
    return members


def _class(worker: Any) -> str:
    return str((worker or {}).get("worker_cls", "")).rsplit(".", 1)[-1]


def _rule_worker(m: Mapper, where: str, worker: dict[str, Any], kind: str) -> None:
    """A rule worker's own keys."""
    if kind == "MathRuleRewardWorker":
        m.ignore(f"{where}.worker_cls=MathRuleRewardWorker", "ROLL checks the answer with math_verify; "
                 "jaxrl_llm's MATH scorer compares the last \\boxed{} with the ground truth as normalised strings "
                 "(1 / 0, as ROLL's)")
    if kind == "CrossThinkQARuleRewardWorker":
        m.set("custom_reward_function.reward_kwargs.reward_type", str(worker.get("reward_type", "soft")),
              f"{where}.reward_type")
        coef = float(worker.get("response_length_penalty_coef", 0.0) or 0.0)
        if coef:
            m.error(f"{where}.response_length_penalty_coef", f"{coef!r}: ROLL's length reward (read from the "
                                                              "padded token tensor) is not built in; 0 turns it off")
    for key in ("format_pattern", "query_filter_config"):
        if worker.get(key) is not None:
            m.error(f"{where}.{key}", f"{worker[key]!r}: not built in for ROLL's reward workers")


def _llm_judge(m: Mapper, where: str, worker: dict[str, Any]) -> None:
    """ROLL's LLMJudgeRewardWorker (roll/pipeline/rlvr/rewards/llm_judge_reward_worker.py) as our judge: its
    prompt, 'yes' anywhere in the verdict scores 1 (else 0), its generating args."""
    kind = worker.get("judge_model_type", "api")
    if kind != "inference":
        m.error(f"{where}.judge_model_type", f"{kind!r}: an API judge (an OpenAI-style server) is not available; "
                                             "'inference' runs the judge model in the run")
    name = worker.get("judge_prompt")
    template = _judge_template(m, f"{where}.judge_prompt", name)
    path = (worker.get("model_args") or {}).get("model_name_or_path")
    if not path:
        m.error(f"{where}.model_args.model_name_or_path", "not given: the judge model's weights")
    gen = worker.get("generating_args") or {}
    temperature = float(gen.get("temperature", ROLL_SAMPLING["temperature"]))
    sampled = gen.get("do_sample", True) and temperature > 0
    m.set("reward_model.style", "generative", f"{where}.worker_cls")
    m.set("reward_model.model.path", path, f"{where}.model_args.model_name_or_path")
    m.set(f"{JUDGE}.template", template, f"{where}.judge_prompt")
    m.set(f"{JUDGE}.parser", "contains_yes", f"{where}.worker_cls")
    m.set(f"{JUDGE}.default_score", 0.0, f"{where}.worker_cls")
    m.set(f"{JUDGE}.combine", "judge", f"{where}.worker_cls")
    m.set(f"{JUDGE}.temperature", temperature if sampled else 0.0, f"{where}.generating_args.temperature")
    m.set(f"{JUDGE}.top_p", float(gen.get("top_p", ROLL_SAMPLING["top_p"])), f"{where}.generating_args.top_p")
    m.set(f"{JUDGE}.top_k", int(gen.get("top_k", ROLL_SAMPLING["top_k"]) or -1), f"{where}.generating_args.top_k")
    new_tokens = int(gen.get("max_new_tokens", 100))
    m.set(f"{JUDGE}.max_new_tokens", new_tokens, f"{where}.generating_args.max_new_tokens")
    for key in ("num_beams", "num_return_sequences"):
        if int(gen.get(key, 1)) != 1:
            m.error(f"{where}.generating_args.{key}", f"{gen[key]!r}: the judge writes one verdict, sampled")
    # vLLM's max_model_len bounds the judge's prompt and verdict; without it, the policy's prompt and response
    # with room for the template
    max_len = ((worker.get("strategy_args") or {}).get("strategy_config") or {}).get("max_model_len")
    room = int(max_len) - new_tokens if max_len else (
        int(m.get("data.max_prompt_length")) + int(m.get("data.max_response_length")) + 512)
    m.set(f"{JUDGE}.max_prompt_length", room, f"{where}.strategy_args.strategy_config.max_model_len")
    m.ignore(f"{where}.data_args.template", "the judge's prompt is rendered with the judge model's own chat template")


def _judge_template(m: Mapper, key: str, name: Any) -> str:
    """ROLL's judge prompt `name`, read from roll/utils/prompt.py of the ROLL checkout the config comes from
    (the folders above the file, then the working directory: ROLL runs its examples from its root), with its
    fields renamed to ours ({question} -> {prompt}, {reference} -> {ground_truth}). Parsed, never run."""
    if name is None:
        m.error(key, "not given: ROLL's built-in fallback prompt asks for 'Score: n' but ROLL then reads yes / no; "
                     "name one of its prompt_maps, or set reward_model.judge.template yourself")
    source = pathlib.Path(m.source).resolve()
    places = [folder / PROMPTS_FILE for folder in source.parents] + [pathlib.Path(os.getcwd()) / PROMPTS_FILE]
    found = next((place for place in places if place.is_file()), None)
    if found is None:
        m.error(key, f"{name!r}: ROLL's prompt text is read from {PROMPTS_FILE} of the ROLL checkout this file comes "
                     f"from, and none is above {source.parent} or in the working directory; run from ROLL's root, or "
                     "set reward_model.judge.template")
    prompts = prompt_maps(pathlib.Path(str(found)).read_text())
    if name not in prompts:
        m.error(key, f"{name!r}: {found} maps {', '.join(prompts) or 'no prompt'}")
    return prompts[name].replace("{question}", "{prompt}").replace("{reference}", "{ground_truth}")


def prompt_maps(text: str) -> dict[str, str]:
    """ROLL's `prompt_maps` (name -> prompt text) from its prompt module's source: module-level string
    constants and the dict naming them, read with `ast`."""
    strings: dict[str, str] = {}
    maps: dict[str, str] = {}
    for node in ast.parse(text).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        target, value = node.targets[0].id, node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            strings[target] = value.value
        elif target == "prompt_maps" and isinstance(value, ast.Dict):
            for k, v in zip(value.keys, value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Name) and v.id in strings:
                    maps[str(k.value)] = strings[v.id]
    return maps
