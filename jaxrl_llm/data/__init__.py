"""grain data pipelines for veRL / ROLL formats: parquet, jsonl, json, csv; chat templates; truncation.

    dataset = build_dataset(spec.data, tokenizer, "train")             # spec: jaxrl_llm.config.resolve
    loader = make_dataloader(spec.data, tokenizer, "train", batch_size=..., process_index=...,
                             process_count=...)                       # PromptLoader
    batch = next(loader); loader.get_state(); loader.set_state(state); len(loader)

See `jaxrl_llm.data.loader` for the batch layout and `jaxrl_llm.data.prompts` for the row formats.
`jaxrl_llm.data.synthetic` writes small verifiable tasks as veRL parquet.
"""
from jaxrl_llm.data.loader import PromptLoader, collate, make_dataloader
from jaxrl_llm.data.prompts import PromptDataset, build_dataset, truncate_ids
from jaxrl_llm.data.sources import DataError, read_rows
from jaxrl_llm.data.spec import DataSpec

__all__ = [
    "DataError",
    "DataSpec",
    "PromptDataset",
    "PromptLoader",
    "build_dataset",
    "collate",
    "make_dataloader",
    "read_rows",
    "truncate_ids",
]
