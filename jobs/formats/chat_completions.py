"""OpenAI's `/v1/chat/completions`: a conversation in, `chat.completion` out (tool calls found in the text)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

from jobs.formats.base import (
    Generation,
    GeneratedSequence,
    GenerationResult,
    LineReader,
    LineRejected,
    SampleAnswer,
    best_first,
    in_index_order,
    parse_body,
    random_id,
    read_sample,
    token_text,
)
from jobs.openai_format.reasoning import effort_asks
from jobs.openai_format.requests import CHAT_COMPLETIONS, BatchRequest, ChatCompletionBody, PromptTokenizer
from jobs.openai_format.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletion,
    ChatTokenLogprob,
    CompletionTokensDetails,
    FinishReason,
    PromptTokensDetails,
    TokenCounts,
    TopLogprob,
    Usage,
)
from jobs.served_models import ModelKind


class ChatCompletions:
    url = CHAT_COMPLETIONS
    model_kind: ModelKind = "generation"

    def read(self, custom_id: str, body: dict[str, Any], line: LineReader) -> BatchRequest:
        chat = parse_body(ChatCompletionBody, body)
        adapter = line.check_model(chat.model, "generation")
        plan, constraint = line.with_tools(chat.constraint(), chat.tools, chat.tool_choice, chat.parallel_tool_calls)
        prompt = line.encode_chat(
            chat.messages,
            chat.tools if plan is not None else None,
            chat.chat_template_kwargs,
            effort_asks(chat.reasoning_effort, "reasoning_effort"),
        )
        generation = Generation(
            adapter=adapter,
            prompts=[prompt.token_ids],
            requested_max_tokens=chat.max_tokens if chat.max_completion_tokens is None else chat.max_completion_tokens,
            default_max_tokens=None,
            sampling=chat.sampling_kwargs(),
            constraint=constraint,
            logprobs=_logprobs_count(chat),
            logit_bias=chat.logit_bias,
            tool_calls=plan,
            reasoning=prompt.reasoning,
            images=prompt.images,
        )
        return line.request(custom_id, self.url, generation)

    def answer(
        self,
        request: BatchRequest,
        results: Sequence[GenerationResult],
        counts: TokenCounts,
        *,
        model: str,
        tokenizer: PromptTokenizer,
    ) -> ChatCompletion:
        (result,) = results
        wants_logprobs = request.sampling_params.logprobs is not None
        top_n = request.sampling_params.logprobs or 0
        samples = in_index_order(result)
        answers = [read_sample(sample, request, tokenizer) for sample in samples]
        thinks = request.reasoning is not None
        return ChatCompletion(
            id=random_id("chatcmpl-"),
            created=int(time.time()),
            model=model,
            usage=openai_usage(counts, sum(answer.reasoning_tokens for answer in answers) if thinks else None),
            choices=[
                _choice(sample, answer, _logprobs(sample, top_n, tokenizer) if wants_logprobs else None)
                for sample, answer in zip(samples, answers, strict=True)
            ],
        )


def openai_usage(counts: TokenCounts, reasoning_tokens: int | None = None) -> Usage:
    """Chat and completions' usage object; `reasoning_tokens` for a model that thinks."""
    return Usage(
        prompt_tokens=counts.input_tokens,
        completion_tokens=counts.output_tokens,
        total_tokens=counts.input_tokens + counts.output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached_tokens),
        completion_tokens_details=(
            None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        ),
    )


def _logprobs_count(chat: ChatCompletionBody) -> int | None:
    if chat.top_logprobs is not None and not chat.logprobs:
        raise LineRejected("invalid_parameter", "top_logprobs requires logprobs to be true")
    return (chat.top_logprobs or 0) if chat.logprobs else None


def _choice(sample: GeneratedSequence, answer: SampleAnswer, logprobs: ChatChoiceLogprobs | None) -> ChatChoice:
    finish_reason = cast(FinishReason, sample.finish_reason)  # aborted samples were answered before
    if answer.calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return ChatChoice(
        index=sample.index,
        message=AssistantMessage(
            content=answer.text, tool_calls=answer.calls or None, reasoning_content=answer.reasoning
        ),
        logprobs=logprobs,
        finish_reason=finish_reason,
    )


def _logprobs(sample: GeneratedSequence, top_n: int, tokenizer: PromptTokenizer) -> ChatChoiceLogprobs | None:
    if sample.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> TopLogprob:
        token = token_text(tokenizer, token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    content = []
    for token_id, candidates in zip(sample.token_ids, sample.logprobs, strict=True):
        sampled = entry(token_id, candidates[token_id])
        # The engine adds the sampled token to the top-N when it ranks lower; OpenAI lists exactly N.
        top = [entry(candidate_id, logprob) for candidate_id, logprob in best_first(candidates)[:top_n]]
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)
