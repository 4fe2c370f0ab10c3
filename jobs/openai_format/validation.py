"""The OpenAI Batch file format, checked: one input line in, one engine request (or an error) out.

An input line is `{"custom_id", "method": "POST", "url", "body"}`; an output line is
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}` with exactly one of
`response` and `error` set. Every problem with a line becomes an error record for that line, never an
exception, so one bad line cannot fail a whole file.

Pure apart from a tokenizer (prompts must be counted against the context): the service's `validate`
task and the offline `conveyor run` command share it without loading a model. Embedding lines need no
tokenizer to validate; `embedding_records` answers them with whatever `TextEmbedder` the caller holds.

max_tokens policy (OpenAI's): a prompt must leave room for at least one generated token. An explicit
`max_tokens` / `max_completion_tokens` that does not fit beside the prompt is rejected with
`context_length_exceeded`, as OpenAI does, rather than silently shortened. Without one, chat completions
may use the whole remaining context and completions default to 16 tokens, cut to the remaining context.

Admission: with the engine's `AdmissionLimits` (engine/admission.py), a line whose whole cost the engine would
refuse (too many sequences, more KV blocks than the pool, a max_tokens over the operator's limit) is refused here,
at validation, with `request_too_large`; a line without max_tokens then gets the deployment's default.

A line can also break the reader itself: JSON nested thousands of levels deep, or a lone UTF-16 surrogate escape
that no output file could hold (`jobs.json_lines`). Each is that line's `invalid_line` error, and any
other exception a line provokes while it is checked is caught at `validate`, logged, and becomes that line's
error too: whatever the input, validation answers every line.

Embeddings policy: a text longer than the embedding model's max_seq_length is truncated, as
sentence-transformers (the model's own library) does, where OpenAI would refuse the request; usage counts
the tokens after truncation. Empty strings and token-id inputs are refused per line (OpenAI refuses the
former; OpenAI's token ids mean nothing to another model's vocabulary). `dimensions` is accepted only when
it equals the model's dimension, which is known once the model is loaded, so that check happens when the
line runs, not in validate.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.admission import AdmissionLimits, AdmissionRefused, admit
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputParams
from jobs.formats.base import ChatPrompt, Generation, LineRejected
from jobs.formats.registry import FORMATS
from jobs.json_lines import UnreadableLine, load_json_line
from jobs.images.inputs import ImageInputs, ImageLimits
from jobs.openai_format.requests import (
    BatchRequest,
    ChatMessage,
    ContentPart,
    EmbeddingRequest,
    PromptTokenizer,
    TextPart,
)
from jobs.openai_format.reasoning import ThinkingAsked, after_thinking, reasoning_plan, thinking_variables
from jobs.openai_format.responses import ErrorCode
from jobs.openai_format.structured_output import ConstraintRejected
from jobs.openai_format.tool_calls import (
    Tool,
    ToolCallPlan,
    ToolChoice,
    generic_tool_prompt,
    plan_tool_calls,
    template_messages,
)
from jobs.openai_format.tool_syntax import HERMES, detect_call_syntax
from jobs.served_models import ModelKind, ModelNames

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LineError:
    """Why a line cannot run. custom_id is None when the line did not carry a readable one."""

    custom_id: str | None
    code: ErrorCode
    message: str


def _template_content(
    content: str | list[ContentPart], with_images: bool, as_parts: bool
) -> str | list[dict[str, str]]:
    """A message's content as the template is given it: its texts joined, or (`as_parts`) transformers' list of parts,
    with each image part `{"type": "image"}` when `with_images`."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if as_parts else content
    if with_images:
        return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in content]
    if as_parts:
        return [{"type": "text", "text": part.text} for part in content if isinstance(part, TextPart)]
    return "\n".join(part.text for part in content if isinstance(part, TextPart))


# A template that loops over a message's content and never asks whether it is a string reads parts only (LLaVA-1.5's
# processors' template): a string would render as no text at all. vLLM detects the same ("openai" content format).
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+message\s*(\[\s*['\"]content['\"]\s*\]|\.content)")


def reads_parts_only(template: str | None) -> bool:
    """Whether the chat template takes a message's content only as a list of parts."""
    return template is not None and bool(_CONTENT_LOOP.search(template)) and "is string" not in template


class BatchLineValidator:
    """Validates the lines of one batch input file, in order.

    One validator per file: it remembers the custom_ids it has seen, and every later line that repeats
    one is rejected (the first keeps running). `endpoint` is the batch's endpoint, which every line's url
    must match; None accepts every endpoint conveyor serves. `models` resolves a line's `model` to a model this
    process serves; `batch_model`, when set, is the one model every line must resolve to (a batch runs one model,
    the one its first line names). A line without `model` is answered by the batch's (or this process's) model.
    """

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        max_model_len: int,
        endpoint: str | None = None,
        *,
        models: ModelNames,
        batch_model: str | None = None,
        limits: AdmissionLimits | None = None,
        image_limits: ImageLimits = ImageLimits(),
    ) -> None:
        """limits: the engine's admission limits; None checks the context length only. image_limits: the
        deployment's `CONVEYOR_IMAGE_*` (a line's image count is checked here; the rest when its images are read)."""
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._endpoint = endpoint
        self._models = models
        self._batch_model = batch_model
        self._limits = limits
        self._image_limits = image_limits
        # The template's own tool-call syntax, None for the generic format (which writes Hermes' syntax)
        self._call_syntax = detect_call_syntax(tokenizer.chat_template)
        self._parts_only = reads_parts_only(tokenizer.chat_template)
        self._seen_custom_ids: set[str] = set()

    def validate(self, line: str | bytes) -> BatchRequest | EmbeddingRequest | LineError:
        custom_id: str | None = None
        try:
            fields = _parse_json_object(line)
            custom_id = _read_custom_id(fields)
            if custom_id in self._seen_custom_ids:
                raise LineRejected("duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line")
            self._seen_custom_ids.add(custom_id)
            url = self._read_url(fields)
            return self._build_request(custom_id, url, fields.get("body"))
        except LineRejected as rejected:
            return LineError(custom_id=custom_id, code=rejected.code, message=rejected.message)
        except Exception as failure:  # the bulkhead: whatever a line provokes fails that line alone
            log.exception("a batch line broke its validation")
            return LineError(custom_id, "invalid_line", f"the line could not be checked: {type(failure).__name__}: {failure}")

    def _read_url(self, fields: Mapping[str, Any]) -> str:
        method = fields.get("method")
        if method != "POST":
            raise LineRejected("invalid_method", f"method must be 'POST', got {method!r}")
        url = fields.get("url")
        if url not in FORMATS:
            raise LineRejected("invalid_url", f"url must be one of {list(FORMATS)}, got {url!r}")
        if self._endpoint is not None and url != self._endpoint:
            raise LineRejected(
                "mismatched_endpoint", f"url {url!r} does not match the batch's endpoint {self._endpoint!r}"
            )
        return url

    def _build_request(self, custom_id: str, url: str, body: object) -> BatchRequest | EmbeddingRequest:
        if body is None:
            raise LineRejected("invalid_body", "missing 'body': the request to run")
        if not isinstance(body, dict):
            raise LineRejected("invalid_body", f"'body' must be a JSON object, got {type(body).__name__}")
        try:
            return FORMATS[url].read(custom_id, body, self)
        except ConstraintRejected as rejected:
            raise LineRejected(rejected.code, rejected.message) from None

    # The `jobs.formats.base.LineReader` a format reads its body with

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self._tokenizer

    def request(self, custom_id: str, url: str, generation: Generation) -> BatchRequest:
        self._check_vocabulary("stop_token_ids", generation.sampling.get("stop_token_ids", []))
        # The prompts of one line share their parameters, fitted to the longest: what fits it fits every one.
        longest = max(len(prompt) for prompt in generation.prompts)
        max_tokens = self._fit_max_tokens(longest, generation.requested_max_tokens, generation.default_max_tokens)
        try:
            bias = self._logit_bias(generation.logit_bias)
            constraint = generation.constraint
            if constraint is not None and generation.reasoning is not None:  # the answer is constrained, not the thinking
                constraint = after_thinking(constraint, generation.reasoning)
            params = SamplingParams(
                **generation.sampling,
                max_tokens=max_tokens,
                logprobs=generation.logprobs,
                prompt_logprobs=generation.prompt_logprobs,
                structured_output=constraint,
                logit_bias=bias,
                adapter=generation.adapter,
            )
        except ValueError as invalid:
            raise LineRejected("invalid_parameter", str(invalid)) from None
        if self._limits is not None:
            try:
                admitted = admit(longest, params, self._limits)
            except AdmissionRefused as refused:
                raise LineRejected("request_too_large", str(refused)) from None
            # An image line's max_tokens is resolved on its prompt with the images' placeholders, once they are known
            # (jobs.images.engine_prompt): resolved on its text alone, it would be more than the context leaves.
            if generation.images is None:
                params = admitted
        return BatchRequest(
            custom_id,
            url,
            generation.prompts,
            params,
            generation.tool_calls,
            generation.context,
            generation.reasoning,
            generation.images,
        )

    def with_tools(
        self,
        constraint: StructuredOutputParams | None,
        tools: list[Tool] | None,
        tool_choice: ToolChoice | None,
        parallel_tool_calls: bool | None,
    ) -> tuple[ToolCallPlan | None, StructuredOutputParams | None]:
        """The line's tool plan, and its one output constraint: the format it asks for, or its tool calls' in the
        template's syntax (tool_calls.py)."""
        plan, tool_constraint = plan_tool_calls(tools, tool_choice, parallel_tool_calls, self._call_syntax or HERMES)
        if constraint is not None and tool_constraint is not None:
            raise LineRejected(
                "invalid_parameter",
                "an output format (response_format, text.format or guided_*) cannot be combined with tools a call may use",
            )
        return plan, constraint or tool_constraint

    def check_model(self, name: str | None, kind: ModelKind) -> str | None:
        """Rejects a `model` no one serves, or of another base model than the batch's; returns the LoRA adapter it
        names (None: the base model)."""
        if name is None:
            return None
        served = self._models.resolve(name, kind)
        if served is None:
            raise LineRejected(
                "model_not_found", f"The model {name!r} does not exist or is not served by this deployment"
            )
        if self._batch_model is not None and self._models.base_of(served) != self._batch_model:
            raise LineRejected(
                "model_not_found",
                f"The model {name!r} is not this batch's: a batch runs one model, {self._batch_model!r} "
                "(the model its first line names) or its adapters",
            )
        return self._models.adapter(served)

    def _logit_bias(self, logit_bias: dict[str, float] | None) -> dict[int, float]:
        if not logit_bias:
            return {}
        if not all(key.isdigit() for key in logit_bias):
            raise ValueError(f"logit_bias keys must be token ids, got {[k for k in logit_bias if not k.isdigit()][:5]}")
        bias = {int(key): value for key, value in logit_bias.items()}
        self._check_vocabulary("logit_bias", list(bias))
        return bias

    def encode_chat(
        self,
        messages: list[ChatMessage],
        tools: list[Tool] | None,
        template_kwargs: Mapping[str, Any] | None = None,
        thinking: ThinkingAsked | None = None,
    ) -> ChatPrompt:
        refs = [ref for message in messages for ref in message.image_refs()]
        if len(refs) > self._image_limits.max_per_line:
            raise LineRejected(
                "too_many_images", f"the line has {len(refs)} images, over the limit of {self._image_limits.max_per_line}"
            )
        conversation = self._template_conversation(messages, tools, with_images=False)
        template_tools = None
        if tools and self._call_syntax is not None:
            template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
        try:
            variables = thinking_variables(self._tokenizer.chat_template, template_kwargs, thinking)
        except ValueError as refusal:
            raise LineRejected("invalid_body", str(refusal)) from None
        tools_argument = {"tools": template_tools} if template_tools else {}
        # An image line's prompt here is its text alone: what the line's checks count. The model's own rendering, with
        # its image tokens, needs the decoded images, and is made when its chunk runs (`BatchRequest.images`).
        images = None
        if refs:
            multimodal = self._template_conversation(messages, tools, with_images=True)
            images = ImageInputs(multimodal, tuple(refs), {**tools_argument, **variables})
        try:
            text = self._tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, **tools_argument, **variables
            )
        except Exception as failure:  # the template is the model's code; it may refuse a conversation by raising
            raise LineRejected("invalid_body", f"the model's chat template rejected 'messages': {failure}") from None
        # The template already wrote the special tokens; adding them again would double the BOS.
        token_ids = self._non_empty(self._tokenizer.encode(text, add_special_tokens=False))
        return ChatPrompt(token_ids, reasoning_plan(self._tokenizer.chat_template, text), images)

    def _template_conversation(
        self, messages: list[ChatMessage], tools: list[Tool] | None, *, with_images: bool
    ) -> list[dict[str, Any]]:
        """The messages as the chat template is given them. Templates rarely know OpenAI's newer "developer" role; it
        means what "system" always meant. A message's `name` goes to the template too: templates that have a place
        for it (e.g. Llama 3's tool turns, some Mistral ones) use it, the rest leave it out, as with OpenAI's own
        models. A message of parts is its texts joined, or `with_images`, transformers' multimodal content list,
        each image part `{"type": "image"}`; a template that reads parts only (`reads_parts_only`) gets every
        message's content as parts, a string as one text part."""
        conversation = [
            {
                **message.model_dump(exclude_none=True),
                "role": "system" if message.role == "developer" else message.role,
                **(
                    {"content": _template_content(message.content, with_images, self._parts_only)}
                    if isinstance(message.content, list) or (self._parts_only and isinstance(message.content, str))
                    else {}
                ),
            }
            for message in messages
        ]
        conversation = template_messages(conversation, self._call_syntax)
        if tools and self._call_syntax is None:
            conversation = generic_tool_prompt(conversation, tools)
        return conversation

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._non_empty(self._tokenizer.encode(prompt))
        self._check_vocabulary("prompt", prompt)
        return self._non_empty(prompt)

    def _check_vocabulary(self, field: str, token_ids: list[int]) -> None:
        # An id past the embedding table would crash the engine mid-batch, taking every other line with it.
        unknown = [token_id for token_id in token_ids if token_id >= self._tokenizer.vocab_size]
        if unknown:
            raise LineRejected(
                "invalid_parameter",
                f"'{field}' holds token ids outside the vocabulary (size {self._tokenizer.vocab_size}): {unknown[:5]}",
            )

    @staticmethod
    def _non_empty(token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise LineRejected("invalid_body", "the prompt is empty")
        return token_ids

    def _fit_max_tokens(self, prompt_tokens: int, requested: int | None, default: int | None) -> int | None:
        """The max_tokens to run with; None leaves it to the admission limits' deployment default."""
        room = self._max_model_len - prompt_tokens
        if room < 1:
            raise LineRejected(
                "context_length_exceeded",
                f"This model's maximum context length is {self._max_model_len} tokens, but the prompt has "
                f"{prompt_tokens} tokens, leaving no room for a completion. Please shorten the prompt.",
            )
        if requested is None:
            if default is None:
                return None if self._limits is not None else room
            return min(default, room)
        if requested > room:
            raise LineRejected(
                "context_length_exceeded",
                f"This model's maximum context length is {self._max_model_len} tokens. However, you requested "
                f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the "
                f"completion). Please reduce the prompt or max_tokens.",
            )
        return requested


def _parse_json_object(line: str | bytes) -> Mapping[str, Any]:
    try:
        value = load_json_line(line)
    except UnreadableLine as unreadable:
        raise LineRejected("invalid_line", str(unreadable)) from None
    except ValueError as invalid:  # also covers bytes that are not UTF-8
        raise LineRejected("invalid_json_line", f"line is not valid JSON: {invalid}") from None
    if not isinstance(value, dict):
        raise LineRejected("invalid_json_line", f"line must be a JSON object, got {type(value).__name__}")
    return value


def _read_custom_id(fields: Mapping[str, Any]) -> str:
    custom_id = fields.get("custom_id")
    if custom_id is None:
        raise LineRejected("invalid_custom_id", "missing 'custom_id': every line needs a unique id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineRejected("invalid_custom_id", f"custom_id must be a non-empty string, got {custom_id!r}")
    return custom_id
