"""Memory plans and roofline estimates of GRPO runs compiled for TPU slices, on this host (libtpu: the
tpu-plan extra). Prints one markdown table: per model and slice, each program's bytes per chip against
the chip's HBM, whether it fits, the micro-batch 'auto' picked, and its roofline estimate (TFLOP, HBM
and link GB per chip, seconds, the bound that holds); then per plan the step's estimated time, the
rollout's tokens/s per chip and the update's MFU.

    JAX_PLATFORMS=cpu python bench/tpu_plan.py                                  # the rows of docs/performance.md
    JAX_PLATFORMS=cpu python bench/tpu_plan.py --plans 0.5b:v5e-8,7b:v5e-32

The runs are configs/tpu_grpo.py's (Qwen2-0.5B / 1.5B / 7B and Qwen3-30B-A3B shapes, random weights,
bf16 compute, fp32 master weights, every micro-batch 'auto'); a plan is what
`launch/train.py --config=configs/tpu_grpo.py:<shape> --plan --topology=<slice>` prints. The Ironwood
(tpu7x) plans need libtpu 0.0.45 through TPU_LIBRARY_PATH (0.0.42.1 segfaults on them; the plan warns
and docs/performance-history.md says how).
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the six plans of issue #58 and the same shapes on Ironwood
PLANS = ("0.5b:v5e-8,0.5b:v6e-8,1.5b:v5e-8,7b:v5e-32,7b:v5p-8,30b-a3b:v5p-32,0.5b:tpu7x-8,1.5b:tpu7x-8,7b:tpu7x-8")


def tpu_grpo(shape: str):
    spec = importlib.util.spec_from_file_location("tpu_grpo", ROOT / "configs" / "tpu_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(shape)


def plan_rows(shape: str, topology: str) -> list[str]:
    from jaxrl_llm.config import ConfigError, validate_config
    from jaxrl_llm.planning.memory import plan_for_config
    from jaxrl_llm.platform import parse_accelerator_type

    _, devices = parse_accelerator_type(topology)
    cfg = tpu_grpo(shape)
    cfg.trainer.plan_topology = topology
    cfg = validate_config(cfg, num_devices=devices)
    start = time.perf_counter()
    try:
        plan = plan_for_config(cfg, check=False)  # every program's row, fitting or not
    except ConfigError as err:  # an 'auto' micro-batch that does not fit even at 1
        return [f"| {shape} | {topology} | does not fit: {str(err)[:200]} |"]
    gib = lambda b: f"{b / (1 << 30):.1f}"  # noqa: E731
    rows = []
    for p in plan.programs:
        fit = "ok" if plan.device_memory is not None and p.fits(plan.device_memory) else "NO"
        r = plan.roofline(p)
        cost = "- | - | - | - | -" if r is None else (
            f"{r.cost.flops / 1e12:.1f} | {r.cost.hbm_bytes / 1e9:.0f} | {r.cost.link_bytes / 1e9:.0f} | "
            f"{r.seconds:.1f} | {r.bound}")
        rows.append(f"| {shape} | {topology} | {p.name} | {p.micro if p.micro is not None else '-'} | "
                    f"{gib(p.total_bytes)} / {gib(plan.device_memory or 0)} | {fit} | {cost} |")
    rows += [f"| {shape} | {topology} | {line} |" for line in plan.estimates()]
    print(f"# {shape} on {topology}: planned in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plans", default=PLANS, help="shape:slice pairs, comma-separated")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("jaxrl_llm").setLevel(logging.INFO)  # one line per compiled program (stderr)
    print("| model | slice | program | micro (auto) | GiB per chip / HBM | fits | TFLOP | GB HBM | GB link "
          "| est. s | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for pair in args.plans.split(","):
        shape, topology = pair.split(":")
        for row in plan_rows(shape, topology):
            print(row, flush=True)


if __name__ == "__main__":
    main()
