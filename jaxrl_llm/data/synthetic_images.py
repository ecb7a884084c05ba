"""The `shapes` synthetic task's pictures: coloured shapes on a plain background, drawn with PIL.

Question k draws, from its own seed, 1 .. 2 + 2 * difficulty shapes (circle, square, triangle) in four colours,
each in its own cell of a 4 x 4 grid of a 112 x 112 picture (no overlap: a count is never ambiguous), and asks
how many shapes have one colour (possibly 0). The picture is PNG bytes, as veRL rows store images
({"bytes": ...}); the answer is a number, scored by the synthetic scorer like the arithmetic tasks.
112 pixels are 4 x 4 merged patches of 28 px for Qwen2.5-VL-style models: a few image tokens a prompt.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
KINDS = ("circle", "square", "triangle")
SIZE, GRID = 112, 4
_CELL = SIZE // GRID
BACKGROUND = (255, 255, 255)


def shape_scene(k: int, difficulty: int) -> list[tuple[str, str, int]]:
    """Question k's shapes: (kind, colour, grid cell) each, deterministic in (k, difficulty)."""
    rng = np.random.default_rng([k, difficulty, 0x5A9E])
    count = int(rng.integers(1, 3 + 2 * difficulty))
    cells = rng.choice(GRID * GRID, size=min(count, GRID * GRID), replace=False)
    names = list(COLOURS)
    return [(KINDS[int(rng.integers(len(KINDS)))], names[int(rng.integers(len(names)))], int(c)) for c in cells]


def draw_scene(scene: list[tuple[str, str, int]]) -> bytes:
    """PNG bytes of the scene."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    margin = 4
    for kind, colour, cell in scene:
        x0, y0 = (cell % GRID) * _CELL + margin, (cell // GRID) * _CELL + margin
        x1, y1 = x0 + _CELL - 2 * margin, y0 + _CELL - 2 * margin
        fill = COLOURS[colour]
        if kind == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif kind == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def shapes_question(k: int, difficulty: int) -> dict[str, Any]:
    """Template fields of question k: the colour asked about, the answer and the picture's PNG bytes."""
    scene = shape_scene(k, difficulty)
    colour = list(COLOURS)[k % len(COLOURS)]
    return {"colour": colour, "answer": str(sum(c == colour for _, c, _ in scene)), "image": draw_scene(scene)}
