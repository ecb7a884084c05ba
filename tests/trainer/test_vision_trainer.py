"""GRPO with a vision-language policy (tiny:qwen2_5_vl, configs/grpo_vl_tiny.py) on 8 devices: the frozen tower's
features reach the sampler's prefill (static sampler; paged engine) and, row by row, every trainer pass (old
log-probs, the update; unpacked, and packed with shared prompts), so the sampled log-probs are the trainer's; without
the images the trainer reads other log-probs; the update trains the text model (all of it; LoRA adapters); the
trained policy exports with its tower, a checkpoint converts with it; 8 devices equal 1, resume equals
uninterrupted; a vision-language run refuses what does not read images yet, by key."""
import dataclasses

import jax
import numpy as np
import pytest
import tiny_runs
from vl_cases import assert_export_reads_and_generates

from jaxrl_llm.config import ConfigError
from jaxrl_llm.trainer import Trainer

pytestmark = pytest.mark.usefixtures("smollm2_gguf")  # the tiny run's tokenizer
ARR = "actor_rollout_ref"


def vl_config(run_dir, tmp_path, **overrides):
    """configs/grpo_vl_tiny.py with a reward a random model earns sometimes (tests/tiny_runs.py REWARD_FILE)."""
    cfg = tiny_runs.tiny_config(run_dir, "grpo_vl_tiny.py", **{"trainer.total_training_steps": 2,
                                                               f"{ARR}.actor.optim.lr": 1e-2, **overrides})
    return tiny_runs.with_reward_file(cfg, tmp_path)


@pytest.fixture(scope="module", params=[("static", False), ("paged", True)], ids=["static", "paged_packed"])
def trainer(request, tmp_path_factory):
    engine, packed = request.param
    tmp = tmp_path_factory.mktemp(f"vl_{engine}")
    lora = {f"{ARR}.model.lora_rank": 8, f"{ARR}.model.lora_alpha": 16} if packed else {}
    return Trainer(vl_config(tmp / "run", tmp, **{f"{ARR}.rollout.engine": engine,
                                                  f"{ARR}.model.use_remove_padding": packed, **lora}))


def test_sampler_and_trainer_read_the_same_images(trainer):
    assert len(jax.devices()) == 8 and trainer.generator.vision is not None
    assert trainer.generator.engine_for(8).engine == trainer.spec.rollout_engine.engine
    params = trainer.actor.model_params
    rollout = trainer.generator.generate(next(trainer.train_loader), params, trainer.spec.train_sampling,
                                         jax.random.key(0))
    images = rollout.images
    assert images is not None
    rows, columns = rollout.input_ids.shape
    assert images.positions.shape == (rows, 3, columns) and images.slots.shape == (rows, columns)
    assert images.features.shape == (rows, 16, trainer.actor.model_cfg.hidden_size)  # 112 x 112: 16 features
    assert ((np.asarray(images.slots) >= 0).sum(axis=1) == 16).all()
    assert images.features.sharding.spec[0] is not None  # rows sharded as the batch's other arrays
    on = np.asarray(rollout.response_mask) > 0
    sampled = np.asarray(rollout.rollout_log_probs)
    recomputed = np.asarray(trainer.log_probs(params, rollout))
    assert np.abs(recomputed - sampled)[on].max() < 1e-5
    # the image tokens' embeddings, not the features: another distribution
    blind = np.asarray(trainer.log_probs(params, dataclasses.replace(rollout, images=None)))
    assert np.abs(blind - sampled)[on].max() > 1e-3


def test_a_step_updates_the_text_model_on_rows_with_images(trainer):
    before = jax.device_get(trainer.actor.params)  # the text model, or its LoRA adapters
    metrics = trainer.step()
    assert metrics["rollout_corr/max_abs_log_ratio"] < 1e-5
    assert metrics["actor/grad_norm"] > 0 and 0 < metrics["critic/score/mean"] < 1  # a learning signal
    assert metrics["prompt_length/mean"] > 16  # the 16 image tokens count as prompt tokens
    after = jax.device_get(trainer.actor.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


@pytest.mark.parametrize("key,value,named", [
    ("algorithm.distillation.enable", True, "distillation.enable=True"),
    ("critic.enable", True, "critic.model.path='tiny:qwen2' \\(a critic of another model"),
])
def test_what_does_not_read_images_yet_is_refused_by_key(tmp_path, key, value, named):
    overrides = {key: value}
    if key == "critic.enable":
        overrides.update({"algorithm.adv_estimator": "gae", "critic.model.path": "tiny:qwen2"})
    if key == "algorithm.distillation.enable":
        overrides.update({"algorithm.distillation.teacher.path": "tiny:qwen2_5_vl"})
    cfg = tiny_runs.tiny_config(tmp_path / "run", "grpo_vl_tiny.py", **overrides)
    with pytest.raises(ConfigError, match=rf"{named}.*: a vision-language policy \(tiny:qwen2_5_vl\)"):
        Trainer(cfg)


def test_a_text_policy_refuses_the_picture_task(tmp_path):
    cfg = tiny_runs.tiny_config(tmp_path / "run", "grpo_vl_tiny.py", **{f"{ARR}.model.path": "tiny:qwen2"})
    with pytest.raises(ConfigError, match=r"data.synthetic.task='shapes': its prompts are pictures, and the policy "
                                          r"\(tiny:qwen2\) reads text only"):
        Trainer(cfg)


def test_the_trained_policy_exports_with_its_tower_and_transformers_reads_it(trainer, tmp_path):
    # transformers reads the actor's logits on a prompt with its picture, and the export reloads through the front
    # door with its tower: a content list's picture and question, greedy through both engines, are
    # transformers.generate's tokens
    import torch
    import transformers

    image_token = trainer.generator.vision.vl.image_token_id

    def hf_inputs(ids: np.ndarray, pixels: np.ndarray, grid: np.ndarray) -> dict:
        return dict(input_ids=torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.int64),
                    pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grid),
                    mm_token_type_ids=torch.tensor((ids == image_token).astype(np.int64)))

    assert_export_reads_and_generates(trainer, trainer.export_hf(str(tmp_path / "hf")),
                                      transformers.Qwen2_5_VLForConditionalGeneration,
                                      jax.device_get(trainer.generator.vision.params), hf_inputs)


def test_eight_devices_equal_one_resume_equals_uninterrupted_and_the_checkpoint_converts(tmp_path):
    import transformers

    from jaxrl_llm.hf.vision import load_vision_tower

    one = tmp_path / "one"
    Trainer(vl_config(one, tmp_path, **{"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1})).fit()
    full = tmp_path / "full"
    trainer = Trainer(vl_config(full, tmp_path, **{"trainer.save_freq": 1, "mesh.data": 2, "mesh.fsdp": 4}))
    trainer.fit()
    a, b = tiny_runs.read_metrics(one), tiny_runs.read_metrics(full)
    for step in (1, 2):
        want, got = tiny_runs.step_numbers(a, step), tiny_runs.step_numbers(b, step)
        # the sampler / trainer mismatch is rounding (asserted small), and the engine's page counts follow its pool,
        # sized per mesh: no numbers to match
        assert got["rollout_corr/max_abs_log_ratio"] < 1e-5 and want["rollout_corr/max_abs_log_ratio"] < 1e-5
        for k in {k for k in want if not k.startswith(("rollout_corr/", "rollout/engine/"))}:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=2e-5, err_msg=f"step {step} {k}")
    tiny_runs.assert_resume_equals_uninterrupted(
        lambda d, n, **kw: Trainer(vl_config(d, tmp_path, **{"trainer.total_training_steps": n, "mesh.data": 2,
                                                             "mesh.fsdp": 4, **kw})), full, tmp_path / "resumed",
        steps=2)
    # the checkpoint converts with the run's tower: what transformers loads as Qwen2.5-VL
    assert tiny_runs.load_convert_to_hf().main(["--input", str(full), "--output", str(tmp_path / "hf")]) == 0
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").model_type == "qwen2_5_vl"
    _, tower = load_vision_tower(tmp_path / "hf")
    jax.tree.map(np.testing.assert_array_equal, tower, jax.device_get(trainer.generator.vision.params))


def test_the_memory_plan_holds_the_tower_and_the_image_rows(trainer):
    from jaxrl_llm.models.vision.qwen_vl import feature_bucket
    from jaxrl_llm.planning.context import device_state_bytes, make_context

    state = device_state_bytes(make_context(trainer.spec, trainer.mesh, trainer.tokenizer))
    tower = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(trainer.generator.vision.params))
    assert state["vision_tower"] == tower  # replicated: all of it on every device
    bp = trainer.spec.plan
    rows, columns = bp.sequences // 8, bp.max_prompt_length + bp.response_length
    room = feature_bucket(bp.max_prompt_length)  # worst case: every prompt token an image token
    # int32 positions [3, T] and slots [T], fp32 features [K, H] per row
    assert state["image_rows"] == rows * (4 * 4 * columns + 4 * room * trainer.actor.model_cfg.hidden_size)
    # the policy's passes are compiled with the rows' images as inputs (their gathers in the plan's temporaries)
    from jaxrl_llm.planning.programs import actor_update_program, old_log_prob_program, ref_program

    ctx = make_context(trainer.spec, trainer.mesh, trainer.tokenizer)
    features = (bp.sequences, room, trainer.actor.model_cfg.hidden_size)
    programs = [p for p in (old_log_prob_program(ctx), ref_program(ctx)) if p is not None]
    for program in [*programs, actor_update_program(ctx)]:
        shapes = [tuple(a.shape) for a in jax.tree.leaves(program.lower(bp).args_info) if hasattr(a, "shape")]
        assert features in shapes, program.name


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_multi_turn_conversations_keep_their_images(tmp_path, engine):
    # the guessing game's turns on picture prompts: every continuation prefills the prompt's image features at its
    # M-RoPE positions and the later turns at their positions plus the prompt's delta, so each model turn's sampled
    # log-probs are the trainer's on the whole conversation with its images
    (tmp_path / "guess.yaml").write_text(tiny_runs.GUESS_YAML)
    mt = f"{ARR}.rollout.multi_turn"
    trainer = Trainer(vl_config(tmp_path / "run", tmp_path, **{
        f"{mt}.enable": True, f"{mt}.interaction_config_path": str(tmp_path / "guess.yaml"),
        f"{mt}.max_assistant_turns": 3, "data.max_response_length": 48, "data.max_prompt_length": 128,
        f"{ARR}.rollout.stop_token_ids": list(range(49152)),  # one-token turns: the environment always replies
        f"{ARR}.rollout.engine": engine, f"{ARR}.model.use_remove_padding": engine == "paged"}))
    rollout = trainer.generator.generate(next(trainer.train_loader), trainer.actor.model_params,
                                         trainer.spec.train_sampling, jax.random.key(0))
    assert rollout.images is not None and rollout.reward_metrics["multi_turn/model_tokens/mean"] >= 2.0  # continued
    on = np.asarray(rollout.response_mask) > 0
    sampled = np.asarray(rollout.rollout_log_probs)
    recomputed = np.asarray(trainer.log_probs(trainer.actor.model_params, rollout))
    np.testing.assert_allclose(sampled[on], recomputed[on], atol=1e-5, rtol=0)
    blind = np.asarray(trainer.log_probs(trainer.actor.model_params, dataclasses.replace(rollout, images=None)))
    assert np.abs(blind - sampled)[on].max() > 1e-3


def test_ngram_speculative_rollouts_read_the_images(tmp_path):
    # prompt-lookup drafts verified by the policy's own forward over the slots' pages: a verified token's log-prob is
    # the trainer's on the rows with their images (the verification applies each slot's M-RoPE delta)
    trainer = Trainer(vl_config(tmp_path / "run", tmp_path, **{
        f"{ARR}.rollout.engine": "paged", f"{ARR}.rollout.speculative.method": "ngram",
        f"{ARR}.rollout.speculative.num_tokens": 3}))
    rollout = trainer.generator.generate(next(trainer.train_loader), trainer.actor.model_params,
                                         trainer.spec.train_sampling, jax.random.key(0))
    on = np.asarray(rollout.response_mask) > 0
    recomputed = np.asarray(trainer.log_probs(trainer.actor.model_params, rollout))
    np.testing.assert_allclose(np.asarray(rollout.rollout_log_probs)[on], recomputed[on], atol=1e-5, rtol=0)


def test_a_critic_of_the_policys_folder_reads_the_images(tmp_path):
    # PPO with a critic (GAE): the critic is the policy's model with a value head, so the rows' features (its own
    # frozen tower's) reach its values and its update
    from jaxrl_llm.batching.ops import run_no_grad_pass
    from jaxrl_llm.roles.experience import values_no_grad

    trainer = Trainer(vl_config(tmp_path / "run", tmp_path, **{
        "algorithm.adv_estimator": "gae", "critic.enable": True, "critic.model.path": "tiny:qwen2_5_vl"}))
    rollout = trainer.generator.generate(next(trainer.train_loader), trainer.actor.model_params,
                                         trainer.spec.train_sampling, jax.random.key(0))
    rows = trainer.batching.rows_of(rollout)
    how = trainer.batching.no_grad(trainer.spec.plan.values, trainer.critic.model, rows)
    values = {blind: np.asarray(run_no_grad_pass(
        values_no_grad, trainer.critic.params, rollout.input_ids, rollout.attention_mask, rollout.response_mask, how,
        images=None if blind else rollout.images, model_cfg=trainer.critic.model_cfg,
        compute_dtype="float32")) for blind in (False, True)}
    on = np.asarray(rollout.response_mask) > 0
    assert np.abs(values[False] - values[True])[on].max() > 1e-4  # the images move the values
    metrics = trainer.step()
    assert np.isfinite(metrics["critic/vf_loss"]) and metrics["critic/grad_norm"] > 0


def test_partial_rollouts_resume_samples_with_their_images(tmp_path):
    # paused samples resume at the next step as their prompt (its images) + their tokens so far: each resumed
    # token's log-prob is the trainer's (a learning rate of 1e-12: the policy stays put, no staleness to weigh)
    key = f"{ARR}.rollout.partial"
    trainer = Trainer(vl_config(tmp_path / "run", tmp_path, **{
        f"{key}.enable": True, f"{key}.max_staleness": 1, "trainer.total_training_steps": 3,
        f"{ARR}.rollout.engine": "paged", f"{ARR}.rollout.max_num_seqs": 4, f"{ARR}.actor.optim.lr": 1e-12,
        f"{ARR}.rollout.stop_token_ids": list(range(0, 49152, 5)), "data.synthetic.n_train": 24}))
    trainer.fit()
    rows = tiny_runs.read_metrics(tmp_path / "run")
    assert sum(r["rollout/partial/resumed"] for r in rows) > 0
    assert all(r["rollout_corr/max_abs_log_ratio"] < 1e-5 for r in rows), [r["rollout_corr/max_abs_log_ratio"]
                                                                          for r in rows]
