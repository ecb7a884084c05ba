"""Synthetic verifiable tasks and the GSM8K converter write veRL rows the loader and scorers accept."""
import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from spec_helpers import data_spec

from jaxrl_llm.data import build_dataset
from jaxrl_llm.data.synthetic import TASKS, make_splits
from jaxrl_llm.rewards import default_compute_score


@pytest.mark.parametrize("task", TASKS)
def test_tasks_have_correct_ground_truth(task):
    train, val = make_splits(task, 50, 10, difficulty=2, seed=1)
    assert len(train) == 50 and len(val) == 10
    question = lambda r: (r["prompt"][-1]["content"] + str(r["extra_info"].get("interaction_kwargs"))  # noqa: E731
                          + str(r.get("images")))  # shapes: the picture is the question
    assert not {question(r) for r in val} & {question(r) for r in train}
    for row in train + val:
        gt = row["reward_model"]["ground_truth"]
        text = question(row)
        assert row["data_source"] == f"synthetic/{task}"
        if task == "add":
            a, b = [int(x) for x in text.split("What is ")[1].split("?")[0].split(" + ")]
            assert 10 <= a <= 99 and 10 <= b <= 99 and gt == str(a + b)
        elif task == "larger":
            a, b = [int(x) for x in text.split(": ")[1].split("?")[0].split(" or ")]
            assert a != b and gt == str(max(a, b))
        elif task == "multiply":
            a, b = [int(x) for x in text.split("What is ")[1].split("?")[0].split(" * ")]
            assert 10 <= a <= 99 and 10 <= b <= 99 and gt == str(a * b)
            assert [m["role"] for m in row["prompt"]] == ["user", "assistant", "tool", "assistant", "user"]
        elif task == "guess":  # scored by the interaction (GuessNumberEnv), not the scorer
            assert row["extra_info"]["interaction_kwargs"] == {"name": "guess_number", "target": int(gt)}
            assert 1 <= int(gt) <= 100
            assert default_compute_score(row["data_source"], gt, gt, row["extra_info"]) == 0.0
            continue
        elif task == "shapes":  # the pictures against the answers: tests/data/test_data_images.py
            assert text.startswith("<image>How many ") and 0 <= int(gt) <= 6 and len(row["images"]) == 1
        else:
            assert len(gt.split()) == 2 and f"exactly: {gt}." in text
        assert default_compute_score(row["data_source"], gt, gt, row["extra_info"]) == 1.0
    assert make_splits(task, 5, 2, seed=3) == make_splits(task, 5, 2, seed=3)


def test_small_pool_reuses_questions():
    train, val = make_splits("add", 300, 20, difficulty=1)  # only 100 single-digit sums
    assert len(train) == 300 and len(val) == 20


def test_cli_writes_loadable_parquet(tmp_path, char_tok):
    out = subprocess.run([sys.executable, "-m", "jaxrl_llm.data.synthetic", "--out", str(tmp_path), "--task", "add",
                          "--n-train", "16", "--n-val", "4", "--answer-format", "lenient"],
                         capture_output=True, text=True, check=True)
    assert "wrote 16 rows" in out.stdout
    ds = build_dataset(data_spec(train_files=str(tmp_path / "train.parquet"), max_prompt_length=128), char_tok, "train")
    assert len(ds) == 16 and ds[0]["extra_info"]["answer_format"] == "lenient"
    assert pq.read_table(tmp_path / "test.parquet").num_rows == 4


def test_write_jsonl_paths(tmp_path, char_tok):
    from jaxrl_llm.data.synthetic import write_synthetic_files

    write_synthetic_files(str(tmp_path / "d" / "train.jsonl"), str(tmp_path / "d" / "val.jsonl"), "larger", 8, 3,
                          difficulty=2, answer_format="lenient", seed=5)
    ds = build_dataset(data_spec(train_files=str(tmp_path / "d" / "train.jsonl"),
                                 val_files=str(tmp_path / "d" / "val.jsonl")), char_tok, "val")
    assert len(ds) == 3 and ds[0]["data_source"] == "synthetic/larger"
    assert [r["ground_truth"] for r in ds] == [r["reward_model"]["ground_truth"]
                                               for r in make_splits("larger", 8, 3, difficulty=2, seed=5)[1]]


def test_prepare_gsm8k(tmp_path, char_tok):
    rows = [{"question": "Tom has 3 apples and buys 1,231 more. How many?", "answer": "3+1231=1234\n#### 1,234"},
            {"question": "What is 2-5?", "answer": "#### -3"}]
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst = tmp_path / "out" / "train.parquet"
    subprocess.run([sys.executable, "scripts/prepare_gsm8k.py", "--input", str(src), "--output", str(dst)],
                   check=True, capture_output=True)
    out = pq.read_table(dst).to_pylist()
    assert out[0]["prompt"] == [{"role": "user", "content": rows[0]["question"]
                                 + ' Let\'s think step by step and output the final answer after "####".'}]
    assert [r["reward_model"]["ground_truth"] for r in out] == ["1234", "-3"]
    assert out[1]["data_source"] == "openai/gsm8k" and out[1]["ability"] == "math"
    assert out[0]["extra_info"] == {"split": "train", "index": 0, "answer": rows[0]["answer"],
                                    "question": rows[0]["question"]}
    assert len(build_dataset(data_spec(train_files=str(dst), max_prompt_length=256), char_tok, "train")) == 2
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    bad = subprocess.run([sys.executable, "scripts/prepare_gsm8k.py", "--input", str(tmp_path / "bad.jsonl"),
                          "--output", str(tmp_path / "bad.parquet")], capture_output=True, text=True)
    assert bad.returncode == 1 and "bad.jsonl line 1: answer has no '#### <number>'" in bad.stderr
    assert not (tmp_path / "bad.parquet").exists()
