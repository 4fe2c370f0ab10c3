"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(conversations, params)`."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from engine.llm_engine import LLMEngine
from engine.model_registry import DEFAULT_MODEL
from engine.multimodal.inputs import ImageInput, PlacedImage
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        load_format: str = "auto",
        **engine_options: object,
    ) -> None:
        self.engine = LLMEngine(model, dtype=dtype, device=device, load_format=load_format, **engine_options)
        self._next_id = 0

    def add_lora(self, name: str, folder: str) -> None:
        """Register a PEFT LoRA adapter folder as `name` (LLMEngine.add_lora); requests pick it with
        SamplingParams(adapter=name)."""
        self.engine.add_lora(name, folder)

    @property
    def tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError(f"model {self.engine.model_name!r} has no tokenizer; pass token ids")
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: Sequence[int] | None = None,
        images: Sequence[Sequence[ImageInput | PlacedImage]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. `use_tqdm`: a progress bar on stderr
        (requests done, output tokens/s, ETA), or a tqdm subclass (or factory) to show it some other way. `images`:
        per prompt, its images, one image token each in the prompt (LLMEngine.add_request)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        images_list = list(images) if images is not None else [()] * len(prompts)
        if len(images_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images_list)} image lists")

        ids: list[str] = []
        texts: dict[str, str | None] = {}
        try:
            for prompt, p, prio, prompt_images in zip(prompts, params_list, priorities, images_list):
                request_id = str(self._next_id)
                self._next_id += 1
                token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self.engine.add_request(request_id, token_ids, p, priority=prio, images=prompt_images)
                ids.append(request_id)
                texts[request_id] = prompt if isinstance(prompt, str) else None
        except BaseException:
            # One bad prompt fails the call; the ones already added must not linger in the engine,
            # holding KV blocks and running along with the next call.
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, texts, use_tqdm)

    def chat(
        self,
        conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. A message's content may be a list
        of parts in transformers' form: `{"type": "text", "text": ...}` and, for a vision-language model,
        `{"type": "image", "image": <RGB PIL image>, "detail": "auto"}` (detail optional)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        token_lists = [
            self.tokenizer.encode(self.tokenizer.apply_chat_template(list(c)), add_special_tokens=False)
            for c in conversations
        ]
        images = [conversation_images(c) for c in conversations]
        return self.generate(token_lists, params, use_tqdm=use_tqdm, images=images)

    def _run(
        self, ids: list[str], texts: dict[str, str | None], use_tqdm: bool | Callable[..., tqdm]
    ) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(ids), desc="requests", unit="req", disable=use_tqdm is False, file=sys.stderr)
        generated = 0
        while len(done) < len(ids):
            for output in self.engine.step():
                if output.finished:
                    output.prompt = texts.get(output.request_id)
                    done[output.request_id] = output
                    generated += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = 0 if bar.disable else bar.format_dict["elapsed"]
                    if elapsed > 0:
                        bar.set_postfix_str(f"{generated / elapsed:.1f} output tok/s", refresh=False)
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]


def conversation_images(messages: Sequence[dict[str, Any]]) -> list[ImageInput]:
    """The image parts of a conversation, in the order the chat template meets them (message by message)."""
    images = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image":
                if "image" not in part:
                    raise ValueError('an image part needs its decoded image: {"type": "image", "image": <PIL image>}')
                images.append(ImageInput(part["image"], part.get("detail", "auto")))
    return images
