"""Per-domain data mixtures (`data.domains.*`, ROLL's `domain_interleave_probs`).

Each row belongs to a domain named by its `data.domains.key` column (ROLL: `tag`), through
`data.domains.members` (domain -> the column values it holds, ROLL's reward workers' `tag_included`;
a domain not listed holds the rows whose value is its own name). With `data.domains.probs` set, every
training batch holds a fixed number of prompts of each domain, as ROLL's RLVR pipeline draws them:
int(p * B) each, the rest to the largest share (`domain_counts`). Each domain walks through its
own rows in its own shuffled order (reshuffled each time it has gone through them), so a small domain
repeats while a large one is still in its first pass; an epoch (`len(loader)`) is the number of
batches the slowest domain takes to go through its rows once. Within a batch the domains' rows are
interleaved in a seeded order, so no device's share of the batch is one domain.

`data.domains.data_sources` gives the rows of a domain that have no data_source column one (it picks
their scorer; `reward_model.judge.data_sources` picks the rows a judge grades);
`data.domains.ground_truth_columns` makes a domain's ground truth the dict of some of its columns
(ROLL's code rows: case_type, test_cases, test_case_function).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from jaxrl_llm.data.sources import DataError


@dataclasses.dataclass(frozen=True)
class DomainSpec:
    """`data.domains.*`, resolved: which column names a row's domain and what each domain is."""

    key: str = "domain"
    probs: tuple[tuple[str, float], ...] = ()  # domain -> share (the rest of a batch: the largest share)
    members: tuple[tuple[str, tuple[str, ...]], ...] = ()
    data_sources: tuple[tuple[str, str], ...] = ()
    ground_truth_columns: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def enabled(self) -> bool:
        """Whether rows carry a domain at all (a mixture, or a data_source per domain)."""
        return bool(self.probs or self.members or self.data_sources or self.ground_truth_columns)

    @functools.cached_property
    def value_to_domain(self) -> dict[str, str]:
        """The key column's value -> its domain (a value listed under no domain is its own domain)."""
        out: dict[str, str] = {}
        for domain, values in self.members:
            for value in values:
                if value in out and out[value] != domain:
                    raise DataError(f"data.domains.members: {value!r} is listed under both {out[value]!r} and "
                                    f"{domain!r}")
                out[value] = domain
        return out

    def domain_of(self, row: Mapping[str, Any]) -> str | None:
        """The domain of a raw row (None: the row has no value in the key column)."""
        value = row.get(self.key)
        if value is None:
            return None
        value = str(value)
        return self.value_to_domain.get(value, value)

    @functools.cached_property
    def _source_of(self) -> dict[str, str]:
        return dict(self.data_sources)

    @functools.cached_property
    def _columns_of(self) -> dict[str, tuple[str, ...]]:
        return dict(self.ground_truth_columns)

    def data_source_of(self, domain: str | None) -> str | None:
        return self._source_of.get(domain) if domain is not None else None

    def ground_truth_of(self, domain: str | None, row: Mapping[str, Any]) -> dict[str, Any] | None:
        """The row's ground truth made of its domain's columns (None: the domain names none)."""
        columns = self._columns_of.get(domain) if domain is not None else None
        return None if columns is None else {column: row.get(column) for column in columns}


def domain_counts(probs: Sequence[tuple[str, float]], batch_size: int) -> list[tuple[str, int]]:
    """Prompts of each domain in a batch of `batch_size`: int(p * B) each, as ROLL's RLVRPipeline counts
    them, and the rest to the domain with the largest share (ROLL gives it to the last one listed; a
    config's keys are sorted, so the order cannot say: the ROLL importer writes shares that leave no rest).
    Shares that are not positive, do not sum to 1, or leave a domain no prompt are errors naming
    data.domains.probs."""
    if any(p <= 0 for _, p in probs):
        raise DataError(f"data.domains.probs={dict(probs)}: every share must be positive")
    total = sum(p for _, p in probs)
    if abs(total - 1.0) > 1e-6:
        raise DataError(f"data.domains.probs={dict(probs)}: the shares sum to {total:g}, not 1")
    counts = {domain: int(p * batch_size + 1e-9) for domain, p in probs}  # 0.3 * 10 is 3, not 2.9999
    largest = max(probs, key=lambda item: item[1])[0]
    counts[largest] += batch_size - sum(counts.values())
    for domain, p in probs:
        if counts[domain] <= 0:
            raise DataError(f"data.domains.probs: domain {domain!r} gets 0 of a batch of {batch_size} prompts "
                            f"(share {p:g}); raise its share or data.train_batch_size")
    return [(domain, counts[domain]) for domain, _ in probs]


class MixtureBatches(grain.transforms.Map):
    """Batch number k -> the global row indices of batch k: each domain's k-th block of its own endless
    (re)shuffled stream, interleaved in a seeded order (picklable for grain workers)."""

    def __init__(self, rows_by_domain: Sequence[np.ndarray], counts: Sequence[int], *, shuffle: bool, seed: int):
        self.streams = []
        for i, (rows, count) in enumerate(zip(rows_by_domain, counts)):
            stream = grain.MapDataset.source(np.asarray(rows, np.int64).tolist())
            if shuffle:
                stream = stream.shuffle(seed=seed + 7919 * i)  # each domain its own order
            self.streams.append(stream.batch(int(count), drop_remainder=True, batch_fn=np.asarray).repeat(None))
        self.shuffle, self.seed = shuffle, seed

    # grain's stub declares map(element) -> None
    def map(self, k: int) -> np.ndarray:  # pyright: ignore[reportIncompatibleMethodOverride]
        rows = np.concatenate([stream[int(k)] for stream in self.streams])
        if self.shuffle:
            rows = rows[np.random.default_rng([self.seed, int(k)]).permutation(len(rows))]
        return rows


def mixture_batches(domains: Sequence[str | None], spec: DomainSpec, batch_size: int, *, shuffle: bool,
                    seed: int, name: str) -> tuple[grain.MapDataset, int]:
    """(an endless MapDataset of batches of row indices, batches per epoch) for rows whose domains are
    `domains` (one per row of the dataset `name`)."""
    counts = domain_counts(spec.probs, batch_size)
    found = np.asarray(["" if d is None else d for d in domains], dtype=object)
    rows_by_domain, batches = [], []
    for domain, count in counts:
        rows = np.flatnonzero(found == domain)
        if len(rows) < count:
            raise DataError(f"{name}: domain {domain!r} has {len(rows)} rows (column {spec.key!r}), fewer than its "
                            f"{count} prompts of each batch of {batch_size} (data.domains.probs)")
        rows_by_domain.append(rows)
        batches.append(len(rows) // count)
    per_epoch = max(batches)
    gather = MixtureBatches(rows_by_domain, [c for _, c in counts], shuffle=shuffle, seed=seed)
    return grain.MapDataset.range(np.iinfo(np.int64).max).map(gather), per_epoch


def unmixed_rows(domains: Sequence[str | None], spec: DomainSpec) -> dict[str, int]:
    """Rows per domain value that no domain of data.domains.probs samples (reported when loading)."""
    wanted = {d for d, _ in spec.probs}
    out: dict[str, int] = {}
    for domain in domains:
        if domain not in wanted:
            label = "<no value>" if domain is None else domain
            out[label] = out.get(label, 0) + 1
    return out
