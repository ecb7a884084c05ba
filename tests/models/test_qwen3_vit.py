"""Qwen3-VL's vision tower (models/vision/qwen3_vit.py) against transformers' `Qwen3VLVisionModel`: the merger's
features and the deepstack features within 1e-5 in fp32, image by image as the whole batch; the learned position
embeddings' resampling, the deepstack mergers and GELU's tanh form each matter."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxrl_llm.models.vision.qwen3_vit import (  # noqa: E402
    Qwen3VisionConfig,
    qwen3_image_features,
    qwen3_layout,
    qwen3_vision_features,
    qwen3_vision_params_from_hf,
)

GRIDS = np.array([[1, 4, 6], [1, 8, 4], [1, 2, 2]])  # a 6-wide image, a tall one, one merge block


@pytest.fixture(scope="module")
def tower():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(0)
    hf = Qwen3VLVisionConfig(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                             patch_size=16, num_position_embeddings=25, deepstack_visual_indexes=[0, 2])
    hf._attn_implementation = "eager"
    model = Qwen3VLVisionModel(hf).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    cfg = Qwen3VisionConfig.from_hf(hf.to_dict())
    params = qwen3_vision_params_from_hf({k: v.numpy() for k, v in model.state_dict().items()}, cfg)
    return model, cfg, params


def test_features_and_deepstack_match_transformers(tower):
    model, cfg, params = tower
    rng = np.random.default_rng(0)
    pixels = rng.normal(size=(int(GRIDS.prod(-1).sum()), cfg.patch_dim)).astype(np.float32)
    with torch.no_grad():
        out = model(torch.from_numpy(pixels), grid_thw=torch.from_numpy(GRIDS))
    expected = np.stack([out.pooler_output.numpy(), *[d.numpy() for d in out.deepstack_features]])
    assert expected.shape == (3, int(GRIDS.prod(-1).sum()) // 4, 64)
    whole = np.asarray(qwen3_vision_features(params, cfg, pixels, qwen3_layout(cfg, GRIDS)))
    np.testing.assert_allclose(whole, expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(qwen3_image_features(params, cfg, pixels, GRIDS)), expected, atol=1e-5,
                               rtol=1e-5)
    # each trait moves the features: no position embeddings, the deepstack features read elsewhere
    grid, index, weight = qwen3_layout(cfg, GRIDS)
    flat = np.asarray(qwen3_vision_features(params, cfg, pixels, (grid, index, np.zeros_like(weight))))
    assert np.abs(flat - expected).max() > 1e-3
    assert np.abs(whole[1] - whole[2]).max() > 1e-3
