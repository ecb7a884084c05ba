"""Bad inputs through `launch/train.py`: each of 40+ broken configs, data files, model folders,
reward files and paths ends the run with exactly one line (`config error: ...` / `data error: ...`)
that names the culprit, a non-zero exit status, no traceback, and nothing written to the run dir.

The cases run in forked children of one warm interpreter (bad_input_runner.py: the same
`launch/train.py` code path and process boundary, without paying the imports 40 times); two
of them also run as plain `python launch/train.py` subprocesses.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from tiny_models import make_char_tokenizer

from jaxrl_llm.models import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNNER = pathlib.Path(__file__).resolve().parent / "bad_input_runner.py"
ERROR_LINE = re.compile(r"^(config|data) error: ")


def _env() -> dict[str, str]:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=1",
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _jsonl(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _hf_folder(path: pathlib.Path, config: dict | None = None, *, weights: bool = True) -> str:
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return str(path)


ROW = {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "data_source": "openai/gsm8k",
       "reward_model": {"style": "rule", "ground_truth": "2"}}


class Inputs:
    """Every file the cases point at, written once."""

    def __init__(self, d: pathlib.Path):
        self.d = d
        self.tok = d / "tok"
        make_char_tokenizer().save_pretrained(self.tok)
        self.good = _jsonl(d / "good.jsonl", [ROW] * 8)
        self.runs = d / "runs"
        self.cases: list[tuple[str, list[str], str, str]] = []

    def write(self, name: str, content: str | bytes) -> str:
        path = self.d / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def rows(self, name: str, bad: dict, at: int = 1) -> str:
        rows = [ROW] * 8
        rows[at] = bad
        return _jsonl(self.d / name, rows)

    def base(self, name: str) -> list[str]:
        return [f"data.tokenizer={self.tok}", "data.synthetic.task=null", f"data.train_files={self.good}",
                f"trainer.default_local_dir={self.runs / name}"]


def build_cases(x: Inputs) -> list[tuple[str, list[str], str, str]]:
    """(name, overrides after the base ones, the culprit the error line must name, config | data)."""
    tiny_hf = ModelConfig.tiny().to_hf_config()
    gpt2 = {**tiny_hf, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    long_prompt = {**ROW, "prompt": [{"role": "user", "content": "x" * 200}]}
    reward_ok = x.write("reward_ok.py", "def compute_score(data_source, solution_str, ground_truth, extra_info=None):"
                                        "\n    return 1.0\nNOT_CALLABLE = 3\n")
    malformed = x.write("m.jsonl", json.dumps(ROW) + "\n{oops\n")
    latin1 = x.write("l1.jsonl", json.dumps(ROW).encode() + b'\n{"prompt": "caf\xe9"}\n')
    latin1_csv = x.write("l1.csv", b"prompt\ncaf\xe9\n")
    latin1_val = x.write("v.csv", b"prompt\n\xff\n")
    exits = x.write("ex.py", "import sys\nsys.exit(3)\n")
    return [
        # config keys and values
        ("unknown_key", ["actor_rollout_ref.actor.ppo_mini_batch=3"], "actor_rollout_ref.actor.ppo_mini_batch",
         "config"),
        ("bad_type", ["data.train_batch_size=abc"], "data.train_batch_size", "config"),
        ("unknown_estimator", ["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator='grpoo'", "config"),
        ("indivisible_batch", ["data.train_batch_size=6"], "actor_rollout_ref.actor.ppo_mini_batch_size", "config"),
        ("negative_lr", ["actor_rollout_ref.actor.optim.lr=-1"], "actor_rollout_ref.actor.optim.lr", "config"),
        ("full_kl", ["actor_rollout_ref.actor.kl_loss_type=full"], "actor_rollout_ref.actor.kl_loss_type", "config"),
        ("top_p_zero", ["actor_rollout_ref.rollout.top_p=0"], "actor_rollout_ref.rollout.top_p", "config"),
        ("unknown_logger", ["trainer.logger=[console,mlfow]"], "trainer.logger: unknown sink 'mlfow'", "config"),
        ("experiment_path", ["trainer.experiment_name=a/b"], "trainer.experiment_name='a/b'", "config"),
        ("project_dotdot", ["trainer.project_name=.."], "trainer.project_name='..'", "config"),
        ("filter_metric", ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=accuracy"],
         "algorithm.filter_groups.metric='accuracy'", "config"),
        ("override_shape", ["actor_rollout_ref.model.override_config.num_hidden_layers=4"],
         "actor_rollout_ref.model.override_config.num_hidden_layers", "config"),
        ("too_long_for_context", ["data.max_prompt_length=250"], "data.max_prompt_length=250", "config"),
        ("resume_path_unset", ["trainer.resume_mode=resume_path"], "trainer.resume_from_path", "config"),
        ("resume_path_missing", ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={x.d}/nope/40"],
         "trainer.resume_from_path", "config"),
        ("deleted_key", ["~trainer.seed=1"], "trainer.seed", "config"),
        # model folders
        ("model_missing", [f"actor_rollout_ref.model.path={x.d}/no_model"], "actor_rollout_ref.model.path", "config"),
        ("model_gpt2", [f"actor_rollout_ref.model.path={_hf_folder(x.d / 'gpt2', gpt2)}"], "GPT2LMHeadModel",
         "config"),
        ("model_no_config", [f"actor_rollout_ref.model.path={_hf_folder(x.d / 'noconfig')}"], "no config.json",
         "config"),
        ("model_bad_json", [f"actor_rollout_ref.model.path={x.d / 'badjson'}"], "cannot read config.json", "config"),
        ("model_no_weights", [f"actor_rollout_ref.model.path={_hf_folder(x.d / 'noweights', tiny_hf, weights=False)}"],
         "no model.safetensors", "config"),
        ("model_bad_gguf", [f"actor_rollout_ref.model.path={x.write('m.gguf', b'GARBAGE' * 8)}"], "m.gguf", "config"),
        ("model_not_gguf", [f"actor_rollout_ref.model.path={x.write('m.bin', b'0' * 8)}"], "not .gguf", "config"),
        ("model_unknown_tiny", ["actor_rollout_ref.model.path=tiny:gpt2"], "tiny:gpt2", "config"),
        # tokenizers
        ("tokenizer_missing", [f"data.tokenizer={x.d}/no_tok"], "data.tokenizer", "config"),
        ("tokenizer_empty_folder", [f"data.tokenizer={_hf_folder(x.d / 'emptytok', weights=False)}"],
         "no tokenizer in the folder", "config"),
        ("tokenizer_corrupt", [f"data.tokenizer={x.d / 'badtok'}"], "badtok", "config"),
        # data files
        ("data_missing", [f"data.train_files={x.d}/nope.jsonl"], "nope.jsonl", "config"),
        ("data_suffix", [f"data.train_files={x.write('d.txt', 'hi')}"], "d.txt: unsupported file type", "data"),
        ("data_malformed_json", [f"data.train_files={malformed}"],
         "m.jsonl line 2: malformed JSON", "data"),
        ("data_not_utf8", [f"data.train_files={latin1}"],
         "l1.jsonl line 2: not UTF-8", "data"),
        ("data_csv_not_utf8", [f"data.train_files={latin1_csv}"], "l1.csv line 2: not UTF-8",
         "data"),
        ("data_empty_prompt", [f"data.train_files={x.rows('ep.jsonl', {**ROW, 'prompt': ''}, at=3)}"],
         "ep.jsonl line 4: empty prompt", "data"),
        ("data_no_ground_truth", [f"data.train_files={x.rows('ngt.jsonl', {**ROW, 'reward_model': {}}, at=5)}"],
         "ngt.jsonl line 6: no ground truth", "data"),
        ("data_ground_truth_type",  # a dict where the gsm8k scorer reads a string: was scored 0 and trained on
         [f"data.train_files={x.rows('gtt.jsonl', {**ROW, 'reward_model': {'ground_truth': {'answer': '2'}}}, at=6)}"],
         "gtt.jsonl line 7: reward_model.ground_truth: the 'openai/gsm8k' scorer compares the answer with a string",
         "data"),
        ("data_unknown_source", [f"data.train_files={x.rows('uds.jsonl', {**ROW, 'data_source': 'my/task'})}"],
         "uds.jsonl line 2: data_source 'my/task'", "data"),
        ("data_no_prompt_column", [f"data.train_files={_jsonl(x.d / 'q.jsonl', [{'question': 'hi'}] * 8)}"],
         "missing column 'prompt'", "data"),
        ("data_too_few_rows", [f"data.train_files={_jsonl(x.d / 'few.jsonl', [ROW] * 2)}"], "few.jsonl: 2 prompts",
         "data"),
        ("data_prompt_too_long", [f"data.train_files={x.rows('long.jsonl', long_prompt, at=2)}"],
         "long.jsonl line 3: prompt has", "data"),
        ("data_empty_file", [f"data.train_files={x.write('empty.jsonl', ' ')}"], "empty.jsonl: empty dataset", "data"),
        ("data_corrupt_parquet", [f"data.train_files={x.write('c.parquet', b'PAR1 not really')}"],
         "c.parquet: cannot read parquet", "data"),
        ("data_extra_info_type", [f"data.train_files={x.rows('ei.jsonl', {**ROW, 'extra_info': [1]})}"],
         "ei.jsonl line 2: extra_info must be a dict", "data"),
        ("val_not_utf8", [f"data.val_files={latin1_val}"], "v.csv line 2: not UTF-8", "data"),
        # reward and dataset code
        ("reward_missing", [f"custom_reward_function.path={x.d}/no_reward.py"], "custom_reward_function.path",
         "config"),
        ("reward_syntax", [f"custom_reward_function.path={x.write('syn.py', 'def compute_score(:')}"],
         "syn.py failed: SyntaxError", "config"),
        ("reward_exits", [f"custom_reward_function.path={exits}"],
         "ex.py failed: SystemExit", "config"),
        ("reward_import_error", [f"custom_reward_function.path={x.write('imp.py', 'import not_a_module_xyz')}"],
         "imp.py failed: ModuleNotFoundError", "config"),
        ("reward_no_function", [f"custom_reward_function.path={reward_ok}", "custom_reward_function.name=score"],
         "custom_reward_function.name", "config"),
        ("reward_not_callable", [f"custom_reward_function.path={reward_ok}",
                                 "custom_reward_function.name=NOT_CALLABLE"],
         "is not callable", "config"),
        ("dataset_class_broken", [f"data.custom_cls.path={x.write('cls.py', 'raise RuntimeError(1)')}",
                                  "data.custom_cls.name=Rows"], "data.custom_cls.path", "config"),
    ]


def _make_folders(x: Inputs) -> None:
    (x.d / "badjson").mkdir()
    (x.d / "badjson" / "config.json").write_text("{not json")
    (x.d / "badtok").mkdir()
    (x.d / "badtok" / "tokenizer.json").write_text("{broken")
    (x.d / "badtok" / "tokenizer_config.json").write_text("{broken")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Inputs:
    x = Inputs(tmp_path_factory.mktemp("bad_inputs"))
    _make_folders(x)
    x.cases = build_cases(x)
    return x


@pytest.fixture(scope="module")
def results(inputs):
    cases = inputs.cases
    names = [c[0] for c in cases]
    assert len(set(names)) == len(names)
    control = ("control_dry_run", ["--config=configs/tiny.py", "--dry_run", "--", *inputs.base("control")])
    payload = [{"name": control[0], "argv": control[1]}] + [
        {"name": name, "argv": ["--config=configs/tiny.py", "--", *inputs.base(name), *extra]}
        for name, extra, _, _ in cases]
    cases_file, results_file = inputs.d / "cases.json", inputs.d / "out" / "results.json"
    results_file.parent.mkdir()
    cases_file.write_text(json.dumps(payload))
    proc = subprocess.run([sys.executable, str(RUNNER), str(cases_file), str(results_file), str(inputs.tok)],
                          cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {r["name"]: r for r in json.loads(results_file.read_text())}
    return out, {name: (culprit, kind) for name, _, culprit, kind in cases}


def _check(result: dict, culprit: str, kind: str, run_dir: pathlib.Path) -> None:
    stderr = result["stderr"]
    assert result["code"] not in (0, None), f"exit status {result['code']}; stderr:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    assert len(errors) == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == errors[0], stderr[-3000:]  # the error is the last word
    assert errors[0].startswith(f"{kind} error: ") and culprit in errors[0], errors[0]
    left = [p for p in run_dir.rglob("*") if p.is_file()] if run_dir.exists() else []
    assert not left, left


def test_the_base_config_is_valid(results, inputs):
    out, _ = results
    control = out["control_dry_run"]
    assert control["code"] == 0 and "Traceback" not in control["stderr"], control["stderr"][-3000:]
    assert not (inputs.runs / "control").exists()


def test_every_bad_input_gives_one_clear_line(results, inputs):
    out, expected = results
    assert len(expected) >= 30
    failures = []
    for name, (culprit, kind) in expected.items():
        try:
            _check(out[name], culprit, kind, inputs.runs / name)
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("name", ["unknown_key", "data_unknown_source"])
def test_plain_subprocess_runs_agree(results, inputs, name):
    """Two cases again as `python launch/train.py ...` (no fork): the same line and exit status."""
    out, expected = results
    extra = {c[0]: c[1] for c in inputs.cases}[name]
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config=configs/tiny.py", "--",
                           *inputs.base(name + "_plain"), *extra], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    result = {"code": proc.returncode, "stderr": proc.stderr}
    culprit, kind = expected[name]
    _check(result, culprit, kind, inputs.runs / (name + "_plain"))
    forked = [line for line in out[name]["stderr"].splitlines() if ERROR_LINE.match(line)]
    plain = [line for line in proc.stderr.splitlines() if ERROR_LINE.match(line)]
    assert plain == [line.replace(name, name + "_plain") for line in forked] or plain == forked
    assert proc.returncode == out[name]["code"]

