"""The run's record: `<run dir>/metrics.jsonl` is always written (whatever `trainer.logger` says), is
rewound to the resumed step before a resumed run logs (no step twice; a torn last line
tolerated), W&B continues the same run id, and step dumps are never duplicated."""
import json
import logging
import sys
import types

import pytest

from jaxrl_llm.bookkeeping import tracking
from jaxrl_llm.bookkeeping.tracking import RunRecord, Tracking, dump_jsonl


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("sinks", [["console"], [], ["console", "jsonl"]])
def test_metrics_jsonl_is_written_whatever_the_logger_list(tmp_path, sinks, capsys):
    tracker = Tracking(sinks, str(tmp_path / "run"))
    tracker.log({"actor/pg_loss": 0.5, "critic/score/mean": float("nan")}, step=1)
    tracker.log_generations("val/generations", [{"input": "q", "output": "a", "score": 1.0}], step=1)
    tracker.close()
    assert _records(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 1, "actor/pg_loss": 0.5, "critic/score/mean": "nan"},
        {"step": 1, "val/generations": [{"input": "q", "output": "a", "score": 1.0}]},
    ]
    assert ("step:1 - actor/pg_loss:0.5000" in capsys.readouterr().out) == ("console" in sinks)


def _killed_run_record(path):
    """What a killed run leaves: steps 0..5 (a generation table at step 4) and half of step 6's line."""
    lines = [json.dumps({"step": s, "critic/score/mean": s / 10}) for s in range(6)]
    lines.insert(5, json.dumps({"step": 4, "val/generations": [{"output": "x"}]}))
    path.write_text("\n".join(lines) + "\n" + '{"step": 6, "critic/sco')


def test_rewind_drops_records_after_the_resumed_step_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _killed_run_record(path)
    record = RunRecord(str(path))
    assert record.rewind(3) == 3  # step 4 (two records) and step 5; the torn line goes too
    record.append({"step": 4, "critic/score/mean": 0.45})
    record.close()
    got = _records(path)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    assert got[-1] == {"step": 4, "critic/score/mean": 0.45}
    # a fresh start on a run dir whose earlier attempt never saved a checkpoint: nothing is kept
    assert RunRecord(str(path)).rewind(None) == 5
    assert path.read_text() == ""


def test_a_foreign_line_is_dropped_with_a_warning_naming_it(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        RunRecord(str(path)).rewind(5)
    assert _records(path) == [{"step": 1}, {"step": 2}]
    assert any(f"{path} line 2" in r.getMessage() for r in caplog.records)


def test_appending_after_a_torn_line_starts_a_new_line(tmp_path):
    """Without a rewind (a val_only run on a finished run dir) the torn line stays; the next record
    does not get glued to it."""
    path = tmp_path / "metrics.jsonl"
    _killed_run_record(path)
    record = RunRecord(str(path))
    record.append({"step": 0, "val-core/x/reward/mean@1": 1.0})
    record.close()
    assert tracking.parse_records(path.read_text())[-1] == {"step": 0, "val-core/x/reward/mean@1": 1.0}
    assert path.read_text().splitlines()[-2] == '{"step": 6, "critic/sco'


class _FakeWandb(types.ModuleType):
    """The part of the `wandb` module Tracking uses, recording every init call."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged = [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        wandb = self

        class Run:
            def log(self, data, step=None):
                wandb.logged.append((step, data))

            def finish(self):
                pass

        return Run()


def test_wandb_resumes_the_same_run_id(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "run"
    first = Tracking(["wandb"], str(run), project_name="p", experiment_name="e")
    first.log({"actor/lr": 1e-3}, step=1)
    first.close()
    again = Tracking(["wandb"], str(run), project_name="p", experiment_name="e")  # a resumed job
    again.close()
    run_id = (run / "wandb_run_id").read_text().strip()
    assert len(run_id) >= 8
    for kwargs in fake.inits:
        assert (kwargs["id"], kwargs["resume"], kwargs["dir"], kwargs["project"], kwargs["name"]) == (
            run_id, "allow", str(run), "p", "e")
    assert fake.logged == [(1, {"actor/lr": 1e-3})]
    # another run dir is another W&B run
    other = Tracking(["wandb"], str(tmp_path / "other"))
    other.close()
    assert fake.inits[-1]["id"] != run_id


def test_dumps_are_rewritten_not_appended(tmp_path):
    """A resumed run that redoes step 7 rewrites 7.jsonl instead of adding its rows twice."""
    path = tmp_path / "rollouts" / "7.jsonl"
    dump_jsonl(str(path), [{"output": "killed run", "score": 0.0}] * 3)
    dump_jsonl(str(path), [{"output": "a", "score": 1.0}, {"output": "b", "score": 0.0}])
    assert _records(path) == [{"output": "a", "score": 1.0}, {"output": "b", "score": 0.0}]
    assert [p.name for p in path.parent.iterdir()] == ["7.jsonl"]  # no temporary file left
