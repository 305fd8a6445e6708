"""Labelled image grids: the pictures people look at instead of reading JSON (demo, eval compare).

Drawn with Pillow alone (a base dependency), so `mhla-diffusion demo` needs no plotting library.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

PAD = 6


def _text_size(draw, text: str, font) -> tuple[int, int]:
    left, top, right, bottom = draw.multiline_textbbox((0, 0), text, font=font, spacing=2)
    return right - left, bottom - top


def labelled_grid(path, cells, row_labels: list[str], column_labels: list[str] | None = None, title: str = "",
                  cell: int = 96, footer: str = "") -> Path:
    """Save `cells` (rows of (H, W, 3) floats in [0, 1]) as one PNG: a title, each column's label above
    it, each row's label (several lines allowed) on its left, a footer (a legend, the scores). Small
    images are scaled up to `cell` pixels (nearest). Written under a temporary name, then moved."""
    font, small = ImageFont.load_default(size=14), ImageFont.load_default(size=12)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    cols = max(len(row) for row in cells)
    h, w = cells[0][0].shape[:2]
    scale = max(1, -(-cell // max(h, w)))
    ch, cw = h * scale, w * scale
    label_w = max(_text_size(probe, label, font)[0] for label in row_labels) + 2 * PAD
    title_h = _text_size(probe, title, font)[1] + 2 * PAD if title else 0
    col_h = max(_text_size(probe, c, small)[1] for c in column_labels) + PAD if column_labels else 0
    foot_h = _text_size(probe, footer, small)[1] + 2 * PAD if footer else 0
    width = max(label_w + cols * (cw + PAD) + PAD, _text_size(probe, footer, small)[0] + 2 * PAD if footer else 0,
                _text_size(probe, title, font)[0] + 2 * PAD if title else 0)
    top = title_h + col_h + PAD
    canvas = Image.new("RGB", (width, top + len(cells) * (ch + PAD) + foot_h), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((PAD, PAD), title, fill="black", font=font)
    for c, label in enumerate(column_labels or []):
        tw = _text_size(draw, label, small)[0]
        draw.text((label_w + c * (cw + PAD) + (cw - tw) // 2, title_h), label, fill="black", font=small)
    for r, (row, label) in enumerate(zip(cells, row_labels)):
        y = top + r * (ch + PAD)
        draw.multiline_text((PAD, y + (ch - _text_size(draw, label, font)[1]) // 2), label, fill="black", font=font,
                            spacing=2)
        for c, img in enumerate(row):
            tile = Image.fromarray((np.clip(img, 0, 1) * 255).round().astype(np.uint8))
            canvas.paste(tile.resize((cw, ch), Image.NEAREST), (label_w + c * (cw + PAD), y))
    if footer:
        draw.multiline_text((PAD, canvas.height - foot_h + PAD), footer, fill="dimgray", font=small, spacing=2)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    canvas.save(tmp, format="png")
    os.replace(tmp, path)
    return path
