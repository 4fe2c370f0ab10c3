"""Gemma 3 (transformers' `Gemma3ForConditionalGeneration`): a SigLIP vision tower whose last hidden state is
average-pooled from (image_size / patch_size)² patches down to `mm_tokens_per_image` rows, RMS-normed
(`mm_soft_emb_norm`, scaling by 1 + weight) and projected (`mm_input_projection_weight`) into a Gemma 3 text model,
one row per placeholder.

The prompt: the chat template writes `<start_of_image>` (boi) per image; `Gemma3Processor` replaces it in the text by
"\\n\\n<start_of_image>" + `<image_soft_token>` × mm_tokens_per_image + "<end_of_image>\\n\\n" before tokenizing,
so the newlines it adds merge with the newlines around them into one token ("user\\n" then "\\n\\n" is one
"\\n\\n\\n"). `expand` does the same on token ids: each run of newline tokens the replacement touches is
tokenized again as one string, with the folder's tokenizer.

Attention: the text model's prefill lets an image's soft tokens attend to each other both ways (transformers'
`token_type_ids` mask; on sliding layers still within the window), so `bidirectional_images`: the scheduler
computes an image within one chunk and the attention widens its mask over the image's span.

`detail`: every image is resized to the one input size (896 px for the Hub's models), so "auto", "low" and "high"
all give the same input; other values are refused. Pan-and-scan (`do_pan_and_scan`, extra crops of a long image)
is refused when the folder enables it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from engine.models.siglip import SiglipVisionModel, siglip_vision_config
from engine.multimodal.image_processor import (
    ClipImageProcessing, read_image_processor_settings, read_processor_settings,
)
from engine.multimodal.inputs import DETAILS, ImageInput
from engine.multimodal.kind import (
    CheckpointPart, check_image_marks, load_encoder_weights, route_conditional_generation,
)

# Gemma3TextConfig's defaults, for text configs saved with only what differs from them (the Hub's Gemma 3 configs)
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                         "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                         "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                         "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
                         "final_logit_softcapping": None, "attn_logit_softcapping": None, "bos_token_id": 2,
                         "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True}
# Gemma3ImageProcessor's defaults where they differ from CLIPImageProcessor's: bilinear, mean and std 0.5
_IMAGE_PROCESSOR_DEFAULTS = {"resample": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
_MAX_NEWLINE_RUN = 32  # Gemma's vocabulary has one token per run of up to 31 newlines


class Gemma3Projector(nn.Module):
    """transformers' `Gemma3MultiModalProjector`: [N, patches, vision] -> [N, mm_tokens_per_image, text]."""

    def __init__(self, vision_width: int, text_width: int, patches_per_side: int, tokens_per_side: int, eps: float):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_width, text_width))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(vision_width))
        self.patches_per_side, self.eps = patches_per_side, eps
        self.pool = nn.AvgPool2d(patches_per_side // tokens_per_side)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        batch, _, width = patches.shape
        grid = patches.transpose(1, 2).reshape(batch, width, self.patches_per_side, self.patches_per_side)
        pooled = self.pool(grid).flatten(2).transpose(1, 2)
        # Gemma's RMSNorm: in float32, scaled by (1 + weight), back to the input's dtype
        x = pooled.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.weight.float())).type_as(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(patches)


class Gemma3VisionEncoder(nn.Module):
    def __init__(self, vision_tower: SiglipVisionModel, projector: Gemma3Projector) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        load_encoder_weights(self, named_tensors)


class Gemma3Kind:
    name = "Gemma3ForConditionalGeneration"
    bidirectional_images = True

    def __init__(self, hf_config: dict[str, Any], folder: Path) -> None:
        self._hf = hf_config
        self.image_token_id: int = hf_config.get("image_token_index", 262_144)
        self.boi_token_id: int = hf_config.get("boi_token_index", 255_999)
        self.eoi_token_id: int = hf_config.get("eoi_token_index", 256_000)
        self.vision = siglip_vision_config(hf_config.get("vision_config") or {})
        self.tokens_per_image: int = hf_config.get("mm_tokens_per_image", 256)
        patches_per_side = self.vision.image_size // self.vision.patch_size
        self.tokens_per_side = round(self.tokens_per_image**0.5)
        if self.tokens_per_side**2 != self.tokens_per_image or patches_per_side % self.tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image {self.tokens_per_image} must be a square whose side divides the "
                f"{patches_per_side} patches per side"
            )
        settings = {**_IMAGE_PROCESSOR_DEFAULTS, **read_image_processor_settings(folder)}
        if settings.get("do_pan_and_scan"):
            raise ValueError(f"{folder}: pan-and-scan (do_pan_and_scan) is not supported; turn it off in the folder's "
                             "image processor settings")
        self.processing = ClipImageProcessing.from_settings(settings, folder, "Gemma3ImageProcessor")
        size = self.vision.image_size
        self.pixel_shape = (self.vision.num_channels, size, size)
        if self.processing.crop is not None or self.processing.output_size(size, size) != (size, size):
            raise ValueError(f"{folder}: the image processor's output size differs from the vision tower's {size} px")
        processor = read_processor_settings(folder)
        if processor.get("image_seq_length", self.tokens_per_image) != self.tokens_per_image:
            raise ValueError(f"{folder}: the processor writes {processor['image_seq_length']} image tokens per image "
                             f"but the projector gives mm_tokens_per_image = {self.tokens_per_image}")
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{folder} has no tokenizer.json: Gemma 3's image prompt is tokenized as its processor does")
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        newline_runs = {self._tokenizer.token_to_id("\n" * count): count for count in range(1, _MAX_NEWLINE_RUN)}
        self._newlines: dict[int, int] = {token: count for token, count in newline_runs.items() if token is not None}
        # (empty for a tokenizer that drops newlines, as it then does in the processor's text)
        self._two_newlines = self._tokenizer.encode("\n\n", add_special_tokens=False).ids

    def text_config(self) -> dict[str, Any]:
        text = dict(self._hf.get("text_config") or {})
        if text.get("model_type", "gemma3_text") != "gemma3_text":
            raise ValueError(f"unsupported Gemma 3 text model {text.get('model_type')!r}; supported: gemma3_text")
        # Stop tokens named at the top level win (Gemma 3's instruction-tuned: [1, 106], <eos> and <end_of_turn>)
        stops = {"eos_token_id": self._hf["eos_token_id"]} if "eos_token_id" in self._hf else {}
        return {**_GEMMA3_TEXT_DEFAULTS, **text, **stops, "architectures": ["Gemma3ForCausalLM"]}

    def num_placeholders(self, image: ImageInput) -> int:
        return self.tokens_per_image

    def expand(self, prompt_token_ids: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
        check_image_marks(prompt_token_ids, self.boi_token_id, len(lengths))
        expanded: list[int] = []
        offsets: list[int] = []
        run: list[int] = []  # newline tokens not yet written: the prompt's and the replacement's, merged when written
        run_is_new = False  # the run holds the replacement's newlines (else it is the tokenizer's own: kept)
        remaining = iter(lengths)

        def flush() -> None:
            nonlocal run_is_new
            if run_is_new and len(run) > 1:
                text = "".join("\n" * self._newlines[token] for token in run)
                expanded.extend(self._tokenizer.encode(text, add_special_tokens=False).ids)
            else:
                expanded.extend(run)
            run.clear()
            run_is_new = False

        def newlines(tokens: Iterable[int], new: bool) -> None:
            nonlocal run_is_new
            for token in tokens:
                if token in self._newlines:
                    run.append(token)
                    run_is_new |= new
                else:  # any other token ends the run
                    flush()
                    expanded.append(token)

        for token in prompt_token_ids:
            if token != self.boi_token_id:
                newlines([token], False)
                continue
            newlines(self._two_newlines, True)
            flush()
            expanded.append(self.boi_token_id)
            offsets.append(len(expanded))
            expanded.extend([self.image_token_id] * next(remaining))
            expanded.append(self.eoi_token_id)
            newlines(self._two_newlines, True)
        flush()
        return expanded, offsets

    def preprocess(self, image: ImageInput) -> torch.Tensor:
        if image.detail not in DETAILS:
            raise ValueError(f"image detail {image.detail!r} is not one of {DETAILS}")
        return self.processing(image.image)

    def rotary_positions(self, pixel_values: torch.Tensor) -> None:
        return None  # Gemma 3's decoder: one position per placeholder

    def route(self, name: str) -> tuple[CheckpointPart, str] | None:
        return route_conditional_generation(name, "Gemma 3")

    def build_encoder(self) -> Gemma3VisionEncoder:
        text_width = self.text_config()["hidden_size"]
        projector = Gemma3Projector(
            self.vision.hidden_size, text_width, self.vision.image_size // self.vision.patch_size,
            self.tokens_per_side, self.vision.layer_norm_eps,
        )
        return Gemma3VisionEncoder(SiglipVisionModel(self.vision), projector)
