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


GEMMA_IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")


def test_gemma3_prompts_and_pixels_are_its_processors(tmp_path, smollm2_tok):
    # a Gemma 3 folder's image: the blank lines, <start_of_image>, mm_tokens_per_image soft tokens, <end_of_image>
    # whatever its size, placed as transformers' Gemma3Processor places them after the chat template (so a template
    # that trims messages keeps them), pixels from its image processor; the folder's sizes read
    import copy
    import json

    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    from jaxrl_llm.data.vision_prompts import chat_with_images
    from jaxrl_llm.hf.tokenizer import render_chat

    tok = copy.deepcopy(smollm2_tok)
    tok.add_special_tokens({"additional_special_tokens": list(GEMMA_IMAGE_TOKENS)}, replace_extra_special_tokens=False)
    start, soft, end = (int(tok.convert_tokens_to_ids(t)) for t in GEMMA_IMAGE_TOKENS)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "image_token_index": soft,
                                                      "mm_tokens_per_image": 4, "vision_config": {"image_size": 56}}))
    tokens = image_tokens_of(str(tmp_path), tok)
    assert tokens is not None and (tokens.image_token_id, tokens.fixed_tokens, tokens.image_size) == (soft, 4, 56)
    assert tokens.tokens_for(640, 480) == tokens.tokens_for(20, 20) == 4
    picture = Image.open(io.BytesIO(png((60, 40), (200, 30, 30))))
    ours, _ = chat_with_images([{"role": "user", "content": "<image>How many?"}], tokens, tok, [picture])
    tok.boi_token, tok.image_token, tok.eoi_token = GEMMA_IMAGE_TOKENS  # what Gemma3Processor reads of Gemma's
    tok.boi_token_id, tok.image_token_id, tok.eoi_token_id = start, soft, end
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
                                tokenizer=tok, image_seq_length=4)
    text = render_chat(tok, [{"role": "user", "content": "<start_of_image>How many?"}], add_generation_prompt=True)
    theirs = processor(text=[text], images=[[picture]], return_tensors="np")
    np.testing.assert_array_equal(ours, theirs["input_ids"][0])
    np.testing.assert_array_equal(tokens.pixels([picture])[0], theirs["pixel_values"])
    # the records: the same ids from a veRL row
    path = tmp_path / "train.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "<image>How many?"}]],
                  "images": [[{"bytes": png((60, 40), (200, 30, 30))}]]}).to_parquet(path)
    data = build_dataset(data_spec(train_files=str(path), max_prompt_length=64), tok, "train", tokens)
    np.testing.assert_array_equal(data[0]["input_ids"], ours)


def test_gemma4_prompts_and_pixels_are_its_processors(tmp_path, smollm2_tok):
    # a Gemma 4 folder's image: its begin-of-image token, as many image tokens as Gemma4ImageProcessorPil's
    # aspect-preserving resize gives the image (transformers' Gemma4Processor puts num_soft_tokens_per_image of them
    # between the begin / end tokens; its video processor needs torchvision, so its rule is spelled out here), the
    # end token; the tokens' strings read from the tokenizer by the config's ids; the folder's processor sizes read
    import copy
    import json

    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.data.vision_prompts import chat_with_images
    from jaxrl_llm.hf.tokenizer import render_chat

    tok = copy.deepcopy(smollm2_tok)
    texts = ["<|image>", "<|image|>", "<image|>"]
    tok.add_special_tokens({"additional_special_tokens": texts}, replace_extra_special_tokens=False)
    start, image, end = (int(tok.convert_tokens_to_ids(t)) for t in texts)
    config = {"model_type": "gemma4", "image_token_id": image, "boi_token_id": start, "eoi_token_id": end,
              "text_config": {"hidden_size": 64}, "vision_config": {"hidden_size": 32, "num_attention_heads": 2}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 8, "max_soft_tokens": 140,
                                                                   "pooling_kernel_size": 3}))
    tokens = image_tokens_of(str(tmp_path), tok)
    assert tokens is not None and (tokens.start_text, tokens.pad_text, tokens.end_text) == tuple(texts)
    assert (tokens.patch_size, tokens.max_soft_tokens, tokens.pooling_kernel_size) == (8, 140, 3)
    processor = Gemma4ImageProcessorPil(patch_size=8, max_soft_tokens=140, pooling_kernel_size=3)
    for size in [(60, 40), (640, 480), (20, 300), (24, 24)]:
        picture = Image.open(io.BytesIO(png(size, (200, 30, 30))))
        theirs = processor(images=[picture], return_tensors="np")
        count = int(theirs["num_soft_tokens_per_image"][0])
        assert tokens.tokens_for(*size) == count <= 140
        pixels, grid = tokens.pixels([picture])
        np.testing.assert_array_equal(pixels, theirs["pixel_values"])
        assert int(grid[0].prod()) == int((theirs["image_position_ids"][0, :, 0] >= 0).sum())
        ours, _ = chat_with_images([{"role": "user", "content": "<image>How many?"}], tokens, tok, [picture])
        text = render_chat(tok, [{"role": "user", "content": texts[1] + "How many?"}], add_generation_prompt=True)
        expected = tok(text.replace(texts[1], texts[0] + texts[1] * count + texts[2]),
                       add_special_tokens=False)["input_ids"]
        np.testing.assert_array_equal(ours, expected)
    # a config whose image token the tokenizer lacks is refused by key
    (tmp_path / "config.json").write_text(json.dumps({**config, "boi_token_id": len(tok) + 5}))
    with pytest.raises(ConfigError, match="boi_token_id"):
        image_tokens_of(str(tmp_path), tok)
