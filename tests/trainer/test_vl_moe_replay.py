"""Routing replay (`actor.router_replay='rollout'`) on a vision-language mixture-of-experts policy (a random tiny
`Qwen3VLMoeForConditionalGeneration` folder, SmolLM2's tokenizer given the vision tokens) on the synthetic picture
task, 8 devices, the paged engine: the rollout records each token's experts from the forward that reads the
prompt's image features and M-RoPE positions, the update replays them, and the sampled log-probs are the trainer's."""
import jax
import numpy as np
import pytest
import tiny_runs

from jaxrl_llm.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ARR = "actor_rollout_ref"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


@pytest.fixture(scope="module")
def qwen3_vl_moe_folder(tmp_path_factory, smollm2_gguf):
    from jaxrl_llm.hf import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_gguf))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
    start, end, image, video = (int(tokenizer.convert_tokens_to_ids(t)) for t in VISION_TOKENS)
    config = transformers.Qwen3VLMoeConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                           patch_size=16, num_position_embeddings=25, deepstack_visual_indexes=[0]),
        image_token_id=image, vision_start_token_id=start, vision_end_token_id=end, video_token_id=video,
        pad_token_id=tokenizer.pad_token_id or 0, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.normal_(0.0, 0.2)
    folder = tmp_path_factory.mktemp("qwen3_vl_moe_policy")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_grpo_replays_the_experts_the_rollout_recorded_with_images(qwen3_vl_moe_folder, tmp_path):
    cfg = tiny_runs.tiny_config(tmp_path / "run", "grpo_vl_tiny.py", **{
        f"{ARR}.model.path": str(qwen3_vl_moe_folder), "data.tokenizer": str(qwen3_vl_moe_folder),
        f"{ARR}.actor.router_replay": "rollout", "trainer.total_training_steps": 1, f"{ARR}.actor.optim.lr": 1e-2})
    trainer = Trainer(tiny_runs.with_reward_file(cfg, tmp_path))
    assert len(jax.devices()) == 8 and trainer.generator.vision is not None and trainer.actor.model_cfg.is_moe
    params = trainer.actor.model_params
    rollout = trainer.generator.generate(next(trainer.train_loader), params, trainer.spec.train_sampling,
                                         jax.random.key(0))
    assert rollout.images is not None and rollout.routing is not None
    on = np.asarray(rollout.response_mask) > 0
    replayed = np.asarray(trainer.log_probs(params, rollout))
    assert np.abs(replayed - np.asarray(rollout.rollout_log_probs))[on].max() < 1e-5
    metrics = trainer.step()
    assert metrics["rollout_corr/max_abs_log_ratio"] < 1e-5 and metrics["actor/grad_norm"] > 0
