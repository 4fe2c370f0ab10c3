"""Rotary positions of a prompt with images. A token's position is its index in the sequence, except after and
inside images with multi-axis rotary positions (Qwen2.5-VL's M-RoPE): such an image's placeholders take their
(temporal, height, width) positions from its grid, starting where a text token would, and take `position_span`
positions (fewer than its placeholders), so every token after it sits `length - position_span` positions earlier
than its index; as transformers' `get_rope_index` and its `rope_deltas` place them for prefill and decode alike.

The scheduler sends each chunk the shift at its first token (`position_shift`) and the images it overlaps; the
runner turns them into the step's positions, 1-D, or [3, T] when a chunk holds placeholders with grid positions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.multimodal.inputs import PlacedImage


def position_shift(images: Sequence[PlacedImage], position: int) -> int:
    """How many positions earlier than its index the token at sequence index `position` sits (<= 0): the images
    ending at or before it took fewer positions than placeholders."""
    return sum(image.position_span - image.length for image in images if image.stop <= position)


def chunk_positions(
    start: int, stop: int, shift: int, images: Sequence[PlacedImage]
) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:
    """Positions of tokens [start, stop) of a sequence whose shift at `start` is `shift` and whose images overlapping
    them are `images`: each token's 1-D position, and for the placeholders with grid positions, (index in the chunk,
    their [3, n] positions), which replace those tokens' 1-D ones."""
    flat: list[int] = []
    grids: list[tuple[int, torch.Tensor]] = []
    for image in sorted(images, key=lambda placed: placed.offset):
        low, high = max(start, image.offset), min(stop, image.stop)
        flat.extend(range(start + len(flat) + shift, low + shift))  # the text before the image
        if image.rotary_positions is not None:
            base = image.offset + shift  # where the image's first placeholder would sit as text
            grids.append((low - start, image.rotary_positions[:, low - image.offset : high - image.offset] + base))
        flat.extend(range(low + shift, high + shift))
        if image.stop <= stop:  # the tokens after it, in this chunk, follow its span
            shift += image.position_span - image.length
    flat.extend(range(start + len(flat) + shift, stop + shift))
    return flat, grids
