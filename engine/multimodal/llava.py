"""LLaVA-1.5 (transformers' `LlavaForConditionalGeneration`): a CLIP vision tower whose hidden state at
`vision_feature_layer` (the last but one by default; a list of layers is concatenated), less the class token with
the "default" strategy, goes through a two-layer projector into a Llama-family text model, one row per
placeholder. Its processor expands each `<image>` into (image_size / patch_size)^2 of them (+1 with "full").

Checkpoint names, all read: the Hub's, transformers 4.5x's and transformers 5's layouts
(`kind.route_conditional_generation`).

`detail`: LLaVA-1.5 sees every image at its one input size (336 px), so "auto", "low" and "high" all give the
same input; other values are refused."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.models.clip import ClipVisionConfig, ClipVisionModel, activation
from engine.multimodal.image_processor import ClipImageProcessing, read_processor_settings
from engine.multimodal.inputs import DETAILS, ImageInput
from engine.multimodal.kind import (
    CheckpointPart, load_encoder_weights, repeat_image_marks, route_conditional_generation,
)

# LlamaConfig's defaults, for text configs saved with only what differs from them (the Hub's LLaVA-1.5 configs)
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
# The decoder class of each text model_type LLaVA checkpoints use
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class LlavaProjector(nn.Module):
    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVisionEncoder(nn.Module):
    def __init__(self, vision: ClipVisionConfig, layers: tuple[int, ...], drop_cls: bool, projector: LlavaProjector):
        super().__init__()
        self.layers, self.drop_cls = layers, drop_cls
        self.vision_tower = ClipVisionModel(vision, max(layers))
        self.multi_modal_projector = projector

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower(pixel_values, self.layers)
        if self.drop_cls:
            states = [state[:, 1:] for state in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        # the final norm and the layers past the last one read: transformers computes them, LLaVA ignores them
        load_encoder_weights(self, named_tensors)


class LlavaKind:
    name = "LlavaForConditionalGeneration"
    bidirectional_images = False  # causal, like the text around them

    def __init__(self, hf_config: dict[str, Any], folder: Path) -> None:
        self._hf = hf_config
        self.image_token_id: int = hf_config.get("image_token_index", hf_config.get("image_token_id", 32000))
        self.vision = ClipVisionConfig.from_hf(hf_config.get("vision_config") or {})
        strategy = hf_config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}; supported: default, full")
        self.drop_cls = strategy == "default"
        layer = hf_config.get("vision_feature_layer", -2)
        depth = self.vision.num_hidden_layers + 1  # transformers' hidden_states: the embeddings, then each layer's
        self.feature_layers = tuple(index % depth for index in (layer if isinstance(layer, list) else [layer]))
        self.processing = ClipImageProcessing.from_folder(folder)
        size = self.vision.image_size
        self.pixel_shape = (self.vision.num_channels, size, size)
        if self.processing.output_size(size, size) != (size, size):
            raise ValueError(f"{folder}: the image processor's output size differs from the vision tower's {size} px")
        processor = read_processor_settings(folder)
        patch = processor.get("patch_size") or self.vision.patch_size
        # The processor's count, as LlavaProcessor computes it (it must agree with the rows the encoder gives).
        self._num_placeholders = (size // patch) ** 2 + processor.get("num_additional_image_tokens", 1 if patch else 0)
        if self.drop_cls:
            self._num_placeholders -= 1
        features = self.vision.num_patches + (0 if self.drop_cls else 1)
        if self._num_placeholders != features:
            raise ValueError(
                f"{folder}: the processor writes {self._num_placeholders} image tokens per image but the vision "
                f"tower gives {features} features"
            )

    def text_config(self) -> dict[str, Any]:
        text = dict(self._hf.get("text_config") or {})
        model_type = text.get("model_type", "llama")
        if model_type not in _TEXT_ARCHITECTURES:
            raise ValueError(f"unsupported LLaVA text model {model_type!r}; supported: {sorted(_TEXT_ARCHITECTURES)}")
        defaults = _LLAMA_DEFAULTS if model_type == "llama" else {}
        return {**defaults, **text, "architectures": [_TEXT_ARCHITECTURES[model_type]]}

    def expand(self, prompt_token_ids: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
        return repeat_image_marks(prompt_token_ids, self.image_token_id, lengths)

    def num_placeholders(self, image: ImageInput) -> int:
        return self._num_placeholders

    def preprocess(self, image: ImageInput) -> torch.Tensor:
        if image.detail not in DETAILS:
            raise ValueError(f"image detail {image.detail!r} is not one of {DETAILS}")
        return self.processing(image.image)

    def rotary_positions(self, pixel_values: torch.Tensor) -> None:
        return None  # a Llama-family decoder: one position per placeholder

    def route(self, name: str) -> tuple[CheckpointPart, str] | None:
        return route_conditional_generation(name, "LLaVA")

    def build_encoder(self) -> LlavaVisionEncoder:
        hf = self._hf
        text_width = self.text_config()["hidden_size"]
        projector = LlavaProjector(
            self.vision.hidden_size * len(self.feature_layers), text_width, hf.get("projector_hidden_act", "gelu"),
            hf.get("multimodal_projector_bias", True),
        )
        return LlavaVisionEncoder(self.vision, self.feature_layers, self.drop_cls, projector)
