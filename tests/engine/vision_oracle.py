"""Hugging Face as the vision families' oracle: chat conversations with images, and greedy `generate` through a
folder's own processor, with each token's log-prob (shared by the LLaVA, Qwen2.5-VL and Gemma 3 tests)."""

from __future__ import annotations

from collections.abc import Iterable

from PIL import Image


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
