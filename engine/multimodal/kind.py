"""The protocol a vision-language model family implements (engine/multimodal/registry.py finds a folder's).

A family says how its chat template's image token becomes the per-image placeholder tokens, how an image is
preprocessed (as its Hugging Face processor does), which config is its text decoder's, which checkpoint tensors are
its vision encoder's, and builds that encoder (pixels in, one text-embedding row per placeholder out). The text
decoder is an ordinary engine/models class; the engine splices the encoder's rows into its token embeddings."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Literal, Protocol

import torch
from torch import nn

from engine.multimodal.inputs import ImageInput
from engine.parallel_layers import CheckpointTensor

CheckpointPart = Literal["text", "vision"]


class VisionEncoder(Protocol):
    """A family's vision encoder and projector, an nn.Module."""

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, ...] preprocessed images of one shape -> [N, placeholders, text hidden size]."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class VisionLanguageKind(Protocol):
    name: str  # the architecture, e.g. "LlavaForConditionalGeneration"
    image_token_id: int  # the token the chat template writes per image, expanded into the placeholders
    pixel_shape: tuple[int, ...]  # the largest preprocessed image (C, H, W): sizes the start-up memory profile

    def text_config(self) -> dict[str, Any]:
        """The text decoder's config.json, as ModelConfig.from_hf reads it."""
        ...

    def num_placeholders(self, image: ImageInput) -> int:
        """Placeholder tokens (= encoder output rows) the image takes in the prompt."""
        ...

    def preprocess(self, image: ImageInput) -> torch.Tensor:
        """The encoder's input for one image, equal to the folder's HF processor's `pixel_values[i]`; raises
        ValueError for a `detail` the family refuses."""
        ...

    def rotary_positions(self, pixel_values: torch.Tensor) -> torch.Tensor | None:
        """Each placeholder's rotary position relative to the image's first, [3, placeholders] (temporal, height,
        width) for a decoder with multi-axis rotary positions (M-RoPE); None where placeholders take one position
        each, as text tokens do."""
        ...

    def route(self, name: str) -> tuple[CheckpointPart, str] | None:
        """Which part a checkpoint tensor belongs to, under the name that part's loader reads; None: unused."""
        ...

    def build_encoder(self) -> nn.Module:
        """The vision encoder (a VisionEncoder), in the current default device and dtype, weights uninitialised."""
        ...


def split_checkpoint(
    kind: VisionLanguageKind, named_tensors: Iterable[tuple[str, CheckpointTensor]], part: CheckpointPart
) -> Iterator[tuple[str, CheckpointTensor]]:
    """The tensors of `part`, renamed for its loader."""
    for name, tensor in named_tensors:
        routed = kind.route(name)
        if routed is not None and routed[0] == part:
            yield routed[1], tensor
