"""Hugging Face as the vision families' oracle: chat conversations with images, and greedy `generate` through a
folder's own processor, with each token's log-prob; and the engine's side of the same conversations, stepped by
hand (shared by the LLaVA, Qwen2.5-VL and Gemma 3 tests)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from PIL import Image

if TYPE_CHECKING:
    from engine import SamplingParams
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput


def user(text: str, *images: Image.Image) -> list[dict]:
    """One user turn: the images (as transformers' processors take them), then the text."""
    parts = [{"type": "image", "image": picture} for picture in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def hf_greedy_run(
    processor, model, conversation: list[dict], max_tokens: int, drop_inputs: Iterable[str] = ()
) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (exactly `max_tokens`) for a conversation through `processor`, and each token's
    log-prob under the raw logits; `drop_inputs`: processor outputs the model is not given."""
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    images = [part["image"] for part in conversation[0]["content"] if part["type"] == "image"] or None
    inputs = processor(images=images, text=text, return_tensors="pt")
    for name in drop_inputs:
        inputs.pop(name)
    output = model.generate(
        **inputs, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens, output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = output.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, [logits[0].log_softmax(-1)[token].item() for logits, token in zip(output.logits, tokens)]


def step_chats(
    engine: LLMEngine, conversations: list[list[dict]], params: SamplingParams, **extra: object
) -> list[RequestOutput]:
    """Every conversation as one request (images from its image parts; `extra`: more `add_request` arguments),
    stepped to the end, in order."""
    from engine.llm import conversation_images

    for index, conversation in enumerate(conversations):
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conversation), add_special_tokens=False)
        engine.add_request(str(index), ids, params, images=conversation_images(conversation), **extra)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[str(i)] for i in range(len(conversations))]


def first_tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    """Each output's first sample's tokens."""
    return [output.outputs[0].token_ids for output in outputs]
