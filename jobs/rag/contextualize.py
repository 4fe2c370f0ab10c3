"""Contexts for passages from the engine: one greedy chat request per passage, every request submitted before any wait.

    generate = engine_context_generator(loop, loop.engine.tokenizer, max_tokens=96, prompt_template=DEFAULT_CONTEXT_PROMPT)
    generate([(document_text, [passage_text, ...]), ...])   # → per document, one context per passage

Each prompt is the model's chat template around `prompt_template` with the whole document first, so all the
prompts of one document start with the same tokens and the engine's prefix cache computes the document once; the
requests of every document go to the `EngineLoop` together, so its running batch stays full.

A document too long for the model's context (with the passage, the template and `max_tokens` to generate) is cut
to the tokens that fit, at the same place for all its passages (their prompts keep their shared prefix), and marked
with " […]"; the passage itself is always in the prompt whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.engine_loop import EngineLoop, RequestHandle
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from jobs.rag.processing import ContextGenerator

_TRUNCATION_MARK = " […]"
# Tokens kept free when cutting a document: decoding a token prefix and encoding it again inside the prompt may
# merge or split a few tokens at the cut and around the mark.
_TRUNCATION_SLACK = 16


def engine_context_generator(
    loop: EngineLoop, tokenizer: Tokenizer, max_tokens: int, prompt_template: str, priority: int = 0
) -> ContextGenerator:
    """A `ContextGenerator` running on `loop`'s engine at `priority` (lower runs first, as for batches)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    max_prompt_tokens = loop.engine.max_model_len - max_tokens

    def generate(documents: Sequence[tuple[str, Sequence[str]]]) -> list[list[str]]:
        # Every prompt is built before the first submit: a document that cannot fit fails the call with nothing
        # left running in the engine.
        prompts = [
            context_prompts(tokenizer, prompt_template, document, passages, max_prompt_tokens)
            for document, passages in documents
        ]
        handles = [[loop.submit(prompt, params, priority=priority) for prompt in document] for document in prompts]
        try:
            return [[handle.result().outputs[0].text.strip() for handle in document] for document in handles]
        except BaseException:
            _abort_unfinished(loop, [handle for document in handles for handle in document])
            raise

    return generate


def context_prompts(
    tokenizer: Tokenizer, prompt_template: str, document: str, passages: Sequence[str], max_prompt_tokens: int
) -> list[list[int]]:
    """The token ids of each passage's chat prompt, each at most `max_prompt_tokens` long."""

    def encode(document_text: str, passage: str) -> list[int]:
        content = prompt_template.format(document=document_text, chunk=passage)
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        return tokenizer.encode(text, add_special_tokens=False)

    if not passages:
        return []
    # The prompts' length without the document says how much of the document fits beside the longest passage.
    overhead = max(len(encode("", passage)) for passage in passages)
    document_budget = max_prompt_tokens - overhead - _TRUNCATION_SLACK
    document_tokens = tokenizer.encode(document, add_special_tokens=False)
    if len(document_tokens) + overhead > max_prompt_tokens:
        if document_budget <= 0:
            raise ValueError(
                f"a passage's context prompt needs {overhead} tokens without the document, more than the "
                f"{max_prompt_tokens} the model's context leaves beside the generated tokens"
            )
        document = tokenizer.decode(document_tokens[:document_budget]) + _TRUNCATION_MARK
    prompts = [encode(document, passage) for passage in passages]
    longest = max(map(len, prompts))
    if longest > max_prompt_tokens:  # only if re-encoding grew by more than the slack
        raise ValueError(f"a context prompt of {longest} tokens exceeds the {max_prompt_tokens} available")
    return prompts


def _abort_unfinished(loop: EngineLoop, handles: list[RequestHandle]) -> None:
    """Requests of a call that failed (or was interrupted) must not keep running and holding KV blocks."""
    for handle in handles:
        if not handle.done():
            loop.abort(handle.request_id)
