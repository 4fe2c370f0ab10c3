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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from engine.admission import AdmissionLimits, AdmissionRefused, admit
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputParams
from jobs.json_lines import UnreadableLine, load_json_line
from jobs.openai_format.requests import (
    CHAT_COMPLETIONS,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    EMBEDDINGS,
    ENDPOINTS,
    BatchRequest,
    ChatCompletionBody,
    ChatMessage,
    CompletionBody,
    EmbeddingBody,
    EmbeddingRequest,
    Endpoint,
    PromptTokenizer,
    RESPONSES,
)
from jobs.openai_format.responses import ErrorCode
from jobs.openai_format.responses_api import ResponsesBody
from jobs.openai_format.structured_output import ConstraintRejected
from jobs.openai_format.tool_calls import (
    Tool,
    ToolCallPlan,
    ToolChoice,
    generic_tool_prompt,
    plan_tool_calls,
    template_messages,
)
from jobs.openai_format.tool_syntax import HERMES, CallSyntax, detect_call_syntax
from jobs.served_models import ModelKind, ModelNames

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LineError:
    """Why a line cannot run. custom_id is None when the line did not carry a readable one."""

    custom_id: str | None
    code: ErrorCode
    message: str


class _LineRejected(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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
        endpoint: Endpoint | None = None,
        *,
        models: ModelNames,
        batch_model: str | None = None,
        limits: AdmissionLimits | None = None,
    ) -> None:
        """limits: the engine's admission limits; None checks the context length only."""
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._endpoint = endpoint
        self._models = models
        self._batch_model = batch_model
        self._limits = limits
        # The template's own tool-call syntax, None for the generic format (which writes Hermes' syntax)
        self._call_syntax = detect_call_syntax(tokenizer.chat_template)
        self._seen_custom_ids: set[str] = set()

    def validate(self, line: str | bytes) -> BatchRequest | EmbeddingRequest | LineError:
        custom_id: str | None = None
        try:
            fields = _parse_json_object(line)
            custom_id = _read_custom_id(fields)
            if custom_id in self._seen_custom_ids:
                raise _LineRejected("duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line")
            self._seen_custom_ids.add(custom_id)
            url = self._read_url(fields)
            return self._build_request(custom_id, url, fields.get("body"))
        except _LineRejected as rejected:
            return LineError(custom_id=custom_id, code=rejected.code, message=rejected.message)
        except Exception as failure:  # the bulkhead: whatever a line provokes fails that line alone
            log.exception("a batch line broke its validation")
            return LineError(custom_id, "invalid_line", f"the line could not be checked: {type(failure).__name__}: {failure}")

    def _read_url(self, fields: Mapping[str, Any]) -> Endpoint:
        method = fields.get("method")
        if method != "POST":
            raise _LineRejected("invalid_method", f"method must be 'POST', got {method!r}")
        url = fields.get("url")
        if url not in ENDPOINTS:
            raise _LineRejected("invalid_url", f"url must be one of {list(ENDPOINTS)}, got {url!r}")
        if self._endpoint is not None and url != self._endpoint:
            raise _LineRejected(
                "mismatched_endpoint", f"url {url!r} does not match the batch's endpoint {self._endpoint!r}"
            )
        return url

    def _build_request(self, custom_id: str, url: Endpoint, body: object) -> BatchRequest | EmbeddingRequest:
        if body is None:
            raise _LineRejected("invalid_body", "missing 'body': the request to run")
        if not isinstance(body, dict):
            raise _LineRejected("invalid_body", f"'body' must be a JSON object, got {type(body).__name__}")
        if url == EMBEDDINGS:
            embedding = _parse_body(EmbeddingBody, body)
            self._check_model(embedding.model, "embedding")
            encoding_format = embedding.encoding_format or "float"
            return EmbeddingRequest(custom_id, embedding.input, encoding_format, embedding.dimensions)
        plan = None
        echo_texts, response_fields, logit_bias, prompt_logprobs = None, None, None, None
        try:
            if url == CHAT_COMPLETIONS:
                chat = _parse_body(ChatCompletionBody, body)
                adapter = self._check_model(chat.model, "generation")
                plan, constraint = _with_tools(
                    chat.constraint(), chat.tools, chat.tool_choice, chat.parallel_tool_calls, self._call_syntax or HERMES
                )
                prompts = [self._encode_chat(chat.messages, chat.tools if plan is not None else None)]
                requested_max_tokens = chat.max_tokens if chat.max_completion_tokens is None else chat.max_completion_tokens
                default_max_tokens = None
                logprobs = _chat_logprobs_count(chat)
                sampling = chat.sampling_kwargs()
                logit_bias = chat.logit_bias
            elif url == RESPONSES:
                responses = _parse_body(ResponsesBody, body)
                adapter = self._check_model(responses.model, "generation")
                tools = responses.chat_tools()
                plan, constraint = _with_tools(
                    responses.constraint(),
                    tools,
                    responses.chat_tool_choice(),
                    responses.parallel_tool_calls if tools else None,  # without tools it asks nothing
                    self._call_syntax or HERMES,
                )
                prompts = [self._encode_chat(responses.messages(), tools if plan is not None else None)]
                requested_max_tokens = responses.max_output_tokens
                default_max_tokens = None
                logprobs = None
                sampling = responses.model_dump(include={"temperature", "top_p"}, exclude_none=True)
                response_fields = responses.echoed()
            else:
                completion = _parse_body(CompletionBody, body)
                adapter = self._check_model(completion.model, "generation")
                constraint = completion.constraint()
                prompts = [self._encode_prompt(prompt) for prompt in completion.prompt]
                requested_max_tokens = completion.max_tokens
                default_max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
                logprobs = completion.logprobs
                sampling = completion.sampling_kwargs()
                echo_texts = self._echo_texts(completion) if completion.echo else None
                # Echo with logprobs reports the prompt tokens' log-probs too (as many alternatives as the completion's).
                prompt_logprobs = completion.logprobs if completion.echo else None
                logit_bias = completion.logit_bias
        except ConstraintRejected as rejected:
            raise _LineRejected(rejected.code, rejected.message) from None
        self._check_vocabulary("stop_token_ids", sampling.get("stop_token_ids", []))
        # The prompts of one line share their parameters, fitted to the longest: what fits it fits every one.
        longest = max(len(prompt) for prompt in prompts)
        max_tokens = self._fit_max_tokens(longest, requested_max_tokens, default_max_tokens)
        try:
            bias = self._logit_bias(logit_bias)
            params = SamplingParams(
                **sampling,
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_output=constraint,
                logit_bias=bias,
                adapter=adapter,
            )
        except ValueError as invalid:
            raise _LineRejected("invalid_parameter", str(invalid)) from None
        if self._limits is not None:
            try:
                params = admit(longest, params, self._limits)
            except AdmissionRefused as refused:
                raise _LineRejected("request_too_large", str(refused)) from None
        return BatchRequest(custom_id, url, prompts, params, echo_texts, response_fields, plan)

    def _echo_texts(self, completion: CompletionBody) -> list[str]:
        return [
            prompt if isinstance(prompt, str) else self._tokenizer.decode(prompt, skip_special_tokens=False)
            for prompt in completion.prompt
        ]

    def _check_model(self, name: str | None, kind: ModelKind) -> str | None:
        """Rejects a `model` no one serves, or of another base model than the batch's; returns the LoRA adapter it
        names (None: the base model)."""
        if name is None:
            return None
        served = self._models.resolve(name, kind)
        if served is None:
            raise _LineRejected(
                "model_not_found", f"The model {name!r} does not exist or is not served by this deployment"
            )
        if self._batch_model is not None and self._models.base_of(served) != self._batch_model:
            raise _LineRejected(
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

    def _encode_chat(self, messages: list[ChatMessage], tools: list[Tool] | None) -> list[int]:
        # Templates rarely know OpenAI's newer "developer" role; it means what "system" always meant.
        # A message's `name` goes to the template too: templates that have a place for it (e.g. Llama 3's tool turns,
        # some Mistral ones) use it, the rest leave it out, as with OpenAI's own models.
        conversation = [
            {**message.model_dump(exclude_none=True), "role": "system" if message.role == "developer" else message.role}
            for message in messages
        ]
        conversation = template_messages(conversation, self._call_syntax)
        template_tools = None
        if tools and self._call_syntax is not None:
            template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
        elif tools:
            conversation = generic_tool_prompt(conversation, tools)
        try:
            tools_argument = {"tools": template_tools} if template_tools else {}
            text = self._tokenizer.apply_chat_template(conversation, add_generation_prompt=True, **tools_argument)
        except Exception as failure:  # the template is the model's code; it may refuse a conversation by raising
            raise _LineRejected("invalid_body", f"the model's chat template rejected 'messages': {failure}") from None
        # The template already wrote the special tokens; adding them again would double the BOS.
        return self._non_empty(self._tokenizer.encode(text, add_special_tokens=False))

    def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._non_empty(self._tokenizer.encode(prompt))
        self._check_vocabulary("prompt", prompt)
        return self._non_empty(prompt)

    def _check_vocabulary(self, field: str, token_ids: list[int]) -> None:
        # An id past the embedding table would crash the engine mid-batch, taking every other line with it.
        unknown = [token_id for token_id in token_ids if token_id >= self._tokenizer.vocab_size]
        if unknown:
            raise _LineRejected(
                "invalid_parameter",
                f"'{field}' holds token ids outside the vocabulary (size {self._tokenizer.vocab_size}): {unknown[:5]}",
            )

    @staticmethod
    def _non_empty(token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise _LineRejected("invalid_body", "the prompt is empty")
        return token_ids

    def _fit_max_tokens(self, prompt_tokens: int, requested: int | None, default: int | None) -> int | None:
        """The max_tokens to run with; None leaves it to the admission limits' deployment default."""
        room = self._max_model_len - prompt_tokens
        if room < 1:
            raise _LineRejected(
                "context_length_exceeded",
                f"This model's maximum context length is {self._max_model_len} tokens, but the prompt has "
                f"{prompt_tokens} tokens, leaving no room for a completion. Please shorten the prompt.",
            )
        if requested is None:
            if default is None:
                return None if self._limits is not None else room
            return min(default, room)
        if requested > room:
            raise _LineRejected(
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
        raise _LineRejected("invalid_line", str(unreadable)) from None
    except ValueError as invalid:  # also covers bytes that are not UTF-8
        raise _LineRejected("invalid_json_line", f"line is not valid JSON: {invalid}") from None
    if not isinstance(value, dict):
        raise _LineRejected("invalid_json_line", f"line must be a JSON object, got {type(value).__name__}")
    return value


def _read_custom_id(fields: Mapping[str, Any]) -> str:
    custom_id = fields.get("custom_id")
    if custom_id is None:
        raise _LineRejected("invalid_custom_id", "missing 'custom_id': every line needs a unique id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineRejected("invalid_custom_id", f"custom_id must be a non-empty string, got {custom_id!r}")
    return custom_id


BodyT = TypeVar("BodyT", ChatCompletionBody, CompletionBody, EmbeddingBody, ResponsesBody)


_OUT_OF_RANGE_ERRORS = {"greater_than_equal", "less_than_equal", "too_short", "too_long"}


def _parse_body(model: type[BodyT], body: dict[str, Any]) -> BodyT:
    try:
        return model.model_validate(body)
    except ValidationError as invalid:
        first = invalid.errors(include_url=False)[0]
        code: ErrorCode = "invalid_parameter" if first["type"] in _OUT_OF_RANGE_ERRORS else "invalid_body"
        more = f" (and {invalid.error_count() - 1} more problems)" if invalid.error_count() > 1 else ""
        raise _LineRejected(code, _describe(first) + more) from None


def _describe(error: ErrorDetails) -> str:
    where = "body" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
    match error["type"]:
        case "missing":
            return f"missing required parameter '{where}'"
        case "extra_forbidden":
            return f"unsupported parameter '{where}'"
        case "value_error":  # raised by this module's own validators: their message is the whole story
            return f"invalid '{where}': {error['ctx']['error']}"
        case _:
            return f"invalid '{where}': {error['msg']}"


def _with_tools(
    constraint: StructuredOutputParams | None,
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    syntax: CallSyntax,
) -> tuple[ToolCallPlan | None, StructuredOutputParams | None]:
    """The line's tool plan, and its one output constraint: the format it asks for, or its tool calls' in the
    template's `syntax` (tool_calls.py)."""
    plan, tool_constraint = plan_tool_calls(tools, tool_choice, parallel_tool_calls, syntax)
    if constraint is not None and tool_constraint is not None:
        raise _LineRejected(
            "invalid_parameter",
            "an output format (response_format, text.format or guided_*) cannot be combined with tools a call may use",
        )
    return plan, constraint or tool_constraint


def _chat_logprobs_count(chat: ChatCompletionBody) -> int | None:
    if chat.top_logprobs is not None and not chat.logprobs:
        raise _LineRejected("invalid_parameter", "top_logprobs requires logprobs to be true")
    return (chat.top_logprobs or 0) if chat.logprobs else None
