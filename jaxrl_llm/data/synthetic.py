"""Small verifiable tasks written as veRL-format parquet (offline data for the quickstart and tests).

Tasks (data_source `synthetic/<task>`, scored by `jaxrl_llm.rewards.scorers.synthetic` through
`default_compute_score`); `difficulty` tunes each one:

  add      "What is 3 + 4?"                 operands have `difficulty` digits (1: 0..9)
  larger   "Which is larger: 17 or 42?"     numbers have `difficulty` digits
  repeat   "Repeat exactly: apple river"    `difficulty` words from a fixed list
  multiply "What is 47 * 38? Use the calculator tool ..."   operands have `difficulty` digits; the
           prompt holds one worked example of a hermes calculator call (configs/multiturn_tool.py)
  guess    guess-the-number with GuessNumberEnv (configs/multiturn_guess.py): target in
           1..10**difficulty (extra_info.interaction_kwargs {name: guess_number, target}); scored
           by the interaction alone (the scorer gives 0)
  shapes   "<image>How many red shapes are in the picture?"  a 112 x 112 PNG of up to 2 + 2 * difficulty
           coloured shapes (data/synthetic_images.py) in the row's `images` column, veRL's multimodal row
           format ({"bytes": ...}); written as .parquet only

Every prompt asks for the bare answer. `answer_format` (stored in extra_info) picks how strictly
it is scored: `strict` = the whole response is the answer; `lenient` = the last number (or the
words anywhere) matches; `first` = the first number matches (or the response starts with the
words). Rows: prompt (one user message), data_source, ability, reward_model {style: rule,
ground_truth}, extra_info {split, index, task, difficulty, answer_format}, and a preference pair
(chosen: the answer, rejected: a wrong one) for DPO.
Validation questions are disjoint from training questions whenever the task has enough distinct
questions.

    python -m jaxrl_llm.data.synthetic --out DIR --task add --n-train 2000 --n-val 64 \
        [--difficulty 1] [--answer-format strict] [--seed 0]

writes DIR/train.parquet and DIR/test.parquet; `write_synthetic_files(train_path, val_path, ...)`
writes to given .parquet / .jsonl paths (what the trainer uses for `data.synthetic`).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl_llm import storage
from jaxrl_llm.data.spec import SyntheticSpec

TASKS = ("add", "larger", "repeat", "multiply", "guess", "shapes")
ANSWER_FORMATS = ("strict", "lenient", "first")

_WORDS = (
    "apple river stone cloud green table music house light paper water chair bread smile "
    "garden window silver forest candle rocket orange planet winter summer yellow pencil "
    "bottle mirror castle dragon island jacket ladder marble needle ocean pepper rabbit "
    "saddle tunnel violin wallet zebra anchor basket cookie desert engine falcon guitar "
    "hammer insect jungle kettle lemon magnet nickel oyster parrot quartz ribbon sunset "
    "tomato umbrella velvet walnut yogurt button canvas dinner feather ginger harbor"
).split()

_PROMPTS = {
    "add": "What is {a} + {b}? Answer with only the number.",
    "larger": "Which number is larger: {a} or {b}? Answer with only the number.",
    "repeat": "Repeat exactly: {text}. Answer with only those words.",
    "multiply": "What is {a} * {b}? Use the calculator tool, then answer with only the number.",
    "shapes": "<image>How many {colour} shapes are in the picture? Answer with only the number.",
}
_ABILITY = {"add": "arithmetic", "larger": "comparison", "repeat": "copying", "multiply": "tool use",
            "guess": "interaction", "shapes": "vision"}
# the worked example before a multiply question: one hermes call, the tool's reply, the bare answer
_MULTIPLY_EXAMPLE = [
    {"role": "user", "content": _PROMPTS["multiply"].format(a=12, b=34)},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}'
                                     "\n</tool_call>"},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "408"},
]


def _messages(task: str, fields: dict[str, Any]) -> list[dict[str, str]]:
    if task == "guess":  # GuessNumberEnv.reset adds the game's first message
        return [{"role": "system", "content": "You are playing a number guessing game."}]
    question = [{"role": "user", "content": _PROMPTS[task].format(**fields)}]
    return _MULTIPLY_EXAMPLE + question if task == "multiply" else question


def _number_range(difficulty: int) -> tuple[int, int]:
    low = 0 if difficulty == 1 else 10 ** (difficulty - 1)
    return low, 10**difficulty - 1


def _questions(task: str, difficulty: int) -> tuple[int, Callable[[int], dict[str, Any]]]:
    """(number of distinct questions, question number -> template fields + answer)."""
    if task == "guess":
        return 10**difficulty, lambda k: {"answer": str(k + 1)}
    if task in ("add", "larger", "multiply"):
        low, high = _number_range(difficulty)
        span = high - low + 1

        def numbers(k: int) -> dict[str, Any]:
            a, b = low + k // span, low + k % span
            if task == "add":
                return {"a": a, "b": b, "answer": str(a + b)}
            if task == "multiply":
                return {"a": a, "b": b, "answer": str(a * b)}
            if a == b:  # "larger" needs two different numbers
                b = low + (b - low + 1) % span
            return {"a": a, "b": b, "answer": str(max(a, b))}

        return span * span, numbers
    if task == "repeat":
        n = len(_WORDS)

        def words(k: int) -> dict[str, Any]:
            chosen = [_WORDS[(k // n**j) % n] for j in range(difficulty)]
            return {"text": " ".join(chosen), "answer": " ".join(chosen)}

        return n**difficulty, words
    if task == "shapes":  # question k's own seed draws its picture: as many questions as seeds
        from jaxrl_llm.data.synthetic_images import shapes_question

        return 2**31, lambda k: shapes_question(k, difficulty)
    raise ValueError(f"unknown synthetic task {task!r}; expected one of {TASKS}")


def _wrong_answer(task: str, answer: str, k: int) -> str:
    """A deterministic wrong answer to question `k` (the `rejected` side of a preference pair)."""
    if task == "repeat":
        words = answer.split()
        return " ".join(words[::-1]) if len(set(words)) > 1 else f"{answer} {answer}"
    return str(int(answer) + 1 + k % 3)


def make_splits(task: str, n_train: int, n_val: int, *, difficulty: int = 1, answer_format: str = "strict",
                seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """veRL rows of the train and validation splits (deterministic in `seed`)."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")
    if n_train < 0 or n_val < 0 or n_train + n_val == 0:
        raise ValueError(f"need a positive number of rows, got n_train={n_train} n_val={n_val}")
    pool, question = _questions(task, difficulty)
    if pool >= 2**62:
        raise ValueError(f"difficulty={difficulty} is too large for task {task!r}")
    rng = np.random.default_rng(seed)
    if pool >= n_train + n_val:  # distinct questions, validation disjoint from training
        picks = rng.choice(pool, size=n_train + n_val, replace=False)
        val_ids, train_ids = picks[:n_val], picks[n_val:]
    else:
        val_ids = rng.choice(pool, size=n_val, replace=n_val > pool)
        train_ids = rng.integers(0, pool, size=n_train)

    def rows(ids: np.ndarray, split: str) -> list[dict[str, Any]]:
        out = []
        for index, k in enumerate(ids):
            fields = question(int(k))
            extra = {"split": split, "index": index, "task": task, "difficulty": difficulty,
                     "answer_format": answer_format}
            if task == "guess":
                extra["interaction_kwargs"] = {"name": "guess_number", "target": int(fields["answer"])}
            row = {
                "data_source": f"synthetic/{task}",
                "prompt": _messages(task, fields),
                "ability": _ABILITY[task],
                "reward_model": {"style": "rule", "ground_truth": fields["answer"]},
                "extra_info": extra,
                # a preference pair (DPO: configs/dpo_tiny.py): the right answer and a wrong one
                "chosen": fields["answer"],
                "rejected": _wrong_answer(task, fields["answer"], int(k)),
            }
            if "image" in fields:  # veRL's multimodal rows: a list of {"bytes": ...} per row
                row["images"] = [{"bytes": fields["image"]}]
            out.append(row)
        return out

    return rows(train_ids, "train"), rows(val_ids, "test")


def write_rows(rows: list[dict[str, Any]], path: str) -> None:
    """Writes rows as .parquet or .jsonl (by suffix), atomically (a temporary file renamed into
    place). A bucket URL gets the finished local file in one object write."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".parquet", ".jsonl"):
        raise ValueError(f"{path}: synthetic data is written as .parquet or .jsonl, not {suffix!r}")
    if suffix == ".jsonl" and any("images" in row for row in rows):
        raise ValueError(f"{path}: rows with images (PNG bytes) are written as .parquet, not .jsonl")
    if storage.is_url(path):
        with tempfile.TemporaryDirectory() as local:
            write_rows(rows, os.path.join(local, "rows" + suffix))
            with open(os.path.join(local, "rows" + suffix), "rb") as handle:
                storage.write_bytes(path, handle.read())
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=suffix + ".tmp")
    os.close(fd)
    try:
        if suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


write_parquet = write_rows


def write_synthetic_files(train_path: str, val_path: str, task: str, n_train: int, n_val: int, *,
                          difficulty: int = 1, answer_format: str = "strict", seed: int = 0) -> None:
    """Writes both splits to the given .parquet / .jsonl paths (an empty split is not written)."""
    train, val = make_splits(task, n_train, n_val, difficulty=difficulty, answer_format=answer_format, seed=seed)
    for rows, path in ((train, train_path), (val, val_path)):
        if rows:
            write_rows(rows, path)


def write_synthetic(out_dir: str, task: str, n_train: int, n_val: int, *, difficulty: int = 1,
                    answer_format: str = "strict", seed: int = 0) -> tuple[str, str]:
    """Writes `out_dir/train.parquet` and `out_dir/test.parquet`; returns their paths."""
    paths = (storage.join(out_dir, "train.parquet"), storage.join(out_dir, "test.parquet"))
    write_synthetic_files(*paths, task, n_train, n_val, difficulty=difficulty, answer_format=answer_format, seed=seed)
    return paths


def write_synthetic_data(syn: SyntheticSpec | None, *, is_main: bool) -> None:
    """A synthetic task's train / val files (`data.synthetic`), written once by the main process (kept
    when both exist); every process waits for them."""
    if syn is None:
        return
    if is_main and not (storage.exists(syn.train_path) and storage.exists(syn.val_path)):
        write_synthetic_files(syn.train_path, syn.val_path, syn.task, syn.n_train, syn.n_val,
                              difficulty=syn.difficulty, answer_format=syn.answer_format, seed=syn.seed)
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("synthetic data written")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--task", choices=TASKS, default="add")
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-val", type=int, default=64)
    parser.add_argument("--difficulty", type=int, default=1)
    parser.add_argument("--answer-format", choices=ANSWER_FORMATS, default="strict")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, val = write_synthetic(args.out, args.task, args.n_train, args.n_val, difficulty=args.difficulty,
                                 answer_format=args.answer_format, seed=args.seed)
    print(f"wrote {args.n_train} rows to {train} and {args.n_val} rows to {val}")


if __name__ == "__main__":
    main()
