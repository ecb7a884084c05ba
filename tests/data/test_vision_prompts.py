"""A vision-language policy's prompts (data/vision_prompts.py): each `<image>` becomes the model's vision tokens,
repeated once per merged block of the image as the HF processor resizes it; the count is in max_prompt_length;
the records keep the images; the pixels are the processor's."""
import io

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from spec_helpers import data_spec

from jaxrl_llm.data import DataError, build_dataset
from jaxrl_llm.data.loader import collate
from jaxrl_llm.data.vision_prompts import ImageTokens, expand_image_tokens, with_image_tokens
from jaxrl_llm.roles.vision import image_tokens_of, with_vision_tokens


def png(size, colour=(0, 0, 255)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vl_tok(smollm2_tok):
    return with_vision_tokens("tiny:qwen2_5_vl", smollm2_tok)


@pytest.mark.parametrize("size", [(112, 112), (100, 60), (30, 500), (1000, 800), (20, 20)])
def test_image_token_counts_are_the_processors(size):
    tokens = ImageTokens(image_token_id=7, max_pixels=28 * 28 * 256)
    pixels, grid = tokens.pixels([png(size)])
    (t, h, w), = grid.tolist()
    assert t == 1 and pixels.shape == (t * h * w, 3 * 2 * 14 * 14)
    assert tokens.tokens_for(*size) == h * w // 4  # merged 2 x 2 blocks
    assert tokens.tokens_for(1000, 800) <= 256  # max_pixels bounds the tokens


def test_placeholders_become_the_vision_tokens():
    ph = "<|vision_start|><|image_pad|><|vision_end|>"
    assert with_image_tokens("a <image> b", ph) == f"a {ph} b"
    content = [{"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "q<image>"}]}]
    assert with_image_tokens(content, ph) == [{"role": "user", "content": f"{ph}q{ph}"}]
    ids = np.asarray([1, 9, 2, 9, 3])
    assert expand_image_tokens(ids, [2, 3], 9, "r").tolist() == [1, 9, 9, 2, 9, 9, 9, 3]
    with pytest.raises(DataError, match=r"^r: the rendered prompt holds 2 image token\(s\) \(id 9\) for 1 image"):
        expand_image_tokens(ids, [2], 9, "r")


def test_records_hold_the_image_tokens_and_their_images(tmp_path, vl_tok):
    path = tmp_path / "train.parquet"
    prompts = [[{"role": "user", "content": "<image>How many?"}], [{"role": "user", "content": "plain text"}],
               [{"role": "user", "content": "<image>and<image>?"}]]
    images = [[{"bytes": png((112, 112))}], [], [{"bytes": png((56, 112))}, {"bytes": png((112, 112))}]]
    pd.DataFrame({"prompt": prompts, "images": images}).to_parquet(path)
    tokens = image_tokens_of("tiny:qwen2_5_vl", vl_tok)
    assert tokens is not None and tokens.image_token_id == vl_tok.convert_tokens_to_ids("<|image_pad|>")
    data = build_dataset(data_spec(train_files=str(path), max_prompt_length=128), vl_tok, "train", tokens)
    start, end = (vl_tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    for i, counts in enumerate([[16], [], [8, 16]]):
        ids = np.asarray(data[i]["input_ids"])
        assert (ids == tokens.image_token_id).sum() == sum(counts)
        assert (ids == start).sum() == (ids == end).sum() == len(counts)
        runs = np.split(ids, np.flatnonzero(ids == start) + 1)[1:]  # each image's run after its start token
        assert [int((r[:list(r).index(end)] == tokens.image_token_id).sum()) for r in runs] == counts
        assert len(data[i].get("images", [])) == len(counts)
    batch = collate([data[0], data[1], data[2]])
    assert [len(row) for row in batch["images"]] == [1, 0, 2]
    # the image tokens count in max_prompt_length: never truncated, dropped with filter_overlong_prompts
    short = len(data[0]["input_ids"]) - 1
    with pytest.raises(DataError, match=r"row 0: the prompt is \d+ tokens with its 16 image tokens, more than "
                                        rf"data.max_prompt_length={short}"):
        build_dataset(data_spec(train_files=str(path), max_prompt_length=short), vl_tok, "train", tokens)
    kept = build_dataset(data_spec(train_files=str(path), max_prompt_length=short, filter_overlong_prompts=True),
                         vl_tok, "train", tokens)
    assert len(kept) == 1 and "images" not in kept[0]  # only the text row fits


def test_a_model_folder_and_its_tokenizer_must_agree_on_the_image_token(tmp_path, vl_tok):
    import json

    from jaxrl_llm.config import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "image_token_id": 5}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 200704}))
    with pytest.raises(ConfigError, match=r"the tokenizer's '<\|image_pad\|>' is id \d+, the model's image token is 5"):
        image_tokens_of(str(tmp_path), vl_tok)
    pad = vl_tok.convert_tokens_to_ids("<|image_pad|>")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "image_token_id": pad}))
    tokens = image_tokens_of(str(tmp_path), vl_tok)
    assert tokens is not None and tokens.max_pixels == 200704 and tokens.image_token_id == pad
    assert image_tokens_of("tiny:qwen2", vl_tok) is None
