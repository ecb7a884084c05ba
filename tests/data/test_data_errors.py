"""Bad data inputs: one DataError naming the file (and row / line) and the problem."""
import pandas as pd
import pytest
from spec_helpers import data_spec

from jaxrl_llm.data import DataError, build_dataset, make_dataloader


def cfg(path, **kw):
    return data_spec(**{"train_files": str(path), "max_prompt_length": 64, "train_batch_size": 2, **kw})


def test_missing_path(tmp_path, char_tok):
    with pytest.raises(DataError, match=r"nope\.parquet: no such file"):
        build_dataset(cfg(tmp_path / "nope.parquet"), char_tok, "train")
    with pytest.raises(DataError, match="data.train_files is not set"):
        build_dataset(data_spec(), char_tok, "train")


def test_unsupported_suffix(tmp_path, char_tok):
    (tmp_path / "d.txt").write_text("hi")
    with pytest.raises(DataError, match=r"d\.txt: unsupported file type '\.txt'"):
        build_dataset(cfg(tmp_path / "d.txt"), char_tok, "train")


def test_missing_column(tmp_path, char_tok):
    pd.DataFrame({"question": ["a", "b"]}).to_parquet(tmp_path / "q.parquet")
    with pytest.raises(DataError, match=r"q\.parquet: missing column 'prompt' \(data.prompt_key\).*\['question'\]"):
        build_dataset(cfg(tmp_path / "q.parquet"), char_tok, "train")
    # the configured key is the one named
    with pytest.raises(DataError, match="missing column 'text'"):
        build_dataset(cfg(tmp_path / "q.parquet", prompt_key="text"), char_tok, "train")


@pytest.mark.parametrize("name,content", [("e.jsonl", "\n\n"), ("e.json", "[]"), ("e.csv", "")])
def test_empty_dataset(tmp_path, char_tok, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=rf"{name.replace('.', r'.')}: empty dataset"):
        build_dataset(cfg(tmp_path / name), char_tok, "train")


def test_empty_parquet_and_all_filtered(tmp_path, char_tok):
    pd.DataFrame({"prompt": pd.Series([], dtype=str)}).to_parquet(tmp_path / "e.parquet")
    with pytest.raises(DataError, match=r"e\.parquet: empty dataset"):
        build_dataset(cfg(tmp_path / "e.parquet"), char_tok, "train")
    pd.DataFrame({"prompt": ["x" * 100]}).to_parquet(tmp_path / "long.parquet")
    with pytest.raises(DataError, match="empty dataset after filtering"):
        build_dataset(cfg(tmp_path / "long.parquet", filter_overlong_prompts=True), char_tok, "train")


def test_malformed_jsonl_line(tmp_path, char_tok):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 3: malformed JSON"):
        build_dataset(cfg(tmp_path / "bad.jsonl"), char_tok, "train")


@pytest.mark.parametrize("value", [5, ["just", "strings"], {"role": "user"}, None])
def test_prompt_neither_string_nor_messages(tmp_path, char_tok, value):
    import json

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": value}) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl line 2: column 'prompt' is neither a string nor a list of chat"):
        build_dataset(cfg(tmp_path / "p.jsonl"), char_tok, "train")


def test_messages_without_template(tmp_path, char_tok):
    pd.DataFrame({"prompt": [[{"role": "user", "content": "hi"}]]}).to_parquet(tmp_path / "m.parquet")
    want = r"m\.parquet row 0: prompt is a message list but data.apply_chat_template=False"
    with pytest.raises(DataError, match=want):
        build_dataset(cfg(tmp_path / "m.parquet", apply_chat_template=False), char_tok, "train")


def test_too_few_rows_for_a_batch(tmp_path, char_tok):
    pd.DataFrame({"prompt": ["a", "b"]}).to_parquet(tmp_path / "s.parquet")
    with pytest.raises(DataError, match="2 prompts, fewer than one batch of 4"):
        make_dataloader(cfg(tmp_path / "s.parquet"), char_tok, "train", batch_size=4)


def test_bad_truncation_mode(tmp_path, char_tok):
    pd.DataFrame({"prompt": ["a"]}).to_parquet(tmp_path / "s.parquet")
    with pytest.raises(DataError, match="data.truncation='sideways'"):
        build_dataset(cfg(tmp_path / "s.parquet", truncation="sideways"), char_tok, "train")


def _jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {"prompt": "What is 1 + 1?", "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "2"}}


@pytest.mark.parametrize("prompt,why", [("", "empty prompt \\(column 'prompt'\\)"), ("  \n", "empty prompt"),
                                        ([], r"empty prompt \(column 'prompt' is an empty list\)"),
                                        ([{"role": "user", "content": " "}], r"empty prompt \(every message .* empty")])
def test_empty_prompt_names_the_line(tmp_path, char_tok, prompt, why):
    path = _jsonl(tmp_path / "p.jsonl", [GOOD, GOOD, {**GOOD, "prompt": prompt}])
    with pytest.raises(DataError, match=rf"p\.jsonl line 3: {why}"):
        build_dataset(cfg(path), char_tok, "train")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_non_utf8_file_names_the_line(tmp_path, char_tok, suffix):
    lines = {".jsonl": [b'{"prompt": "a"}', b'{"prompt": "caf\xe9"}'],
             ".json": [b'[{"prompt": "a"},', b' {"prompt": "caf\xe9"}]'],
             ".csv": [b"prompt", b"caf\xe9"]}[suffix]
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=rf"latin1\{suffix} line 2: not UTF-8 text \(byte 0xe9 at offset \d+\)"):
        build_dataset(cfg(path), char_tok, "train")


def test_utf8_bom_and_unicode_line_separator_are_fine(tmp_path, char_tok):
    import json

    text = json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False) + "\n" + json.dumps({"prompt": "c"}) + "\n"
    (tmp_path / "u.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert len(build_dataset(cfg(tmp_path / "u.jsonl"), char_tok, "train")) == 2


def test_builtin_scorers_need_ground_truth_and_known_data_source(tmp_path, char_tok):
    ok = _jsonl(tmp_path / "ok.jsonl", [GOOD, {**GOOD, "data_source": "aime2024", "reward_model": {"ground_truth": 7}}])
    ds = build_dataset(cfg(ok, builtin_scorers=True), char_tok, "train")
    assert [r["ground_truth"] for r in ds] == ["2", "7"]
    cases = [({**GOOD, "reward_model": {}}, "no ground truth"),
             ({**GOOD, "reward_model": {"ground_truth": ""}}, "no ground truth"),
             ({**GOOD, "data_source": "my/task"}, "data_source 'my/task': no built-in scorer applies"),
             ({"prompt": "hi", "ground_truth": "1"}, "no data_source, so no built-in scorer applies")]
    for i, (row, why) in enumerate(cases):
        path = _jsonl(tmp_path / f"bad{i}.jsonl", [GOOD, row])
        with pytest.raises(DataError, match=rf"bad{i}\.jsonl line 2: {why}.*custom_reward_function.path"):
            build_dataset(cfg(path, builtin_scorers=True), char_tok, "train")
        assert len(build_dataset(cfg(path), char_tok, "train")) == 2  # a custom reward may not need them


@pytest.mark.parametrize("value,want", [(42, "42"), (2.5, "2.5"), (3.0, "3"), (-1, "-1"), (float("nan"), None),
                                        ("12", "12"), ([1, 2], [1, 2]), (True, True)])
def test_numeric_ground_truth_normalised(value, want):
    from jaxrl_llm.data.prompts import normalise_ground_truth

    assert normalise_ground_truth(value) == want


def test_skip_bad_rows_leaves_them_out_and_names_the_first(tmp_path, char_tok, caplog):
    """data.skip_bad_rows (veRL skips rows it cannot read): an empty prompt, a row without the prompt column and a
    ground truth the row's scorer cannot read are left out, counted, the first named; off, the first stops the
    run naming file and row."""
    import json

    rows = [{"prompt": f"q{i}", "data_source": "openai/gsm8k", "ground_truth": str(i)} for i in range(8)]
    rows[2]["prompt"] = "  "
    del rows[4]["prompt"]
    rows[6]["ground_truth"] = {"answer": 6}  # the gsm8k scorer compares strings
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = data_spec(True, train_files=str(path), max_prompt_length=64, apply_chat_template=False)
    with pytest.raises(DataError, match=r"rows.jsonl line 3: empty prompt"):
        build_dataset(spec, char_tok, "train")
    with caplog.at_level("WARNING"):
        dataset = build_dataset(data_spec(True, train_files=str(path), max_prompt_length=64,
                                          apply_chat_template=False, skip_bad_rows=True), char_tok, "train")
    assert [r["ground_truth"] for r in dataset] == ["0", "1", "3", "5", "7"]
    assert [r["index"] for r in dataset] == list(range(5))
    assert "data.skip_bad_rows: left out 3 of 8 rows; the first: " in caplog.text
    assert "rows.jsonl line 3: empty prompt" in caplog.text
