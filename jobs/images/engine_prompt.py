"""An image line as the engine runs it: its prompt rendered by the model's chat template with the image parts in
(`{"type": "image"}`, one image token each), the engine's image placeholders expanded and the pixels prepared, and
its limits checked again on the expanded prompt.

A line's checks (`jobs.openai_format.validation`) count its text alone: the placeholders an image becomes are only
known to the model's preprocessing, once the image is decoded. Here, on the chunk's thread (never the engine's), the
prompt is expanded and counted as the engine will hold it: in the context length, the admission limits and the
line's `usage.prompt_tokens`, which counts every placeholder token (576 per image for LLaVA-1.5 at 336 px; for
Qwen2.5-VL one per 28 x 28 px block of the image as its preprocessing resizes it; for Gemma 3 256 and the few tokens
its processor writes around them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.admission import AdmissionLimits, AdmissionRefused, admit
from engine.multimodal.inputs import ImageInput
from jobs.images.inputs import LineImages
from jobs.openai_format.requests import BatchRequest, PromptTokenizer
from jobs.openai_format.validation import LineError

if TYPE_CHECKING:  # the API process imports no torch: the engine's placed images only pass through here
    from engine.multimodal.inputs import PlacedImage
    from engine.sampling_params import SamplingParams


class ImagePlacer(Protocol):
    """What of the engine an image line needs: `LLMEngine` is one."""

    @property
    def max_model_len(self) -> int: ...

    def place_images(
        self, prompt_token_ids: list[int], images: list[ImageInput]
    ) -> tuple[list[int], tuple[PlacedImage, ...]]: ...


@dataclass(frozen=True)
class PlacedLine:
    """An image line ready for the engine: its expanded prompt, its images placed in it, its admitted parameters."""

    prompt_token_ids: list[int]
    images: tuple[PlacedImage, ...]
    params: SamplingParams


def place_line(
    request: BatchRequest,
    images: LineImages,
    tokenizer: PromptTokenizer,
    engine: ImagePlacer,
    limits: AdmissionLimits,
) -> PlacedLine | LineError:
    """The line's prompt as the engine runs it, or its error: `model_not_multimodal` (the engine reads text only),
    `invalid_body` (the template refused the conversation, or wrote another number of image tokens than the line has
    images), `invalid_parameter` (an image the model's preprocessing refuses, e.g. a `detail` it has no meaning for),
    `context_length_exceeded` or `request_too_large` (the expanded prompt does not fit)."""
    custom_id = request.custom_id
    try:
        text = tokenizer.apply_chat_template(images.messages, add_generation_prompt=True, **images.template_arguments)
    except Exception as failure:  # the template is the model's code; it may refuse a conversation by raising
        return LineError(custom_id, "invalid_body", f"the model's chat template rejected 'messages': {failure}")
    # The template already wrote the special tokens; adding them again would double the BOS.
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    inputs = [ImageInput(image, detail) for image, detail in zip(images.images, images.details, strict=True)]
    try:
        expanded, placed = engine.place_images(token_ids, inputs)
    except ValueError as refused:
        message = str(refused)
        if "model_not_multimodal" in message:
            return LineError(custom_id, "model_not_multimodal", message)
        if "image token(s)" in message:  # the template did not write one image token per image part
            return LineError(custom_id, "invalid_body", f"the model's chat template and the line's images differ: {message}")
        return LineError(custom_id, "invalid_parameter", message)
    params = request.sampling_params
    max_model_len = engine.max_model_len
    room = max_model_len - len(expanded)
    if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
        asked = "" if params.max_tokens is None else f" and {params.max_tokens} for the completion"
        return LineError(
            custom_id,
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has {len(expanded)} tokens "
            f"with its images' placeholders{asked}. Please send fewer or smaller images, or reduce max_tokens.",
        )
    try:
        params = admit(len(expanded), params, limits)
    except AdmissionRefused as refused:
        return LineError(custom_id, "request_too_large", str(refused))
    return PlacedLine(expanded, placed, params)


def locate(error: LineError, line_number: int) -> LineError:
    """The error as validate locates its errors: the client finds the line in its input file."""
    return dataclasses.replace(error, message=f"line {line_number}: {error.message}")
