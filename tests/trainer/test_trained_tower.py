"""A trained vision tower (`actor.freeze_vision_tower=False`, veRL's default; tiny:qwen2_5_vl on 8 devices, packed
rows): the tower is the actor's params["vision"], so the update moves it, the next rollout's sampler reads it (the
sampled log-probs stay the trainer's), a checkpoint resumes it, and the export and the checkpoint's conversion carry
the trained tower; LoRA on it trains adapters on its blocks instead; what does not go with it yet is refused by key;
the memory plan holds the tower's moments and the rows' pixels."""
import jax
import numpy as np
import pytest
import tiny_runs

from jaxrl_llm.config import ConfigError
from jaxrl_llm.trainer import Trainer

pytestmark = pytest.mark.usefixtures("smollm2_gguf")
ARR = "actor_rollout_ref"


def config(run_dir, tmp_path, **overrides):
    cfg = tiny_runs.tiny_config(run_dir, "grpo_vl_tiny.py", **{
        "trainer.total_training_steps": 2, f"{ARR}.actor.optim.lr": 1e-2, f"{ARR}.actor.freeze_vision_tower": False,
        f"{ARR}.model.use_remove_padding": True, "mesh.data": 2, "mesh.fsdp": 4, **overrides})
    return tiny_runs.with_reward_file(cfg, tmp_path)


def test_the_tower_trains_resumes_and_exports(tmp_path):
    import transformers

    from jaxrl_llm.hf.vision import load_vision_tower

    full = tmp_path / "full"
    trainer = Trainer(config(full, tmp_path, **{"trainer.save_freq": 1}))
    initial = jax.device_get(trainer.generator.vision.params)
    assert trainer.generator.vision.trained and "vision" in trainer.actor.params
    # split over 'fsdp' as the text model's weights are (roles/vision.py tower_shardings): each device holds
    # 1 / fsdp of the block kernels (and of their Adam moments)
    qkv, split = trainer.actor.params["vision"]["blocks"]["qkv"], trainer.mesh.shape["fsdp"]
    assert split > 1 and "fsdp" in qkv.sharding.spec and qkv.addressable_shards[0].data.size * split == qkv.size
    rollout = trainer.generator.generate(next(trainer.train_loader), trainer.actor.model_params,
                                         trainer.spec.train_sampling, jax.random.key(0))
    assert rollout.images is not None and rollout.images.tower is not None  # each row's pixels
    trainer.fit()
    for row in tiny_runs.read_metrics(full):  # step 2 samples with the tower step 1 trained
        assert row["rollout_corr/max_abs_log_ratio"] < 1e-5, row["step"]
    trained = jax.device_get(trainer.actor.params["vision"])
    moved = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(trained))]
    assert min(moved) > 0  # every tower weight took gradient steps
    tiny_runs.assert_resume_equals_uninterrupted(
        lambda d, n, **kw: Trainer(config(d, tmp_path, **{"trainer.total_training_steps": n, **kw})), full,
        tmp_path / "resumed", steps=2)
    # the export and the checkpoint's conversion write the trained tower, which transformers reads
    for out in (trainer.export_hf(str(tmp_path / "export")), tmp_path / "converted"):
        if out == tmp_path / "converted":
            assert tiny_runs.load_convert_to_hf().main(["--input", str(full), "--output", str(out)]) == 0
        assert transformers.AutoConfig.from_pretrained(out).model_type == "qwen2_5_vl"
        _, tower = load_vision_tower(out)
        jax.tree.map(np.testing.assert_array_equal, tower, trained)


def test_the_memory_plan_holds_the_trained_tower_and_the_rows_pixels(tmp_path):
    from jaxrl_llm.planning.context import device_state_bytes, make_context
    from jaxrl_llm.planning.programs import actor_update_program

    trainer = Trainer(config(tmp_path / "run", tmp_path, **{"trainer.total_training_steps": 1}))
    ctx = make_context(trainer.spec, trainer.mesh, trainer.tokenizer)
    assert "vision" in ctx.states["actor_params"] and "vision_tower" not in ctx.states
    tower = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.generator.vision.params))
    moments = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ctx.states["actor_opt"]) if x.ndim)
    assert moments >= 2 * tower  # Adam's two moments of the tower too
    planned = ctx.states["actor_params"]["vision"]["blocks"]["qkv"]
    assert planned.sharding == trainer.actor.params["vision"]["blocks"]["qkv"].sharding  # planned where it lives
    pixels = ctx.states["image_rows"]["tower"].pixels
    assert pixels.shape[0] == trainer.spec.plan.sequences and device_state_bytes(ctx)["image_rows"] > 0
    shapes = [tuple(a.shape) for a in jax.tree.leaves(actor_update_program(ctx).lower(trainer.spec.plan).args_info)
              if hasattr(a, "shape")]
    assert tuple(pixels.shape) in shapes  # the update is compiled with the rows' pixels, through the tower


def test_lora_on_the_tower_trains_its_adapters_not_its_weights(tmp_path):
    # lora_rank > 0 with the tower trained: adapters on the tower's block projections beside the text model's
    # (models/vision/tower_lora.py); the tower's own weights stay the base's, the sampler reads base + adapters
    # (the sampled log-probs stay the trainer's), and the export and the checkpoint's conversion write the merged tower
    from jaxrl_llm.hf.vision import load_vision_tower
    from jaxrl_llm.models.vision.tower_lora import merged_tower

    run = tmp_path / "run"
    trainer = Trainer(config(run, tmp_path, **{f"{ARR}.model.lora_rank": 4, f"{ARR}.model.lora_alpha": 8,
                                               f"{ARR}.model.target_modules": "all-linear",
                                               "trainer.save_freq": 2}))
    base = jax.device_get(trainer.actor.frozen["vision"])
    adapters = trainer.actor.params["lora"]["vision"]["blocks"]
    assert sorted(adapters) == ["down_proj", "gate_proj", "proj", "qkv", "up_proj"]
    assert adapters["qkv"]["A"].shape[-1] == 4
    from jaxrl_llm.planning.context import make_context  # the plan holds the tower's adapters where they live

    planned = make_context(trainer.spec, trainer.mesh, trainer.tokenizer).states["actor_params"]["lora"]["vision"]
    shapes = lambda tree: jax.tree.map(lambda x: x.shape, tree)  # noqa: E731
    assert shapes(planned) == shapes(trainer.actor.params["lora"]["vision"])
    trainer.fit()
    for row in tiny_runs.read_metrics(run):  # step 2 samples with the adapters step 1 trained
        assert row["rollout_corr/max_abs_log_ratio"] < 1e-5, row["step"]
    trained = jax.device_get(trainer.actor.params["lora"]["vision"])
    assert all(np.abs(np.asarray(a["B"])).max() > 0 for a in trained["blocks"].values())  # B left zero: moved
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.actor.frozen["vision"]), base)
    expected = jax.device_get(merged_tower(base, trained, 2.0))
    for out in (trainer.export_hf(str(tmp_path / "export")), tmp_path / "converted"):
        if out == tmp_path / "converted":
            assert tiny_runs.load_convert_to_hf().main(["--input", str(run), "--output", str(out)]) == 0
        _, tower = load_vision_tower(out)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), tower, expected)


@pytest.mark.parametrize("overrides,named", [
    ({"algorithm.filter_groups.enable": True}, "filter_groups.enable=True"),
    ({"algorithm.adv_estimator": "gae", "critic.enable": True, "critic.model.path": "tiny:qwen2_5_vl"},
     "critic.enable=True"),
])
def test_what_a_trained_tower_does_not_go_with_yet_is_refused_by_key(tmp_path, overrides, named):
    with pytest.raises(ConfigError, match=rf"freeze_vision_tower=False with .*{named}"):
        Trainer(config(tmp_path / "run", tmp_path, **overrides))
