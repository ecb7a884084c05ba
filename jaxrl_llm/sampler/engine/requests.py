"""What the paged engine runs and reports (sampler/engine/scheduler.py drives it): a request and its images,
the sources requests come from (`RequestSource`; `BatchSource`: a whole batch at once, as `PagedEngine.run`
queues it), the results laid out as the static sampler's (`sample_output`) and the run's counters."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.moe import NOT_RECORDED
from jaxrl_llm.models.vision.qwen_vl import ImagePrompt, feature_bucket, row_images
from jaxrl_llm.sampler.core import SampleOutput
from jaxrl_llm.sampler.engine import decode_state
from jaxrl_llm.sampler.host import left_pad


@dataclasses.dataclass
class EngineStats:
    """Counters of one `run` (slot utilisation = useful_token_steps / slot_steps)."""

    decode_steps: int = 0
    slot_steps: int = 0  # decode steps x the slots each step computed
    useful_token_steps: int = 0
    prefill_tokens: int = 0  # real prompt tokens prefilled (once per prompt)
    prefill_calls: int = 0  # program calls (a batched call prefills several prompts)
    max_prefill_tokens_per_round: int = 0  # bounded by max_num_batched_tokens (or one prompt)
    generate_calls: int = 0
    peak_pages_used: int = 0
    waits_for_pages: int = 0
    resizes: int = 0  # slot-set changes (shrunk while the queue drains, grown back for new requests)
    peak_cascade_groups: int = 0  # most groups reading their shared prompt pages once in one generate call
    # speculative decoding: tokens its verification steps emitted, drafts verified, drafts kept
    spec_emitted: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    speculative: bool = False

    @property
    def utilisation(self) -> float:
        return self.useful_token_steps / max(1, self.slot_steps)

    def metrics(self) -> dict[str, float]:
        """The step metrics of a paged generation (`rollout/engine/*`)."""
        return {"rollout/engine/slot_utilisation": self.utilisation,
                "rollout/engine/decode_steps": float(self.decode_steps),
                "rollout/engine/prefill_tokens": float(self.prefill_tokens),
                "rollout/engine/peak_kv_pages": float(self.peak_pages_used),
                "rollout/engine/waits_for_pages": float(self.waits_for_pages),
                "rollout/engine/cascade_groups": float(self.peak_cascade_groups),
                **self.speculative_metrics()}

    def speculative_metrics(self) -> dict[str, float]:
        """`rollout/tokens_per_step` (tokens a live slot emits per decode step: 1 without speculation)
        and, speculating, `rollout/spec_accept_rate` (drafts the target kept / drafts verified)."""
        if not self.speculative:
            return {"rollout/tokens_per_step": 1.0}
        return {"rollout/tokens_per_step": self.spec_emitted / max(1, self.useful_token_steps),
                "rollout/spec_accept_rate": self.spec_accepted / max(1, self.spec_proposed)}


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One sequence to generate.

    ids: prompt token ids. key: its random-number identity (two ints: token t draws with
    fold_in(fold_in(fold_in(rng, key[0]), key[1]), t)). group: requests of one group have the same
    ids and share one prefill (the n samples of a prompt); a source delivers a group's requests in
    one `poll`. max_new_tokens: its own budget, at most the settings' max_new_tokens. routing: when
    recording a MoE model's routing, the experts to replay for `ids` [len(ids), L, k] in the prefill
    (a multi-turn conversation's earlier turns; NOT_RECORDED where the router chooses); a group's
    requests have the same. images: a vision-language prompt's (`RequestImages`); a group's requests have the same.
    """

    ids: Sequence[int]
    key: tuple[int, int]
    group: int
    max_new_tokens: int
    routing: np.ndarray | None = None
    images: RequestImages | None = None


@dataclasses.dataclass(frozen=True)
class RequestImages:
    """A vision-language prompt's images as its prefill reads them: M-RoPE positions [3, L] and the feature each
    image token takes [L] (-1 elsewhere; host arrays, the prompt's own tokens, no padding), its features [K, H]
    (where the tower left them: `of_batch` keeps them on the devices, K its power-of-two room, zeros past its own)
    and the M-RoPE delta its decode steps add to their rotary positions."""

    positions: np.ndarray
    slots: np.ndarray
    features: Any
    delta: int
    deepstack: Any = None  # [D, K, H] Qwen3-VL's deepstack features

    @staticmethod
    def of_batch(images: ImagePrompt, prompt_mask: np.ndarray) -> list[RequestImages]:
        """Each prompt's, from a left-padded batch's `ImagePrompt` (models/vision/qwen_vl.py): positions, slots and
        deltas to the host, each prompt's features sliced on the devices (a batch's features never visit the host:
        a Geometry3K batch's are gigabytes)."""
        rows = row_images(images, prompt_mask, 1, 0)  # each prompt's own features [room, H], its slots into them
        out = []
        for b, valid in enumerate(np.asarray(prompt_mask) > 0):
            out.append(RequestImages(positions=rows["positions"][b][:, valid], slots=rows["slots"][b][valid],
                                     features=rows["features"][b], delta=int(np.asarray(images.deltas)[b]),
                                     deepstack=rows["deepstack"][b] if "deepstack" in rows else None))
        return out

    def extended(self, length: int) -> RequestImages:
        """These images for a longer prefix of `length` tokens (a multi-turn conversation's so far): the tokens after
        the prompt are text, at their 1-D positions plus the delta in every stream, as decode steps put them."""
        have = self.positions.shape[1]
        if length <= have:
            return self
        after = np.arange(have, length, dtype=np.int32) + np.int32(self.delta)
        return dataclasses.replace(
            self, positions=np.concatenate([self.positions, np.broadcast_to(after, (3, length - have))], axis=1),
            slots=np.concatenate([self.slots, np.full(length - have, -1, np.int32)]))

    def padded(self, width: int) -> decode_state.PromptImages:
        """As `prefill` takes them for a prompt bucket of `width` tokens; the features padded to a power of two
        (a handful of compiled prefill shapes; on their devices)."""
        length = self.positions.shape[1]
        positions = np.zeros((3, width), np.int32)
        positions[:, :length] = self.positions
        slots = np.full((width,), -1, np.int32)
        slots[:length] = self.slots
        extra = feature_bucket(self.features.shape[0]) - self.features.shape[0]
        features = jnp.pad(jnp.asarray(self.features), ((0, extra), (0, 0))) if extra else jnp.asarray(self.features)
        deepstack = None
        if self.deepstack is not None:
            deepstack = jnp.asarray(self.deepstack)
            deepstack = jnp.pad(deepstack, ((0, 0), (0, extra), (0, 0))) if extra else deepstack
        return decode_state.PromptImages(jnp.asarray(positions), jnp.asarray(slots), features,
                                     jnp.asarray(self.delta, jnp.int32), deepstack)


def batch_image_prompt(requests: Sequence[RequestImages | None], lengths: Sequence[int], width: int
                       ) -> ImagePrompt | None:
    """The `ImagePrompt` of prompts left-padded to `width` whose row i (lengths[i] tokens) has requests[i]'s images
    (None: a text prompt, its plain positions), for the static sampler (a multi-turn round's prefixes); None when no
    row has images."""
    if all(r is None for r in requests):
        return None
    rows = len(requests)
    positions = np.zeros((3, rows, width), np.int32)
    slots = np.full((rows, width), -1, np.int32)
    deltas = np.zeros((rows,), np.int32)
    features, deepstack, base = [], [], 0
    for i, (request, length) in enumerate(zip(requests, lengths)):
        at = width - length
        if request is None:
            positions[:, i, at:] = np.arange(length, dtype=np.int32)
            continue
        request = request.extended(length)
        positions[:, i, at:] = request.positions
        slots[i, at:] = np.where(request.slots >= 0, request.slots + base, -1)
        deltas[i] = request.delta
        features.append(jnp.asarray(request.features))
        if request.deepstack is not None:
            deepstack.append(jnp.asarray(request.deepstack))
        base += int(request.features.shape[0])
    return ImagePrompt(jnp.asarray(positions), jnp.asarray(slots), jnp.concatenate(features), jnp.asarray(deltas),
                       jnp.concatenate(deepstack, axis=1) if deepstack else None)


class RequestSource(Protocol):
    """What `PagedEngine.serve` runs: requests arrive through `poll`, results go to `finished`."""

    def poll(self) -> Sequence[EngineRequest]:
        """Requests ready now (called between decode calls; must not block)."""
        ...

    def finished(self, request: EngineRequest, token_ids: np.ndarray, log_probs: np.ndarray, finish: int,
                 routing: np.ndarray | None = None) -> None:
        """One request's generated ids, their log-probs and its finish code (sampler.FINISH_REASONS);
        with settings.record_routing on a MoE model (and only then) also `routing`, the experts of its
        prompt and response tokens [len(ids) + len(token_ids), L, k] (NOT_RECORDED for the last token,
        never fed)."""

    def more_coming(self) -> bool:
        """Whether `poll` may return requests later (the engine stops once False with nothing left)."""
        ...

    def wait(self) -> None:
        """Block briefly for `poll` to have something (called when the engine has no work at all)."""

    # Optional (a source without them runs to the end): `stop_requested() -> bool`, checked before
    # every admission round: True stops the run, and the engine hands each unfinished request back
    # through `paused(request, token_ids, log_probs)` with the tokens it has so far (none if it was
    # still queued) before returning (partial rollouts: rollout/partial.py).


class BatchSource:
    """`run`'s requests: every (prompt, sample) at once; results into `SampleOutput` arrays."""

    def __init__(self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int,
                 order: Sequence[tuple[int, int]], prompt_routing: Sequence[np.ndarray | None] | None = None,
                 budgets: Sequence[int] | None = None, images: Sequence[RequestImages | None] | None = None) -> None:
        self.requests = [EngineRequest(prompts[i], (i, j), i, max_new_tokens if budgets is None else int(budgets[i]),
                                       None if prompt_routing is None else prompt_routing[i],
                                       None if images is None else images[i]) for i, j in order]
        self.n, self.r = n, max_new_tokens
        rows = len(prompts) * n
        self.tokens = np.zeros((rows, max_new_tokens), np.int32)
        self.log_probs = np.zeros((rows, max_new_tokens), np.float32)
        self.lengths = np.zeros((rows,), np.int32)
        self.finish = np.zeros((rows,), np.int32)
        self.routing: dict[int, np.ndarray] = {}  # row -> [prompt + response tokens, L, k]

    def poll(self) -> list[EngineRequest]:
        out, self.requests = self.requests, []
        return out

    def finished(self, request: EngineRequest, token_ids: np.ndarray, log_probs: np.ndarray, finish: int,
                 routing: np.ndarray | None = None) -> None:
        row = request.key[0] * self.n + request.key[1]
        self.tokens[row, :len(token_ids)], self.log_probs[row, :len(token_ids)] = token_ids, log_probs
        self.lengths[row], self.finish[row] = len(token_ids), finish
        if routing is not None:
            self.routing[row] = routing

    def routing_rows(self, prompt_lengths: np.ndarray, prompt_width: int) -> np.ndarray | None:
        """The recorded routing as the static sampler lays it out: [rows, prompt_width + R, L, k],
        prompts left-padded to `prompt_width`, NOT_RECORDED where nothing was fed."""
        if not self.routing:
            return None
        first = next(iter(self.routing.values()))
        out = np.full((self.tokens.shape[0], prompt_width + self.r, *first.shape[1:]), NOT_RECORDED, first.dtype)
        for row, rec in self.routing.items():
            start = prompt_width - int(prompt_lengths[row])
            out[row, start:start + len(rec)] = rec
        return out

    def more_coming(self) -> bool:
        return bool(self.requests)

    def wait(self) -> None:
        return None



def sample_output(prompts: Sequence[Sequence[int]], n: int, tokens: np.ndarray, log_probs: np.ndarray,
                  lengths: np.ndarray, finish: np.ndarray, pad_id: int) -> SampleOutput:
    """Host results as the static sampler lays them out: rows prompt-major (row i*n + j: sample j of
    prompt i), tokens / log_probs [rows, R] padded past each row's length, prompts left-padded to
    their bucket and repeated n times; no routing."""
    valid = np.arange(tokens.shape[1])[None] < lengths[:, None]
    p_ids, p_mask = left_pad([p for p in prompts for _ in range(n)], pad_id)
    return SampleOutput(tokens=np.where(valid, tokens, pad_id), response_mask=valid.astype(np.int32),
                        log_probs=np.where(valid, log_probs, 0.0).astype(np.float32), lengths=lengths,
                        finish_reason=finish, prompt_ids=p_ids, prompt_mask=p_mask,
                        num_steps=np.asarray(lengths.max(initial=0), np.int32))
