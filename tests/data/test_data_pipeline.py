"""Data pipeline: file formats, chat template, truncation, filtering, loader batches and state."""
import json

import numpy as np
import pandas as pd
import pytest
from spec_helpers import data_spec

from jaxrl_llm.data import DataError, build_dataset, make_dataloader, truncate_ids

QUESTIONS = ["What is 1 + 2?", "Name a colour.", "Say hi!", "Count to three.", "2 * 4 = ?"]


def verl_rows(n=5):
    return [
        {
            "data_source": "synthetic/add" if i % 2 else "openai/gsm8k",
            "prompt": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" #{i}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def write(rows, path):
    suffix = path.suffix
    if suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    return path


def expected_ids(tok, prompt):
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def cfg(files, **kw):
    return data_spec(**{"train_files": str(files) if not isinstance(files, list) else [str(f) for f in files],
                        "val_files": str(files) if not isinstance(files, list) else [str(f) for f in files],
                        "max_prompt_length": 64, "train_batch_size": 2, **kw})


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_verl_rows_round_trip(tmp_path, char_tok, suffix):
    rows = verl_rows()
    ds = build_dataset(cfg(write(rows, tmp_path / f"d{suffix}")), char_tok, "train")
    assert len(ds) == len(rows)
    for i, (rec, row) in enumerate(zip(ds, rows)):
        assert rec["input_ids"].dtype == np.int32
        assert rec["input_ids"].tolist() == expected_ids(char_tok, row["prompt"])
        assert rec["data_source"] == row["data_source"]
        assert rec["ground_truth"] == row["reward_model"]["ground_truth"]
        assert rec["extra_info"] == row["extra_info"]
        assert rec["ability"] == "math" and rec["index"] == i
        assert rec["raw_prompt"] == row["prompt"]


def test_csv_plain_prompt_column(tmp_path, char_tok):
    rows = [{"prompt": q, "ground_truth": i, "data_source": "synthetic/add"} for i, q in enumerate(QUESTIONS)]
    ds = build_dataset(cfg(write(rows, tmp_path / "d.csv")), char_tok, "train")
    assert [r["input_ids"].tolist() for r in ds] == [expected_ids(char_tok, q) for q in QUESTIONS]
    # a numeric ground truth is normalised to its string, as the scorers compare strings
    assert [r["ground_truth"] for r in ds] == ["0", "1", "2", "3", "4"] and ds[0]["extra_info"] == {}


def test_messages_column_and_raw_text(tmp_path, char_tok):
    msgs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}] for q in QUESTIONS]
    ds = build_dataset(cfg(write([{"messages": m} for m in msgs], tmp_path / "m.jsonl")), char_tok, "train")
    assert [r["input_ids"].tolist() for r in ds] == [expected_ids(char_tok, m) for m in msgs]
    assert ds[0]["data_source"] == "unknown" and ds[0]["ground_truth"] is None
    raw = build_dataset(cfg(write([{"prompt": q} for q in QUESTIONS], tmp_path / "p.jsonl"),
                            apply_chat_template=False), char_tok, "train")
    assert [r["input_ids"].tolist() for r in raw] == [char_tok(q)["input_ids"] for q in QUESTIONS]


def test_truncation_modes():
    ids = np.arange(10, dtype=np.int32)
    assert truncate_ids(ids, 4, "left").tolist() == [6, 7, 8, 9]
    assert truncate_ids(ids, 4, "right").tolist() == [0, 1, 2, 3]
    assert truncate_ids(ids, 5, "middle").tolist() == [0, 1, 7, 8, 9]
    assert truncate_ids(ids, 10, "error").tolist() == ids.tolist()


def test_truncation_through_dataset_and_error_names_row(tmp_path, char_tok):
    rows = [{"prompt": "short"}, {"prompt": "a much longer prompt " * 4}]
    path = write(rows, tmp_path / "t.jsonl")
    full = expected_ids(char_tok, rows[1]["prompt"])
    for mode, want in [("left", full[-30:]), ("right", full[:30]), ("middle", full[:15] + full[-15:])]:
        ds = build_dataset(cfg(path, max_prompt_length=30, truncation=mode), char_tok, "train")
        assert ds[1]["input_ids"].tolist() == want
        assert ds[0]["input_ids"].tolist() == expected_ids(char_tok, "short")
    with pytest.raises(DataError, match=rf"t\.jsonl line 2: prompt has {len(full)} tokens.*max_prompt_length=30"):
        build_dataset(cfg(path, max_prompt_length=30), char_tok, "train")


@pytest.mark.parametrize("workers", [1, 2])
def test_filter_overlong_prompts(tmp_path, char_tok, workers):
    rows = [{"prompt": "x" * n} for n in (1, 40, 2, 50, 3, 4, 60, 5)]
    ds = build_dataset(cfg(write(rows, tmp_path / "f.jsonl"), max_prompt_length=30, filter_overlong_prompts=True,
                           filter_overlong_prompts_workers=workers), char_tok, "train")
    assert [r["raw_prompt"] for r in ds] == ["x" * n for n in (1, 2, 3, 4, 5)]
    assert [r["index"] for r in ds] == list(range(5))


def test_max_samples(tmp_path, char_tok):
    path = write(verl_rows(10), tmp_path / "d.parquet")
    first = build_dataset(cfg(path, train_max_samples=3, shuffle=False), char_tok, "train")
    assert [r["ground_truth"] for r in first] == ["0", "1", "2"]
    a = build_dataset(cfg(path, train_max_samples=4, seed=7), char_tok, "train")
    b = build_dataset(cfg(path, train_max_samples=4, seed=7), char_tok, "train")
    assert len(a) == 4 and [r["ground_truth"] for r in a] == [r["ground_truth"] for r in b]
    assert len(build_dataset(cfg(path, val_max_samples=2), char_tok, "val")) == 2


def test_several_files_and_formats(tmp_path, char_tok):
    rows = verl_rows(6)
    files = [write(rows[:3], tmp_path / "a.parquet"), write(rows[3:], tmp_path / "b.jsonl")]
    ds = build_dataset(cfg(files), char_tok, "train")
    assert [r["ground_truth"] for r in ds] == [str(i) for i in range(6)]


def test_batch_layout(tmp_path, char_tok):
    rows = verl_rows(4)
    loader = make_dataloader(cfg(write(rows, tmp_path / "d.parquet"), shuffle=False, return_raw_chat=True),
                             char_tok, "train", batch_size=4)
    batch = next(loader)
    assert len(loader) == 1
    # prompts stay unpadded: the sampler left-pads them to its own length bucket
    assert set(batch) == {"raw_prompt_ids", "prompt_lengths", "index", "data_source", "ground_truth", "extra_info",
                          "ability", "source", "domain", "raw_prompt"}
    assert batch["domain"].tolist() == [None] * 4  # no data.domains
    assert batch["source"].tolist() == [f"{tmp_path / 'd.parquet'} row {i}" for i in range(4)]  # what scorers name
    for i, row in enumerate(rows):
        ids = expected_ids(char_tok, row["prompt"])
        assert batch["prompt_lengths"][i] == len(ids)
        assert batch["raw_prompt_ids"][i].dtype == np.int32
        assert batch["raw_prompt_ids"][i].tolist() == ids
        assert batch["raw_prompt"][i] == row["prompt"]
    assert batch["index"].tolist() == [0, 1, 2, 3]
    assert batch["ground_truth"].dtype == object and batch["ground_truth"].tolist() == ["0", "1", "2", "3"]
    assert batch["data_source"][[0, 0, 1]].tolist() == ["openai/gsm8k", "openai/gsm8k", "synthetic/add"]
    assert batch["extra_info"][2] == {"split": "train", "index": 2}


def _indices(loader, k):
    return [next(loader)["index"].tolist() for _ in range(k)]


def test_shuffle_reproducible_and_epochs(tmp_path, char_tok):
    path = write(verl_rows(10), tmp_path / "d.parquet")
    a = _indices(make_dataloader(cfg(path, seed=3), char_tok, "train", batch_size=4), 6)
    b = _indices(make_dataloader(cfg(path, seed=3), char_tok, "train", batch_size=4), 6)
    c = _indices(make_dataloader(cfg(path, seed=4), char_tok, "train", batch_size=4), 6)
    assert a == b and a != c
    epochs = [sum(a[2 * e:2 * e + 2], []) for e in range(3)]  # 2 full batches per epoch, drop_last
    assert all(len(set(e)) == 8 for e in epochs) and epochs[0] != epochs[1]
    loader = make_dataloader(cfg(path, shuffle=False), char_tok, "train", batch_size=4, num_epochs=2)
    assert len(loader) == 2 and _indices(loader, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    with pytest.raises(StopIteration):
        next(loader)


def test_resumed_iterator_equals_uninterrupted(tmp_path, char_tok):
    path = write(verl_rows(10), tmp_path / "d.parquet")
    ref = make_dataloader(cfg(path), char_tok, "train", batch_size=3)
    _indices(ref, 4)  # into the second epoch
    state = json.loads(json.dumps(ref.get_state()))  # states go through JSON checkpoints
    rest = [next(ref) for _ in range(5)]
    resumed = make_dataloader(cfg(path), char_tok, "train", batch_size=3)
    resumed.set_state(state)
    for want in rest:
        got = next(resumed)
        assert got["index"].tolist() == want["index"].tolist()
        assert [a.tolist() for a in got["raw_prompt_ids"]] == [a.tolist() for a in want["raw_prompt_ids"]]


def test_process_slicing(tmp_path, char_tok):
    path = write(verl_rows(10), tmp_path / "d.parquet")
    whole = _indices(make_dataloader(cfg(path), char_tok, "train", batch_size=4), 3)
    parts = [_indices(make_dataloader(cfg(path), char_tok, "train", batch_size=4, process_index=p,
                                      process_count=2), 3) for p in range(2)]
    assert [p0 + p1 for p0, p1 in zip(*parts)] == whole
    with pytest.raises(ValueError, match="not divisible by process_count=3"):
        make_dataloader(cfg(path), char_tok, "train", batch_size=4, process_count=3)


def test_val_loader(tmp_path, char_tok):
    path = write(verl_rows(5), tmp_path / "d.jsonl")
    whole = make_dataloader(cfg(path, val_batch_size=None), char_tok, "val")
    assert _indices(whole, 1) == [[0, 1, 2, 3, 4]]
    with pytest.raises(StopIteration):
        next(whole)
    batched = make_dataloader(cfg(path, val_batch_size=2), char_tok, "val")
    assert len(batched) == 3 and [b["index"].tolist() for b in batched] == [[0, 1], [2, 3], [4]]
    batched.reset()
    assert next(batched)["index"].tolist() == [0, 1]


def test_worker_threads_give_same_batches(tmp_path, char_tok):
    path = write(verl_rows(8), tmp_path / "d.parquet")
    want = _indices(make_dataloader(cfg(path), char_tok, "train", batch_size=2), 5)
    loader = make_dataloader(cfg(path, dataloader_num_workers=1), char_tok, "train", batch_size=2)
    assert _indices(loader, 5) == want
    state = loader.get_state()
    resumed = make_dataloader(cfg(path, dataloader_num_workers=2), char_tok, "train", batch_size=2)
    resumed.set_state(state)
    assert _indices(resumed, 3) == _indices(loader, 3)


CUSTOM_CLS = '''
class RawRows:
    def __init__(self, data_files, tokenizer, config):
        self.rows = [{"prompt": f"q{i}", "ground_truth": str(i), "data_source": "synthetic/add"} for i in range(3)]
    def __len__(self):
        return len(self.rows)
    def __getitem__(self, i):
        return self.rows[i]

class Tokenised:
    def __init__(self, data_files, tokenizer, config):
        self.n = 3
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return {"input_ids": [0, 0, 5 + i, 6], "attention_mask": [0, 0, 1, 1], "ground_truth": str(i)}
'''


def test_custom_dataset_class(tmp_path, char_tok):
    (tmp_path / "my_data.py").write_text(CUSTOM_CLS)
    path = write(verl_rows(2), tmp_path / "unused.parquet")
    raw = build_dataset(cfg(path, custom_cls={"path": str(tmp_path / "my_data.py"), "name": "RawRows"}),
                        char_tok, "train")
    assert [r["input_ids"].tolist() for r in raw] == [expected_ids(char_tok, f"q{i}") for i in range(3)]
    tok = build_dataset(cfg(path, custom_cls={"path": str(tmp_path / "my_data.py"), "name": "Tokenised"}),
                        char_tok, "train")
    assert [r["input_ids"].tolist() for r in tok] == [[5, 6], [6, 6], [7, 6]]
    assert tok[2]["ground_truth"] == "2"
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        build_dataset(cfg(path, custom_cls={"path": str(tmp_path / "my_data.py"), "name": "Nope"}), char_tok, "train")


def test_data_spec_from_config_section(tmp_path, char_tok):
    """The loader reads the `DataSpec` a run resolves from its `data` section, defaults included."""
    from jaxrl_llm.config import default_config, resolve_data

    cfg_tree = default_config()
    cfg_tree.data.train_files = str(write(verl_rows(4), tmp_path / "d.parquet"))
    cfg_tree.data.train_batch_size, cfg_tree.data.shuffle = 2, False
    spec = resolve_data(cfg_tree)
    assert (spec.train_files, spec.max_prompt_length, spec.truncation) == ((cfg_tree.data.train_files,), 512, "error")
    loader = make_dataloader(spec, char_tok, "train")
    assert next(loader)["index"].tolist() == [0, 1]


@pytest.mark.slow
def test_smollm2_chat_template_ids(tmp_path, smollm2_tok):
    rows = verl_rows(3)
    ds = build_dataset(cfg(write(rows, tmp_path / "d.parquet"), max_prompt_length=128), smollm2_tok, "train")
    for rec, row in zip(ds, rows):
        want = smollm2_tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        assert rec["input_ids"].tolist() == list(want)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_num_workers_is_honoured(tmp_path, char_tok, workers):
    """k > 0 collates in grain threads from the first batch on (not only after reset()); 0 in this thread."""
    import threading

    path = write(verl_rows(8), tmp_path / "d.parquet")
    spec = cfg(path, dataloader_num_workers=workers)
    dataset = build_dataset(spec, char_tok, "train")
    threads = []

    class Recording(type(dataset)):
        def __getitem__(self, i):
            threads.append(threading.current_thread() is threading.main_thread())
            return super().__getitem__(i)

    dataset.__class__ = Recording  # before the loader exists, so every collate is recorded
    loader = make_dataloader(spec, char_tok, "train", batch_size=2, dataset=dataset)
    want = _indices(make_dataloader(cfg(path), char_tok, "train", batch_size=2), 3)
    assert _indices(loader, 3) == want
    assert threads and all(threads) == (workers == 0) and any(threads) == (workers == 0)


def test_trinity_style_rows_system_prompt_answer_column_and_default_source(tmp_path, char_tok):
    """A dataset read as it is (Trinity's taskset keys): the prompt column, the answer column
    (data.ground_truth_key), one system prompt for all rows, a data_source for rows without one."""
    rows = [{"question": q, "answer": f"work ... #### {i}"} for i, q in enumerate(QUESTIONS)]
    rows[0]["data_source"] = "synthetic/add"  # a row's own data_source wins
    ds = build_dataset(cfg(write(rows, tmp_path / "t.jsonl"), prompt_key="question", ground_truth_key="answer",
                           system_prompt="Be brief.", default_data_source="openai/gsm8k"), char_tok, "train")
    want = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}] for q in QUESTIONS]
    assert [r["input_ids"].tolist() for r in ds] == [expected_ids(char_tok, m) for m in want]
    assert [r["raw_prompt"] for r in ds] == want
    assert [r["ground_truth"] for r in ds] == [f"work ... #### {i}" for i in range(5)]
    assert [r["data_source"] for r in ds] == ["synthetic/add"] + ["openai/gsm8k"] * 4
    # a prompt that has its own system message keeps it
    msgs = [{"messages": [{"role": "system", "content": "Own."}, {"role": "user", "content": "x"}]}]
    own = build_dataset(cfg(write(msgs, tmp_path / "o.jsonl"), system_prompt="Be brief."), char_tok, "train")
    assert own[0]["raw_prompt"][0]["content"] == "Own."
    with pytest.raises(DataError, match=r"missing column 'solution' \(data.ground_truth_key\)"):
        build_dataset(cfg(tmp_path / "t.jsonl", prompt_key="question", ground_truth_key="solution"), char_tok,
                      "train")


def test_chat_template_replaces_the_tokenizers(tmp_path, smollm2_gguf):
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.planning.preflight import run_tokenizer

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok = run_tokenizer(data_spec(tokenizer=str(smollm2_gguf), chat_template=str(template)))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "[user] hi\n[assistant] "
    base = run_tokenizer(data_spec(tokenizer=str(smollm2_gguf)))  # the shared, cached tokenizer is untouched
    assert base is not tok and base.chat_template != tok.chat_template
    with pytest.raises(ConfigError, match="data.chat_template: the template does not render"):
        run_tokenizer(data_spec(tokenizer=str(smollm2_gguf), chat_template="{{ messages[0].nope.deeper }}"))


def test_validation_reads_its_own_keys_and_chat_template(tmp_path, smollm2_gguf):
    """data.val_overrides (Trinity's eval tasksets with their own format and use_base): the training rows render
    with data.chat_template, the validation rows with their own columns and the tokenizer's own template."""
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.planning.preflight import run_tokenizer

    plain = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %} A:{% endif %}"
    train = write([{"prompt": "1 + 1?", "solution": "2"}], tmp_path / "train.jsonl")
    val = write([{"question": "2 + 2?", "answer": "4"}], tmp_path / "val.jsonl")
    spec = data_spec(tokenizer=str(smollm2_gguf), chat_template=plain, train_files=str(train), val_files=str(val),
                     ground_truth_key="solution", train_batch_size=1,
                     val_overrides={"prompt_key": "question", "ground_truth_key": "answer", "chat_template": "native"})
    tok = run_tokenizer(spec)
    train_row = build_dataset(spec, tok, "train")[0]
    assert tok.decode(train_row["input_ids"]) == "1 + 1? A:" and train_row["ground_truth"] == "2"
    val_row = build_dataset(spec, tok, "val")[0]
    assert val_row["input_ids"].tolist() == expected_ids(run_tokenizer(data_spec(tokenizer=str(smollm2_gguf))),
                                                         "2 + 2?")
    assert val_row["ground_truth"] == "4" and tok.chat_template == plain  # the run's tokenizer is untouched
    with pytest.raises(ConfigError, match="data.val_overrides.max_prompt_length: not a key validation reads"):
        data_spec(val_overrides={"max_prompt_length": 8})
