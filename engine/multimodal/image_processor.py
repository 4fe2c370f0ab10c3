"""CLIP-style image preprocessing, equal to transformers' `CLIPImageProcessor` (and `Gemma3ImageProcessor`, which
resizes to a fixed size and does not crop) on its PIL backend (the reference numerics; the torchvision backend
resizes on tensors and differs in the last bits): resize the shortest edge (or to a fixed size) with PIL,
centre-crop (zero-padding a smaller image), rescale in float64 then float32, normalise per channel. Read from the
folder's processor settings, without importing transformers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from math import ceil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


@dataclass(frozen=True)
class ClipImageProcessing:
    shortest_edge: int | None  # resize so the shorter side has this many pixels (aspect kept); None: no resize
    resize_to: tuple[int, int] | None  # or to exactly (height, width)
    resample: int  # PIL's resampling filter number (3: bicubic)
    crop: tuple[int, int] | None  # centre crop (height, width); None: no crop
    rescale_factor: float | None  # pixel values times this (1/255); None: not rescaled
    mean: tuple[float, ...] | None  # per-channel normalisation; None: not normalised
    std: tuple[float, ...] | None

    @classmethod
    def from_folder(cls, folder: Path, processor: str = "CLIPImageProcessor") -> "ClipImageProcessing":
        """The image processor settings transformers saved: `preprocessor_config.json` (the Hub's, older
        transformers), else `processor_config.json`'s "image_processor" (transformers 5). `processor`: the class
        the family's folders name, whose steps are these (Gemma 3's `Gemma3ImageProcessor` too: resize to a fixed
        size, no crop)."""
        return cls.from_settings(read_image_processor_settings(folder), folder, processor)

    @classmethod
    def from_settings(cls, settings: dict[str, Any], folder: Path, processor: str) -> "ClipImageProcessing":
        kind = settings.get("image_processor_type", processor)
        if kind.removesuffix("Fast").removesuffix("Pil") != processor:
            raise ValueError(f"{folder}: image processor {kind!r} is not supported here; expected {processor}")
        size, crop = settings.get("size") or {}, settings.get("crop_size")
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        do = lambda name: settings.get(f"do_{name}", True)  # noqa: E731 - the processor's own defaults: all on
        return cls(
            shortest_edge=size.get("shortest_edge") if do("resize") else None,
            resize_to=(size["height"], size["width"]) if do("resize") and "height" in size else None,
            resample=int(settings.get("resample", 3)),
            crop=(crop["height"], crop["width"]) if do("center_crop") and crop else None,
            rescale_factor=float(settings.get("rescale_factor", 1 / 255)) if do("rescale") else None,
            mean=tuple(settings["image_mean"]) if do("normalize") else None,
            std=tuple(settings["image_std"]) if do("normalize") else None,
        )

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) of the preprocessed image for an input of that size."""
        if self.crop is not None:
            return self.crop
        return self._resized(width, height)[::-1]

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        if self.resize_to is not None:
            return self.resize_to[1], self.resize_to[0]
        if self.shortest_edge is None:
            return width, height
        short, long = min(width, height), max(width, height)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """[3, H, W] float32 pixel values, as the processor's `pixel_values[i]`."""
        image = image.convert("RGB") if image.mode != "RGB" else image
        size = self._resized(*image.size)
        if size != image.size:
            image = image.resize(size, resample=RESAMPLE[self.resample], reducing_gap=None)
        pixels = np.asarray(image).transpose(2, 0, 1)  # CHW uint8
        if self.crop is not None:
            pixels = _center_crop(pixels, *self.crop)
        return torch.from_numpy(rescale_and_normalize(pixels, self.rescale_factor, self.mean, self.std))


def rescale_and_normalize(
    pixels: np.ndarray, rescale_factor: float | None, mean: tuple[float, ...] | None, std: tuple[float, ...] | None
) -> np.ndarray:
    """CHW uint8 pixels rescaled (in float64, then float32) and normalised per channel, as transformers' PIL backend
    does; float32, contiguous."""
    if rescale_factor is not None:
        pixels = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    if mean is not None and std is not None:
        pixels = pixels if np.issubdtype(pixels.dtype, np.floating) else pixels.astype(np.float32)
        channel_mean = np.array(mean, dtype=pixels.dtype)[:, None, None]
        pixels = (pixels - channel_mean) / np.array(std, dtype=pixels.dtype)[:, None, None]
    return np.ascontiguousarray(pixels, dtype=np.float32)


def _center_crop(pixels: np.ndarray, crop_height: int, crop_width: int) -> np.ndarray:
    """transformers' `center_crop`: the middle, or the image zero-padded to the crop where it is smaller."""
    _, height, width = pixels.shape
    top, left = (height - crop_height) // 2, (width - crop_width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + crop_height, left : left + crop_width]
    new_height, new_width = max(crop_height, height), max(crop_width, width)
    padded = np.zeros_like(pixels, shape=(pixels.shape[0], new_height, new_width))
    top_pad, left_pad = ceil((new_height - height) / 2), ceil((new_width - width) / 2)
    padded[:, top_pad : top_pad + height, left_pad : left_pad + width] = pixels
    top, left = top + top_pad, left + left_pad  # the crop box, moved with the image
    return padded[:, max(0, top) : min(new_height, top + crop_height), max(0, left) : min(new_width, left + crop_width)]


def read_image_processor_settings(folder: Path) -> dict[str, Any]:
    legacy = folder / "preprocessor_config.json"
    if legacy.is_file():
        return json.loads(legacy.read_text(encoding="utf-8"))
    combined = folder / "processor_config.json"
    if combined.is_file():
        settings = json.loads(combined.read_text(encoding="utf-8")).get("image_processor")
        if settings:
            return settings
    raise ValueError(f"{folder} has no image processor settings (preprocessor_config.json or processor_config.json)")


def read_processor_settings(folder: Path) -> dict[str, Any]:
    """The processor's own settings (processor_config.json), e.g. LLaVA's patch_size; empty when there are none."""
    path = folder / "processor_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
