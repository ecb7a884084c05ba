"""One process of a multi-process tiny training run (launched by tests/multiprocess_util.py):
`python mp_trainer_worker.py RUN_DIR STEPS [split]`; prints the last step's metrics as one JSON line.
`split`: the rollout on its own mesh of the devices at positions 2, 3, 6, 7 of the 8 (each process's
last two of four when there are two), the training mesh on the others: both meshes span both processes,
so the weights move between meshes across processes at every sync."""
import importlib.util
import json
import pathlib
import sys

from jaxrl_llm import sharding

sharding.initialize()  # before anything touches the backend

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main() -> None:
    run_dir, steps = sys.argv[1], int(sys.argv[2])
    spec = importlib.util.spec_from_file_location("tiny_config", ROOT / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.trainer.default_local_dir = run_dir
    cfg.trainer.total_training_steps = steps
    cfg.trainer.logger = ["jsonl"]
    cfg.trainer.save_freq = steps
    cfg.trainer.export_hf = True
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 2, 2, 2
    if sys.argv[3:] == ["split"]:
        import jax

        cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 2, 2
        cfg.mesh.rollout_devices = [d.id for i, d in enumerate(jax.devices()) if i % 4 >= 2]

    from jaxrl_llm.trainer import Trainer

    last = Trainer(cfg).fit()
    import jax

    metrics = {k: v for k, v in last.items() if not k.startswith(("timing_s/", "perf/"))}
    print(json.dumps({"process_count": jax.process_count(), "metrics": metrics}))


if __name__ == "__main__":
    main()
