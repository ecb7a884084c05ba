"""Batches of prompts for the trainer: a grain pipeline with a checkpointable iterator.

    loader = make_dataloader(spec.data, tokenizer, "train", batch_size=spec.data.train_batch_size,
                             process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(loader)
    state = loader.get_state()   # JSON-able dict; save with the checkpoint
    loader.set_state(state)      # resume: the next batches are exactly those that were to come

A batch is a dict of numpy arrays for this process's share of one global batch
(`batch_size // process_count` rows, contiguous block `process_index` of the global batch):

    raw_prompt_ids  object[B]    unpadded int32 id arrays (the sampler left-pads them to its length bucket)
    prompt_lengths  int32[B]     their lengths
    index           int64[B]     row position in the dataset
    data_source, ground_truth, extra_info, ability, source   object[B]  per-row metadata for the rewards
    raw_prompt      object[B]    chat messages / text, only with data.return_raw_chat=True
    images          object[B]    each row's images (a list, encoded), only for a vision-language policy's data

Rows are not repeated here for `n` samples; the trainer repeats them by index (object arrays take
fancy indexing). Train order: shuffled with `data.seed` (reshuffled each epoch, the same on every
process), only full batches (`drop_last`); `len(loader)` = batches per epoch; the stream runs for
`num_epochs` epochs (None = forever). Validation (`split="val"`): file order, one pass, the last
batch may be short; `data.val_batch_size=None` makes the whole set one batch; `reset()` starts
the pass again. `data.dataloader_num_workers = k > 0` collates up to 2k batches ahead in k grain threads.
"""
from __future__ import annotations

from typing import Any

import grain
import numpy as np

from jaxrl_llm.data.domains import DomainSpec, mixture_batches
from jaxrl_llm.data.prompts import PromptDataset, build_dataset
from jaxrl_llm.data.sources import DataError
from jaxrl_llm.data.spec import DataSpec
from jaxrl_llm.data.vision_prompts import ImageTokens
from jaxrl_llm.hf.tokenizer import Tokenizer

# "source": the file and row a prompt came from (str of data.sources.RowRef; None for generated rows), what a
# failed scorer call names; "domain": the row's data.domains domain (None without data.domains)
METADATA_KEYS = ("data_source", "ground_truth", "extra_info", "ability", "source", "domain")


def _object_array(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values  # element-wise, so lists / dicts stay single objects
    return out


def collate(records: list[dict[str, Any]], return_raw_chat: bool = False) -> dict[str, np.ndarray]:
    """One batch dict of the records (see module docstring); prompts stay unpadded, since the
    sampler pads them to its own length bucket."""
    batch = {
        "raw_prompt_ids": _object_array([r["input_ids"] for r in records]),
        "prompt_lengths": np.asarray([len(r["input_ids"]) for r in records], dtype=np.int32),
        "index": np.asarray([r["index"] for r in records], dtype=np.int64),
    }
    for key in METADATA_KEYS:
        batch[key] = _object_array([r.get(key) for r in records])
    if any("images" in r for r in records):  # a vision-language policy's rows: each row's images (encoded)
        batch["images"] = _object_array([list(r.get("images", [])) for r in records])
    if return_raw_chat:
        batch["raw_prompt"] = _object_array([r["raw_prompt"] for r in records])
    return batch


class _Collate(grain.transforms.Map):
    """Global batch of row indices -> this process's collated share (picklable for grain workers)."""

    def __init__(self, dataset: PromptDataset, process_index: int, process_count: int, return_raw_chat: bool) -> None:
        self.dataset = dataset
        self.process_index = process_index
        self.process_count = process_count
        self.return_raw_chat = return_raw_chat

    # grain's stub declares map(element) -> None
    def map(self, indices: np.ndarray) -> dict[str, np.ndarray]:  # pyright: ignore[reportIncompatibleMethodOverride]
        share = np.array_split(np.asarray(indices), self.process_count)[self.process_index]
        return collate([self.dataset[int(i)] for i in share], self.return_raw_chat)


class PromptLoader:
    """Iterator over prompt batches with grain `get_state` / `set_state` (see module docstring)."""

    def __init__(
        self,
        dataset: PromptDataset,
        *,
        batch_size: int | None,
        shuffle: bool,
        seed: int | None,
        drop_last: bool,
        num_epochs: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
        return_raw_chat: bool = False,
        num_workers: int = 0,
        domains: DomainSpec | None = None,
    ):
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} is outside [0, process_count={process_count})")
        n = len(dataset)
        batch_size = n if batch_size is None else int(batch_size)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and batch_size % process_count:
            raise ValueError(f"batch size {batch_size} is not divisible by process_count={process_count}")
        if drop_last and n < batch_size:
            raise DataError(f"{dataset.name}: {n} prompts, fewer than one batch of {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.process_index = process_index
        self.process_count = process_count
        self.num_epochs = num_epochs

        seed = 0 if seed is None else int(seed)
        if drop_last and domains is not None and domains.probs:
            # a fixed share of each batch per domain, each domain its own endless stream (data/domains.py)
            endless, self._batches_per_epoch = mixture_batches(
                [r.get("domain") for r in dataset.records], domains, batch_size, shuffle=shuffle, seed=seed,
                name=dataset.name)
            batches = endless if num_epochs is None else endless[:self._batches_per_epoch * num_epochs]
        else:
            rows = grain.MapDataset.range(n)
            if shuffle:
                rows = rows.shuffle(seed=seed)
            batches = rows.batch(batch_size, drop_remainder=drop_last, batch_fn=np.asarray)
            self._batches_per_epoch = len(batches)
            # repeat after shuffle + batch: each epoch is reshuffled and batches never cross epochs
            batches = batches.repeat(num_epochs)
        pipeline = batches.map(_Collate(dataset, process_index, process_count, return_raw_chat))
        # num_workers=0: collate on demand; k > 0: k grain threads collate up to 2k batches ahead
        # (the iterator state still counts only the batches handed out)
        read_options = grain.ReadOptions(num_threads=num_workers, prefetch_buffer_size=2 * num_workers)
        self._pipeline = pipeline.to_iter_dataset(read_options)
        self._iterator = iter(self._pipeline)

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._batches_per_epoch

    def __iter__(self) -> PromptLoader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def get_state(self) -> dict[str, Any]:
        return self._iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._iterator.set_state(state)

    def reset(self) -> None:
        """Starts again from the first batch of the first epoch."""
        self._iterator = iter(self._pipeline)


def make_dataloader(
    data: DataSpec,
    tokenizer: Tokenizer,
    split: str = "train",
    *,
    batch_size: int | None = None,
    num_epochs: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
    dataset: PromptDataset | None = None,
    image_tokens: ImageTokens | None = None,
) -> PromptLoader:
    """The `PromptLoader` of `split`.

    `batch_size` is the global batch (default data.train_batch_size / data.val_batch_size, where a
    None val batch means the whole set). Train: shuffled (data.shuffle, data.seed), full batches,
    `num_epochs` (None = endless), with data.domains.probs a fixed share per domain (data/domains.py).
    Val: in order, one pass. Pass `dataset` to reuse a built one; `image_tokens`: a vision-language policy's
    (data/vision_prompts.py).
    """
    if dataset is None:
        dataset = build_dataset(data, tokenizer, split, image_tokens)
    train = split == "train"
    if batch_size is None:
        batch_size = data.train_batch_size if train else data.val_batch_size
    return PromptLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train and data.shuffle,
        seed=data.seed,
        drop_last=train,
        num_epochs=num_epochs if train else 1,
        process_index=process_index,
        process_count=process_count,
        return_raw_chat=data.return_raw_chat,
        num_workers=data.dataloader_num_workers,
        domains=data.domains if train else None,
    )
