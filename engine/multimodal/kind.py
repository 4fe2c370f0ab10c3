"""The protocol a vision-language model family implements (engine/multimodal/registry.py finds a folder's).

A family says how its chat template's image token becomes the per-image placeholder tokens, how an image is
preprocessed (as its Hugging Face processor does), which rotary positions its placeholders take (M-RoPE) and
whether they attend to each other both ways, which config is its text decoder's, which checkpoint tensors are its
vision encoder's, and builds that encoder (pixels in, one text-embedding row per placeholder out). The text decoder
is an ordinary engine/models class; the engine splices the encoder's rows into its token embeddings. Below the
protocol, what several families share: the marks' check and repetition, the `*ForConditionalGeneration` checkpoint
layouts, the encoder's weight loading."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
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
    image_token_id: int  # the placeholder token: each of an image's encoder rows takes one position holding it
    pixel_shape: tuple[int, ...]  # the largest preprocessed image (C, H, W): sizes the start-up memory profile
    # Whether an image's placeholders attend to each other both ways in the text model's prefill (Gemma 3): each
    # image is then computed within one prefill chunk, and attention adds its span to the causal mask.
    bidirectional_images: bool

    def expand(self, prompt_token_ids: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
        """The prompt with each image mark the chat template wrote (one per image, in order) replaced as the
        family's HF processor replaces it: `lengths[i]` placeholder tokens, and whatever the processor writes around
        them. Returns the expanded prompt and each image's first placeholder position; raises ValueError (through
        `check_image_marks`) when the marks and the images do not pair up."""
        ...

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


def check_image_marks(prompt_token_ids: Sequence[int], mark: int, num_images: int) -> None:
    """ValueError unless the prompt holds `mark` (the token a chat template writes per image) once per image."""
    found = sum(1 for t in prompt_token_ids if t == mark)
    if found != num_images:
        raise ValueError(
            f"the prompt has {found} image token(s) (id {mark}) but {num_images} image(s) came with it: the chat "
            "template writes one per image part"
        )


def repeat_image_marks(prompt_token_ids: Sequence[int], mark: int, lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """`VisionLanguageKind.expand` for a family whose processor repeats the template's image token into the
    placeholders (LLaVA)."""
    check_image_marks(prompt_token_ids, mark, len(lengths))
    expanded: list[int] = []
    offsets: list[int] = []
    remaining = iter(lengths)
    for t in prompt_token_ids:
        if t != mark:
            expanded.append(t)
            continue
        offsets.append(len(expanded))
        expanded.extend([mark] * next(remaining))
    return expanded, offsets


def route_conditional_generation(name: str, family: str) -> tuple[CheckpointPart, str] | None:
    """The checkpoint layout transformers gives its `*ForConditionalGeneration` models built of a vision tower, a
    projector and a language model (LLaVA, Gemma 3): as the Hub publishes them (`vision_tower.vision_model.*`,
    `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`), as transformers 4.5x saves
    them (`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`) and as
    transformers 5 does (`vision_tower.embeddings.*` without `vision_model.`, `language_model.model.*`). The vision
    part's names lose `vision_model.`, the text part's are the decoder's (`model.*`, `lm_head.*`)."""
    if name.startswith(("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.")):
        name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        return "vision", "vision_tower." + name.removeprefix("vision_tower.").removeprefix("vision_model.")
    if name.startswith("multi_modal_projector."):
        return "vision", name
    if name.startswith("language_model."):
        rest = name.removeprefix("language_model.")
        return "text", rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
    if name.startswith("lm_head."):
        return "text", name
    raise ValueError(f"unexpected tensor {name!r} in a {family} checkpoint")


@torch.no_grad()
def load_encoder_weights(
    encoder: nn.Module, named_tensors: Iterable[tuple[str, Any]], strict_family: str | None = None
) -> None:
    """Copy the vision part's tensors into `encoder` by name, shapes checked; a parameter left unfilled is an error.
    Tensors it has no parameter for are skipped (the layers past the last one LLaVA reads), or, with
    `strict_family` (a family whose encoder reads every vision tensor), an error naming that family."""
    params = dict(encoder.named_parameters())
    filled = set()
    for name, tensor in named_tensors:
        if name not in params:
            if strict_family is not None:
                raise ValueError(f"unexpected vision tensor {name!r} in a {strict_family} checkpoint")
            continue
        whole = tensor[:] if not isinstance(tensor, torch.Tensor) else tensor
        if params[name].shape != whole.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(whole.shape)} != model {tuple(params[name].shape)}")
        params[name].copy_(whole)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} vision tensors, e.g. {missing[:3]}")
