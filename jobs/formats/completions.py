"""OpenAI's legacy `/v1/completions`: one or several prompts in (text or token ids), `text_completion` out."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any, cast

from jobs.formats.base import (
    Generation,
    GeneratedSequence,
    GenerationResult,
    LineReader,
    best_first,
    in_index_order,
    parse_body,
    random_id,
    token_text,
)
from jobs.formats.chat_completions import openai_usage
from jobs.openai_format.requests import (
    COMPLETIONS,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    BatchRequest,
    CompletionBody,
    PromptTokenizer,
)
from jobs.openai_format.responses import (
    CompletionChoice,
    CompletionLogprobs,
    FinishReason,
    TextCompletion,
    TokenCounts,
)
from jobs.served_models import ModelKind


class Completions:
    url = COMPLETIONS
    model_kind: ModelKind = "generation"

    def read(self, custom_id: str, body: dict[str, Any], line: LineReader) -> BatchRequest:
        completion = parse_body(CompletionBody, body)
        adapter = line.check_model(completion.model, "generation")
        generation = Generation(
            adapter=adapter,
            prompts=[line.encode_prompt(prompt) for prompt in completion.prompt],
            requested_max_tokens=completion.max_tokens,
            default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
            sampling=completion.sampling_kwargs(),
            constraint=completion.constraint(),
            logprobs=completion.logprobs,
            # Echo with logprobs reports the prompt tokens' log-probs too (as many alternatives as the completion's).
            prompt_logprobs=completion.logprobs if completion.echo else None,
            logit_bias=completion.logit_bias,
            context=_echo_texts(completion, line.tokenizer) if completion.echo else None,
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
    ) -> TextCompletion:
        echo_texts = cast(list[str] | None, request.context)  # each prompt as text, put before its choices' text
        wants_logprobs = request.sampling_params.logprobs is not None
        # OpenAI's order for several prompts: prompt i's sample j is choice i * n + j.
        n = request.sampling_params.n
        return TextCompletion(
            id=random_id("cmpl-"),
            created=int(time.time()),
            model=model,
            usage=openai_usage(counts),
            choices=[
                CompletionChoice(
                    index=prompt_index * n + sample.index,
                    text=(echo_texts[prompt_index] if echo_texts else "") + sample.text,
                    logprobs=_logprobs(sample, result, echo_texts is not None, tokenizer) if wants_logprobs else None,
                    finish_reason=cast(FinishReason, sample.finish_reason),  # aborted samples were answered before
                )
                for prompt_index, result in enumerate(results)
                for sample in in_index_order(result)
            ],
        )


def _echo_texts(completion: CompletionBody, tokenizer: PromptTokenizer) -> list[str]:
    return [
        prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)
        for prompt in completion.prompt
    ]


def _logprobs(
    sample: GeneratedSequence, result: GenerationResult, echo: bool, tokenizer: PromptTokenizer
) -> CompletionLogprobs | None:
    """OpenAI's legacy parallel lists; with echo, the prompt's tokens first (the first with null: nothing predicts
    it), as OpenAI returns them."""
    if sample.logprobs is None:
        return None
    scored: list[tuple[int, Mapping[int, float] | None]] = list(zip(sample.token_ids, sample.logprobs, strict=True))
    if echo:
        assert result.prompt_logprobs is not None, "echo with logprobs asks the engine for the prompt's"
        scored = list(zip(result.prompt_token_ids, result.prompt_logprobs, strict=True)) + scored
    tokens = [token_text(tokenizer, token_id) for token_id, _ in scored]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[candidates[token_id] if candidates is not None else None for token_id, candidates in scored],
        top_logprobs=[
            {token_text(tokenizer, candidate_id): logprob for candidate_id, logprob in best_first(candidates)}
            if candidates is not None
            else None
            for _, candidates in scored
        ],
        text_offset=list(accumulate((len(token) for token in tokens[:-1]), initial=0)) if tokens else [],
    )
