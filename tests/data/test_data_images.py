"""veRL's multimodal rows (data/images.py): images decode and match the prompt's placeholders, each bad row a
DataError naming file, row and image; rows with images are refused (no vision-language policy yet) instead of
being trained as text; the synthetic `shapes` task's pictures hold what their answers say."""
import io

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from spec_helpers import data_spec

from jaxrl_llm.data import DataError, build_dataset
from jaxrl_llm.data.images import count_placeholders, decode_image, load_image, row_images
from jaxrl_llm.data.sources import RowRef


def png(colour=(255, 0, 0), size=(8, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def question(n_images: int = 1) -> list[dict]:
    return [{"role": "user", "content": "<image>" * n_images + "What colour is it?"}]


def test_every_image_form_decodes_to_rgb(tmp_path):
    (tmp_path / "pics").mkdir()
    Image.new("L", (5, 5), 128).save(tmp_path / "pics" / "grey.png")
    ref = RowRef(str(tmp_path / "train.parquet"), 3)
    forms = [png(), {"bytes": png()}, {"path": "pics/grey.png"}, "pics/grey.png", str(tmp_path / "pics/grey.png"),
             Image.new("RGBA", (4, 4)), np.zeros((3, 2, 3), np.uint8)]
    row = {"images": forms}
    sources = row_images(row, question(len(forms)), ref, "images", "videos")
    images = [load_image(s) for s in sources]
    assert all(im.mode == "RGB" for im in images)
    assert images[0].size == (8, 6) and images[0].getpixel((0, 0)) == (255, 0, 0)
    assert images[2].getpixel((0, 0)) == (128, 128, 128)  # read from the data file's folder, greyscale -> RGB
    assert sources[2] == {"path": str(tmp_path / "pics/grey.png")}  # kept encoded, the path made absolute
    assert images[6].size == (2, 3)


def test_hf_content_lists_count_and_carry_their_images():
    prompt = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (2, 2))},
                                           {"type": "text", "text": "and <image> here"}]}]
    assert count_placeholders(prompt) == 2
    assert count_placeholders("a <image> b <image>") == 2
    with pytest.raises(DataError, match=r"has 2 image placeholder\(s\).*the prompt's image entries holds 1"):
        row_images({}, prompt, "rows[0]", "images", "videos")
    one = [{"role": "user", "content": [prompt[0]["content"][0], {"type": "text", "text": "what is it?"}]}]
    assert len(row_images({}, one, "r", "images", "videos")) == 1


@pytest.mark.parametrize("images,why", [
    ([{"bytes": png()[:20]}], r"row 1: image 0 of column 'images' \(data.image_key\): cannot decode the image"),
    ([{"bytes": b"not an image"}], r"row 1: image 0 of column 'images' .*cannot decode"),
    ([{"path": "missing.png"}], r"row 1: image 0 .*image file 'missing.png' not found"),
    ([{"url": "x"}], r"row 1: image 0 .*needs 'bytes' or 'path'"),
    ([{"bytes": png()}] * 2, r"row 1: the prompt has 1 image placeholder\(s\) .* holds 2 image\(s\)"),
    ([], r"row 1: the prompt has 1 image placeholder\(s\) .* holds 0 image\(s\)"),
])
def test_bad_image_rows_name_file_row_and_image(tmp_path, char_tok, images, why):
    path = tmp_path / "train.parquet"
    # row 0 a text row (a good image row would be refused first: no vision-language policy)
    pd.DataFrame({"prompt": [[{"role": "user", "content": "text"}], question()],
                  "images": [[], images]}).to_parquet(path)
    with pytest.raises(DataError, match=r"train\.parquet " + why):
        build_dataset(data_spec(train_files=str(path), max_prompt_length=64), char_tok, "train")


def test_rows_with_images_are_refused_not_trained_as_text(tmp_path, char_tok):
    path = tmp_path / "train.parquet"
    text = [{"role": "user", "content": "plain question"}]
    pd.DataFrame({"prompt": [text, question()], "images": [[], [{"bytes": png()}]]}).to_parquet(path)
    spec = data_spec(train_files=str(path), max_prompt_length=64)
    with pytest.raises(DataError, match=r"train\.parquet row 1: the row has 1 image\(s\) \(data.image_key='images'\), "
                                        r"but the policy reads text only"):
        build_dataset(spec, char_tok, "train")
    # data.skip_bad_rows leaves it out (counted); data.image_key names the column
    assert len(build_dataset(data_spec(train_files=str(path), max_prompt_length=64, skip_bad_rows=True), char_tok,
                             "train")) == 1
    pd.DataFrame({"prompt": [question()], "pictures": [[{"bytes": png()}]]}).to_parquet(path)
    with pytest.raises(DataError, match="the row has 1 image"):
        build_dataset(data_spec(train_files=str(path), max_prompt_length=64, image_key="pictures"), char_tok,
                      "train")


def test_videos_are_refused(tmp_path, char_tok):
    path = tmp_path / "train.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "q"}]], "videos": [["clip.mp4"]]}).to_parquet(path)
    with pytest.raises(DataError, match=r"train\.parquet row 0: column 'videos' \(data.video_key\) holds 1 video"):
        build_dataset(data_spec(train_files=str(path), max_prompt_length=64), char_tok, "train")


def test_shapes_pictures_hold_what_the_answers_say(tmp_path):
    from jaxrl_llm.data.synthetic import make_splits, write_rows
    from jaxrl_llm.data.synthetic_images import _CELL, COLOURS, GRID, SIZE, shape_scene

    train, val = make_splits("shapes", 40, 8, difficulty=2, seed=3)
    again, _ = make_splits("shapes", 40, 8, difficulty=2, seed=3)
    assert train == again  # deterministic in the seed
    answers = []
    for row in train + val:
        image = decode_image(row["images"][0], "row")
        assert image.size == (SIZE, SIZE)
        colour = row["prompt"][0]["content"].split("How many ")[1].split(" shapes")[0]
        # each grid cell's centre pixel: the shape's colour or the background
        centres = [image.getpixel(((c % GRID) * _CELL + _CELL // 2, (c // GRID) * _CELL + _CELL * 2 // 3))
                   for c in range(GRID * GRID)]
        assert sum(p == COLOURS[colour] for p in centres) == int(row["reward_model"]["ground_truth"])
        assert count_placeholders(row["prompt"]) == 1 and row["ability"] == "vision"
        answers.append(int(row["reward_model"]["ground_truth"]))
    assert len(set(answers)) >= 3  # not one constant answer
    assert {len(shape_scene(k, 2)) for k in range(200)} == set(range(1, 7))  # 1 .. 2 + 2 * difficulty shapes
    write_rows(train, str(tmp_path / "shapes.parquet"))
    assert pd.read_parquet(tmp_path / "shapes.parquet")["images"][0][0]["bytes"] == train[0]["images"][0]["bytes"]
    with pytest.raises(ValueError, match=r"rows with images \(PNG bytes\) are written as \.parquet"):
        write_rows(train, str(tmp_path / "shapes.jsonl"))


def test_prepare_geo3k_writes_verl_rows_and_names_bad_rows(tmp_path):
    import subprocess
    import sys

    from jaxrl_llm.rewards import default_compute_score

    (tmp_path / "geo" / "data").mkdir(parents=True)
    pd.DataFrame({"problem": ["<image>Find x.", "<image>Find the area."], "answer": ["3", "\\frac{1}{2}"],
                  "images": [[{"bytes": png(), "path": "a.png"}], [{"bytes": png((0, 0, 255)), "path": "b.png"}]]}
                 ).to_parquet(tmp_path / "geo" / "data" / "train-00000-of-00001.parquet")
    out = tmp_path / "geo3k" / "train.parquet"
    done = subprocess.run([sys.executable, "scripts/prepare_geo3k.py", "--input", str(tmp_path / "geo"), "--output",
                           str(out), "--split", "train"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = pd.read_parquet(out).to_dict("records")
    assert [r["data_source"] for r in rows] == ["hiyouga/geometry3k"] * 2
    assert rows[1]["prompt"][0]["content"].startswith("<image>Find the area. ") and "\\boxed{}" in \
        rows[1]["prompt"][0]["content"]
    assert decode_image(rows[1]["images"][0], "r").getpixel((0, 0)) == (0, 0, 255)
    assert rows[1]["reward_model"]["ground_truth"] == "\\frac{1}{2}" and rows[0]["extra_info"]["split"] == "train"
    # veRL's geo3k weights: 0.9 accuracy + 0.1 format
    good = "<think>the triangle's legs</think> so x is \\boxed{3}"
    assert default_compute_score("hiyouga/geometry3k", good, "3")["score"] == pytest.approx(1.0)
    assert default_compute_score("hiyouga/geometry3k", "x = \\boxed{3}", "3")["score"] == pytest.approx(0.9)
    assert default_compute_score("hiyouga/geometry3k", "<think>t</think> \\boxed{4}", "3")["score"] == \
        pytest.approx(0.1)
    # a problem without its placeholder: the file and row named, nothing written
    pd.DataFrame({"problem": ["Find x."], "answer": ["3"], "images": [[{"bytes": png(), "path": None}]]}
                 ).to_parquet(tmp_path / "bad.parquet")
    bad = subprocess.run([sys.executable, "scripts/prepare_geo3k.py", "--input", str(tmp_path / "bad.parquet"),
                          "--output", str(tmp_path / "bad_out.parquet")], capture_output=True, text=True)
    assert bad.returncode == 1 and "bad.parquet row 0: the prompt has 0 image placeholder(s)" in bad.stderr
    assert not (tmp_path / "bad_out.parquet").exists()
