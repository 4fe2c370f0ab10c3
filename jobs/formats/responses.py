"""OpenAI's Responses API, `/v1/responses`: input items in, a `response` object out (`jobs.openai_format.responses_api`
holds the body and the object)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from jobs.formats.base import Generation, GenerationResult, LineReader, parse_body
from jobs.openai_format.reasoning import reasoning_token_count, split_reasoning
from jobs.openai_format.requests import RESPONSES, BatchRequest, PromptTokenizer
from jobs.openai_format.responses import FinishReason, TokenCounts
from jobs.openai_format.responses_api import ResponseObject, ResponsesBody, response_object
from jobs.openai_format.tool_calls import parse_tool_calls
from jobs.served_models import ModelKind


class Responses:
    url = RESPONSES
    model_kind: ModelKind = "generation"

    def read(self, custom_id: str, body: dict[str, Any], line: LineReader) -> BatchRequest:
        responses = parse_body(ResponsesBody, body)
        line.check_model(responses.model, "generation")
        tools = responses.chat_tools()
        plan, constraint = line.with_tools(
            responses.constraint(),
            tools,
            responses.chat_tool_choice(),
            responses.parallel_tool_calls if tools else None,  # without tools it asks nothing
        )
        prompt = line.encode_chat(responses.messages(), tools if plan is not None else None)
        generation = Generation(
            prompts=[prompt.token_ids],
            requested_max_tokens=responses.max_output_tokens,
            default_max_tokens=None,
            sampling=responses.model_dump(include={"temperature", "top_p"}, exclude_none=True),
            constraint=constraint,
            tool_calls=plan,
            context=responses.echoed(),  # what the response object repeats of its request
            reasoning=prompt.reasoning,
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
        split = split_reasoning(sample.text, request.reasoning) if request.reasoning else None
        answer = sample.text if split is None else split.answer  # calls are looked for after the thinking
        text, calls = parse_tool_calls(answer, request.tool_calls) if request.tool_calls else (answer, [])
        return response_object(
            text=text,
            calls=calls,
            reasoning=split.reasoning if split is not None else None,
            reasoning_tokens=reasoning_token_count(sample.token_ids, split, tokenizer) if split is not None else 0,
            finish_reason=cast(FinishReason, sample.finish_reason),
            model=model,
            echoed=dict(cast(Mapping[str, Any], request.context)),
            input_tokens=counts.input_tokens,
            output_tokens=counts.output_tokens,
            cached_tokens=counts.cached_tokens,
        )
