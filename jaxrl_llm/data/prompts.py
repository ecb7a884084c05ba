"""Prompt datasets: rows -> tokenised prompt records (chat template, truncation, filtering).

`build_dataset(data: DataSpec, tokenizer, split)` reads `data.train_files` / `data.val_files`, keeps
`train_max_samples` / `val_max_samples` rows, renders each prompt and tokenises it once, applies
`filter_overlong_prompts` or `truncation`, and returns a `PromptDataset`: a random-access sequence
of records

    {"input_ids": int32[L] (unpadded, L <= max_prompt_length), "data_source": str,
     "ground_truth": Any, "extra_info": dict, "ability": str | None, "raw_prompt": list | str,
     "domain": str | None (data.domains: data/domains.py), "index": int (position in this dataset)}

Prompt column: `data.prompt_key` (veRL: a list of chat messages; ROLL: a plain string); when that
column is absent, `data.messages_key` (a messages column). Message lists go through
`tokenizer.apply_chat_template(..., add_generation_prompt=True)` and are tokenised without extra
special tokens (the template has them). String prompts are wrapped as one user message, or, with
`data.apply_chat_template=False`, tokenised as raw text with the tokenizer's own special tokens.
Images (`data.image_key`, veRL's multimodal rows: data/images.py) are read and checked against the prompt's
`<image>` placeholders; for a vision-language policy each becomes its image tokens (data/vision_prompts.py:
counted in max_prompt_length, never truncated) and the record keeps the images ("images"); for a text policy
such a row is refused (a multimodal folder that loads its text tower would drop them); `data.video_key` rows
are refused.
Ground truth: `reward_model.ground_truth` (veRL) or a top-level `ground_truth` column; a number
is turned into its string (`normalise_ground_truth`). An empty prompt is an error naming the row;
with `data.builtin_scorers` (no custom reward function, no reward model) so is a row without a
ground truth or whose `data_source` no built-in scorer knows, found here rather than at step 1.

`data.custom_cls.path` / `.name` name a user class called as `cls(data_files, tokenizer, config)`;
it must be a sequence (`__len__`, `__getitem__`) whose items are either raw rows (tokenised as
above) or dicts with `input_ids` (1-D, optional `attention_mask` to drop padding) plus any of the
metadata keys above.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import math
import multiprocessing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.domains import unmixed_rows
from jaxrl_llm.data.images import sized_row_images
from jaxrl_llm.data.sources import DataError, RowRef, as_path_list, read_files
from jaxrl_llm.data.spec import DataSpec
from jaxrl_llm.data.vision_prompts import ImageTokens, expand_image_tokens, with_image_tokens
from jaxrl_llm.hf.tokenizer import Tokenizer, load_tokenizer, render_chat

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")
NATIVE_TEMPLATE = "native"  # data.val_overrides.chat_template: the tokenizer's own (ROLL's name for it)

def truncate_ids(ids: np.ndarray, max_length: int, mode: str, where: object = "prompt") -> np.ndarray:
    """Cut `ids` to `max_length` tokens: `left` keeps the end, `right` the start, `middle` the head
    (max_length // 2 tokens) and the tail; `error` raises a DataError naming `where` and the length."""
    n = len(ids)
    if n <= max_length:
        return ids
    if mode == "error":
        raise DataError(
            f"{where}: prompt has {n} tokens, more than data.max_prompt_length={max_length} "
            "(set data.filter_overlong_prompts=True or data.truncation=left|right|middle)"
        )
    if mode == "left":
        return ids[n - max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        return np.concatenate([ids[:head], ids[n - (max_length - head):]])
    raise DataError(f"data.truncation={mode!r} is not one of {TRUNCATION_MODES}")


def _is_message_list(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


def _normalise_prompt(value: Any, where: RowRef | str, column: str) -> list[dict[str, Any]] | str:
    """A message list (as plain dicts) or a string; anything else (or nothing to say) is a DataError."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: empty prompt (column {column!r})")
        return value
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) == 0:
        raise DataError(f"{where}: empty prompt (column {column!r} is an empty list)")
    if _is_message_list(value) and not any(str(m["content"] or "").strip() for m in value):
        raise DataError(f"{where}: empty prompt (every message in column {column!r} has empty content)")
    if _is_message_list(value):
        return [dict(m) for m in (value.tolist() if isinstance(value, np.ndarray) else value)]
    raise DataError(
        f"{where}: column {column!r} is neither a string nor a list of chat messages "
        f"({{'role': ..., 'content': ...}}); got {type(value).__name__}: {str(value)[:80]!r}"
    )


def with_system_prompt(prompt: list[dict[str, Any]] | str, system_prompt: str | None
                       ) -> list[dict[str, Any]] | str:
    """`prompt` with `system_prompt` as its first message when it has no system message (a string
    prompt becomes [system, user], as TRL / open-r1 build it); unchanged when `system_prompt` is None."""
    if system_prompt is None:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if messages and messages[0].get("role") == "system":
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def render_prompt(prompt: list[dict[str, Any]] | str, tokenizer: Tokenizer, apply_chat_template: bool,
                  template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The exact text fed to the tokenizer for one prompt (`template_kwargs`: the chat template's own)."""
    if isinstance(prompt, str) and not apply_chat_template:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return render_chat(tokenizer, messages, add_generation_prompt=True, **dict(template_kwargs or {}))


def encode_prompts(
    prompts: Sequence[list[dict[str, Any]] | str], tokenizer: Tokenizer, apply_chat_template: bool,
    template_kwargs: Mapping[str, Any] | None = None, after_render: Callable[[str], str] | None = None,
) -> list[np.ndarray]:
    """Token ids (int32, unpadded) of each prompt; `after_render`: applied to each rendered text before it is
    tokenized (a processor's own edits: Gemma 3's blank lines around each image, `ImageTokens.after_render`)."""
    templated = [not (isinstance(p, str) and not apply_chat_template) for p in prompts]
    texts = [render_prompt(p, tokenizer, apply_chat_template, template_kwargs) for p in prompts]
    if after_render is not None:
        texts = [after_render(t) for t in texts]
    out: list[np.ndarray | None] = [None] * len(texts)
    for with_template in (True, False):
        pos = [i for i, t in enumerate(templated) if t == with_template]
        if not pos:
            continue
        # a chat template already contains the special tokens; raw text gets the tokenizer's own
        enc = tokenizer([texts[i] for i in pos], add_special_tokens=not with_template)["input_ids"]
        for i, ids in zip(pos, enc):
            out[i] = np.asarray(ids, dtype=np.int32)
    return out  # type: ignore[return-value]


def _encode_chunk(args: tuple[Sequence[Any], Any, bool, Any]) -> list[np.ndarray]:
    prompts, tokenizer, apply_chat_template, after_render = args
    return encode_prompts(prompts, tokenizer, apply_chat_template, after_render=after_render)


def encode_prompts_parallel(
    prompts: Sequence[list[dict[str, Any]] | str], tokenizer: Tokenizer, apply_chat_template: bool, workers: int,
    after_render: Callable[[str], str] | None = None,
) -> list[np.ndarray]:
    """`encode_prompts` split over `workers` processes (spawned, so safe next to jax threads); `after_render` must
    pickle (a module's function, a frozen dataclass's method)."""
    if workers <= 1 or len(prompts) < 2 * workers:
        return encode_prompts(prompts, tokenizer, apply_chat_template, after_render=after_render)
    chunk = -(-len(prompts) // workers)
    parts = [(prompts[i:i + chunk], tokenizer, apply_chat_template, after_render)
             for i in range(0, len(prompts), chunk)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        results = list(pool.map(_encode_chunk, parts))
    return [ids for part in results for ids in part]


def _select_max_samples(n: int, max_samples: int, shuffle: bool, seed: int | None) -> np.ndarray:
    if max_samples is None or max_samples < 0 or max_samples >= n:
        return np.arange(n)
    if shuffle:
        return np.sort(np.random.default_rng(seed).choice(n, size=max_samples, replace=False))
    return np.arange(max_samples)


@dataclasses.dataclass
class PromptDataset(Sequence):
    """Tokenised prompt records (see module docstring)."""

    records: list[dict[str, Any]]
    name: str = "dataset"

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):  # type: ignore[override]
        return self.records[i]

    @property
    def prompt_lengths(self) -> np.ndarray:
        return np.asarray([len(r["input_ids"]) for r in self.records], dtype=np.int32)


def normalise_ground_truth(value: Any) -> Any:
    """A number becomes its string, as veRL's files store answers: 42 -> "42", 2.5 -> "2.5", and an
    integral float (a numeric column that pandas read as float) 3.0 -> "3"; NaN (a missing cell)
    becomes None. Anything else is kept."""
    if isinstance(value, (bool, np.bool_)):
        return value
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        number = float(value)
        if math.isnan(number):
            return None
        return str(int(number)) if number.is_integer() else repr(number)
    return value


def _metadata(row: Mapping[str, Any], where: RowRef | str, builtin_scorers: bool = False,
              ground_truth_key: str | None = None, default_data_source: str | None = None,
              domain: str | None = None, columns_truth: dict[str, Any] | None = None,
              extra_info_keys: Sequence[str] = ()) -> dict[str, Any]:
    reward_model = row.get("reward_model")
    if columns_truth is not None:  # data.domains.ground_truth_columns
        ground_truth = columns_truth
    elif ground_truth_key is not None:
        if ground_truth_key not in row:
            raise DataError(f"{where}: missing column {ground_truth_key!r} (data.ground_truth_key); columns are "
                            f"{sorted(row)}")
        ground_truth = row[ground_truth_key]
    elif isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
        ground_truth = reward_model["ground_truth"]
    else:
        ground_truth = row.get("ground_truth")
    ground_truth = normalise_ground_truth(ground_truth)
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, Mapping):
        raise DataError(f"{where}: extra_info must be a dict, got {type(extra_info).__name__}")
    extra_info = {**extra_info, **{k: row[k] for k in extra_info_keys if k in row}}  # data.extra_info_keys
    data_source = row.get("data_source") or default_data_source or "unknown"
    if builtin_scorers:  # what the built-in scorers need, checked now rather than at the first step
        from jaxrl_llm.rewards.scorers import BUILTIN_SOURCES, ground_truth_problem, has_builtin_scorer

        if ground_truth is None or (isinstance(ground_truth, str) and not ground_truth.strip()):
            raise DataError(f"{where}: no ground truth (reward_model.ground_truth or a ground_truth column), which "
                            "the built-in scorers need; fill it in or set custom_reward_function.path")
        if not has_builtin_scorer(str(data_source)):
            what = "no data_source, so" if data_source == "unknown" else f"data_source {data_source!r}:"
            raise DataError(f"{where}: {what} no built-in scorer applies (built in: {', '.join(BUILTIN_SOURCES)}); "
                            "fix the data_source column or set custom_reward_function.path")
        problem = ground_truth_problem(str(data_source), ground_truth)
        if problem is not None:
            raise DataError(f"{where}: reward_model.ground_truth: {problem}")
    return {
        "data_source": data_source,
        "ground_truth": ground_truth,
        "extra_info": dict(extra_info),
        "ability": row.get("ability"),
        "source": str(where),
        "domain": domain,
    }


def _prompt_column(
    rows: Sequence[Mapping[str, Any]], refs: Sequence[RowRef | str], prompt_key: str, messages_key: str
) -> list[str]:
    """Checks the prompt column per file; returns the column name of each row."""
    columns: list[str] = []
    checked: dict[str, str] = {}
    for row, ref in zip(rows, refs):
        source = ref.path if isinstance(ref, RowRef) else str(ref)
        if source not in checked:
            if prompt_key in row:
                checked[source] = prompt_key
            elif messages_key and messages_key in row:
                checked[source] = messages_key
            else:
                raise DataError(
                    f"{source}: missing column {prompt_key!r} (data.prompt_key) and no "
                    f"{messages_key!r} column (data.messages_key); columns are {sorted(row)}"
                )
        columns.append(checked[source])  # a row without it is an error of that row (records_from_rows)
    return columns


def records_from_rows(
    rows: Sequence[Mapping[str, Any]],
    refs: Sequence[RowRef | str],
    tokenizer: Tokenizer,
    data: DataSpec,
    image_tokens: ImageTokens | None = None,
) -> list[dict[str, Any]]:
    """Tokenised, filtered / truncated records of raw rows (errors name the row). `image_tokens`: a
    vision-language policy's (data/vision_prompts.py): a row's images then become its image tokens (counted in
    data.max_prompt_length) and its record keeps them; without it a row with images is refused."""
    prompt_key, messages_key = data.prompt_key, data.messages_key
    apply_template = data.apply_chat_template
    max_len, truncation = data.max_prompt_length, data.truncation
    if truncation not in TRUNCATION_MODES:
        raise DataError(f"data.truncation={truncation!r} is not one of {TRUNCATION_MODES}")
    filter_overlong = data.filter_overlong_prompts
    workers = data.filter_overlong_prompts_workers if filter_overlong else 1

    if apply_template and getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template; set data.apply_chat_template=False for string prompts")
    bad = BadRows(data.skip_bad_rows, len(rows))
    columns = _prompt_column(rows, refs, prompt_key, messages_key)
    kept: list[tuple[Mapping[str, Any], RowRef | str, list[dict[str, Any]] | str, list[Any], list[int]]] = []
    for row, ref, col in zip(rows, refs, columns):
        with bad.row():
            if col not in row:
                raise DataError(f"{ref}: missing column {col!r}")
            prompt = _normalise_prompt(row[col], ref, col)
            sized = sized_row_images(row, prompt, ref, data.image_key, data.video_key)
            images = [value for value, _ in sized]
            counts: list[int] = []
            if images and image_tokens is None:
                raise DataError(f"{ref}: the row has {len(images)} image(s) (data.image_key={data.image_key!r}), "
                                "but the policy reads text only (vision-language policies: Qwen2.5-VL / Qwen3-VL / "
                                "Gemma 3 / Gemma 4 folders and tiny:qwen2_5_vl; a Qwen3.5 folder trains its text "
                                "model)")
            if images:
                assert image_tokens is not None
                prompt = with_image_tokens(prompt, image_tokens.placeholder)
                counts = [image_tokens.tokens_for(*size) for _, size in sized]
            prompt = with_system_prompt(prompt, data.system_prompt)
            if not isinstance(prompt, str) and not apply_template:
                raise DataError(f"{ref}: prompt is a message list but data.apply_chat_template=False")
            kept.append((row, ref, prompt, images, counts))
    after = None if image_tokens is None or not image_tokens.around_text else image_tokens.after_render
    ids_list = encode_prompts_parallel([p for _, _, p, _, _ in kept], tokenizer, apply_template, workers, after)

    records = []
    num_dropped = 0
    for (row, ref, prompt, images, counts), ids in zip(kept, ids_list):
        with bad.row():
            if images:
                assert image_tokens is not None
                ids = expand_image_tokens(ids, counts, image_tokens.image_token_id, ref)
        if filter_overlong and len(ids) > max_len:
            num_dropped += 1
            continue
        with bad.row():
            if images and len(ids) > max_len:  # truncation would cut image tokens off their image
                raise DataError(f"{ref}: the prompt is {len(ids)} tokens with its {sum(counts)} image tokens, more "
                                f"than data.max_prompt_length={max_len}, and image tokens are never truncated (set "
                                "data.filter_overlong_prompts=True or a larger max_prompt_length)")
            record = {"input_ids": truncate_ids(ids, max_len, truncation, ref), "raw_prompt": prompt}
            if images:
                record["images"] = images
            domain = data.domains.domain_of(row) if data.domains.enabled else None
            # a domain's data_source (data.domains.data_sources) before the run-wide default
            source = data.domains.data_source_of(domain) or data.default_data_source
            record.update(_metadata(row, ref, data.builtin_scorers, data.ground_truth_key, source, domain,
                                    data.domains.ground_truth_of(domain, row), data.extra_info_keys))
            records.append(record)
    if num_dropped:
        logger.info("filter_overlong_prompts dropped %d of %d prompts longer than %d tokens",
                    num_dropped, len(rows), max_len)
    bad.report()
    return records


class BadRows:
    """data.skip_bad_rows: a row's DataError is raised (off), or the row is left out, counted and the first
    one named in one warning (on, as veRL skips rows it cannot read)."""

    def __init__(self, skip: bool, total: int):
        self.skip, self.total, self.errors = skip, total, []

    @contextlib.contextmanager
    def row(self) -> Iterator[None]:
        try:
            yield
        except DataError as err:
            if not self.skip:
                raise
            self.errors.append(str(err))

    def report(self) -> None:
        if self.errors:
            logger.warning("data.skip_bad_rows: left out %d of %d rows; the first: %s", len(self.errors), self.total,
                           self.errors[0])


def _records_from_custom(dataset: Any, tokenizer: Tokenizer, data: DataSpec, name: str) -> list[dict[str, Any]]:
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise DataError(f"data.custom_cls {name}: instances must define __len__ and __getitem__")
    items = [dataset[i] for i in range(len(dataset))]
    refs = [f"{name}[{i}]" for i in range(len(items))]
    raw = [(it, ref) for it, ref in zip(items, refs) if "input_ids" not in it]
    records: list[dict[str, Any]] = []
    if raw:
        records = records_from_rows([r for r, _ in raw], [ref for _, ref in raw], tokenizer, data)
        if len(raw) != len(items):
            raise DataError(f"data.custom_cls {name}: items mix raw rows and tokenised rows")
        return records
    max_len, truncation, filter_overlong = data.max_prompt_length, data.truncation, data.filter_overlong_prompts
    for item, ref in zip(items, refs):
        ids = np.asarray(item["input_ids"]).reshape(-1)
        if "attention_mask" in item:
            ids = ids[np.asarray(item["attention_mask"]).reshape(-1).astype(bool)]
        ids = ids.astype(np.int32)
        if len(ids) == 0:
            raise DataError(f"{ref}: empty prompt (no input_ids)")
        if filter_overlong and len(ids) > max_len:
            continue
        record = {"input_ids": truncate_ids(ids, max_len, truncation, ref), "raw_prompt": item.get("raw_prompt")}
        record.update(_metadata(item, ref, data.builtin_scorers))
        records.append(record)
    return records


def split_tokenizer(data: DataSpec, train: DataSpec, tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` (set up for training's settings `train`) with the chat template of `data`, a split's settings
    (data.val_overrides.chat_template: a text, or 'native' for the tokenizer's own, which data.chat_template
    replaced for training); itself when the split renders as training does."""
    if data.chat_template == train.chat_template:
        return tokenizer
    template = data.chat_template
    if template in (None, NATIVE_TEMPLATE):
        if train.chat_template is None:
            return tokenizer
        if data.tokenizer is None:
            raise DataError("data.val_overrides.chat_template='native': data.tokenizer names no tokenizer")
        template = load_tokenizer(data.tokenizer).chat_template
    out = copy.copy(tokenizer)  # tokenizers are shared (cached): never changed in place
    out.chat_template = template
    return out


def build_dataset(data: DataSpec, tokenizer: Tokenizer, split: str = "train",
                  image_tokens: ImageTokens | None = None) -> PromptDataset:
    """The `PromptDataset` of `split` ("train" reads data.train_files, "val" data.val_files, with the keys of
    data.val_overrides); `image_tokens`: a vision-language policy's (`records_from_rows`)."""
    train, data = data, data.for_split(split)
    tokenizer = split_tokenizer(data, train, tokenizer)
    paths = as_path_list(data.files(split), f"data.{split}_files")
    max_samples = data.max_samples(split)
    if data.custom_cls_path:
        from jaxrl_llm.rewards.custom import load_from_file

        if not data.custom_cls_name:
            raise DataError("data.custom_cls.path is set but data.custom_cls.name is empty")
        cls = load_from_file(data.custom_cls_path, data.custom_cls_name, "data.custom_cls")
        records = _records_from_custom(cls(paths, tokenizer, data), tokenizer, data, data.custom_cls_name)
        records = [records[i] for i in _select_max_samples(len(records), max_samples, data.shuffle, data.seed)]
        name = data.custom_cls_name
    else:
        rows, refs = read_files(paths)
        keep = _select_max_samples(len(rows), max_samples, data.shuffle, data.seed)
        rows = [rows[i] for i in keep]
        refs = [refs[i] for i in keep]
        records = records_from_rows(rows, refs, tokenizer, data, image_tokens)
        name = ", ".join(paths)
    if not records:
        raise DataError(f"{name}: empty dataset after filtering (no prompt fits data.max_prompt_length)")
    if split == "train" and data.domains.probs:
        left = unmixed_rows([r.get("domain") for r in records], data.domains)
        if left:
            logger.warning("data.domains: rows in no domain of data.domains.probs are not sampled (column %r: %s)",
                           data.domains.key, ", ".join(f"{k}: {v}" for k, v in sorted(left.items())))
    for i, record in enumerate(records):
        record["index"] = i
    return PromptDataset(records, name)
