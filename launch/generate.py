"""Batch generation: a prompt file -> the same rows with n sampled responses each (veRL's main_generation).

    python launch/generate.py --config=configs/quickstart.py -- generation.input_path=prompts.parquet \
        generation.output_path=out.parquet generation.n_samples=4 actor_rollout_ref.rollout.temperature=0.7
    python launch/generate.py --import_config=generation.yaml          # veRL's generation.yaml
    python launch/generate.py -- data.path=test.parquet data.output_path=gen.parquet data.n_samples=8 \
        model.path=/models/Qwen2.5-0.5B-Instruct rollout.temperature=1.0 rollout.response_length=512  # veRL keys

The model is actor_rollout_ref.model.path (an HF folder, .gguf, one of our checkpoints, tiny:<arch>);
prompts are read as RL reads them; sampling follows actor_rollout_ref.rollout.*. A killed run relaunched
with the same command continues where it stopped (jaxrl_llm/evaluation/generate.py). A bad input ends
the run with one `config error:` / `data error:` line.
"""
from __future__ import annotations

import os

from absl import flags
from ml_collections import config_flags

from jaxrl_llm.config import default_config
from jaxrl_llm.config.importers.verl_offline import GENERATION, offline_config
from jaxrl_llm.entry import one_line_errors, run_app

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "quickstart.py")
_CONFIG = config_flags.DEFINE_config_file("config", os.path.normpath(_DEFAULT_CONFIG),
                                          "Config file with get_config() (the model and sampling keys).",
                                          lock_config=False)
_IMPORT = flags.DEFINE_string("import_config", None, "veRL's generation.yaml, applied onto --config (default: "
                                                     "the default tree).")
_FLAG_OVERRIDES: list[str] = []


def main(argv: list[str]) -> None:
    from absl import logging as absl_logging

    from jaxrl_llm.sharding import initialize

    absl_logging.set_verbosity(absl_logging.WARNING)
    initialize()
    with one_line_errors():  # a bad key or row: one `config error:` / `data error:` line
        base = _CONFIG.value if flags.FLAGS["config"].present else default_config()
        cfg = offline_config(base, list(_FLAG_OVERRIDES) + argv[1:], _IMPORT.value, GENERATION)
        from jaxrl_llm.evaluation import BatchGenerator

        print(f"wrote {BatchGenerator(cfg).run()}")


if __name__ == "__main__":
    run_app(main, _FLAG_OVERRIDES)
