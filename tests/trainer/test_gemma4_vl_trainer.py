"""GRPO with a Gemma 4 multimodal policy (a random tiny `Gemma4ForConditionalGeneration` folder: its vision tower
and embedder, sliding and full layers, per-layer inputs; SmolLM2's tokenizer given three image tokens, which the
folder's config.json names by id) on the synthetic picture task, 8 devices, the paged engine, the tower trained
(actor.freeze_vision_tower=False): every picture is as many image tokens as the processor's aspect-preserving resize
gives it; the sampled log-probs are the trainer's (an image's tokens see each other on the sliding layers in both);
the step moves the tower; the export (text model, tower, embedder) reads the same logits in transformers and
reloads through `jrl.load_model` / `jrl.generate`."""
import json

import jax
import numpy as np
import pytest
import tiny_runs
from vl_cases import assert_export_reads_and_generates

from jaxrl_llm.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ARR = "actor_rollout_ref"
IMAGE_TOKENS = ["<|image>", "<|image|>", "<image|>"]
PROCESSOR = {"patch_size": 16, "max_soft_tokens": 70, "pooling_kernel_size": 2}


@pytest.fixture(scope="module")
def gemma4_folder(tmp_path_factory, smollm2_gguf):
    from jaxrl_llm.hf import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_gguf))
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS}, replace_extra_special_tokens=False)
    start, image, end = (int(tokenizer.convert_tokens_to_ids(t)) for t in IMAGE_TOKENS)
    pad = tokenizer.pad_token_id or 0
    text = transformers.Gemma4TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=512, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=len(tokenizer), use_bidirectional_attention="vision", pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                             pooling_kernel_size=2, patch_size=16, position_embedding_size=64)
    config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None,
                                       image_token_id=image, boi_token_id=start, eoi_token_id=end)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.model.vision_tower.parameters():
            p.normal_(0.0, 0.2)
    folder = tmp_path_factory.mktemp("gemma4_vl_policy")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return folder


def test_grpo_on_pictures_trains_the_tower_and_exports(gemma4_folder, tmp_path):
    cfg = tiny_runs.tiny_config(tmp_path / "run", "grpo_vl_tiny.py", **{
        f"{ARR}.model.path": str(gemma4_folder), "data.tokenizer": str(gemma4_folder), "data.max_prompt_length": 128,
        f"{ARR}.actor.freeze_vision_tower": False, "trainer.total_training_steps": 1, f"{ARR}.actor.optim.lr": 1e-2})
    trainer = Trainer(tiny_runs.with_reward_file(cfg, tmp_path))
    vision = trainer.generator.vision
    assert len(jax.devices()) == 8 and vision is not None and vision.trained
    assert (vision.tokens.max_soft_tokens, vision.tokens.tokens_for(112, 112)) == (70, 64)  # 256 x 256: 8 x 8 cells
    assert trainer.actor.model_cfg.bidirectional_image_tokens == 1120
    before = jax.device_get(trainer.actor.params["vision"])
    metrics = trainer.step()
    assert metrics["rollout_corr/max_abs_log_ratio"] < 1e-5 and metrics["actor/grad_norm"] > 0
    after = jax.device_get(trainer.actor.params["vision"])
    assert not np.array_equal(before["blocks"]["q"], after["blocks"]["q"])
    assert not np.array_equal(before["embedder"]["kernel"], after["embedder"]["kernel"])

    from jaxrl_llm.models.vision.gemma4_vit import patch_positions

    def hf_inputs(ids: np.ndarray, pixels: np.ndarray, grid: np.ndarray) -> dict:
        return dict(input_ids=torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.int64),
                    pixel_values=torch.tensor(pixels),
                    image_position_ids=torch.tensor(patch_positions(grid, pixels.shape[1]).astype(np.int64)),
                    mm_token_type_ids=torch.tensor((ids == vision.vl.image_token_id).astype(np.int64)))

    reloaded = assert_export_reads_and_generates(trainer, trainer.export_hf(str(tmp_path / "hf")),
                                                 transformers.Gemma4ForConditionalGeneration, after, hf_inputs)
    assert reloaded.vision.tokens.max_soft_tokens == 70
