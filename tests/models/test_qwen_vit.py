"""Qwen2.5-VL's vision tower (models/vision/qwen_vit.py) against transformers' on images of several sizes through
the HF image processor: features within 1e-5 (fp32); window attention, the window order and the merger each
matter (dropping one moves the features)."""
import dataclasses

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxrl_llm.models.vision.qwen_vit import (  # noqa: E402
    VisionConfig,
    image_features,
    vision_features,
    vision_layout,
    vision_params_from_hf,
)

TINY = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=40, window_size=56,
            fullatt_block_indexes=[1, 3], patch_size=14, temporal_patch_size=2, spatial_merge_size=2)


@pytest.fixture(scope="module")
def tower():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    config = Qwen2_5_VLVisionConfig(**TINY)
    config._attn_implementation = "eager"
    model = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    with torch.no_grad():  # random norms and biases too: a dropped weight shows
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model, VisionConfig.from_hf(config.to_dict())


def pictures(seed=0):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(seed)
    # 84 x 56 -> 4 x 6 patches (one window of 2 x 2 merged blocks plus a partial one), 56 x 112 -> 8 x 4, 140 x 140
    sizes = [(84, 56), (56, 112), (140, 140)]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    out = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 64)(images=images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def test_features_match_transformers(tower):
    model, cfg = tower
    pixels, grid = pictures()
    with torch.no_grad():
        expected = model(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grid)).pooler_output.numpy()
    params = vision_params_from_hf({k: v.numpy() for k, v in model.state_dict().items()}, cfg)
    layout = vision_layout(cfg, grid)
    got = np.asarray(vision_features(params, cfg, pixels, layout))
    assert got.shape == expected.shape == (int(grid.prod(-1).sum()) // 4, 40)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    # each trait matters: every block attending to the whole image, or no window order (the merger's groups
    # then straddle windows differently only through attention) move the features
    full = dataclasses.replace(cfg, fullatt_block_indexes=tuple(range(cfg.depth)))
    assert np.abs(np.asarray(vision_features(params, full, pixels, layout)) - expected).max() > 1e-3
    plain = layout._replace(window=layout.frame)
    assert np.abs(np.asarray(vision_features(params, cfg, pixels, plain)) - expected).max() > 1e-3
    unordered = layout._replace(restore=np.arange(len(layout.restore)))
    assert np.abs(np.asarray(vision_features(params, cfg, pixels, unordered)) - expected).max() > 1e-3
    # image by image (24, 32 and 100 patches padded to 32, 32 and 128; the two 32s in one call): the same features
    np.testing.assert_allclose(np.asarray(image_features(params, cfg, pixels, grid)), expected, atol=1e-5, rtol=1e-5)


def test_layout_windows_follow_the_window_size(tower):
    _, cfg = tower
    grid = np.array([[1, 4, 6], [1, 8, 4]])
    layout = vision_layout(cfg, grid)
    # image 1: 2 x 3 merged blocks, windows of 2 x 2 blocks -> 2 windows (4 + 2 blocks); image 2: 4 x 2 -> 2 windows
    sizes = np.bincount(layout.window) // cfg.merge_unit
    assert sizes.tolist() == [4, 2, 4, 4]
    assert sorted(layout.order.tolist()) == list(range(int(grid.prod(-1).sum())))
    assert np.bincount(layout.frame).tolist() == [24, 32]
    with pytest.raises(ValueError, match="not a multiple of spatial_merge_size=2"):
        vision_layout(cfg, np.array([[1, 3, 4]]))
