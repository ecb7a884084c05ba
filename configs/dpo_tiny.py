"""DPO on the tiny model (CI): the synthetic `add` task's rows (written into the run dir at start) carry a
preference pair each (chosen: the right sum, rejected: a wrong one: jaxrl_llm/data/synthetic.py).
`python launch/dpo.py --config=configs/dpo_tiny.py`."""
import pathlib

from jaxrl_llm.config import config_from_file


def get_config():
    cfg = config_from_file(pathlib.Path(__file__).with_name("tiny.py"))
    cfg.data.train_batch_size = 8
    cfg.dpo.max_length = 64
    cfg.dpo.micro_batch_size_per_device = 1
    cfg.dpo.beta = 0.1
    cfg.actor_rollout_ref.actor.optim.lr = 1e-3
    cfg.trainer.experiment_name = "dpo_tiny"
    cfg.trainer.default_local_dir = "runs/dpo_tiny"
    cfg.trainer.total_training_steps = 4
    cfg.trainer.test_freq = 2
    cfg.trainer.save_freq = 2
    return cfg
