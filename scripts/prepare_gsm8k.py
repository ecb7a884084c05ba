"""Convert a local GSM8K file into veRL's parquet format (no download).

Input: a .jsonl / .json / .parquet / .csv file with `question` and `answer` columns (the answer
ends with `#### <number>`, as in openai/gsm8k). Output rows match veRL's
examples/data_preprocess/gsm8k.py: the question plus the instruction suffix
`Let's think step by step and output the final answer after "####".`, data_source
"openai/gsm8k", ability "math", reward_model {style: rule, ground_truth: <number, commas removed>},
extra_info {split, index, answer, question}.

    python scripts/prepare_gsm8k.py --input gsm8k/train.jsonl --output data/gsm8k/train.parquet --split train
"""
from __future__ import annotations

import argparse
import re
import sys

from jaxrl_llm.data.sources import DataError, read_rows
from jaxrl_llm.data.synthetic import write_rows

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "openai/gsm8k"
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_ground_truth(answer: str) -> str | None:
    """The first `#### N` of a GSM8K answer with commas removed (veRL's preprocessing)."""
    found = _FINAL_ANSWER.search(answer)
    return found.group(1).replace(",", "") if found else None


def convert(input_path: str, split: str) -> list[dict]:
    rows, refs = read_rows(input_path)
    out = []
    for index, (row, ref) in enumerate(zip(rows, refs)):
        for column in ("question", "answer"):
            if not isinstance(row.get(column), str):
                raise DataError(f"{ref}: missing or non-string column {column!r}")
        ground_truth = extract_ground_truth(row["answer"])
        if ground_truth is None:
            raise DataError(f"{ref}: answer has no '#### <number>' final answer")
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": row["question"] + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index, "answer": row["answer"], "question": row["question"]},
        })
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GSM8K (question/answer) -> veRL parquet")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True, help="output .parquet path")
    parser.add_argument("--split", default="train", help="stored in extra_info.split (train / test)")
    args = parser.parse_args(argv)
    try:
        rows = convert(args.input, args.split)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    write_rows(rows, args.output)
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
