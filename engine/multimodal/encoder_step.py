"""The vision part of an engine step: the images that the step's prefill chunks reach are encoded in batches (one
per preprocessed shape), unless the encoder cache holds them, and their rows replace the placeholder tokens' rows of
the token embeddings, for exactly the positions each chunk computes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import PlacedImage
from engine.scheduler import ScheduledSequence


class EncoderStep:
    def __init__(
        self, encoder: nn.Module, cache: EncoderCache, max_images_per_batch: int, pixel_shape: tuple[int, ...]
    ) -> None:
        self.encoder = encoder
        self.cache = cache
        self.max_images_per_batch = max_images_per_batch  # bounds the encoder's activations per forward pass
        self.pixel_shape = pixel_shape  # the largest preprocessed image, for the start-up memory profile
        self.images_encoded = 0  # encoder runs, counted per image

    def embed(
        self,
        embed_tokens: Callable[[torch.Tensor], torch.Tensor],
        input_ids: torch.Tensor,
        scheduled: Sequence[ScheduledSequence],
        query_start_loc: Sequence[int],
    ) -> torch.Tensor:
        """The step's input embeddings [T, hidden]: the tokens', with every image placeholder row computed this
        step replaced by its image's encoder output row."""
        embeds = embed_tokens(input_ids)
        rows = self._encoder_rows({image.content_hash: image for item in scheduled for image in item.images})
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for item, base in zip(scheduled, query_start_loc):
            start, stop = item.start_position, item.start_position + item.num_new_tokens
            for image in item.images:
                low, high = max(start, image.offset), min(stop, image.stop)
                targets.append(torch.arange(base + low - start, base + high - start, device=embeds.device))
                sources.append(rows[image.content_hash][low - image.offset : high - image.offset])
        if targets:
            embeds[torch.cat(targets)] = torch.cat(sources).to(embeds.dtype)
        return embeds

    def _encoder_rows(self, images: dict[bytes, PlacedImage]) -> dict[bytes, torch.Tensor]:
        rows: dict[bytes, torch.Tensor] = {}
        missing: dict[tuple[int, ...], list[PlacedImage]] = {}
        for content_hash, image in images.items():
            cached = self.cache.get(content_hash)
            if cached is not None:
                rows[content_hash] = cached
            else:
                missing.setdefault(tuple(image.pixel_values.shape), []).append(image)
        device, dtype = self._device_dtype()
        for group in missing.values():
            for first in range(0, len(group), self.max_images_per_batch):
                batch = group[first : first + self.max_images_per_batch]
                pixels = torch.stack([image.pixel_values for image in batch]).to(device=device, dtype=dtype)
                outputs = self.encoder(pixels)
                self.images_encoded += len(batch)
                for image, output in zip(batch, outputs):
                    if output.shape[0] != image.length:
                        raise RuntimeError(f"the encoder gave {output.shape[0]} rows for {image.length} placeholders")
                    rows[image.content_hash] = output
                    self.cache.put(image.content_hash, output)
        return rows

    @torch.inference_mode()
    def run_largest_batch(self) -> None:
        """A throwaway forward pass over the largest batch the step may encode: for the start-up memory profile."""
        device, dtype = self._device_dtype()
        self.encoder(torch.zeros(self.max_images_per_batch, *self.pixel_shape, device=device, dtype=dtype))

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        parameter = next(self.encoder.parameters())
        return parameter.device, parameter.dtype
