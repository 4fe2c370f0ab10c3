"""Qwen2-VL's dynamic-resolution preprocessing, equal to transformers' `Qwen2VLImageProcessor` on its PIL backend
(the reference numerics, as engine/multimodal/image_processor.py explains): the image resized (bicubic) to the
nearest size whose sides are multiples of patch x merge pixels and whose area lies within [min_pixels, max_pixels]
(`smart_resize`), rescaled and normalised, then cut into patches, each repeated over the temporal patch (a still
image is a one-frame video), in transformers' row order: 2 x 2 merge blocks, row-major. Read from the folder's
processor settings, without importing transformers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from engine.multimodal.image_processor import RESAMPLE, read_image_processor_settings, rescale_and_normalize

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' OPENAI_CLIP_MEAN / STD: the processor's defaults
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) as transformers' `smart_resize` computes them: sides multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be at most 200, got {max(height, width) / min(height, width):.0f}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLImageProcessing:
    min_pixels: int  # resized area bounds
    max_pixels: int
    patch_size: int  # pixels per patch side
    temporal_patch_size: int  # frames per patch (an image's one frame repeated)
    merge_size: int  # patches per side merged into one placeholder token
    resample: int  # PIL's resampling filter number (3: bicubic)
    do_resize: bool
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_folder(cls, folder: Path) -> "Qwen2VLImageProcessing":
        """`preprocessor_config.json` as the Hub publishes it (`min_pixels`, `max_pixels`) or as transformers 5
        saves it (`size`: `shortest_edge`, `longest_edge`), or `processor_config.json`'s "image_processor"."""
        settings = read_image_processor_settings(folder)
        kind = settings.get("image_processor_type", "Qwen2VLImageProcessor")
        if kind.removesuffix("Fast").removesuffix("Pil") != "Qwen2VLImageProcessor":
            raise ValueError(
                f"{folder}: image processor {kind!r} is not supported here; expected Qwen2VLImageProcessor"
            )
        size = settings.get("size") or {}
        do = lambda name: settings.get(f"do_{name}", True)  # noqa: E731 - the processor's own defaults: all on
        return cls(
            min_pixels=int(
                settings.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
            ),
            max_pixels=int(
                settings.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
            ),
            patch_size=int(settings.get("patch_size", 14)),
            temporal_patch_size=int(settings.get("temporal_patch_size", 2)),
            merge_size=int(settings.get("merge_size", 2)),
            resample=int(settings.get("resample", 3)),
            do_resize=do("resize"),
            rescale_factor=float(settings.get("rescale_factor", 1 / 255)) if do("rescale") else None,
            mean=tuple(settings.get("image_mean") or _CLIP_MEAN) if do("normalize") else None,
            std=tuple(settings.get("image_std") or _CLIP_STD) if do("normalize") else None,
        )

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) of the resized image for an input of that size."""
        if not self.do_resize:
            return height, width
        factor = self.patch_size * self.merge_size
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(frames, rows, columns) of patches: transformers' `image_grid_thw`."""
        resized_height, resized_width = self.output_size(width, height)
        return 1, resized_height // self.patch_size, resized_width // self.patch_size

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """[1, grid rows, grid columns, channels x temporal patch x patch x patch] float32: the processor's
        `pixel_values` rows of the image (in its order: merge blocks row-major, the patches of a block row-major),
        shaped by `image_grid_thw` so that the tensor carries its grid."""
        image = image.convert("RGB") if image.mode != "RGB" else image
        height, width = self.output_size(*image.size)
        if (width, height) != image.size:
            image = image.resize((width, height), resample=RESAMPLE[self.resample], reducing_gap=None)
        pixels = rescale_and_normalize(np.asarray(image).transpose(2, 0, 1), self.rescale_factor, self.mean, self.std)
        channels, patch, merge = pixels.shape[0], self.patch_size, self.merge_size
        rows, columns = height // patch, width // patch
        if rows % merge or columns % merge:
            raise ValueError(f"{height} x {width} px is not a whole number of {merge} x {merge} patch blocks")
        patches = pixels.reshape(channels, rows // merge, merge, patch, columns // merge, merge, patch)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # blocks, then patches in a block, then (C, P, P)
        patches = np.broadcast_to(
            patches[:, :, :, :, :, None], (*patches.shape[:5], self.temporal_patch_size, patch, patch)
        )
        flat = patches.reshape(1, rows, columns, channels * self.temporal_patch_size * patch * patch)
        return torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
