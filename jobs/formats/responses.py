"""OpenAI's Responses API, `/v1/responses`: input items in, a `response` object out (`jobs.openai_format.responses_api`
holds the body and the object)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from jobs.formats.base import Generation, GenerationResult, LineReader, parse_body, read_sample
from jobs.openai_format.requests import RESPONSES, BatchRequest, PromptTokenizer
from jobs.openai_format.responses import FinishReason, TokenCounts
from jobs.openai_format.responses_api import ResponseObject, ResponsesBody, response_object
from jobs.served_models import ModelKind


class Responses:
    url = RESPONSES
    model_kind: ModelKind = "generation"

    def read(self, custom_id: str, body: dict[str, Any], line: LineReader) -> BatchRequest:
        responses = parse_body(ResponsesBody, body)
        adapter = line.check_model(responses.model, "generation")
        tools = responses.chat_tools()
        plan, constraint = line.with_tools(
            responses.constraint(),
            tools,
            responses.chat_tool_choice(),
            responses.parallel_tool_calls if tools else None,  # without tools it asks nothing
        )
        prompt = line.encode_chat(
            responses.messages(), tools if plan is not None else None, thinking=responses.thinking_asked()
        )
        generation = Generation(
            adapter=adapter,
            prompts=[prompt.token_ids],
            requested_max_tokens=responses.max_output_tokens,
            default_max_tokens=None,
            sampling=responses.model_dump(include={"temperature", "top_p"}, exclude_none=True),
            constraint=constraint,
            tool_calls=plan,
            context=responses.echoed(),  # what the response object repeats of its request
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
    ) -> ResponseObject:
        (result,) = results  # one prompt, one sample: the endpoint has no n
        sample = result.outputs[0]
        answer = read_sample(sample, request, tokenizer)
        return response_object(
            text=answer.text,
            calls=answer.calls,
            reasoning=answer.reasoning,
            reasoning_tokens=answer.reasoning_tokens,
            finish_reason=cast(FinishReason, sample.finish_reason),
            model=model,
            echoed=dict(cast(Mapping[str, Any], request.context)),
            input_tokens=counts.input_tokens,
            output_tokens=counts.output_tokens,
            cached_tokens=counts.cached_tokens,
        )
