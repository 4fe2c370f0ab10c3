"""An image prompt's tokens as the engine computes them: each image token the chat template wrote becomes the
image's placeholder tokens (the image token repeated, as the family's HF processor expands it), and each image is
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
    images do not pair up one to one, or an image is not an RGB PIL image. Images already placed (`PlacedImage`s,
    from an earlier call on another thread) come with their expanded prompt: checked, and returned as they are."""
    from PIL import Image

    token = kind.image_token_id
    if images and all(isinstance(image, PlacedImage) for image in images):
        placed_tokens = {p for image in images for p in range(image.offset, image.stop)}  # type: ignore[union-attr]
        if any((t == token) != (p in placed_tokens) for p, t in enumerate(prompt_token_ids)):
            raise ValueError("the placed images do not match the prompt's image placeholder tokens")
        return list(prompt_token_ids), tuple(images)  # type: ignore[arg-type]
    found = sum(1 for t in prompt_token_ids if t == token)
    if found != len(images):
        raise ValueError(
            f"the prompt has {found} image token(s) (id {token}) but {len(images)} image(s) came with it: the chat "
            "template writes one per image part"
        )
    expanded: list[int] = []
    placed: list[PlacedImage] = []
    remaining = iter(images)
    for t in prompt_token_ids:
        if t != token:
            expanded.append(t)
            continue
        image = next(remaining)
        if not isinstance(image, ImageInput) or not isinstance(image.image, Image.Image):
            raise ValueError("images must be ImageInput(image=PIL.Image.Image, detail=...)")
        if image.image.mode != "RGB":
            raise ValueError(f"images must be decoded to RGB; got mode {image.image.mode!r}")
        pixel_values = kind.preprocess(image)
        length = kind.num_placeholders(image)
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr((tuple(pixel_values.shape), str(pixel_values.dtype))).encode())
        digest.update(pixel_values.contiguous().numpy().tobytes())
        rotary = kind.rotary_positions(pixel_values)
        placed.append(PlacedImage(len(expanded), length, digest.digest(), pixel_values, rotary))
        expanded.extend([token] * length)
    return expanded, tuple(placed)
