"""ROLL's reward workers (`rewards.<domain>` of an RLVR config) -> our scoring: rule workers score with
jaxrl_llm's scorer for each row's data_source; one LLMJudgeRewardWorker (its only domain) becomes our
generative reward model (docs/importing.md, ROLL)."""
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


def import_rewards(m: Mapper, src: Source) -> None:
    """ROLL's reward workers, one per domain: rule workers score with jaxrl_llm's scorer for each row's
    data_source; one LLMJudgeRewardWorker (its only domain) becomes our generative reward model."""
    workers = src.take("rewards") or {}
    judges = [name for name, worker in workers.items()
              if str((worker or {}).get("worker_cls", "")).endswith(".LLMJudgeRewardWorker")]
    if not judges:
        if workers:
            m.ignore("rewards", "scoring uses jaxrl_llm's scorer for each row's data_source (or "
                                "custom_reward_function.path)")
        return
    if len(workers) > 1:
        m.error(f"rewards.{judges[0]}", f"an LLM judge beside the rule rewards {sorted(set(workers) - set(judges))}, "
                                        "each for its own domain of rows: jaxrl_llm scores every row with one reward "
                                        "setup (a judge, rules, or the two combined: reward_model.judge.combine)")
    _llm_judge(m, f"rewards.{judges[0]}", workers[judges[0]])


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
