"""What an image prompt is as plain data: the caller's `ImageInput`, and a `PlacedImage` once the engine expanded
its placeholder tokens into the prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plain data, importable without torch or PIL (the request side builds ImageInputs)
    import torch
    from PIL import Image

DETAILS = ("auto", "low", "high")  # OpenAI's `image_url.detail` values


@dataclass(frozen=True)
class ImageInput:
    """One image of a request, decoded (RGB), and the OpenAI `detail` asked for it."""

    image: "Image.Image"
    detail: str = "auto"


@dataclass(frozen=True, eq=False)
class PlacedImage:
    """An image inside an expanded prompt: its placeholder tokens are prompt positions [offset, offset + length).
    `content_hash` names what the encoder sees (its preprocessed pixels): it keys the encoder-output cache and
    enters the prefix-cache names of the blocks holding its placeholders.

    Rotary positions: by default each placeholder takes one position, as a text token does. A family with
    multi-axis rotary positions (Qwen2.5-VL's M-RoPE) gives `rotary_positions`: each placeholder's (temporal, height,
    width) position relative to the image's first one; the image then takes `position_span` positions (the largest
    relative position plus one) and the tokens after it continue from there (engine/multimodal/positions.py)."""

    offset: int  # prompt position of its first placeholder token
    length: int  # placeholder tokens = embedding rows the encoder gives it
    content_hash: bytes
    pixel_values: "torch.Tensor"  # the model's preprocessed input, e.g. [3, H, W] float32
    rotary_positions: "torch.Tensor | None" = None  # [3, length] int64 relative positions; None: one each, 1-D
    position_span: int = 0  # rotary positions the image takes (= length when rotary_positions is None)
    # Its placeholders attend to each other both ways (VisionLanguageKind.bidirectional_images, Gemma 3): the
    # scheduler computes them within one prefill chunk, and the chunk's attention adds their span to its mask.
    bidirectional: bool = False

    def __post_init__(self) -> None:
        if self.rotary_positions is None:
            object.__setattr__(self, "position_span", self.length)
        else:
            object.__setattr__(self, "position_span", int(self.rotary_positions.max()) + 1)

    @property
    def stop(self) -> int:
        return self.offset + self.length


def images_within(images: tuple[PlacedImage, ...], start: int, stop: int) -> tuple[PlacedImage, ...]:
    """The images whose placeholders overlap positions [start, stop)."""
    return tuple(image for image in images if image.offset < stop and start < image.stop)


def image_block_key(images: tuple[PlacedImage, ...], start: int, stop: int) -> bytes:
    """What a KV block over positions [start, stop) depends on beyond its tokens: the content of every image whose
    placeholders it holds (and where each starts), so equal tokens over different images never share a block."""
    return b"".join(image.content_hash + image.offset.to_bytes(8, "little") for image in images_within(images, start, stop))
