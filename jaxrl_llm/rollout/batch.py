"""The rollout batch (`Rollout`) and what the rollout sources do to it: score responses (on process
0, broadcast to every process), pick DAPO's filter metric, keep rows, join batches.

Both generators (rollout/generator.py's single-turn `RolloutGenerator` and rollout/multi_turn.py)
build a `Rollout`; the trainer and the pipeline consume it. Rows are prompt-major: row i*n + j is
sample j of prompt i, and `group_ids[row] = i`.
"""
from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, PartitionSpec

from jaxrl_llm.config.schema import ConfigError
from jaxrl_llm.data.loader import METADATA_KEYS
from jaxrl_llm.models.moe import NOT_RECORDED
from jaxrl_llm.models.vision.qwen_vl import ImagePrompt, RowImages
from jaxrl_llm.rewards import RewardManager, RewardResult
from jaxrl_llm.shapes import next_power_of_two
from jaxrl_llm.sharding import batch_axes

Array = jax.Array
_MIN_RESPONSE_BUCKET = 8



class BatchLoader(Protocol):
    """The prompt batches a rollout source reads, in order, with a state a checkpoint saves: the data's
    `PromptLoader` (data/loader.py), or a partial-rollout run's `StepLoader` around it."""

    dataset: Any  # the rows (a partial-rollout checkpoint names its carried samples by dataset index)

    def __next__(self) -> dict[str, np.ndarray]: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...

@dataclasses.dataclass
class Rollout:
    """One generation batch: device arrays for the update, host arrays for rewards and logging."""

    input_ids: Array  # int32 [N, P + R] prompt (left-padded) + response (right-padded)
    attention_mask: Array  # int32 [N, P + R]
    response_mask: Array  # float32 [N, R]
    rollout_log_probs: Array  # float32 [N, R] sampler log-probs (temperature-scaled)
    token_level_scores: Array  # float32 [N, R] the score at each row's last response token
    group_ids: np.ndarray  # int32 [N] prompt index within the batch
    scores: np.ndarray  # float32 [N] sequence scores (after shaping)
    response_lengths: np.ndarray  # int32 [N]
    prompt_lengths: np.ndarray  # int32 [N]
    texts: list[str]
    prompt_texts: list[str]
    meta: dict[str, np.ndarray]  # data_source, ground_truth, extra_info, ... repeated per row
    reward_extra_info: dict[str, np.ndarray]
    reward_metrics: dict[str, float]
    # routing replay (actor.router_replay = rollout): int [N, P + R, L, k] the experts the sampler's MoE
    # layers ran for each token (models/moe.py NOT_RECORDED where it recorded none)
    routing: Array | None = None
    # a vision-language policy's rows' image features and M-RoPE positions (models/vision/qwen_vl.py)
    images: RowImages | None = None

    @property
    def num_rows(self) -> int:
        return int(self.group_ids.shape[0])


# the batch columns a rollout keeps per row (scoring, validation, dumps)
ROLLOUT_META_KEYS = (*METADATA_KEYS, "raw_prompt", "index")


def rows_meta(batch: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    """The batch's metadata columns (`ROLLOUT_META_KEYS` it has) repeated per rollout row: `rows`
    are the prompt index of each row."""
    return {k: v[rows] for k, v in batch.items() if k in ROLLOUT_META_KEYS}

T = TypeVar("T")  # what `broadcast_from_main` hands every process


def response_bucket(longest: int, limit: int) -> int:
    """Power of two >= longest (min 8), capped at the configured response length."""
    return min(limit, max(_MIN_RESPONSE_BUCKET, next_power_of_two(longest)))


def broadcast_from_main(compute: Callable[[], T]) -> T:
    """`compute()` run on process 0 only, its result (any picklable object) returned on every
    process; an exception raised there is raised on every process (none waits forever)."""
    if jax.process_count() == 1:
        return compute()
    payload = b""
    if jax.process_index() == 0:
        try:
            outcome: tuple[str, Any] = ("ok", compute())
        except Exception as err:  # re-raised on every process below
            outcome = ("error", err)
        try:
            payload = pickle.dumps(outcome)
        except Exception:  # an unpicklable exception
            payload = pickle.dumps(("error", RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]}")))
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(payload))))
    buffer = np.zeros(size, np.uint8)
    if payload:
        buffer[:] = np.frombuffer(payload, np.uint8)
    buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    status, value = pickle.loads(buffer.tobytes())
    if status == "error":
        raise value
    return value


def score_responses(manager: RewardManager, texts: list[str], meta: dict[str, np.ndarray], *,
                    response_lengths: np.ndarray, finished_with_eos: np.ndarray) -> RewardResult:
    """The reward manager's scores of `texts` (rows of `meta`), computed on process 0 and
    broadcast to every process."""
    extra_info, sources = meta.get("extra_info"), meta.get("source")
    return broadcast_from_main(lambda: manager.score(
        texts, list(meta["data_source"]), list(meta["ground_truth"]),
        None if extra_info is None else list(extra_info), response_lengths=response_lengths,
        finished_with_eos=finished_with_eos, sources=None if sources is None else list(sources)))


def rollout_dump_rows(r: Rollout, step: int) -> list[dict[str, Any]]:
    """One `trainer.rollout_data_dir` record per row: prompt, response, score, data source, ground
    truth, and a judge's verdict and score beside the response when a judge scored it."""
    rows = [{"step": step, "input": p, "output": o, "score": float(s), "data_source": str(ds),
             "ground_truth": str(gt)}
            for p, o, s, ds, gt in zip(r.prompt_texts, r.texts, r.scores, r.meta["data_source"],
                                       r.meta["ground_truth"])]
    verdicts = r.reward_extra_info.get("judge_verdict")
    if verdicts is not None:
        for row, verdict, judge_score in zip(rows, verdicts, r.reward_extra_info["judge_score"]):
            row.update(judge_verdict=str(verdict), judge_score=float(judge_score))
    return rows


def filter_metric(r: Rollout, metric: str) -> np.ndarray:
    """DAPO `filter_groups.metric` per row: the sequence score for seq_reward / seq_final_reward /
    score, else the numeric key of that name the reward function returned (a clear error otherwise)."""
    if metric in ("seq_reward", "seq_final_reward", "score"):
        return np.asarray(r.scores, np.float64)
    if metric not in r.reward_extra_info:
        keys = sorted(k for k in r.reward_extra_info if k != "score")
        raise ConfigError(f"algorithm.filter_groups.metric={metric!r}: the reward function returned no such key "
                          f"(its keys: {keys}; or use seq_reward, seq_final_reward, score)")
    values = np.asarray(r.reward_extra_info[metric])
    if not (np.issubdtype(values.dtype, np.number) or values.dtype == bool):
        raise ConfigError(f"algorithm.filter_groups.metric={metric!r}: the reward function's {metric!r} values are "
                          f"not numbers (e.g. {values[0]!r})")
    return values.astype(np.float64)


def select_rows(r: Rollout, rows: np.ndarray) -> Rollout:
    """The rollout restricted to `rows` (host indices), e.g. the groups DAPO's filter keeps."""
    rows = np.asarray(rows)
    take = lambda x: x[rows]  # noqa: E731
    return dataclasses.replace(
        r, input_ids=take(r.input_ids), attention_mask=take(r.attention_mask),
        response_mask=take(r.response_mask), rollout_log_probs=take(r.rollout_log_probs),
        token_level_scores=take(r.token_level_scores), group_ids=r.group_ids[rows], scores=r.scores[rows],
        response_lengths=r.response_lengths[rows], prompt_lengths=r.prompt_lengths[rows],
        texts=[r.texts[i] for i in rows], prompt_texts=[r.prompt_texts[i] for i in rows] if r.prompt_texts else [],
        meta={k: v[rows] for k, v in r.meta.items()},
        reward_extra_info={k: np.asarray(v)[rows] for k, v in r.reward_extra_info.items()},
        routing=None if r.routing is None else take(r.routing),
        images=None if r.images is None else jax.tree.map(take, r.images))


def concat_rollouts(parts: list[Rollout], mesh: Mesh) -> Rollout:
    """Rows of several rollouts in one, padded to common prompt / response widths; group ids are
    renumbered so groups of different parts stay distinct."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.response_mask.shape[1] for p in parts)
    prompt_width = max(p.input_ids.shape[1] - p.response_mask.shape[1] for p in parts)

    def pad(p: Rollout) -> dict[str, Any]:
        r = p.response_mask.shape[1]
        left = prompt_width - (p.input_ids.shape[1] - r)
        right = width - r
        seq = lambda x: jnp.pad(x, ((0, 0), (left, right)))  # noqa: E731  (pad id 0 under mask 0)
        resp = lambda x: jnp.pad(x, ((0, 0), (0, right)))  # noqa: E731
        out: dict[str, Any] = {"input_ids": seq(p.input_ids), "attention_mask": seq(p.attention_mask),
                               "response_mask": resp(p.response_mask), "rollout_log_probs": resp(p.rollout_log_probs),
                               "token_level_scores": resp(p.token_level_scores)}
        if p.routing is not None:  # not recorded on the padding columns
            out["routing"] = jnp.pad(p.routing, ((0, 0), (left, right), (0, 0), (0, 0)), constant_values=NOT_RECORDED)
        if p.images is not None:
            out["images"] = p.images.pad_columns(left, right).pad_features(room)
        return out

    room = max((p.images.features.shape[1] for p in parts if p.images is not None), default=0)
    padded = [pad(p) for p in parts]
    joined = {k: jax.tree.map(lambda *xs: jnp.concatenate(xs), *[d[k] for d in padded]) for k in padded[0]}
    spec = lambda x: jax.sharding.NamedSharding(mesh, PartitionSpec(batch_axes(mesh), *([None] * (x.ndim - 1))))  # noqa: E731
    joined = {k: jax.tree.map(lambda x: jax.device_put(x, spec(x)), v) for k, v in joined.items()}
    joined_routing = joined.pop("routing", None)
    offsets = np.cumsum([0] + [int(p.group_ids.max()) + 1 for p in parts[:-1]])
    cat = lambda xs: np.concatenate(xs)  # noqa: E731
    return Rollout(
        **joined, group_ids=cat([p.group_ids + o for p, o in zip(parts, offsets)]).astype(np.int32),
        scores=cat([p.scores for p in parts]), response_lengths=cat([p.response_lengths for p in parts]),
        prompt_lengths=cat([p.prompt_lengths for p in parts]), texts=sum((p.texts for p in parts), []),
        prompt_texts=sum((p.prompt_texts for p in parts), []),
        meta={k: cat([p.meta[k] for p in parts]) for k in parts[0].meta},
        reward_extra_info={k: cat([np.asarray(p.reward_extra_info[k]) for p in parts])
                           for k in parts[0].reward_extra_info if all(k in p.reward_extra_info for p in parts)},
        # counts (reward/num_errors, num_nonfinite, ...) add up over the parts; rates are averaged
        reward_metrics={k: float((np.sum if k.startswith("reward/num_") else np.mean)(
                            [p.reward_metrics.get(k, 0.0) for p in parts])) for k in parts[0].reward_metrics},
        routing=joined_routing)


def rollout_row_images(prompt: ImagePrompt, prompt_mask: np.ndarray, width: int, mesh: Mesh, vision: Any, *,
                       n: int = 1) -> RowImages:
    """A rollout's `RowImages` (on the mesh, rows split as the batch's) from its prompts' `ImagePrompt`
    (`prompt_mask`: one host row per prompt), n rows per prompt, `width` response columns. The features stay on the
    devices, gathered row by row there, in the policy's compute dtype (`vision.compute_dtype`): every pass rounds
    them to it first, so they keep the same bits in half the bytes under bf16; a trained tower's pixels go to the
    devices by rows."""
    from jaxrl_llm.models.dtypes import COMPUTE_DTYPES, as_jnp_dtype
    from jaxrl_llm.models.vision.qwen_vl import row_images
    from jaxrl_llm.sharding import to_device_if_rows_split

    fields = row_images(prompt, prompt_mask, n, width)
    dtype = as_jnp_dtype(vision.compute_dtype, allowed=COMPUTE_DTYPES, what="actor.compute_dtype")
    fields.update({k: v.astype(dtype) for k, v in fields.items() if k in ("features", "deepstack")})
    host = ("positions", "slots", "tower")  # host arrays: placed by rows
    placed: dict[str, Any] = to_device_if_rows_split({k: fields.pop(k) for k in host if k in fields}, mesh)
    placed.update({k: rows_sharded(v, mesh) for k, v in fields.items() if k != "vision"})
    return RowImages(**placed, vision=fields.get("vision"))


def rows_sharded(x: jax.Array, mesh: Mesh) -> jax.Array:
    """A device array (the tower's features, per row) with its rows over the mesh's batch axes, as `to_device`
    places host rows, resharded on the devices (a short batch the axes do not divide stays as it is)."""
    from jaxrl_llm.sharding import batch_axis_size, batch_sharding

    if x.shape[0] % batch_axis_size(mesh):
        return x
    return _resharded(x, batch_sharding(mesh, x.ndim))


@functools.partial(jax.jit, static_argnums=1)
def _resharded(x: jax.Array, sharding: Any) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, sharding)
