"""Host-side KV page bookkeeping: a free list with reference counts, and the pool's size plan.

Pages are handed out in a fixed (lowest id first) order, so every process of a multi-process run
makes the same choices from the same inputs. Page 0 is the scratch page and never handed out.
"""
from __future__ import annotations

import heapq

import jax

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.platform.target import planned_in_use_bytes, target_memory_bytes

# gpu_memory_utilization 'auto': the KV pool gets this fraction of the device's memory, less what is in use
# and the sampling step's temporaries, as vLLM's default utilisation leaves room for its own
AUTO_MEMORY_FRACTION = 0.9


class PagePool:
    """Reference-counted pages 1..num_pages-1; the scheduler checks `num_free` before `alloc`."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(1, num_pages))
        heapq.heapify(self._free)
        self._refs: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, count: int, refs: int = 1) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"page pool: {count} pages asked, {len(self._free)} free (check num_free first)")
        pages = [heapq.heappop(self._free) for _ in range(count)]
        for p in pages:
            self._refs[p] = refs
        return pages

    def retain(self, pages: list[int]) -> None:
        """One more holder of `pages` (each released once per holder)."""
        for p in pages:
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                heapq.heappush(self._free, p)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def device_kv_budget(gpu_memory_utilization: float | str, temporaries: int = 0) -> int | None:
    """KV bytes per device from `rollout.gpu_memory_utilization`: that fraction of the device's
    memory limit minus what is in use (params, optimizer state, reference); 'auto': what is left,
    AUTO_MEMORY_FRACTION of the limit less what is in use and the sampling step's `temporaries`.
    None where the backend reports no memory limit (CPU). Planning (platform/target.py): a target's
    memory, and the in-use bytes the plan gives (`planning_in_use`) rather than this host's."""
    limit, in_use = target_memory_bytes(), planned_in_use_bytes()
    if limit is None:
        try:
            stats = jax.local_devices()[0].memory_stats()
        except Exception:  # backends without memory stats
            stats = None
        if not stats or "bytes_limit" not in stats:
            return None
        limit = int(stats["bytes_limit"])
        in_use = int(stats.get("bytes_in_use", 0)) if in_use is None else in_use
    in_use = in_use or 0
    if gpu_memory_utilization == "auto":
        return max(0, int(AUTO_MEMORY_FRACTION * limit) - in_use - temporaries)
    return max(0, int(float(gpu_memory_utilization) * limit) - in_use)


def plan_num_pages(cfg: ModelConfig, *, max_num_seqs: int, pages_per_slot: int, page_bytes: int,
                   kv_shards: int, budget_bytes: int | None, slot_shards: int = 1) -> int:
    """Pool pages: enough for every slot at full length (plus the scratch page), capped by the
    per-device budget (the pool's kv-heads dim is split `kv_shards` ways); with `slot_shards`
    (engine/slot_shards.py) that many pools of their slots' pages and a scratch page each, one per device
    of a batch split."""
    full = max_num_seqs // slot_shards * pages_per_slot + 1  # a shard's
    if budget_bytes is None:
        return full * slot_shards
    per_device_page = max(1, page_bytes // max(1, kv_shards))
    fit = budget_bytes // per_device_page
    if fit < pages_per_slot + 1:
        raise ValueError(
            f"rollout.gpu_memory_utilization leaves {budget_bytes} bytes of KV per device: fewer than the "
            f"{pages_per_slot + 1} pages ({per_device_page} bytes each) one full-length sequence needs; raise "
            "gpu_memory_utilization or lower response_length / max_prompt_length")
    del cfg
    return int(min(full, fit)) * slot_shards
