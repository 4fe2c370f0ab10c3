"""What a line's image parts become: references while the line is checked, decoded images once fetched.

A line's conversation reaches the chat template as transformers passes a multimodal one: each image part is
`{"type": "image"}` in its message's content list, in order, and the images themselves travel beside it, in the
same order (`LineImages`). `detail` is recorded per image as the client gave it; the model's own preprocessing
decides what it means (a text-only model never gets that far).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from jobs.openai_format.responses import ErrorCode

if TYPE_CHECKING:  # only a chunk that runs decodes images; checking a line needs no Pillow
    from PIL.Image import Image

Detail = Literal["auto", "low", "high"]
IMAGE_SCHEMES = ("data:", "https://", "s3://")


class ImageRejected(Exception):
    """One image cannot be used: its line fails with this code and message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ImageLimits:
    """What one image, and one line, may cost (`CONVEYOR_IMAGE_*` settings)."""

    max_bytes: int = 20 * 1024 * 1024  # bytes of one encoded image (OpenAI's limit is 20 MB)
    max_pixels: int = 25_000_000  # width x height of one image, read from its header before it is decoded
    max_aspect_ratio: float = 200.0  # the long side over the short one (Qwen2-VL's processor refuses past 200)
    max_per_line: int = 16  # image parts in one line
    fetch_timeout_seconds: float = 10.0  # the whole fetch of one URL: connection, redirects and body
    fetch_threads: int = 8  # images fetched and decoded at once per chunk
    # Image lines of one chunk fetched, decoded or in the engine at once: each holds its decoded images and, queued in
    # the engine, its preprocessed pixels (LLaVA-1.5: 3 x 336 x 336 float32, ~1.35 MB an image; Qwen2.5-VL: its
    # patches over two frames, float32, 24 bytes per pixel of the resized image) until it finishes
    lines_in_flight: int = 64


@dataclass(frozen=True)
class ImageRef:
    """One image part as the line gives it: where the image is, and its `detail`."""

    url: str  # a data URL, an https URL or an s3:// URI (`check_image_url`)
    detail: Detail = "auto"


def check_image_url(url: str) -> str:
    """A pydantic validator: the URL's scheme is one images can come from. What it names is checked when fetched."""
    if not url.startswith(IMAGE_SCHEMES):
        shown = url if len(url) <= 80 else url[:77] + "..."
        raise ValueError(f"an image URL must be a data: URL, an https:// URL or an s3:// URI, got {shown!r}")
    return url


@dataclass(frozen=True)
class ImageInputs:
    """A checked line's images, not fetched yet: the conversation with `{"type": "image"}` parts, and what each names."""

    messages: list[dict[str, Any]]  # the chat template's messages, in transformers' multimodal form
    refs: tuple[ImageRef, ...]  # in the order of the image parts
    template_arguments: dict[str, Any]  # the template's further arguments: `tools`, the thinking switch, ...


@dataclass(frozen=True)
class LineImages:
    """A line's images fetched and decoded: what the engine side takes."""

    messages: list[dict[str, Any]]  # as `ImageInputs.messages`
    template_arguments: dict[str, Any]  # as `ImageInputs.template_arguments`
    images: list[Image]  # RGB, one per image part, in order
    details: list[Detail]  # each image's `detail`
