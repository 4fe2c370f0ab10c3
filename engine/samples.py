"""One sample of a request: a sequence's output state (text, log-probs, the grammar's parse state, how it finished),
its stop checks and the `CompletionOutput` it becomes. Its sequence's tokens are appended by engine/requests.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.detokenizer import IncrementalDetokenizer, decode_complete
from engine.outputs import CompletionOutput, FinishReason
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

# The sampler's top alternatives of a step: (token ids, log-probs), each [row][rank]
TopLogprobs = tuple[list[list[int]], list[list[float]]]


@dataclass
class Sample:
    """One sequence of a request and what it produced so far."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # only when text is needed before the end
    logprobs: list[dict[int, float]] | None
    matcher: Any = None  # xgrammar.GrammarMatcher: the parse state of a structured-output sample
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @classmethod
    def of(cls, seq: Sequence, tokenizer: Tokenizer | None, stream: bool) -> "Sample":
        params = seq.params
        needs_text_early = bool(params.stop) or stream
        return cls(
            seq=seq,
            detokenizer=(
                IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, params.stop, params.include_stop_str_in_output)
                if needs_text_early and tokenizer is not None
                else None
            ),
            logprobs=[] if params.logprobs is not None else None,
        )

    def record_logprobs(self, token: int, logprob: float, top: TopLogprobs | None, row: int) -> None:
        """A sampled token's log-prob, and the top alternatives asked for (the step's `row` of them)."""
        self.cumulative_logprob += logprob
        if self.logprobs is not None:
            entry = {token: logprob}
            if top is not None:
                wanted = self.seq.params.logprobs or 0
                entry.update(zip(top[0][row][:wanted], top[1][row][:wanted]))
            self.logprobs.append(entry)

    def check_stop(self, token: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        """`token`, the last of the output, may finish the sample: stop ids, eos, stop strings, max_tokens, context."""
        seq, params = self.seq, self.seq.params
        num_output = len(seq.output_token_ids)
        # As in vLLM, no stop condition counts before min_tokens, stop strings included.
        may_stop = num_output >= params.min_tokens
        stopped_by_token = may_stop and token in params.stop_token_ids
        stop_string = None
        # A stop token's text stays out of the output unless asked for, like a stop string's (vLLM).
        if self.detokenizer is not None and (not stopped_by_token or params.include_stop_str_in_output):
            stop_string = self.detokenizer.append(token, check_stop=may_stop)
        if stopped_by_token:
            self.finish_reason, self.stop_reason = "stop", token
        elif may_stop and token in eos_token_ids and not params.ignore_eos:
            self.finish_reason = "stop"
        elif stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
        if self.finish_reason is None and (
            (params.max_tokens is not None and num_output >= params.max_tokens) or seq.num_tokens >= max_model_len
        ):
            self.finish_reason = "length"

    def completion(self, tokenizer: Tokenizer | None) -> CompletionOutput:
        seq = self.seq
        if self.detokenizer is not None:
            text = self.detokenizer.output_text(finished=self.finish_reason is not None)
        elif tokenizer is not None:
            text_ids = seq.output_token_ids
            if isinstance(self.stop_reason, int) and not seq.params.include_stop_str_in_output:
                text_ids = text_ids[:-1]  # the stop token, kept out of the text as in check_stop
            text = decode_complete(tokenizer, text_ids)
        else:
            text = ""
        return CompletionOutput(
            index=seq.sample_index,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
        )
