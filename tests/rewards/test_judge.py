"""Generative reward models (roles/judge.py, rewards/judge_parsers.py): every built-in parser on
scripted verdicts, garbage counted and defaulted, the three ways to combine with the rule scorer,
the rule scorer's "no verdict", config errors, and a tiny judge through a training step."""
from __future__ import annotations

import json
import types

import jax
import numpy as np
import pytest
from tiny_runs import read_metrics, tiny_config

from jaxrl_llm.bookkeeping.metrics import rollout_context, step_flops
from jaxrl_llm.config import ConfigError, validate_config
from jaxrl_llm.rewards.judge_parsers import ScoreRange, load_parser, read_verdict
from jaxrl_llm.rewards.managers import RewardManager
from jaxrl_llm.rewards.spec import JudgeSpec
from jaxrl_llm.roles.judge import Judge, JudgeVerdicts, last_user_message, render_rubric, render_user_message
from jaxrl_llm.trainer.perf import step_perf_metrics

SCALE = ScoreRange(0.0, 10.0)


@pytest.mark.parametrize("parser,verdict,score", [
    ("number", "I give it 7.", 0.7), ("number", "3 then 12", 1.0), ("number", "-4", 0.0), ("number", "none", None),
    ("boxed", "so \\boxed{8} overall", 0.8), ("boxed", "8", None),
    ("yes_no", "Yes, it is.", 1.0), ("yes_no", "no.", 0.0), ("yes_no", "Nope, yesterday", None),
    ("yes_no", "It is not. No.", 0.0),
    # ROLL's _extract_score_v2: "yes" anywhere first (inside words too), then "no"; else no verdict
    ("contains_yes", "NO. Well, yes", 1.0), ("contains_yes", "Nope, yesterday", 1.0), ("contains_yes", "**NO**", 0.0),
    ("contains_yes", "It is not.", 0.0), ("contains_yes", "maybe", None),
    ("score_tag", "Score: 7/10", 0.7), ("score_tag", "score = 3", 0.3), ("score_tag", "Score: 9/0", None),
    ("score_tag", "seven", None),
])
def test_builtin_parsers(parser, verdict, score):
    got = read_verdict(load_parser(parser, SCALE), verdict, {})
    assert got == pytest.approx(score) if score is not None else got is None


def test_user_parser_file(tmp_path):
    path = tmp_path / "parse.py"
    path.write_text("def grade(verdict, prompt, response, ground_truth):\n"
                    "    if verdict == 'boom':\n        raise RuntimeError('bad')\n"
                    "    return float(verdict.strip() == ground_truth)\n")
    parser = load_parser(f"{path}:grade", SCALE)
    row = {"prompt": "p", "response": "r", "ground_truth": "7"}
    assert read_verdict(parser, "7", row) == 1.0 and read_verdict(parser, "8", row) == 0.0
    assert read_verdict(parser, "boom", row) is None  # a raising parser is a parse failure
    with pytest.raises(ValueError, match="defines no function 'nope'"):
        load_parser(f"{path}:nope", SCALE)


def _spec(**kw) -> JudgeSpec:
    base = dict(template="Q: {prompt}\nA: {response}\nGT: {ground_truth}", system_prompt=None, parser="yes_no",
                min_score=0.0, max_score=10.0, default_score=-1.0, max_new_tokens=8, temperature=0.0,
                max_prompt_length=64, combine="judge", rule_weight=1.0, judge_weight=1.0, on_rollout_devices=True)
    return JudgeSpec(**{**base, **kw})


class ScriptedJudge(Judge):
    """A judge whose engine returns fixed verdicts (no model): parsing and combining under test."""

    def __init__(self, spec: JudgeSpec, verdicts: list[str]):
        from jaxrl_llm.rewards.judge_parsers import load_parser

        self.spec, self.verdicts = spec, verdicts
        self.parser = load_parser(spec.parser, ScoreRange(spec.min_score, spec.max_score))
        self.seen: list = []

    def prompts(self, chats, responses, ground_truths, rubrics=None):
        rubrics = [None] * len(chats) if rubrics is None else rubrics
        self.seen = [render_user_message(self.spec.template, prompt=last_user_message(c), response=r,
                                         ground_truth=g, rubric=b)
                     for c, r, g, b in zip(chats, responses, ground_truths, rubrics)]
        return [np.zeros(1, np.int32)] * len(chats)

    def generate(self, prompts, rng):
        texts = self.verdicts[:len(prompts)]
        return texts, np.asarray([len(t) for t in texts])


@pytest.mark.parametrize("parser,verdicts,want", [
    ("yes_no", ["Yes", "no", "maybe"], [1.0, 0.0, -1.0]),
    ("number", ["7", "score 11", "?"], [0.7, 1.0, -1.0]),
    ("boxed", ["\\boxed{5}", "\\boxed{x}", "\\boxed{10}"], [0.5, -1.0, 1.0]),
    ("score_tag", ["Score: 1/4", "Score: 6", "great"], [0.25, 0.6, -1.0]),
    ("contains_yes", ["**YES**", "**NO**", "unsure"], [1.0, 0.0, -1.0]),
])
def test_scripted_judge_scores_through_every_parser(parser, verdicts, want):
    judge = ScriptedJudge(_spec(parser=parser), verdicts)
    chats = [[{"role": "user", "content": "What is {2}?"}], "plain", [{"role": "system", "content": "s"}]]
    out = judge.judge(chats, ["a", "b", "c"], ["4", None, "x"], rng=None)
    scores, info, metrics = judge.combine(None, out)
    np.testing.assert_allclose(scores, want, rtol=1e-6)
    assert metrics["reward/judge_parse_failures"] == 1.0
    assert metrics["reward/num_judge_prompt_tokens"] == 3.0  # one token per scripted prompt
    assert metrics["reward/num_judge_response_tokens"] == sum(len(v) for v in verdicts)
    assert list(info["judge_verdict"]) == verdicts
    assert judge.seen[0] == "Q: What is {2}?\nA: a\nGT: 4"  # braces in the row's text survive
    assert judge.seen[1] == "Q: plain\nA: b\nGT: "


def test_judge_samples_its_verdicts_with_its_top_p_and_top_k(monkeypatch):
    """reward_model.judge.top_p / top_k (ROLL's judge generating_args) reach the judge's sampling parameters."""
    import jaxrl_llm.roles.judge as judge_module

    seen = {}

    class Sampled(Exception):
        pass

    def sampling(**kw):
        seen.update(kw)
        raise Sampled

    monkeypatch.setattr(judge_module, "SamplingParams", sampling)
    judge = object.__new__(Judge)  # only its spec and mesh are read before sampling
    judge.spec, judge.mesh = _spec(temperature=0.7, top_p=0.8, top_k=5), jax.make_mesh((1,), ("data",))
    with pytest.raises(Sampled):
        judge.generate([np.zeros(1, np.int32)], jax.random.PRNGKey(0))
    assert (seen["temperature"], seen["do_sample"], seen["top_p"], seen["top_k"]) == (0.7, True, 0.8, 5)


def test_combine_modes_and_agreement():
    verdicts = JudgeVerdicts(["yes", "no", "yes", "??"], np.asarray([1.0, 0.0, 1.0, np.nan], np.float32))
    rule = np.asarray([1.0, 1.0, np.nan, 0.0], np.float32)
    judge = ScriptedJudge(_spec(combine="judge", default_score=0.0), [])
    scores, _, metrics = judge.combine(rule, verdicts)
    np.testing.assert_allclose(scores, [1, 0, 1, 0])
    assert metrics["reward/judge_rule_agreement"] == pytest.approx(0.5)  # rows 0, 1 (row 2: no rule, 3: no verdict)
    judge = ScriptedJudge(_spec(combine="sum", rule_weight=2.0, judge_weight=0.5, default_score=0.0), [])
    np.testing.assert_allclose(judge.combine(rule, verdicts)[0], [2.5, 2.0, 0.5, 0.0])
    judge = ScriptedJudge(_spec(combine="fallback", default_score=0.0), [])
    scores, _, metrics = judge.combine(rule, verdicts)
    np.testing.assert_allclose(scores, [1.0, 1.0, 1.0, 0.0])
    assert metrics["reward/judge_fallback_frac"] == pytest.approx(0.25)


def test_judge_grades_only_the_rows_of_its_data_sources():
    """reward_model.judge.data_sources: the judge reads only those rows (ROLL's judge domain); the others keep
    the rule score and have no verdict; [] = every row."""
    meta = {"data_source": np.asarray(["math", "llm_judge", "math", "llm_judge"], dtype=object),
            "ground_truth": np.asarray(["1", "a", "2", "b"], dtype=object)}
    rule = np.asarray([1.0, np.nan, 0.0, np.nan], np.float32)
    judge = ScriptedJudge(_spec(data_sources=("llm_judge",), parser="contains_yes", default_score=0.0),
                          ["YES", "no"])
    scores, info, metrics = judge.grade(["q0", "q1", "q2", "q3"], ["r0", "r1", "r2", "r3"], meta, rule, None)
    np.testing.assert_allclose(scores, [1.0, 1.0, 0.0, 0.0])
    assert [s.split("\n")[0] for s in judge.seen] == ["Q: q1", "Q: q3"]  # only the judged rows were prompted
    assert list(info["judge_verdict"]) == ["", "YES", "", "no"]
    np.testing.assert_allclose(info["judge_score"], [np.nan, 1.0, np.nan, 0.0])
    assert metrics["reward/num_judge_rows"] == 2.0
    everyone = ScriptedJudge(_spec(parser="contains_yes", default_score=0.0), ["yes", "no", "no", "yes"])
    np.testing.assert_allclose(everyone.grade(["q"] * 4, ["r"] * 4, meta, rule, None)[0], [1, 0, 0, 1])
    nobody = ScriptedJudge(_spec(data_sources=("other",)), [])
    np.testing.assert_allclose(nobody.grade(["q"] * 4, ["r"] * 4, meta, rule, None)[0], rule)


# Trinity's RubricJudgeWorkflow.get_judge_reward, step 3 (its file: tests/config/peers/trinity/trinity/common/
# workflows/rubric_judge_workflow.py): (verdict, judge_success, reward = (rating - 1) / 9 or 0)
TRINITY_RATINGS = [
    ('```json\n{\n"rating": 7\n}```', True, 6 / 9),
    ('Thinking... ```json {"rating": 10} ``` done', True, 1.0),
    ('```\n{"rating": 1}\n```', True, 0.0),  # a plain ``` block is read too
    ('```json {"rating": 4.5}```', True, 3.5 / 9),
    ('```json {"rating": 11} ```', False, 0.0),  # out of 1-10
    ('```json {"score": 5} ```', False, 0.0),
    ("rating: 7", False, 0.0),  # no block
    ('```json [7] ```', False, 0.0),  # not an object
    ('no block ```json {"rating": 3}', False, 0.0),  # not closed
]


@pytest.mark.parametrize("verdict,success,reward", TRINITY_RATINGS)
def test_json_rating_reads_as_trinitys_rubric_judge(verdict, success, reward):
    judge = ScriptedJudge(_spec(parser="json_rating", min_score=1.0, max_score=10.0, default_score=0.0), [verdict])
    scores, _, metrics = judge.combine(None, judge.judge(["q"], ["r"], [None], rng=None))
    assert scores[0] == pytest.approx(reward) and metrics["reward/judge_parse_failures"] == float(not success)


def test_rubrics_fill_the_template_as_trinity_lists_them():
    """reward_model.judge.rubric_key: each judged row's rubric from its extra_info, in Trinity's words."""
    rubric = [{"description": "Names the drug", "weight": 5}, {"description": "Warns of side effects", "weight": 2}]
    assert render_rubric(rubric) == ("Rubric 0 (weight: 5): Names the drug\n"
                                     "Rubric 1 (weight: 2): Warns of side effects")
    assert render_rubric(json.dumps(rubric)) == render_rubric(rubric) and render_rubric(np.asarray(rubric)) == \
        render_rubric(rubric)
    assert render_rubric([]) == render_rubric(None) == "Rubrics are not provided."
    judge = ScriptedJudge(_spec(template="<p>{prompt}</p><r>{response}</r><rubrics>\n{rubric}\n</rubrics>",
                                rubric_key="rubric", parser="json_rating", min_score=1.0, max_score=10.0),
                          ['```json {"rating": 10}```', '```json {"rating": 1}```'])
    meta = {"data_source": np.asarray(["med", "med"], dtype=object), "ground_truth": np.asarray([None, None]),
            "extra_info": np.asarray([{"rubric": rubric}, {}], dtype=object)}
    scores, _, _ = judge.grade(["q0", "q1"], ["r0", "r1"], meta, np.full(2, np.nan, np.float32), None)
    np.testing.assert_allclose(scores, [1.0, 0.0])
    assert judge.seen[0] == "<p>q0</p><r>r0</r><rubrics>\n" + render_rubric(rubric) + "\n</rubrics>"
    assert judge.seen[1].endswith("<rubrics>\nRubrics are not provided.\n</rubrics>")


def test_rule_scorer_no_verdict_is_nan_only_when_allowed():
    def score(data_source, solution_str, ground_truth, extra_info=None):
        return None if solution_str == "skip" else 1.0

    result = RewardManager(score, no_verdict_ok=True).score(["a", "skip"], ["d", "d"], ["", ""])
    assert result.scores[0] == 1.0 and np.isnan(result.scores[1])
    result = RewardManager(score).score(["a", "skip"], ["d", "d"], ["", ""])  # None stays an error (score 0)
    assert result.scores[1] == 0.0 and result.metrics["reward/num_errors"] == 1.0
    unknown = RewardManager(no_verdict_ok=True).score(["a"], ["no/such/source"], [""])  # built-ins: no scorer
    assert np.isnan(unknown.scores[0])


@pytest.mark.parametrize("key,value,match", [
    ("reward_model.judge.template", "no response here {prompt}", "has no '{response}'"),
    ("reward_model.judge.template", "{response} {answer}", r"unknown field\(s\) \['answer'\]"),
    ("reward_model.judge.parser", "regex", "one of number, boxed, yes_no, contains_yes, score_tag"),
    ("reward_model.judge.max_score", 0.0, "must exceed min_score"),
])
def test_judge_config_errors(tmp_path, key, value, match):
    cfg = tiny_config(tmp_path, **{"reward_model.enable": True, "reward_model.style": "generative",
                                   "reward_model.model.path": "tiny:llama", key: value})
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg, check_paths=False)


def test_tiny_judge_scores_a_training_step(tmp_path):
    from jaxrl_llm.trainer.trainer import Trainer

    dump = tmp_path / "dump"
    cfg = tiny_config(tmp_path / "run", **{
        "reward_model.enable": True, "reward_model.style": "generative", "reward_model.model.path": "tiny:llama",
        "reward_model.judge.combine": "sum", "reward_model.judge.default_score": 0.25,
        "trainer.total_training_steps": 1, "trainer.rollout_data_dir": str(dump)})
    trainer = Trainer(cfg)
    assert "reward: judge tiny:llama" in trainer.summary()
    trainer.fit()
    row = read_metrics(tmp_path / "run")[-1]
    # a random tiny judge writes no yes / no: every verdict is a parse failure scored the default
    assert row["reward/judge_parse_failures"] == 8.0 and row["reward/judge_score/mean"] == pytest.approx(0.25)
    assert row["timing_s/judge"] > 0
    # perf/mfu counts the judge's generation: its prompts read and verdicts written, at its own size
    read, written = row["reward/num_judge_prompt_tokens"], row["reward/num_judge_response_tokens"]
    assert read > 8 and 8 <= written <= 8 * trainer.judge.spec.max_new_tokens
    rollout = types.SimpleNamespace(prompt_lengths=np.full(8, 12), response_lengths=np.full(8, 5),
                                    group_ids=np.repeat(np.arange(4), 2),
                                    reward_metrics={k: row[k] for k in row if k.startswith("reward/num_judge")})
    mfu = {judged: step_perf_metrics(trainer.spec, rollout, {"step": 1.0}, actor=trainer.actor, teacher=None,
                                     teacher_rollout=None, judge=trainer.judge if judged else None,
                                     peak_flops=1.0)["perf/mfu"]
           for judged in (False, True)}
    j = trainer.judge.model_cfg
    judge_params = sum(x.size for x in jax.tree.leaves(trainer.judge.params))
    assert row["reward/num_judge_rows"] == 8.0
    want = step_flops(num_params=judge_params, num_layers=j.num_hidden_layers, hidden_size=j.hidden_size,
                      prompt_tokens=int(read), response_tokens=int(written), forward_passes=0, training_passes=0,
                      mean_context=rollout_context(np.full(8, (read + written) / 8)))
    assert (mfu[True] - mfu[False]) * jax.device_count() == pytest.approx(want, rel=1e-9)
    rows = [json.loads(line) for line in open(dump / "0.jsonl")]
    assert len(rows) == 8 and all("judge_verdict" in r and r["judge_score"] == 0.25 for r in rows)
    assert all(r["score"] == pytest.approx(0.25 + float(r["output"].strip() == r["ground_truth"])) for r in rows)


def test_judge_generates_on_the_rollout_devices_of_a_split_mesh(tmp_path):
    from jaxrl_llm.trainer.trainer import Trainer

    cfg = tiny_config(tmp_path / "run", **{
        "reward_model.enable": True, "reward_model.style": "generative", "reward_model.model.path": "tiny:llama",
        "mesh.rollout_devices": 4, "synchronizer.sync_offset": 1, "trainer.total_training_steps": 2})
    trainer = Trainer(cfg)
    assert trainer.rollout_mesh is not None and trainer.judge is not None
    assert trainer.judge.mesh is trainer.rollout_mesh
    judge_devices = {d for x in jax.tree.leaves(trainer.judge.params) for d in x.sharding.device_set}
    assert judge_devices == set(trainer.rollout_mesh.devices.flat)
    rows = trainer.fit()
    assert rows["reward/judge_parse_failures"] == 8.0
