"""Convert a model to a Hugging Face folder.

    python launch/convert_to_hf.py --input PATH --output DIR [--dtype float32|bfloat16|float16] [--peft DIR]

PATH is an HF folder, a .gguf file, or a training checkpoint (a step folder such as
`runs/x/checkpoints/40`, a checkpoints folder or a run folder: its latest step); the tokenizer
comes from PATH, or for a checkpoint from the tokenizer the run used (override: --tokenizer).
A LoRA checkpoint holds only adapters: DIR gets them merged into the base (re-read from the base
path the checkpoint records), and `--peft DIR2` also writes them as a PEFT adapter folder.
A vision-language model (a Qwen2.5-VL folder, or a checkpoint of a run whose policy is one) is written with its
vision tower, as `Qwen2_5_VLForConditionalGeneration` loads it.
"""
from __future__ import annotations

import argparse
import sys

from jaxrl_llm.checkpoint import is_checkpoint, load_lora_checkpoint, read_checkpoint_meta, register_checkpoint_loader
from jaxrl_llm.config.checks import reads_images
from jaxrl_llm.hf import export_hf, load_any, load_tokenizer
from jaxrl_llm.hf.vision import export_vision_language
from jaxrl_llm.models.dtypes import DTYPES, as_jnp_dtype
from jaxrl_llm.roles.vision import tower_for_export, vision_language_of, with_vision_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="HF folder, .gguf file or checkpoint")
    parser.add_argument("--output", required=True, help="output HF folder (replaced atomically)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--max-shard-size", type=int, default=5 * 1024**3, help="bytes per shard")
    parser.add_argument("--experts", default="dense", choices=["dense", "mxfp4"],
                        help="GPT-OSS: write the expert matrices as MXFP4 blocks and scales, as its releases do")
    parser.add_argument("--no-tokenizer", action="store_true", help="do not copy the tokenizer")
    parser.add_argument("--tokenizer", default=None, help="tokenizer location (default: see above)")
    parser.add_argument("--peft", default=None, help="also write a LoRA checkpoint's adapters as a PEFT folder here")
    args = parser.parse_args(argv)
    if args.peft is not None:
        from jaxrl_llm.hf.peft import export_peft

        if not is_checkpoint(args.input):
            parser.error("--peft needs a LoRA training checkpoint as --input")
        cfg, adapters, lora, base_path = load_lora_checkpoint(args.input)
        # a vision-language base: the adapters under transformers' VL module paths (its tower's too)
        tower = vision_language_of(base_path, cfg).vision if reads_images(base_path) else None
        out = export_peft(cfg, adapters, lora, args.peft, base_model_name_or_path=base_path, tower=tower)
        print(f"wrote LoRA adapters (rank {lora.rank}) to {out}")

    register_checkpoint_loader()
    cfg, params = load_any(args.input, dtype=as_jnp_dtype(args.dtype))
    tokenizer_path = args.tokenizer or (read_checkpoint_meta(args.input)["tokenizer"]
                                        if is_checkpoint(args.input) else args.input)
    tokenizer = None if args.no_tokenizer else load_tokenizer(tokenizer_path)
    trained_tower = params.pop("vision", None)  # a checkpoint whose run trained its tower (freeze_vision_tower=False)
    vision = tower_for_export(args.input, cfg)  # a vision-language model's tower goes with it
    if vision is not None:
        if tokenizer is not None:  # tiny:qwen2_5_vl's tokenizer: the run's, with the vision tokens it added
            tokenizer = with_vision_tokens(vision.path, tokenizer)
        tower = vision.params if trained_tower is None else trained_tower
        out = export_vision_language(cfg, params, vision.hf_config, tower, args.output, tokenizer=tokenizer,
                                     dtype=as_jnp_dtype(args.dtype), processor_from=vision.path)
        print(f"wrote {vision.hf_config.get('architectures', ['a vision-language model'])[0]} "
              f"({cfg.num_hidden_layers} layers and the vision tower, {args.dtype}) to {out}")
        return 0
    out = export_hf(cfg, params, args.output, tokenizer=tokenizer, max_shard_size=args.max_shard_size,
                    experts=args.experts)
    print(f"wrote {cfg.architecture} ({cfg.num_hidden_layers} layers, {args.dtype}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
