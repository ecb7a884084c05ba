"""GRPO with a Gemma 3 multimodal policy (a random tiny `Gemma3ForConditionalGeneration` folder: SigLIP tower,
projector, sliding and full layers; SmolLM2's tokenizer with Gemma's three image tokens) on the synthetic picture
task, 8 devices, the paged engine, packed rows sharing their prompts: every image is `<start_of_image>`, four soft
tokens, `<end_of_image>` whatever its size; the frozen tower's features reach the prefill and every trainer pass, an
image's tokens see each other in both, so the sampled log-probs are the trainer's; a step trains the text model; the
export (text model, tower, projector) reloads in transformers and through `jrl.load_model` / `jrl.generate`."""
import jax
import numpy as np
import pytest
import tiny_runs
from vl_cases import assert_export_reads_and_generates

from jaxrl_llm.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ARR = "actor_rollout_ref"
GEMMA_IMAGE_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory, smollm2_gguf):
    from jaxrl_llm.hf import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_gguf))
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA_IMAGE_TOKENS}, replace_extra_special_tokens=False)
    start, soft, end = (int(tokenizer.convert_tokens_to_ids(t)) for t in GEMMA_IMAGE_TOKENS)
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=56, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=soft, boi_token_index=start,
                                       eoi_token_index=end, pad_token_id=tokenizer.pad_token_id or 0,
                                       eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.model.vision_tower.parameters():
            p.normal_(0.0, 0.2)
    folder = tmp_path_factory.mktemp("gemma3_vl_policy")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_grpo_on_pictures_reads_the_same_images_in_the_sampler_and_the_trainer_and_exports(gemma3_folder, tmp_path):
    cfg = tiny_runs.tiny_config(tmp_path / "run", "grpo_vl_tiny.py", **{
        f"{ARR}.model.path": str(gemma3_folder), "data.tokenizer": str(gemma3_folder),
        f"{ARR}.model.use_remove_padding": True, "trainer.total_training_steps": 1, f"{ARR}.actor.optim.lr": 1e-2})
    trainer = Trainer(tiny_runs.with_reward_file(cfg, tmp_path))
    vision = trainer.generator.vision
    assert len(jax.devices()) == 8 and vision is not None and vision.tokens.fixed_tokens == 4
    assert trainer.actor.model_cfg.bidirectional_image_tokens == 4
    params = trainer.actor.model_params
    rollout = trainer.generator.generate(next(trainer.train_loader), params, trainer.spec.train_sampling,
                                         jax.random.key(0))
    images = rollout.images
    assert images is not None and ((np.asarray(images.slots) >= 0).sum(axis=1) == 4).all()
    on = np.asarray(rollout.response_mask) > 0
    sampled = np.asarray(rollout.rollout_log_probs)
    assert np.abs(np.asarray(trainer.log_probs(params, rollout)) - sampled)[on].max() < 1e-5
    before = jax.device_get(trainer.actor.params)
    metrics = trainer.step()
    assert metrics["rollout_corr/max_abs_log_ratio"] < 1e-5 and metrics["actor/grad_norm"] > 0
    after = jax.device_get(trainer.actor.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))

    # the trained policy exports with its tower: transformers reads the same logits on a prompt with its picture,
    # and the export reloads through the front door: a content list's picture and question, greedy through both
    # engines, are transformers.generate's tokens
    import torch

    def hf_inputs(ids: np.ndarray, pixels: np.ndarray, grid: np.ndarray) -> dict:
        return dict(input_ids=torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.int64),
                    pixel_values=torch.tensor(pixels),
                    token_type_ids=torch.tensor((ids == vision.vl.image_token_id).astype(np.int64)))

    reloaded = assert_export_reads_and_generates(trainer, trainer.export_hf(str(tmp_path / "hf")),
                                                 transformers.Gemma3ForConditionalGeneration,
                                                 jax.device_get(vision.params), hf_inputs)
    assert reloaded.vision.tokens.fixed_tokens == 4


def test_a_trained_gemma3_tower_moves_and_the_sampler_reads_it(gemma3_folder, tmp_path):
    # actor.freeze_vision_tower=False: SigLIP and the projector are the actor's params["vision"]
    cfg = tiny_runs.tiny_config(tmp_path / "run", "grpo_vl_tiny.py", **{
        f"{ARR}.model.path": str(gemma3_folder), "data.tokenizer": str(gemma3_folder),
        f"{ARR}.actor.freeze_vision_tower": False, "trainer.total_training_steps": 2, f"{ARR}.actor.optim.lr": 1e-2})
    trainer = Trainer(tiny_runs.with_reward_file(cfg, tmp_path))
    before = jax.device_get(trainer.actor.params["vision"])
    for _ in range(2):  # the second step samples with the tower the first one trained
        assert trainer.step()["rollout_corr/max_abs_log_ratio"] < 1e-5
    after = jax.device_get(trainer.actor.params["vision"])
    assert not np.array_equal(before["projector"]["kernel"], after["projector"]["kernel"])
    assert not np.array_equal(before["blocks"]["qkv"], after["blocks"]["qkv"])
