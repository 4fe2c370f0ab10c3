"""Scanned-looking pages and PDFs made of them, for the tests of RAG's `pdf_mode: "pages"` (jobs and service)."""

from __future__ import annotations

import io

from PIL import Image, ImageDraw


def page(seed: int, width: int, height: int) -> Image.Image:
    """A white page with a numbered heading and a coloured block that differ with `seed`."""
    picture = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(picture)
    draw.text((8, 8 + seed * 10), f"Section {seed}", fill="black")
    draw.rectangle((10, 40, 10 + 15 * seed, 60 + 5 * seed), fill=(40 * seed, 0, 120))
    return picture


def pdf_of(pages: list[Image.Image]) -> bytes:
    """A PDF with one page per picture, each page as many points as the picture has pixels (72 dpi)."""
    out = io.BytesIO()
    pages[0].save(out, format="PDF", resolution=72.0, save_all=True, append_images=pages[1:])
    return out.getvalue()
