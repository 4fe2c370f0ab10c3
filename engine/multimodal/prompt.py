"""An image prompt's tokens as the engine computes them: each image token the chat template wrote becomes the
image's placeholder tokens (as the family's HF processor expands it: `VisionLanguageKind.expand`), and each image is
preprocessed and named by the hash of its pixels."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from engine.multimodal.inputs import ImageInput, PlacedImage
from engine.multimodal.kind import VisionLanguageKind


def expand_image_prompt(
    kind: VisionLanguageKind, prompt_token_ids: Sequence[int], images: Sequence[ImageInput | PlacedImage]
) -> tuple[list[int], tuple[PlacedImage, ...]]:
    """(expanded token ids, the images placed in them). Raises ValueError when the prompt's image tokens and the
    images do not pair up one to one, or an image is not an RGB PIL image (both checked before any image is
    preprocessed). Images already placed (`PlacedImage`s, from an earlier call on another thread) come with their
    expanded prompt: checked, and returned as they are."""
    from PIL import Image

    token = kind.image_token_id
    if images and all(isinstance(image, PlacedImage) for image in images):
        placed_tokens = {p for image in images for p in range(image.offset, image.stop)}  # type: ignore[union-attr]
        if any((t == token) != (p in placed_tokens) for p, t in enumerate(prompt_token_ids)):
            raise ValueError("the placed images do not match the prompt's image placeholder tokens")
        return list(prompt_token_ids), tuple(images)  # type: ignore[arg-type]
    for image in images:
        if not isinstance(image, ImageInput) or not isinstance(image.image, Image.Image):
            raise ValueError("images must be ImageInput(image=PIL.Image.Image, detail=...)")
        if image.image.mode != "RGB":
            raise ValueError(f"images must be decoded to RGB; got mode {image.image.mode!r}")
    lengths = [kind.num_placeholders(image) for image in images]  # type: ignore[arg-type]
    expanded, offsets = kind.expand(prompt_token_ids, lengths)
    placed: list[PlacedImage] = []
    for image, offset, length in zip(images, offsets, lengths, strict=True):
        pixel_values = kind.preprocess(image)  # type: ignore[arg-type]
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr((tuple(pixel_values.shape), str(pixel_values.dtype))).encode())
        digest.update(pixel_values.contiguous().numpy().tobytes())
        placed.append(PlacedImage(
            offset, length, digest.digest(), pixel_values, rotary_positions=kind.rotary_positions(pixel_values),
            bidirectional=kind.bidirectional_images,
        ))
    return expanded, tuple(placed)
