"""Trinity-RFT tasksets (`buffer.explorer_input`) -> data.* and the rollout / validation sampling.

A taskset is `path` + `subset_name` + `split` (+ `format` column keys, `rollout_args` sampling). A
file path is used as is; a folder (a local copy of a Hugging Face dataset) is searched for the
split's files under `<path>/<subset_name>` then `<path>` (`<split>.parquet`, `<split>-*.parquet`,
... any of .parquet/.jsonl/.json/.csv); a folder without such files maps to
`<path>/<split>.parquet` (veRL's layout), which validation then reports if it is missing. The
format keys map to ours: `prompt_key` -> data.prompt_key, `response_key` (the reference answer's
column) -> data.ground_truth_key, `system_prompt` -> data.system_prompt, `chat_template` ->
data.chat_template. Scoring is jaxrl_llm's (each row's `data_source` scorer or
`custom_reward_function`): rows without a data_source column take `data.default_data_source`, set
from the reward function (`math_dapo_reward` -> math_dapo) or from a taskset path that names a
built-in source (openai/gsm8k). Single-turn math / simple workflows are accepted with a note, other
workflows are errors; DAPO's overlong penalty (`reward_fn_args`) is veRL's overlong buffer.
"""
from __future__ import annotations

import glob
import os
from typing import Any

from jaxrl_llm.config.importers.common import Mapper, Source, SourceValue
from jaxrl_llm.config.importers.trinity_judge import RUBRIC_WORKFLOWS
from jaxrl_llm.data.prompts import NATIVE_TEMPLATE
from jaxrl_llm.data.sources import SUPPORTED_SUFFIXES
from jaxrl_llm.rewards.scorers import has_builtin_scorer

EI = "buffer.explorer_input"
SINGLE_TURN_WORKFLOWS = ("simple_workflow", "async_simple_workflow", "math_workflow", "async_math_workflow",
                         "math_boxed_workflow", "async_math_boxed_workflow")
SCORING_NOTE = ("scoring uses jaxrl_llm's scorer for each row's data_source (or custom_reward_function.path) "
                "and the tokenizer's chat template")
FORMAT_ERRORS = {
    "system_prompt_key": "a per-row system prompt column is not available (put it in the data's message lists, or "
                         "one system_prompt for all rows)",
    "reply_prefix": "a reply prefix is not available",
    "image_key": "multimodal data is not available",
    "video_key": "multimodal data is not available",
    "enable_concatenated_multi_turn": "multi-turn data is not available",
}


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def taskset_files(path: str, split: str, subset: str | None = None) -> list[str]:
    """The data files of a Trinity taskset (see the module docstring)."""
    local = os.path.expanduser(path)
    if local.endswith(SUPPORTED_SUFFIXES):
        return [path]
    folders = [os.path.join(local, subset), local] if subset else [local]
    for folder in folders:
        if not os.path.isdir(folder):
            continue
        for pattern in (f"{split}.*", f"{split}-*", f"*/{split}.*", f"*/{split}-*", f"*{split}*"):
            found = sorted(f for f in glob.glob(os.path.join(folder, pattern)) if f.endswith(SUPPORTED_SUFFIXES))
            if found:
                return found
    return [os.path.join(path, subset or "", f"{split}.parquet").replace(os.sep + os.sep, os.sep)]


# Trinity reward functions -> the data_source whose built-in scorer computes the same
REWARD_SOURCES = {"math_dapo_reward": "math_dapo"}


def _workflow(m: Mapper, key: str, value: SourceValue) -> None:
    if value in (None, ""):
        return
    # the rubric workflow where its judge was imported (explorer_input's workflow: importers/trinity_judge.py)
    rubric = value in RUBRIC_WORKFLOWS and "reward_model.judge.rubric_key" in m.settings
    if value not in SINGLE_TURN_WORKFLOWS and not rubric:
        m.error(key, f"{value!r}: only single-turn generation is available ({', '.join(SINGLE_TURN_WORKFLOWS)}); "
                     "multi-turn, agentic and model-judged workflows are not")
    m.ignore(f"{key}={value}", SCORING_NOTE)


# Trinity's MathBoxedWorkflow with workflow_args.use_base: no chat template, the prompt as plain text
# "System:<system prompt>\nUser:\n<question>\nAssistant:\n" (without a system prompt: from "User:"), as a
# chat template
BASE_PROMPT_WORKFLOWS = ("math_boxed_workflow", "async_math_boxed_workflow")
BASE_PROMPT_TEMPLATE = ("{%- for message in messages -%}"
                        "{%- if message['role'] == 'system' -%}{{ 'System:' + message['content'] + '\\n' }}"
                        "{%- elif message['role'] == 'user' -%}"
                        "{{ 'User:\\n' + message['content'] + '\\nAssistant:\\n' }}"
                        "{%- endif -%}{%- endfor -%}")


def _taskset(m: Mapper, ts: dict[str, Any], where: str, is_eval: bool, default_workflow: Any = None
             ) -> dict[str, Any]:
    """One taskset's files, prompt keys and sampling arguments; errors for what we cannot honour."""
    if ts.get("storage_type", "file") not in ("file", None):
        m.error(f"{where}.storage_type", f"{ts['storage_type']!r}: only file tasksets are available")
    if not ts.get("path"):
        m.error(f"{where}.path", "missing: the taskset's file or folder")
    fmt = dict(ts.get("format") or {})
    for name, why in FORMAT_ERRORS.items():
        if fmt.get(name):
            m.error(f"{where}.format.{name}", f"{fmt[name]!r}: {why}")
    for name in ("workflow_key", "reward_fn_key"):
        if fmt.get(name):
            m.error(f"{where}.format.{name}", f"{fmt[name]!r}: per-row workflows / reward functions are not available")
    for name in ("prompt_type", "tools_key", "chosen_key", "rejected_key"):
        if name in fmt:
            m.ignore(f"{where}.format.{name}", "used by SFT / DPO / tool workflows only")
    _workflow(m, f"{where}.default_workflow_type", ts.get("default_workflow_type"))
    _workflow(m, f"{where}.default_eval_workflow_type", ts.get("default_eval_workflow_type"))
    if ts.get("default_reward_fn_type"):
        m.ignore(f"{where}.default_reward_fn_type={ts['default_reward_fn_type']}", SCORING_NOTE)
    workflow_args = dict(ts.get("workflow_args") or {})
    use_base = bool(workflow_args.pop("use_base", False))
    for name, value in workflow_args.items():
        m.error(f"{where}.workflow_args.{name}", f"{value!r}: this workflow argument is not available (use_base is)")
    if use_base:
        workflow = ts.get("default_workflow_type") or default_workflow
        if workflow not in BASE_PROMPT_WORKFLOWS:
            m.error(f"{where}.workflow_args.use_base", f"True with workflow {workflow!r}: the plain-text prompt is "
                                                       f"{', '.join(BASE_PROMPT_WORKFLOWS)}'s")
        if fmt.get("chat_template"):
            m.ignore(f"{where}.format.chat_template", "use_base renders the plain-text prompt instead")
        fmt["chat_template"] = BASE_PROMPT_TEMPLATE
    _reward_fn_args(m, dict(ts.get("reward_fn_args") or {}), f"{where}.reward_fn_args")
    args = dict(ts.get("rollout_args") or {})
    if not is_eval and args.get("n") not in (None, 1):
        m.error(f"{where}.rollout_args.n", "set algorithm.repeat_times instead (Trinity: do not set)")
    if args.pop("logprobs", None):
        m.ignore(f"{where}.rollout_args.logprobs", "vLLM top-logprobs only")
    args.pop("n", None)
    for name in args:
        if name not in ("temperature", "top_p", "top_k"):
            m.error(f"{where}.rollout_args.{name}", f"{args[name]!r}: this sampling argument is not available")
    for name in ("name", "index", "enable_progress_bar", "total_epochs", "total_steps", "is_eval", "ray_namespace",
                 "wrap_in_ray", "schema_type", "split", "path", "storage_type", "subset_name", "format",
                 "rollout_args", "default_workflow_type", "default_eval_workflow_type", "default_reward_fn_type",
                 "workflow_args", "reward_fn_args", "repeat_times"):
        ts.pop(name, None)
    for name in ts:
        m.ignore(f"{where}.{name}")
    return {"fmt": fmt, "args": args, "use_base": use_base}


FORMAT_KEYS = {"prompt_key": "data.prompt_key", "messages_key": "data.messages_key",
               "response_key": "data.ground_truth_key", "system_prompt": "data.system_prompt",
               "chat_template": "data.chat_template"}


def _reward_fn_args(m: Mapper, args: dict[str, Any], where: str) -> None:
    """Trinity's math_dapo_reward overlong penalty = veRL's DAPO overlong buffer: a linear penalty of up to
    `penalty_factor` over the last `cache_length` tokens before `max_response_length`."""
    if not args:
        return
    enable = bool(args.pop("enable_overlong_penalty", False))
    length, factor = args.pop("cache_length", None), args.pop("penalty_factor", 1.0)
    max_len = args.pop("max_response_length", None)
    if args:
        m.error(f"{where}.{next(iter(args))}", f"{next(iter(args.values()))!r}: this reward-function argument is "
                                               "not available (overlong penalty arguments only)")
    if not enable:
        return
    if length is None:
        m.error(f"{where}.cache_length", "not given: the overlong penalty's buffer length")
    cfg = "reward_model.reward_kwargs.overlong_buffer_cfg"
    m.set(f"{cfg}.enable", True, f"{where}.enable_overlong_penalty")
    m.set(f"{cfg}.len", length, f"{where}.cache_length")
    m.set(f"{cfg}.penalty_factor", factor, f"{where}.penalty_factor")
    if max_len is not None:
        m.set("reward_model.reward_kwargs.max_resp_len", max_len, f"{where}.max_response_length")


def _collect(m: Mapper, tasksets: list[tuple[str, dict[str, Any]]], is_eval: bool, default_workflow: Any = None
             ) -> dict[str, Any] | None:
    if not tasksets:
        return None
    files: list[str] = []
    seen: dict[str, tuple[str, Any]] = {}
    for where, ts in tasksets:
        path, split = ts.get("path"), ts.get("split", "train")
        repeat = ts.get("repeat_times")
        info = _taskset(m, dict(ts), where, is_eval, default_workflow)
        files += taskset_files(str(path), str(split), ts.get("subset_name") or None)
        values = {**{f"format.{k}": v for k, v in info["fmt"].items() if k in FORMAT_KEYS},
                  **{f"rollout_args.{k}": v for k, v in info["args"].items()},
                  "workflow_args.use_base": info["use_base"]}
        if is_eval:
            values["repeat_times"] = repeat if repeat is not None else 1
        elif repeat is not None:
            m.ignore(f"{where}.repeat_times", "algorithm.repeat_times is used (as in Trinity)")
        for key, value in values.items():
            if key in seen and seen[key][1] != value:
                m.error(f"{where}.{key}", f"{value!r} differs from {seen[key][0]}.{key}={seen[key][1]!r}; "
                                          "jaxrl_llm has one setting for all tasksets")
            seen[key] = (where, value)
    out = {"files": files[0] if len(files) == 1 else files}
    out.update({k: v for k, (_, v) in seen.items()})
    return out


def import_tasksets(m: Mapper, src: Source, base_dir: str) -> None:
    del base_dir  # Trinity resolves relative taskset paths against the working directory, as we do
    if src.peek(f"{EI}.reply_prefix"):
        m.error(f"{EI}.reply_prefix", f"{src.peek(f'{EI}.reply_prefix')!r}: {FORMAT_ERRORS['reply_prefix']}")
    if src.peek(f"{EI}.system_prompt"):
        m.set("data.system_prompt", src.take(f"{EI}.system_prompt"), f"{EI}.system_prompt")
    workflows = {}
    for name in ("default_workflow_type", "default_eval_workflow_type"):  # defaults of every taskset
        workflows[name] = src.take(f"{EI}.{name}")
        _workflow(m, f"{EI}.{name}", workflows[name])
    reward = src.take(f"{EI}.default_reward_fn_type")
    if reward:
        m.ignore(f"{EI}.default_reward_fn_type={reward}", SCORING_NOTE)
        if reward in REWARD_SOURCES:
            m.set("data.default_data_source", REWARD_SOURCES[reward], f"{EI}.default_reward_fn_type")
    single = src.sub(f"{EI}.taskset.")
    train = [(f"{EI}.taskset", _unflatten(single.flat))] if single.flat else []
    listed = src.take(f"{EI}.tasksets") or []
    train += [(f"{EI}.tasksets[{i}]", dict(t)) for i, t in enumerate(listed)]
    evals = [(f"{EI}.eval_tasksets[{i}]", dict(t)) for i, t in enumerate(src.take(f"{EI}.eval_tasksets") or [])]
    for name in ("system_prompt", "reply_prefix"):
        src.take(f"{EI}.{name}")
    got = _collect(m, train, is_eval=False, default_workflow=workflows["default_workflow_type"])
    if got is not None:
        got.pop("workflow_args.use_base", None)  # its template is in format.chat_template
        m.set("data.train_files", got.pop("files"), f"{EI}.taskset.path")
        paths = {str(ts.get("path")) for _, ts in train}
        if "data.default_data_source" not in m.settings and len(paths) == 1 and has_builtin_scorer(next(iter(paths))):
            m.set("data.default_data_source", next(iter(paths)), f"{EI}.taskset.path")
        _sampling(m, got, "actor_rollout_ref.rollout", f"{EI}.taskset")
    got = _collect(m, evals, is_eval=True,
                   default_workflow=workflows["default_eval_workflow_type"] or workflows["default_workflow_type"])
    if got is not None:
        got.pop("workflow_args.use_base", None)
        # the eval tasksets' template (use_base's plain text, their format.chat_template, or the tokenizer's)
        # where it is not training's: data.val_overrides.chat_template
        eval_template = got.pop("format.chat_template", None)
        if eval_template != m.settings.get("data.chat_template"):
            m.set("data.val_overrides.chat_template", eval_template or NATIVE_TEMPLATE, f"{EI}.eval_tasksets")
        m.set("data.val_files", got.pop("files"), f"{EI}.eval_tasksets")
        # Trinity evaluates with the eval tasksets' rollout_args (sampling at temperature 1.0 by default)
        temperature = got.pop("rollout_args.temperature", 1.0)
        val = "actor_rollout_ref.rollout.val_kwargs"
        m.set(f"{val}.temperature", temperature, f"{EI}.eval_tasksets.rollout_args.temperature")
        m.set(f"{val}.do_sample", temperature > 0, f"{EI}.eval_tasksets.rollout_args.temperature")
        m.set(f"{val}.top_p", got.pop("rollout_args.top_p", 1.0), f"{EI}.eval_tasksets.rollout_args.top_p")
        m.set(f"{val}.top_k", got.pop("rollout_args.top_k", -1), f"{EI}.eval_tasksets.rollout_args.top_k")
        m.set(f"{val}.n", got.pop("repeat_times"), f"{EI}.eval_tasksets.repeat_times")
        _sampling(m, got, None, f"{EI}.eval_tasksets")


def _sampling(m: Mapper, got: dict[str, Any], section: str | None, where: str) -> None:
    for key, value in got.items():
        if key.startswith("format."):
            ours = FORMAT_KEYS[key.split(".", 1)[1]]
            if section is not None:
                m.set(ours, value, f"{where}.{key}")
            elif ours not in m.settings or m.settings[ours] != value:  # the eval tasksets' own: validation's
                m.set(f"data.val_overrides.{ours.split('.', 1)[1]}", value, f"{where}.{key}")
        elif section is not None and key.startswith("rollout_args."):
            m.set(f"{section}.{key.split('.', 1)[1]}", value, f"{where}.{key}")
