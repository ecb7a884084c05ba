"""The trained policy as a Hugging Face folder (`trainer.export_hf`, and `Trainer.export_hf`)."""
from __future__ import annotations

from jaxrl_llm.config.spec import ModelSpec
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.roles.trained import TrainedRole
from jaxrl_llm.roles.vision import VisionTower
from jaxrl_llm.sharding import to_host


def export_policy(actor: TrainedRole, model: ModelSpec, tokenizer: Tokenizer, out_dir: str, *, is_main: bool,
                  vision: VisionTower | None = None) -> str:
    """The policy as an HF folder at `out_dir` (LoRA: the merged weights, and the adapters as a PEFT
    folder at `<out_dir>_peft`); a vision-language policy's with its tower (`vision`), as
    `Qwen2_5_VLForConditionalGeneration` / `Qwen3VLForConditionalGeneration` / `Gemma3ForConditionalGeneration` loads
    it (a trained tower as trained). Every process must call
    it (gathering the weights is a collective); the main process writes."""
    from jaxrl_llm.hf import export_hf
    from jaxrl_llm.hf.vision import export_vision_language
    from jaxrl_llm.models.lora import merge_lora

    params = to_host(merge_lora(actor.model_params))
    trained_tower = params.pop("vision", None)  # a trained tower (actor.freeze_vision_tower=False): the actor's own
    if vision is not None:
        tower = trained_tower if trained_tower is not None else to_host(vision.params)
        if is_main:
            export_vision_language(actor.model_cfg, params, vision.hf_config, tower, out_dir, tokenizer=tokenizer,
                                   processor_from=vision.path)
    elif is_main:
        export_hf(actor.model_cfg, params, out_dir, tokenizer=tokenizer)
    if model.lora is not None:
        from jaxrl_llm.hf.peft import export_peft

        adapters = to_host(actor.params["lora"])
        if is_main:  # a VL policy's adapters under transformers' VL module paths (LoRA on its tower too)
            export_peft(actor.model_cfg, adapters, model.lora, f"{out_dir}_peft", base_model_name_or_path=model.path,
                        tower=None if vision is None else vision.vl.vision)
    return out_dir
