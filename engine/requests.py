"""The live requests, and the one owner of a request's state after a step.

    batch = requests.batch(out)                    # the scheduled sequences that sample, as the sampler's rows
    step = runner.execute(out, batch.rows, ...)
    outputs = requests.update(out, batch, step)    # everything the step changes in the requests, here

`update` is the only writer of a sequence's output tokens. Per sampled row it appends the token, forks the
siblings of a prompt reaching its first token (`n` / `best_of`), keeps log-probs, feeds the grammar matcher (and
jumps ahead where the grammar forces text) and checks the stop conditions; once all of a request's beams have
their log-probs it advances the beams. Then it hands the scheduler, in one call, what that means for the KV
cache (`Scheduler.update`: computed counts, the forks that share their parent's blocks, the finished sequences
whose blocks are freed) and returns plain `RequestOutput`s. nano-vllm's `postprocess` and vLLM v1's
`update_from_output` have the same place; here the scheduler does not append tokens nor check stops.

The state itself is plain data (engine/request_state.py), each feature's in a small type of its own: `Sample`
(one sequence's output: text, log-probs, grammar matcher, finish), `BeamSearch` (engine/beam_search.py),
`PromptLogprobsRecord` (engine/prompt_logprobs.py), and the structured-output grammar, compiling
(`Request.grammar`) then per sample (`Sample.matcher`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from itertools import accumulate
from typing import Any

from engine.beam_search import Beam, BeamSearch, BeamSearchState, NextBeam
from engine.detokenizer import IncrementalDetokenizer, decode_complete
from engine.metrics import StepCounters
from engine.model_runner import StepResult
from engine.multimodal.inputs import PlacedImage
from engine.outputs import CompletionOutput, RequestOutput
from engine.prompt_logprobs import PromptLogprobsRecord
from engine.request_state import Request, Sample, StepBatch, TopLogprobs
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.tokenizer import Tokenizer

# GrammarCompilerPool.matcher: (compiled grammar, the request's stop ids) -> a fresh xgrammar.GrammarMatcher
MatcherFactory = Callable[[Any, list[int]], Any]


def _is_finished(request: Request) -> bool:
    if request.beams is not None:
        return request.beams.done
    return all(sample.finish_reason is not None for sample in request.samples)


class Requests:
    """The requests in flight, by id, with their samples. Single-threaded, like the engine that holds it."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        jump_forward: bool,
        counters: StepCounters,
    ) -> None:
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self._jump_forward = jump_forward
        self._counters = counters
        self._requests: dict[str, Request] = {}
        self._samples: dict[int, Sample] = {}  # seq id -> its sample, while unfinished
        self._awaiting_grammar: dict[str, Request] = {}  # kept out of the scheduler until compiled
        # What the scheduler is told at the end of an update (or an abort), in this order:
        self._forks: list[tuple[Sequence, Sequence]] = []  # (parent, child): the child shares its parent's blocks
        self._finished: list[Sequence] = []  # their blocks are freed
        self._next_seq_id = 0
        self._arrivals = 0
        self.jump_forward_tokens = 0  # structured-output tokens appended without a forward pass each

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __bool__(self) -> bool:
        return bool(self._requests)

    def add(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream: bool, priority: int,
        base_seed: int, grammar: Future[Any] | None, images: tuple[PlacedImage, ...] = (),
    ) -> None:
        """Queue an admitted request. One sequence computes the prompt; the other samples fork from it when its
        first token is sampled, sharing the prompt's blocks. A constrained one waits out of the scheduler until
        its `grammar` is compiled (`admit_compiled`)."""
        request = Request(
            request_id, list(prompt_token_ids), params, stream, priority, self._arrivals, base_seed, grammar=grammar,
            prompt_logprobs=PromptLogprobsRecord() if params.prompt_logprobs is not None else None, images=images,
            siblings_to_fork=0 if params.use_beam_search else params.num_sequences - 1,
        )
        self._arrivals += 1
        if params.use_beam_search:
            eos = (() if params.ignore_eos else self._eos_token_ids) + tuple(params.stop_token_ids)
            request.beams = BeamSearch(BeamSearchState(params.beam_width, params.length_penalty, eos))
        first = self._new_sample(request, [])
        self._requests[request_id] = request
        if grammar is not None:
            self._awaiting_grammar[request_id] = request
        else:
            self._scheduler.add(first.seq)

    def admit_compiled(self, make_matcher: MatcherFactory) -> list[RequestOutput]:
        """Hand requests whose grammar is ready to the scheduler, each sample with a fresh matcher. Returns the
        final outputs of those whose constraint failed to compile (they never reached the scheduler)."""
        failed = []
        for request_id, request in list(self._awaiting_grammar.items()):
            assert request.grammar is not None
            if not request.grammar.done():
                continue
            sample = request.samples[0]
            error = request.grammar.exception()
            if error is not None:
                request.error = str(error)
                sample.finish_reason = "abort"
                self._release(sample.seq)
                del self._awaiting_grammar[request_id]
                failed.append(self._finalize(request))
                continue
            del self._awaiting_grammar[request_id]
            sample.matcher = make_matcher(request.grammar.result(), request.params.stop_token_ids)
            self._scheduler.add(sample.seq)
        return failed

    def compiling(self) -> list[Future[Any]]:
        """The grammars that requests kept out of the scheduler wait for."""
        return [request.grammar for request in self._awaiting_grammar.values() if request.grammar is not None]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks are freed. Returns its final output, or None if unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        for sample in request.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
                self._release(sample.seq)
        self._awaiting_grammar.pop(request_id, None)
        for seq in self._finished:
            self._scheduler.finish(seq)
        self._finished.clear()
        return self._finalize(request)

    def blame(self, out: SchedulerOutput, cost: Callable[[int, SamplingParams], int]) -> str | None:
        """The request a failed step is blamed on: the one holding the most tokens (`cost`), the newest among equals."""
        ids = {self._samples[item.seq_id].seq.request_id for item in out.scheduled if item.seq_id in self._samples}
        requests = [self._requests[request_id] for request_id in ids if request_id in self._requests]
        if not requests:
            return None
        return max(
            requests, key=lambda request: (cost(len(request.prompt_token_ids), request.params), request.arrival_order)
        ).request_id

    # ---- one step ---------------------------------------------------------------------------

    def batch(self, out: SchedulerOutput) -> StepBatch:
        samples = [self._samples[item.seq_id] for item in out.scheduled if item.needs_sample]
        requests = [self._requests[sample.seq.request_id] for sample in samples]
        # A prompt reaching its first token samples once for each sample (its siblings fork then); beams take one
        # row each: their next tokens are chosen from all the request's beams' log-probs.
        fanout = [1 + request.siblings_to_fork for request in requests]
        rows = [
            SamplingRow(
                params=sample.seq.params,
                seed=sample.seq.seed + k,
                prompt_token_ids=sample.seq.prompt_token_ids,
                output_token_ids=sample.seq.output_token_ids,
                eos_token_ids=self._eos_token_ids,
            )
            for sample, count in zip(samples, fanout)
            for k in range(count)
        ]
        prompt_tokens = sum(
            max(0, min(item.start_position + len(item.token_ids), len(self._samples[item.seq_id].seq.prompt_token_ids)) - item.start_position)
            for item in out.scheduled
        )
        return StepBatch(samples, requests, fanout, rows, prompt_tokens)

    def update(self, out: SchedulerOutput, batch: StepBatch, step: StepResult) -> list[RequestOutput]:
        """Apply a step's results. Returns the outputs of the requests that finished, and snapshots of the
        streaming ones that advanced."""
        scheduled = [self._samples[item.seq_id].seq for item in out.scheduled]
        try:
            return self._apply(batch, step)
        finally:
            self._scheduler.update(out, scheduled, self._forks, self._finished)
            self._forks.clear()
            self._finished.clear()

    def _apply(self, batch: StepBatch, step: StepResult) -> list[RequestOutput]:
        for seq_id, scored in step.prompt_logprobs.items():
            request = self._requests[self._samples[seq_id].seq.request_id]
            assert request.prompt_logprobs is not None
            request.prompt_logprobs.record(request.prompt_token_ids, scored)
        result = step.sampled
        if result is None:
            return []
        now = time.monotonic()
        for request in batch.requests:
            if request.first_token_time is None:
                request.first_token_time = now
                self._counters.time_to_first_token.observe(now - request.arrival_time)
        token_ids = result.token_ids.tolist()
        token_logprobs = result.logprobs.tolist()
        top = (result.top_logprobs[0].tolist(), result.top_logprobs[1].tolist()) if result.top_logprobs else None
        beam_rows: Iterator[Any] = iter(result.beam_logprobs if result.beam_logprobs is not None else ())

        touched: dict[str, Request] = {}
        first_rows = accumulate(batch.fanout[:-1], initial=0)
        for sample, request, first_row, count in zip(batch.samples, batch.requests, first_rows, batch.fanout):
            touched[request.request_id] = request
            if request.beams is not None:  # its next token is chosen once all the request's beams have log-probs
                request.beams.pending[sample.seq.seq_id] = next(beam_rows)
                continue
            seq = sample.seq
            seq.output_token_ids.append(token_ids[first_row])
            # The siblings fork before the parent's matcher accepts its token.
            siblings = [self._fork(seq, seq.output_token_ids[:-1] + [token_ids[first_row + k]]) for k in range(1, count)]
            request.siblings_to_fork -= len(siblings)
            for row, each in enumerate([sample, *siblings], start=first_row):
                self._accept(each, token_ids[row], token_logprobs[row], top, row)

        outputs = []
        for request in touched.values():
            if request.beams is not None and len(request.beams.pending) == len(request.samples):
                self._advance_beams(request)
            if _is_finished(request):
                outputs.append(self._finalize(request))
            elif request.stream:
                outputs.append(self._snapshot(request))
        return outputs

    def _accept(self, sample: Sample, token: int, logprob: float, top: TopLogprobs | None, row: int) -> None:
        """A sampled token, already appended: its log-probs, the grammar, the stop checks, jump-ahead."""
        sample.cumulative_logprob += logprob
        if sample.logprobs is not None:
            entry = {token: logprob}
            if top is not None:
                wanted = sample.seq.params.logprobs or 0
                entry.update(zip(top[0][row][:wanted], top[1][row][:wanted]))
            sample.logprobs.append(entry)
        if sample.matcher is not None and not sample.matcher.accept_token(token):
            # The bitmask allowed only what the matcher accepts: reaching here is a bug, and this
            # sample's output can no longer be trusted to match its constraint.
            sample.finish_reason, sample.stop_reason = "abort", f"grammar rejected token {token}"
            self._release(sample.seq)
            return
        self._check_stop(sample, token)
        if sample.finish_reason is None and sample.matcher is not None and self._jump_forward:
            self._jump_ahead(sample)

    def _check_stop(self, sample: Sample, token: int) -> None:
        """`token`, the last of the output, may finish the sample: stop ids, eos, stop strings, max_tokens, context."""
        seq, params = sample.seq, sample.seq.params
        num_output = len(seq.output_token_ids)
        # As in vLLM, no stop condition counts before min_tokens, stop strings included.
        may_stop = num_output >= params.min_tokens
        stopped_by_token = may_stop and token in params.stop_token_ids
        stop_string = None
        # A stop token's text stays out of the output unless asked for, like a stop string's (vLLM).
        if sample.detokenizer is not None and (not stopped_by_token or params.include_stop_str_in_output):
            stop_string = sample.detokenizer.append(token, check_stop=may_stop)
        if stopped_by_token:
            sample.finish_reason, sample.stop_reason = "stop", token
        elif may_stop and token in self._eos_token_ids and not params.ignore_eos:
            sample.finish_reason = "stop"
        elif stop_string is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop_string
        if sample.finish_reason is None and (
            (params.max_tokens is not None and num_output >= params.max_tokens)
            or len(seq.prompt_token_ids) + num_output >= self._max_model_len
        ):
            sample.finish_reason = "length"
        if sample.finish_reason is not None:
            self._release(seq)

    def _jump_ahead(self, sample: Sample) -> None:
        """Append the one continuation the grammar allows, token by token through the matcher and the
        stop checks, without sampling: the next step computes them all as one chunk. Samples that
        return log-probs do not jump (a forced token has no sampled log-prob)."""
        if sample.logprobs is not None:
            return
        text = sample.matcher.find_jump_forward_string()
        if not text:
            return
        assert self._tokenizer is not None
        for token in self._tokenizer.encode(text, add_special_tokens=False):
            if not sample.matcher.accept_token(token):
                return  # the text tokenized alone split differently from what the grammar takes: stop here
            sample.seq.output_token_ids.append(token)
            self.jump_forward_tokens += 1
            self._check_stop(sample, token)
            if sample.finish_reason is not None:
                return

    def _advance_beams(self, request: Request) -> None:
        """Every live beam has its log-probs: the next beams by block-table edits (a parent with several
        children forks, one with none is dropped), or the request is done."""
        beams = request.beams
        assert beams is not None
        live = list(request.samples)  # forks append to request.samples
        params, first = request.params, live[0].seq
        is_last = (params.max_tokens is not None and len(first.output_token_ids) + 1 >= params.max_tokens) or (
            len(request.prompt_token_ids) + len(first.output_token_ids) + 1 >= self._max_model_len
        )
        current = [Beam(tuple(sample.seq.output_token_ids), sample.cumulative_logprob) for sample in live]
        next_beams = beams.advance([sample.seq.seq_id for sample in live], current, is_last)
        children: dict[int, list[NextBeam]] = {}
        for beam in next_beams:
            children.setdefault(beam.parent, []).append(beam)
        sample_of: dict[NextBeam, Sample] = {}
        for parent, kids in children.items():  # forks copy the parent before it takes its own token
            seq = live[parent].seq
            for kid in kids[1:]:
                sample_of[kid] = self._fork(seq, seq.output_token_ids + [kid.token_id])
        for parent, kids in children.items():
            live[parent].seq.output_token_ids.append(kids[0].token_id)
            sample_of[kids[0]] = live[parent]
        for index, sample in enumerate(live):
            if index not in children:  # every beam, when the search is done
                self._release(sample.seq)
        if not beams.done:
            request.samples = [sample_of[beam] for beam in next_beams]
        for beam, sample in zip(next_beams, request.samples):
            sample.cumulative_logprob = beam.cum_logprob

    # ---- samples ----------------------------------------------------------------------------

    def _new_sample(self, request: Request, output_token_ids: list[int]) -> Sample:
        params, index = request.params, len(request.samples)
        seq = Sequence(
            seq_id=self._next_seq_id,
            request_id=request.request_id,
            sample_index=index,
            prompt_token_ids=request.prompt_token_ids,
            params=params,
            seed=request.base_seed + index,
            priority=request.priority,
            arrival_order=request.arrival_order,
            output_token_ids=output_token_ids,
            images=request.images,
        )
        self._next_seq_id += 1
        needs_text_early = bool(params.stop) or request.stream
        sample = Sample(
            seq=seq,
            detokenizer=(
                IncrementalDetokenizer(
                    self._tokenizer, seq.prompt_token_ids, tuple(params.stop), params.include_stop_str_in_output
                )
                if needs_text_early and self._tokenizer is not None
                else None
            ),
            logprobs=[] if params.logprobs is not None else None,
        )
        request.samples.append(sample)
        self._samples[seq.seq_id] = sample
        return sample

    def _fork(self, parent: Sequence, output_token_ids: list[int]) -> Sample:
        """A new sample of parent's request with parent's computed tokens plus a different next one, sharing
        parent's blocks, and a fork of parent's matcher, taken before the parent accepts its own token."""
        sample = self._new_sample(self._requests[parent.request_id], output_token_ids)
        parent_matcher = self._samples[parent.seq_id].matcher
        if parent_matcher is not None:
            sample.matcher = parent_matcher.fork()
        self._forks.append((parent, sample.seq))
        return sample

    def _release(self, seq: Sequence) -> None:
        """A finished sequence: its blocks are freed by the scheduler at the end of the update (or abort)."""
        del self._samples[seq.seq_id]
        if seq.request_id in self._awaiting_grammar:
            seq.status = SequenceStatus.FINISHED  # never reached the scheduler
        else:
            self._finished.append(seq)

    # ---- what the caller sees ---------------------------------------------------------------

    def _completion(self, sample: Sample) -> CompletionOutput:
        seq = sample.seq
        if sample.detokenizer is not None:
            text = sample.detokenizer.output_text(finished=sample.finish_reason is not None)
        elif self._tokenizer is not None:
            text_ids = seq.output_token_ids
            if isinstance(sample.stop_reason, int) and not seq.params.include_stop_str_in_output:
                text_ids = text_ids[:-1]  # the stop token, kept out of the text as in _check_stop
            text = decode_complete(self._tokenizer, text_ids)
        else:
            text = ""
        return CompletionOutput(
            index=seq.sample_index,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
            cumulative_logprob=sample.cumulative_logprob,
        )

    def _snapshot(self, request: Request) -> RequestOutput:
        if request.beams is not None and request.beams.done:
            completions = [
                CompletionOutput(
                    index=index,
                    text=decode_complete(self._tokenizer, list(h.output_token_ids)) if self._tokenizer else "",
                    token_ids=list(h.output_token_ids),
                    finish_reason="stop" if h.output_token_ids[-1] in request.beams.state.eos_token_ids else "length",
                    cumulative_logprob=h.cum_logprob,
                )
                for index, h in enumerate(request.beams.best(request.params.n))
            ]
        else:
            completions = [self._completion(sample) for sample in request.samples]
        if len(completions) > request.params.n:  # best_of: only ever at the end (no streaming)
            completions = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[: request.params.n]
            for index, completion in enumerate(completions):
                completion.index = index
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=_is_finished(request),
            num_cached_tokens=max((sample.seq.num_cached_tokens or 0 for sample in request.samples), default=0),
            error=request.error,
            prompt_logprobs=list(request.prompt_logprobs.positions) if request.prompt_logprobs is not None else None,
        )

    def _finalize(self, request: Request) -> RequestOutput:
        del self._requests[request.request_id]
        output = self._snapshot(request)
        generated = max((len(completion.token_ids) for completion in output.outputs), default=0)
        if request.first_token_time is not None and generated > 1:
            per_token = (time.monotonic() - request.first_token_time) / (generated - 1)
            self._counters.time_per_output_token.observe(per_token)
        return output
