"""veRL's offline configs -> our tree: `generation.yaml` (main_generation) for `launch/generate.py` and
`evaluation.yaml` (main_eval) for `launch/evaluate.py`, as files or `key=value` overrides in their names
after `--` (keys of ours pass through). Placement keys (nodes, GPUs, Ray, vLLM memory) are listed in one
warning with their values; a key we cannot honour is an error naming the file and the key.
"""
from __future__ import annotations

import copy
from typing import Any

import ml_collections

from jaxrl_llm.config.importers.common import PLACEMENT, Mapper, Source, flatten, leftover, load_yaml
from jaxrl_llm.config.importers.verl import is_ours
from jaxrl_llm.config.overrides import apply_overrides, parse_value, split_override, unknown_key_message
from jaxrl_llm.config.schema import ConfigError

R = "actor_rollout_ref.rollout"
GENERATION = {
    "data.path": "generation.input_path", "data.output_path": "generation.output_path",
    "data.n_samples": "generation.n_samples", "data.batch_size": "generation.batch_size",
    "data.prompt_key": "data.prompt_key", "model.path": "actor_rollout_ref.model.path",
    "rollout.temperature": f"{R}.temperature", "rollout.top_k": f"{R}.top_k", "rollout.top_p": f"{R}.top_p",
    "rollout.do_sample": f"{R}.do_sample", "rollout.response_length": "data.max_response_length",
    "rollout.prompt_length": "data.max_prompt_length", "rollout.ignore_eos": f"{R}.ignore_eos",
}
EVALUATION = {
    "data.path": "evaluation.path", "data.response_key": "evaluation.response_key",
    "data.data_source_key": "evaluation.data_source_key", "data.reward_model_key": "evaluation.reward_model_key",
    "custom_reward_function.path": "custom_reward_function.path",
    "custom_reward_function.name": "custom_reward_function.name",
}
# keys that place work or pick torch machinery (both files)
PLACEMENT_PREFIXES = ("trainer.", "ray_init.", "ray_kwargs.", "model.external_lib", "model.trust_remote_code",
                      "rollout.name", "rollout.mode", "rollout.dtype", "rollout.gpu_memory_utilization",
                      "rollout.tensor_model_parallel_size", "rollout.enforce_eager", "rollout.free_cache_engine",
                      "rollout.load_format", "rollout.max_num_batched_tokens", "rollout.max_num_seqs",
                      "rollout.log_prob_", "rollout.engine_kwargs", "rollout.disable_log_stats",
                      "rollout.enable_chunked_prefill", "rollout.micro_batch_size", "data.use_shm", "model.use_shm",
                      "actor.", "rollout.calculate_log_probs", "rollout.layered_summon")


def import_offline(m: Mapper, src: Source, table: dict[str, str]) -> None:
    """Maps one veRL offline config's flat keys with `table`."""
    for key in list(src.flat):
        value = src.take(key)
        bare = key.lstrip("+")
        if bare in table:
            m.set(table[bare], value, bare)
        elif bare == "rollout.n" and value not in (None, 1):
            m.error(bare, f"{value!r}: the samples per prompt are data.n_samples")
        elif any(bare.startswith(p) for p in PLACEMENT_PREFIXES) or bare in ("rollout.n", "data.prompt_key"):
            m.ignore(bare, PLACEMENT, value)
        else:
            leftover(m, bare, value)


def offline_config(base: ml_collections.ConfigDict, items: list[str], import_path: str | None,
                   table: dict[str, str]) -> ml_collections.ConfigDict:
    """The config of a generation / evaluation run: `base`, the imported veRL file, then the overrides
    (veRL's names through `table`, ours as they are), later wins."""
    cfg = copy.deepcopy(base)
    if import_path:
        m = Mapper("verl_offline", import_path, base=cfg)
        data: dict[str, Any] = load_yaml(import_path, missing_groups="skip")
        import_offline(m, Source(flatten(data, leaves=("custom_reward_function.reward_kwargs",)), import_path), table)
        result = m.result()
        result.warn()
        cfg = result.apply(cfg)
    ours, peer = [], {}
    for item in items:
        if item == "--":
            continue
        key, text = split_override(item)
        bare = key.lstrip("+")
        if bare in table and table[bare] != bare:
            peer[bare] = parse_value(text)
        elif is_ours(bare):
            ours.append(item)
        elif bare.split(".")[0] in ("data", "model", "rollout", "trainer", "ray_init", "ray_kwargs", "actor"):
            peer[bare] = parse_value(text)  # veRL's layout: mapped, listed or refused by the importer
        else:
            raise ConfigError(unknown_key_message(bare))
    if peer:
        m = Mapper("verl_offline", "command line", base=cfg)
        import_offline(m, Source(peer, "command line"), table)
        result = m.result()
        result.warn()
        cfg = result.apply(cfg)
    return apply_overrides(cfg, ours)

