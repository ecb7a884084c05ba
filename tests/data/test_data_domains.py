"""data.domains: ROLL's per-domain mixture (a fixed share of every batch per domain, each domain its own
stream), domains from a tag column through members, a data_source per domain, resume, processes."""
import json

import numpy as np
import pytest
from spec_helpers import data_spec
from test_data_pipeline import write

from jaxrl_llm.data import DataError, build_dataset, make_dataloader
from jaxrl_llm.data.domains import DomainSpec, domain_counts
from jaxrl_llm.errors import ConfigError

# ROLL's rows: messages + tag; the tags group into domains as its reward workers' tag_included do
TAGS = ["deepmath_103k"] * 6 + ["aime"] * 4 + ["KodCode"] * 5 + ["RLVR"] * 3 + ["ifeval"] * 2
MIX = {"math_rule": 0.4, "code_sandbox": 0.3, "llm_judge": 0.1, "ifeval": 0.2}
MEMBERS = {"math_rule": ["deepmath_103k", "aime"], "code_sandbox": ["KodCode"], "llm_judge": ["RLVR"]}
DOMAIN_OF = {"deepmath_103k": "math_rule", "aime": "math_rule", "KodCode": "code_sandbox", "RLVR": "llm_judge",
             "ifeval": "ifeval"}


def roll_rows():
    return [{"messages": [{"role": "user", "content": f"question {i}"}], "tag": tag, "ground_truth": str(i)}
            for i, tag in enumerate(TAGS)]


def mixed(path, builtin_scorers=False, **kw):
    domains = {"key": "tag", "probs": MIX, "members": MEMBERS, **kw.pop("domains", {})}
    return data_spec(builtin_scorers, **{"train_files": str(path), "max_prompt_length": 64, "train_batch_size": 10,
                        "domains": domains, **kw})


def batches(loader, k):
    return [next(loader)["index"].tolist() for _ in range(k)]


def test_roll_shares_per_batch():
    # ROLL: int(p * B) each (0.3 * 10 is 3); the rest to the largest share (ROLL: the last listed)
    assert domain_counts(tuple(MIX.items()), 10) == [("math_rule", 4), ("code_sandbox", 3), ("llm_judge", 1),
                                                     ("ifeval", 2)]
    assert domain_counts((("a", 0.3), ("b", 0.4), ("c", 0.3)), 16) == [("a", 4), ("b", 8), ("c", 4)]
    with pytest.raises(DataError, match="sum to 0.9"):
        domain_counts((("a", 0.4), ("b", 0.5)), 10)
    with pytest.raises(DataError, match="'a' gets 0 of a batch of 4"):
        domain_counts((("a", 0.1), ("b", 0.9)), 4)


def test_every_batch_holds_each_domains_share_and_walks_each_domain(tmp_path, char_tok):
    path = write(roll_rows(), tmp_path / "roll.jsonl")
    spec = mixed(path)
    dataset = build_dataset(spec, char_tok, "train")
    assert [r["domain"] for r in dataset] == [DOMAIN_OF[t] for t in TAGS]
    loader = make_dataloader(spec, char_tok, "train", dataset=dataset)
    # math: 10 rows / 4 a batch = 2 batches, code 5 / 3 = 1, judge 3 / 1 = 3, ifeval 2 / 2 = 1: the slowest is 3
    assert len(loader) == 3
    got = batches(loader, 6)
    for batch in got:
        domains = [DOMAIN_OF[TAGS[i]] for i in batch]
        assert {d: domains.count(d) for d in MIX} == {"math_rule": 4, "code_sandbox": 3, "llm_judge": 1, "ifeval": 2}
        assert len(set(batch)) == 10
    # the judge domain (one row a batch) goes through its 3 rows in each 3 batches, each time reshuffled
    judge = [[i for i in b if TAGS[i] == "RLVR"][0] for b in got]
    assert sorted(judge[:3]) == sorted(judge[3:]) == [15, 16, 17]
    # math goes through its 10 rows in 2 batches (8 of them: the rest is dropped, as a batch is)
    math = [sorted(i for i in b if DOMAIN_OF[TAGS[i]] == "math_rule") for b in got[:2]]
    assert len(set(math[0] + math[1])) == 8
    # the domains' rows are interleaved, not one block per domain
    assert any(DOMAIN_OF[TAGS[b[0]]] != "math_rule" for b in got)


def test_mixture_is_seeded_resumes_exactly_and_splits_over_processes(tmp_path, char_tok):
    path = write(roll_rows(), tmp_path / "roll.jsonl")
    a = batches(make_dataloader(mixed(path, seed=3), char_tok, "train"), 5)
    assert a == batches(make_dataloader(mixed(path, seed=3), char_tok, "train"), 5)
    assert a != batches(make_dataloader(mixed(path, seed=4), char_tok, "train"), 5)
    ref = make_dataloader(mixed(path), char_tok, "train")
    batches(ref, 4)
    state = json.loads(json.dumps(ref.get_state()))
    resumed = make_dataloader(mixed(path), char_tok, "train")
    resumed.set_state(state)
    assert batches(resumed, 4) == batches(ref, 4)
    whole = batches(make_dataloader(mixed(path), char_tok, "train"), 3)
    parts = [batches(make_dataloader(mixed(path), char_tok, "train", process_index=p, process_count=2), 3)
             for p in range(2)]
    assert [p0 + p1 for p0, p1 in zip(*parts)] == whole
    # unshuffled: each domain in file order, blocks in the domains' (sorted) order
    plain = batches(make_dataloader(mixed(path, shuffle=False), char_tok, "train", num_epochs=1), 3)
    assert plain[0] == [10, 11, 12, 18, 19, 15, 0, 1, 2, 3]
    assert plain[2] == [10, 11, 12, 18, 19, 17, 0, 1, 2, 3]  # math and code begin again, the judge goes on
    with pytest.raises(StopIteration):
        batches(make_dataloader(mixed(path, shuffle=False), char_tok, "train", num_epochs=1), 4)


def test_domain_data_sources_fill_rows_without_one(tmp_path, char_tok):
    rows = roll_rows()
    rows[0]["data_source"] = "openai/gsm8k"
    path = write(rows, tmp_path / "roll.jsonl")
    spec = mixed(path, domains={"data_sources": {"math_rule": "lighteval/MATH", "llm_judge": "llm_judge"}},
                 default_data_source="openai/gsm8k")
    dataset = build_dataset(spec, char_tok, "train")
    sources = [r["data_source"] for r in dataset]
    assert sources[0] == "openai/gsm8k"  # a row's own column wins
    assert sources[1:10] == ["lighteval/MATH"] * 9 and sources[15:18] == ["llm_judge"] * 3
    assert sources[10:15] == ["openai/gsm8k"] * 5  # a domain without one: the run's default
    batch = next(make_dataloader(spec, char_tok, "train", dataset=dataset))
    assert sorted(batch["domain"].tolist()) == sorted(["math_rule"] * 4 + ["code_sandbox"] * 3 + ["llm_judge"]
                                                     + ["ifeval"] * 2)


def test_mixture_errors_name_the_domain(tmp_path, char_tok, caplog):
    path = write(roll_rows(), tmp_path / "roll.jsonl")
    with pytest.raises(DataError, match="domain 'ifeval' has 2 rows .column 'tag'., fewer than its 4 prompts"):
        make_dataloader(mixed(path, domains={"probs": {"math_rule": 0.6, "ifeval": 0.4}}), char_tok, "train")
    with pytest.raises(DataError, match="domain 'math' has 0 rows"):
        make_dataloader(mixed(path, domains={"probs": {"math": 0.5, "ifeval": 0.5}}, train_batch_size=2),
                        char_tok, "train")
    with caplog.at_level("WARNING"):
        build_dataset(mixed(path, domains={"probs": {"math_rule": 1.0}}), char_tok, "train")
    assert "not sampled (column 'tag': code_sandbox: 5, ifeval: 2, llm_judge: 3)" in caplog.text
    with pytest.raises(ConfigError, match=r"data.domains.probs.math=-1"):
        data_spec(domains={"probs": {"math": -1}})
    with pytest.raises(DataError, match="'aime' is listed under both"):
        DomainSpec(members=(("a", ("aime",)), ("b", ("aime",)))).domain_of({"domain": "aime"})


def test_validation_is_not_mixed(tmp_path, char_tok):
    path = write(roll_rows(), tmp_path / "roll.jsonl")
    spec = mixed(path, val_files=str(path), val_batch_size=None)
    assert next(make_dataloader(spec, char_tok, "val"))["index"].tolist() == list(range(len(TAGS)))
    assert np.array_equal(build_dataset(spec, char_tok, "val").prompt_lengths,
                          build_dataset(spec, char_tok, "train").prompt_lengths)


def test_a_domains_ground_truth_is_the_dict_of_its_columns(tmp_path, char_tok):
    """ROLL's code rows: case_type / test_cases columns make the code scorer's ground truth, checked when the rows
    load (builtin scorers on), while the other domains keep their ground_truth column."""
    rows = roll_rows()[:15]  # math and code rows
    for row in rows[10:15]:  # the KodCode rows
        row.update(case_type="assert", test_cases=json.dumps(["assert f() == 1"]), test_case_function=None)
    path = write(rows, tmp_path / "roll.jsonl")
    spec = mixed(path, builtin_scorers=True, domains={
        "probs": {"math_rule": 0.5, "code_sandbox": 0.5}, "members": MEMBERS,
        "data_sources": {"math_rule": "lighteval/MATH", "code_sandbox": "code"},
        "ground_truth_columns": {"code_sandbox": ["case_type", "test_cases", "test_case_function"]}})
    dataset = build_dataset(spec, char_tok, "train")
    assert dataset[10]["ground_truth"] == {"case_type": "assert", "test_cases": '["assert f() == 1"]',
                                           "test_case_function": None}
    assert dataset[10]["data_source"] == "code" and dataset[0]["ground_truth"] == "0"
    rows[12]["case_type"] = "text"
    with pytest.raises(DataError, match=r"bad.jsonl line 13: reward_model.ground_truth: ROLL code row: case_type "
                                        r"'text'"):
        build_dataset(mixed(write(rows, tmp_path / "bad.jsonl"), builtin_scorers=True, domains={
            "probs": {"math_rule": 0.5, "code_sandbox": 0.5}, "members": MEMBERS,
            "data_sources": {"math_rule": "lighteval/MATH", "code_sandbox": "code"},
            "ground_truth_columns": {"code_sandbox": ["case_type", "test_cases"]}}), char_tok, "train")
