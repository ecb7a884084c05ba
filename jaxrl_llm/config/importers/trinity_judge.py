"""Trinity-RFT's rubric judge (`default_workflow_type: rubric_judge_workflow` with an
`explorer.auxiliary_models` judge) -> our generative reward model.

RubricJudgeWorkflow (trinity/common/workflows/rubric_judge_workflow.py) samples the policy as the simple
workflow does (its own default system prompt when the taskset gives none), then asks the auxiliary model,
greedily, to rate each response 1-10 against the row's `rubric` list, and reads the rating from a ```json
block: (rating - 1) / 9, or 0 when unreadable. Ours: reward_model.style generative with that workflow's
prompts, `judge.rubric_key: rubric` (the column copied into extra_info: data.extra_info_keys), parser
`json_rating` over [1, 10], default score 0, temperature 0. The prompts are read (with `ast`, never run)
from the workflow module of the Trinity checkout the config comes from, as ROLL's judge prompts are.
"""
from __future__ import annotations

import ast
import os
import pathlib
from typing import Any

from jaxrl_llm.config.importers.common import Mapper

RUBRIC_WORKFLOWS = ("rubric_judge_workflow",)
WORKFLOW_FILE = "trinity/common/workflows/rubric_judge_workflow.py"
JUDGE = "reward_model.judge"
AUX = "explorer.auxiliary_models"
# the workflow's f-string fields -> our template's
FIELDS = {"self.task_desc": "{prompt}", "response": "{response}", "rubric_list_string": "{rubric}"}
# an auxiliary model's keys that say where and how its engine runs
AUX_PLACEMENT = ("engine_type", "engine_num", "tensor_parallel_size", "use_v1", "enforce_eager", "dtype", "seed",
                 "enable_prefix_caching", "enable_chunked_prefill", "gpu_memory_utilization", "bundle_indices",
                 "enable_openai_api", "enable_history", "enable_auto_tool_choice", "tool_call_parser",
                 "reasoning_parser", "model_path")


def import_rubric_judge(m: Mapper, auxiliary: list[Any], workflow: str) -> None:
    """The rubric workflow's judge (the first auxiliary model, as the workflow calls it) and prompts."""
    if not auxiliary:
        m.error("buffer.explorer_input.default_workflow_type", f"{workflow!r}: judges with explorer.auxiliary_models"
                                                               "[0], and none is given")
    if len(auxiliary) > 1:
        m.error(f"{AUX}[1]", "the rubric workflow calls the first auxiliary model only; jaxrl_llm runs one judge")
    model = dict(auxiliary[0] or {})
    where = f"{AUX}[0]"
    if not model.get("model_path"):
        m.error(f"{where}.model_path", "not given: the judge model's weights")
    prompts = workflow_prompts(m, f"buffer.explorer_input.default_workflow_type={workflow}")
    m.set("reward_model.enable", True, where)
    m.set("reward_model.style", "generative", where)
    m.set("reward_model.model.path", model["model_path"], f"{where}.model_path")
    m.set(f"{JUDGE}.system_prompt", prompts["judge_system"], WORKFLOW_FILE)
    m.set(f"{JUDGE}.template", prompts["judge_user"], WORKFLOW_FILE)
    m.set(f"{JUDGE}.rubric_key", "rubric", WORKFLOW_FILE)
    m.set("data.extra_info_keys", ["rubric"], WORKFLOW_FILE)
    m.set(f"{JUDGE}.parser", "json_rating", WORKFLOW_FILE)
    m.set(f"{JUDGE}.min_score", 1.0, WORKFLOW_FILE)
    m.set(f"{JUDGE}.max_score", 10.0, WORKFLOW_FILE)
    m.set(f"{JUDGE}.default_score", 0.0, WORKFLOW_FILE)
    m.set(f"{JUDGE}.temperature", 0.0, WORKFLOW_FILE)
    m.set(f"{JUDGE}.combine", "judge", WORKFLOW_FILE)
    if "data.system_prompt" not in m.settings:  # the workflow's own when the taskset gives none
        m.set("data.system_prompt", prompts["policy_system"], WORKFLOW_FILE)
    response = model.get("max_response_tokens")
    if response:
        m.set(f"{JUDGE}.max_new_tokens", int(response), f"{where}.max_response_tokens")
    prompt = model.get("max_prompt_tokens")
    if not prompt and model.get("max_model_len") and response:
        prompt = int(model["max_model_len"]) - int(response)
    if prompt:
        m.set(f"{JUDGE}.max_prompt_length", int(prompt), f"{where}.max_prompt_tokens")
    if model.get("enable_thinking") is not None:
        m.set(f"{JUDGE}.chat_template_kwargs", {"enable_thinking": bool(model["enable_thinking"])},
              f"{where}.enable_thinking")
    if model.get("chat_template"):
        m.error(f"{where}.chat_template", "a judge chat template other than the judge model's own is not available")
    known = {"max_response_tokens", "max_prompt_tokens", "max_model_len", "enable_thinking", "chat_template"}
    for key, value in model.items():
        if key in AUX_PLACEMENT:
            m.ignore(f"{where}.{key}", "where and how Trinity's inference engine runs the judge", value)
        elif key not in known:
            m.error(f"{where}.{key}", f"{value!r}: no counterpart for the judge model")


def workflow_prompts(m: Mapper, key: str) -> dict[str, str]:
    """The rubric workflow's prompts, read from WORKFLOW_FILE of the Trinity checkout the config comes from
    (the folders above the file, then the working directory)."""
    source = pathlib.Path(m.source).resolve()
    places = [folder / WORKFLOW_FILE for folder in source.parents] + [pathlib.Path(os.getcwd()) / WORKFLOW_FILE]
    found = next((place for place in places if place.is_file()), None)
    if found is None:
        m.error(key, f"its prompts are read from {WORKFLOW_FILE} of the Trinity checkout this file comes from, and "
                     f"none is above {source.parent} or in the working directory; run from Trinity's root")
    try:
        return read_prompts(pathlib.Path(str(found)).read_text())
    except ValueError as err:
        m.error(key, f"{found}: {err}")


def read_prompts(text: str) -> dict[str, str]:
    """{policy_system, judge_system, judge_user} from the workflow module's source (ast, never run)."""
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = ast.unparse(node.targets[0])
        value = node.value
        if target == "self.system_prompt" and isinstance(value, ast.Constant) and isinstance(value.value, str):
            out["policy_system"] = value.value
        elif target == "ruler_system_prompt" and isinstance(value, ast.Constant) and isinstance(value.value, str):
            out["judge_system"] = value.value
        elif target == "ruler_user_prompt":
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "strip":
                body, strip = value.func.value, True  # f"""...""".strip()
            else:
                body, strip = value, False
            if not isinstance(body, ast.JoinedStr):
                raise ValueError("ruler_user_prompt is not an f-string")
            out["judge_user"] = _template(body).strip() if strip else _template(body)
    missing = [k for k in ("policy_system", "judge_system", "judge_user") if k not in out]
    if missing:
        raise ValueError(f"found no {', '.join(missing)} (self.system_prompt, ruler_system_prompt, ruler_user_prompt)")
    return out


def _template(node: ast.JoinedStr) -> str:
    """The f-string as our judge template: its text, its fields as {prompt} / {response} / {rubric}."""
    parts = []
    for piece in node.values:
        if isinstance(piece, ast.Constant):
            parts.append(str(piece.value))
        elif isinstance(piece, ast.FormattedValue):
            name = ast.unparse(piece.value)
            if name not in FIELDS:
                raise ValueError(f"the judge prompt's field {{{name}}} has no counterpart ({', '.join(FIELDS)})")
            parts.append(FIELDS[name])
    return "".join(parts)
