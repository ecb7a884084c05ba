"""Offline evaluation: a file of responses -> mean@n, pass@k and best@k per data source (veRL's main_eval).

    python launch/evaluate.py -- evaluation.path=gen.parquet                  # the built-in scorers
    python launch/evaluate.py --import_config=evaluation.yaml                 # veRL's evaluation.yaml
    python launch/evaluate.py -- data.path=gen.parquet data.response_key=responses \
        custom_reward_function.path=my_reward.py                              # veRL's keys

Each row's responses are scored with its data_source's built-in scorer (veRL's, case for case) or
custom_reward_function.*; the table is printed and the JSON report written beside the file
(evaluation.output_path). A bad row ends the run with one `data error:` line naming it.
"""
from __future__ import annotations

from absl import flags

from jaxrl_llm.config import ConfigError, default_config
from jaxrl_llm.config.importers.verl_offline import EVALUATION, offline_config
from jaxrl_llm.entry import one_line_errors, run_app

_IMPORT = flags.DEFINE_string("import_config", None, "veRL's evaluation.yaml, applied onto the default tree.")
_FLAG_OVERRIDES: list[str] = []


def main(argv: list[str]) -> None:
    with one_line_errors():  # a bad key or row: one `config error:` / `data error:` line
        cfg = offline_config(default_config(), list(_FLAG_OVERRIDES) + argv[1:], _IMPORT.value, EVALUATION)
        e, custom = cfg.evaluation, cfg.custom_reward_function
        path = e.path or cfg.generation.output_path
        if path is None:
            raise ConfigError("evaluation.path=None: set the responses file (or generation.output_path)")
        from jaxrl_llm.evaluation import evaluate_file
        from jaxrl_llm.rewards import ScorerSpec

        scorer = ScorerSpec(custom.path, custom.name or "compute_score",
                            tuple(sorted(dict(custom.reward_kwargs).items())))
        evaluate_file(path, scorer, response_key=e.response_key, data_source_key=e.data_source_key,
                      reward_model_key=e.reward_model_key, threshold=float(e.correct_threshold),
                      output_path=e.output_path)


if __name__ == "__main__":
    run_app(main, _FLAG_OVERRIDES)
