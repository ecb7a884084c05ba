"""Convert a local copy of Geometry3K (hiyouga/geometry3k) into veRL's multimodal parquet format (no download).

Input: a .parquet / .jsonl / .json file (or a folder holding `<split>.parquet` / `<split>-*.parquet`, a Hugging Face
dataset's layout) with the columns `problem` (its text holds `<image>`), `answer` and `images` (a list of
{"bytes": ...} / {"path": ...}, as the HF Image feature stores them). Output rows are what veRL's
examples/data_preprocess/geo3k.py writes: prompt = one user message, the problem followed by an instruction to
reason inside <think> </think> and put the final answer in \\boxed{}; images as given (checked to decode, and as
many as the problem's `<image>` placeholders); data_source "hiyouga/geometry3k" (scored by
rewards/scorers/geo3k.py); ability "math"; reward_model {style: rule, ground_truth: answer}; extra_info {split,
index, answer, question}. A row that cannot be converted stops the script with the file and row named.

    python scripts/prepare_geo3k.py --input geometry3k/ --split train --output data/geo3k/train.parquet
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

from jaxrl_llm.data.images import row_images
from jaxrl_llm.data.sources import DataError, read_files
from jaxrl_llm.data.synthetic import write_rows

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = ("Think the problem through first, inside <think> </think> tags, then give the final answer "
               "inside \\boxed{}.")


def input_files(path: str, split: str) -> list[str]:
    """The split's files: `path` itself, or its `<split>.parquet` / `<split>-*.parquet` (`data/` too)."""
    if os.path.isfile(path):
        return [path]
    for folder in (path, os.path.join(path, "data")):
        found = sorted(glob.glob(os.path.join(folder, f"{split}.parquet"))
                       + glob.glob(os.path.join(folder, f"{split}-*.parquet")))
        if found:
            return found
    raise DataError(f"{path}: no {split}.parquet or {split}-*.parquet (nor under data/)")


def _entry(image: object) -> dict:
    """An image as veRL's rows store it: {"bytes": ...} or {"path": ...}."""
    if isinstance(image, dict):
        return {"bytes": image.get("bytes"), "path": image.get("path")}
    if isinstance(image, str):
        return {"bytes": None, "path": image}
    if isinstance(image, (bytes, bytearray)):
        return {"bytes": bytes(image), "path": None}
    raise DataError(f"an image of type {type(image).__name__} cannot be written to parquet")


def convert(paths: list[str], split: str) -> list[dict]:
    rows, refs = read_files(paths)
    out = []
    for index, (row, ref) in enumerate(zip(rows, refs)):
        for column in ("problem", "answer"):
            if not isinstance(row.get(column), str) or not row[column].strip():
                raise DataError(f"{ref}: missing, empty or non-string column {column!r}")
        prompt = [{"role": "user", "content": row["problem"] + " " + INSTRUCTION}]
        images = row_images(row, prompt, ref, "images", "")
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": prompt,
            "images": [_entry(image) for image in images],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": row["answer"]},
            "extra_info": {"split": split, "index": index, "answer": row["answer"], "question": row["problem"]},
        })
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Geometry3K (problem / answer / images) -> veRL parquet")
    parser.add_argument("--input", required=True, help="a data file, or the dataset's folder")
    parser.add_argument("--output", required=True, help="output .parquet path")
    parser.add_argument("--split", default="train", help="the split read from a folder; stored in extra_info.split")
    args = parser.parse_args(argv)
    try:
        rows = convert(input_files(args.input, args.split), args.split)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    write_rows(rows, args.output)
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
