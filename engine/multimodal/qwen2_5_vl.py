"""Qwen2.5-VL (transformers' `Qwen2_5_VLForConditionalGeneration`): a windowed vision transformer at dynamic
resolution (engine/models/qwen2_5_vit.py) whose 2 x 2-merged patches become the placeholder tokens of a Qwen2
decoder with M-RoPE. Its processor resizes each image to a whole number of 28 x 28 px blocks within the folder's
[min_pixels, max_pixels] (engine/multimodal/qwen2_vl_processing.py) and expands each `<|image_pad|>` into one token
per block; the placeholders take (temporal, height, width) rotary positions from their place in the grid
(`rotary_positions`; engine/multimodal/positions.py places them and the text after them).

Checkpoint names, all read: as the Hub publishes them and transformers 5 saves them (`visual.*`, `model.*`,
`lm_head.*`), and as transformers 4.5x saves them (`model.visual.*`, `model.language_model.*`, `lm_head.*`). The
config: transformers 5's (`text_config`, `rope_parameters`) or the Hub's (the text model's keys at the top,
`rope_scaling` of type "mrope").

`detail`: "auto" and "high" resize within the folder's [min_pixels, max_pixels], as transformers' processor does;
"low" lowers max_pixels to 512 x 512 px (OpenAI's low-resolution size; at most 334 placeholder tokens at 28 px
blocks, fewer for a folder whose max_pixels is already lower), as the processor does when called with that
`size`; other values are refused."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.models.qwen2_5_vit import Qwen25VisionConfig, Qwen25VisionTransformer
from engine.multimodal.inputs import DETAILS, ImageInput
from engine.multimodal.kind import CheckpointPart, repeat_image_marks
from engine.multimodal.qwen2_vl_processing import Qwen2VLImageProcessing, smart_resize

# Qwen2_5_VLTextConfig's defaults, for what a config leaves out
_TEXT_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "hidden_act": "silu", "attention_bias": True}
_ROPE_THETA = 1000000.0
LOW_DETAIL_PIXELS = 512 * 512  # max_pixels of a `detail: "low"` image
_NOT_TEXT = ("vision_config", "text_config", "architectures", "model_type", "image_token_id", "video_token_id",
             "vision_start_token_id", "vision_end_token_id", "auto_map")


class Qwen25VLKind:
    name = "Qwen2_5_VLForConditionalGeneration"
    bidirectional_images = False  # causal, like the text around them

    def __init__(self, hf_config: dict[str, Any], folder: Path) -> None:
        self._hf = hf_config
        self.image_token_id: int = hf_config.get("image_token_id", 151655)
        self.vision = Qwen25VisionConfig.from_hf(hf_config.get("vision_config") or {})
        self.processing = Qwen2VLImageProcessing.from_folder(folder)
        processing, vision = self.processing, self.vision
        self.low_detail = dataclasses.replace(
            processing, min_pixels=min(processing.min_pixels, LOW_DETAIL_PIXELS),
            max_pixels=min(processing.max_pixels, LOW_DETAIL_PIXELS),
        )
        if (processing.patch_size, processing.merge_size, processing.temporal_patch_size) != (
            vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
        ):
            raise ValueError(
                f"{folder}: the image processor's patch, merge and temporal patch sizes "
                f"{processing.patch_size, processing.merge_size, processing.temporal_patch_size} differ from the "
                f"vision tower's {vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size}"
            )
        text_width = self.text_config()["hidden_size"]
        if vision.out_hidden_size != text_width:
            raise ValueError(
                f"the vision merger gives {vision.out_hidden_size} wide rows; the text model takes {text_width}"
            )
        # The largest input: the biggest square whose side is a whole number of blocks within max_pixels.
        factor = vision.patch_size * vision.spatial_merge_size
        side = max(factor, math.isqrt(processing.max_pixels) // factor * factor)
        height, width = smart_resize(side, side, factor, processing.min_pixels, processing.max_pixels)
        self.pixel_shape = (1, height // vision.patch_size, width // vision.patch_size, vision.patch_dim)

    def text_config(self) -> dict[str, Any]:
        hf = self._hf
        text = hf.get("text_config") or {key: value for key, value in hf.items() if key not in _NOT_TEXT}
        tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        config = {**_TEXT_DEFAULTS, **text, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": tie}
        if "rope_theta" not in config and "rope_theta" not in (config.get("rope_parameters") or {}):
            config["rope_theta"] = _ROPE_THETA
        return config

    def expand(self, prompt_token_ids: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
        return repeat_image_marks(prompt_token_ids, self.image_token_id, lengths)  # each <|image_pad|> repeated

    def num_placeholders(self, image: ImageInput) -> int:
        frames, rows, columns = self._processing(image.detail).grid(*image.image.size)
        return frames * rows * columns // self.vision.spatial_merge_size**2

    def preprocess(self, image: ImageInput) -> torch.Tensor:
        return self._processing(image.detail)(image.image)

    def _processing(self, detail: str) -> Qwen2VLImageProcessing:
        if detail not in DETAILS:
            raise ValueError(f"image detail {detail!r} is not one of {DETAILS}")
        return self.low_detail if detail == "low" else self.processing

    def rotary_positions(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """transformers' `get_vision_position_ids` for an image: each placeholder's (frame, row, column) in the grid
        of merged blocks, row-major."""
        merge = self.vision.spatial_merge_size
        frames, rows, columns = pixel_values.shape[0], pixel_values.shape[1] // merge, pixel_values.shape[2] // merge
        grid = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(columns), indexing="ij")
        return torch.stack([axis.reshape(-1) for axis in grid])

    def route(self, name: str) -> tuple[CheckpointPart, str] | None:
        if name.startswith("model.visual."):  # transformers 4.5x
            name = name.removeprefix("model.")
        if name.startswith("visual."):
            return "vision", name.removeprefix("visual.")
        if name.startswith("model.language_model."):  # transformers 4.5x
            return "text", "model." + name.removeprefix("model.language_model.")
        if name.startswith(("model.", "lm_head.")):
            return "text", name
        raise ValueError(f"unexpected tensor {name!r} in a Qwen2.5-VL checkpoint")

    def build_encoder(self) -> Qwen25VisionTransformer:
        return Qwen25VisionTransformer(self.vision)

