"""LLMEngine: owns the model, KV cache, scheduler and requests; `step()` runs one iteration.

    out = scheduler.schedule()
    sampled = runner.execute(out, rows)
    scheduler.update(out, sampled)   then finish checks (eos / stop ids / stop strings / length)

Single-threaded by design; `EngineLoop` drives it from its own thread for concurrent callers.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from itertools import accumulate
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from engine.admission import AdmissionLimits, EngineFailed, StepFailed, admit, cost
from engine.beam_search import Beam, BeamSearchState, NextBeam, beam_search_step, best_hypotheses
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.distributed import SINGLE
from engine.dtypes import on_device, resolve_device, resolve_dtype, resolve_kernel_backend
from engine.detokenizer import IncrementalDetokenizer, decode_complete
from engine.model_registry import DEFAULT_MODEL, resolve_model
from engine.metrics import EngineStats, StepCounters
from engine.model_runner import ModelRunner
from engine.model_shard import ShardSpec, build_model_shard, rank_model_config, windowed_blocks_per_sequence
from engine.outputs import CompletionOutput, FinishReason, RequestOutput
from engine.prompt_logprobs import PromptLogprobs
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.tensor_parallel import TensorParallelRanks, TensorParallelRunner
from engine.structured_output import GrammarCompilerPool
from engine.tokenizer import Tokenizer


@dataclass
class _SampleState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # only when text is needed before the end
    logprobs: list[dict[int, float]] | None
    matcher: Any = None  # xgrammar.GrammarMatcher: the parse state of a structured-output sample
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    priority: int
    arrival_order: int
    base_seed: int  # sample i draws with base_seed + i
    samples: list[_SampleState] = field(default_factory=list)  # with beam search: the live beams, best first
    beams: BeamSearchState | None = None  # beam search's finished hypotheses
    beam_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)  # seq id -> its next-token log-probs
    beam_results: list[CompletionOutput] | None = None  # beam search's answer, once it is done
    grammar: Future[Any] | None = None  # structured output: its compiled grammar, maybe still compiling
    # prompt_logprobs: per prompt position, token id -> log-prob (its own token, then the top alternatives); the
    # first position has None (nothing predicts it). Grows as the prefill's chunks compute.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # why the request could not run (its constraint did not compile)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        if self.beams is not None:
            return self.beam_results is not None
        return all(s.finish_reason is not None for s in self.samples)


class LLMEngine:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        load_format: str = "auto",
        **engine_options: object,
    ) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(known)}")
        self.config = EngineConfig(**engine_options)  # type: ignore[arg-type]
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kernel_backend = resolve_kernel_backend(self.config.kernel_backend, self.device)

        source = resolve_model(model, load_format)
        self.model_name = source.name
        self.model_config = ModelConfig.from_hf(source.hf_config)
        has_tokenizer = source.path is not None and (source.path / "tokenizer.json").exists()
        self.tokenizer: Tokenizer | None = Tokenizer.from_folder(source.path) if has_tokenizer else None
        eos = self.model_config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids: tuple[int, ...] = eos

        spec = ShardSpec(source, self.model_config, self.config, self.device, self.dtype, self.kernel_backend)
        tp_size = self.config.tensor_parallel_size
        rank_model_config(self.model_config, tp_size)  # sizes not divisible: fail before starting any process
        ranks = TensorParallelRanks(spec) if tp_size > 1 else None
        try:
            shard = build_model_shard(spec, ranks.group if ranks is not None else SINGLE)
        except BaseException:
            if ranks is not None:
                ranks.close()
            raise
        self.model = shard.model
        self.runner: ModelRunner | TensorParallelRunner = (
            shard.runner if ranks is None else TensorParallelRunner(shard.runner, ranks)
        )
        self.max_model_len = shard.max_model_len
        self.block_manager = BlockManager(
            shard.num_blocks,
            self.config.block_size,
            shard.num_host_blocks,
            self.config.enable_prefix_caching,
            self.model_config.uniform_window,
            reuse_cached_before_fresh=self.device.type == "cpu",  # a CPU pool's fresh blocks cost memory when used
        )
        self.scheduler = Scheduler(self.config, self.block_manager, self.model_config.long_rope_threshold)
        self._bytes_per_block = shard.bytes_per_block * tp_size  # the block on every rank
        self.admission_limits = AdmissionLimits(
            max_sequences_per_request=self.config.max_sequences_per_request,
            max_model_len=self.max_model_len,
            max_tokens_limit=self.config.max_tokens_limit,
            default_max_tokens=self.config.default_max_tokens,
            num_kv_blocks=shard.num_blocks,
            block_size=self.config.block_size,
            max_blocks_per_sequence=windowed_blocks_per_sequence(self.model_config, self.config),
            max_prefill_tokens=None if self.config.enable_chunked_prefill else self.config.max_num_batched_tokens,
        )

        self._requests: dict[str, _Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._sample_of: dict[int, _SampleState] = {}
        self._next_seq_id = 0
        self._arrivals = 0
        self._seed_rng = random.Random(self.config.seed)
        self.counters = StepCounters()
        self._grammars: GrammarCompilerPool | None = None  # built with the first constrained request
        self._awaiting_grammar: dict[str, _Request] = {}  # kept out of the scheduler until compiled
        self.jump_forward_tokens = 0  # structured-output tokens appended without a forward pass each

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any. The engine cannot step afterwards."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()

    def check_health(self) -> None:
        """Raises EngineFailed (RankFailure) if a tensor-parallel rank is known to have died, without stepping: how
        an idle engine's driver learns it, before any request fails on it."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.ranks.check()

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        stream: bool = False,
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._validate_prompt(prompt_token_ids)
        params = admit(len(prompt_token_ids), params, self.admission_limits)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab}): {params.stop_token_ids}")
        if stream and (params.num_sequences > params.n or params.use_beam_search):
            raise ValueError("streaming needs n == best_of and no beam search: the best are only known at the end")
        if params.use_beam_search and params.stop:
            raise ValueError("beam search does not support stop strings; use stop_token_ids")
        if (params.stop or stream) and self.tokenizer is None:
            raise ValueError("stop strings and streaming text need a tokenizer; this model has none")
        if any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.structured_output is not None and self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model has none")
        request = _Request(
            request_id,
            list(prompt_token_ids),
            params,
            stream,
            priority=priority,
            arrival_order=self._arrivals,
            base_seed=params.seed if params.seed is not None else self._seed_rng.getrandbits(62),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        self._arrivals += 1
        if params.use_beam_search:
            eos = (() if params.ignore_eos else self.eos_token_ids) + tuple(params.stop_token_ids)
            request.beams = BeamSearchState(params.beam_width, params.length_penalty, eos)
        # One sequence computes the prompt; the other samples fork from it when its first token is
        # sampled, sharing the prompt's blocks.
        first = self._new_sample(request, [])
        self._requests[request_id] = request
        if params.structured_output is not None:
            request.grammar = self._grammar_pool().compiled(params.structured_output)
            self._awaiting_grammar[request_id] = request  # scheduled by step() once compiled
        else:
            self.scheduler.add(first.seq)

    def _grammar_pool(self) -> GrammarCompilerPool:
        if self._grammars is None:
            assert self.tokenizer is not None
            config = self.config
            self._grammars = GrammarCompilerPool(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                config.grammar_compile_threads, config.grammar_cache_size,
            )
        return self._grammars

    @property
    def grammar_compilations(self) -> int:
        """Structured-output grammars compiled so far (cache misses)."""
        return self._grammars.compilations if self._grammars is not None else 0

    def _new_sample(self, request: _Request, output_token_ids: list[int]) -> _SampleState:
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
        )
        self._next_seq_id += 1
        needs_text_early = bool(params.stop) or request.stream
        state = _SampleState(
            seq=seq,
            detokenizer=(
                IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop, params.include_stop_str_in_output)
                if needs_text_early and self.tokenizer is not None
                else None
            ),
            logprobs=[] if params.logprobs is not None else None,
        )
        request.samples.append(state)
        self._seqs[seq.seq_id] = seq
        self._sample_of[seq.seq_id] = state
        return state

    def _fork(self, parent: Sequence, output_token_ids: list[int]) -> _SampleState:
        """A new sequence of parent's request, sharing parent's blocks, with its own output tokens
        (parent's computed ones plus a different next token)."""
        state = self._new_sample(self._requests[parent.request_id], output_token_ids)
        parent_matcher = self._sample_of[parent.seq_id].matcher
        if parent_matcher is not None:  # called before the parent accepts its own token
            state.matcher = parent_matcher.fork()
        child = state.seq
        if parent.status is SequenceStatus.RUNNING:
            child.num_computed_tokens = parent.num_computed_tokens
            child.last_scheduled_step = parent.last_scheduled_step
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
        else:  # a beam parked in the host pool or preempted: the child recomputes, from the prefix cache
            self.scheduler.add(child)
        return state

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {self.max_model_len} "
                "tokens and at least one must be left for the completion"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks are freed. Returns its final output, or None if unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.counters.requests_finished += 1
        for state in request.samples:
            if state.finish_reason is None:
                state.finish_reason = "abort"
                self._release(state.seq)
        self._awaiting_grammar.pop(request_id, None)
        return self._finalize(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. Returns outputs of requests that finished, plus snapshots of streaming ones."""
        started = time.perf_counter()
        failed = self._schedule_compiled()
        out = self.scheduler.schedule()
        if out.is_empty:
            if self._awaiting_grammar and not failed:
                # Nothing to run but grammars compiling: wait for one instead of spinning on the CPU it needs.
                wait([r.grammar for r in self._awaiting_grammar.values() if r.grammar], 0.05, FIRST_COMPLETED)
            self.counters.requests_finished += len(failed)
            return failed
        prompt_tokens = sum(
            max(0, min(item.start_position + item.num_new_tokens, len(self._seqs[item.seq_id].prompt_token_ids)) - item.start_position)
            for item in out.scheduled
        )
        try:
            with on_device(self.device):  # the loop thread's current device is 0 whatever the engine's is
                outputs = failed + self._run(out)
        except EngineFailed:
            raise  # the engine cannot step any more: no request is to blame
        except Exception as error:
            suspect = self._costliest_request(out)
            if suspect is None:
                raise
            raise StepFailed(suspect, error) from error
        counters = self.counters
        counters.steps += 1
        counters.last_step_seconds = time.perf_counter() - started
        counters.step_seconds += counters.last_step_seconds
        counters.step_time.observe(counters.last_step_seconds)
        counters.prompt_tokens_computed += prompt_tokens
        counters.batched_tokens += out.num_batched_tokens
        counters.requests_finished += sum(output.finished for output in outputs)
        counters.last_step_tokens = out.num_batched_tokens
        counters.last_step_sequences = len(out.scheduled)
        counters.last_step_context_tokens = sum(item.start_position + item.num_new_tokens for item in out.scheduled)
        return outputs

    def _costliest_request(self, out: SchedulerOutput) -> str | None:
        """The request a failed step is blamed on: the one holding the most tokens, the newest among equals."""
        ids = {self._seqs[item.seq_id].request_id for item in out.scheduled if item.seq_id in self._seqs}
        requests = [self._requests[request_id] for request_id in ids if request_id in self._requests]
        if not requests:
            return None
        return max(
            requests, key=lambda request: (cost(len(request.prompt_token_ids), request.params), request.arrival_order)
        ).request_id

    def _schedule_compiled(self) -> list[RequestOutput]:
        """Hand requests whose grammar is ready to the scheduler, each sample with a fresh matcher.
        Returns the final outputs of those whose constraint failed to compile."""
        failed = []
        for request_id, request in list(self._awaiting_grammar.items()):
            assert request.grammar is not None
            if not request.grammar.done():
                continue
            state = request.samples[0]
            error = request.grammar.exception()
            if error is not None:
                request.error = str(error)
                state.finish_reason = "abort"
                self._release(state.seq)
                del self._awaiting_grammar[request_id]
                failed.append(self._finalize(request))
                continue
            del self._awaiting_grammar[request_id]
            assert self._grammars is not None
            state.matcher = self._grammars.matcher(request.grammar.result(), request.params.stop_token_ids)
            self.scheduler.add(state.seq)
        return failed

    def stats(self) -> EngineStats:
        scheduler, manager = self.scheduler, self.block_manager
        counters = scheduler.counters
        cached = manager.prefix_cache.num_evictable if manager.prefix_cache is not None else 0
        return EngineStats(
            counters=self.counters.snapshot(),
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped),
            preemptions=dict(counters.preemptions),
            block_size=manager.block_size,
            kv_blocks_total=manager.num_blocks,
            kv_blocks_used=manager.num_blocks - manager.num_free_blocks,
            kv_blocks_cached=cached,
            kv_slots_unused=sum(
                len(manager.block_table(seq.seq_id)) * manager.block_size - seq.num_computed_tokens
                for seq in scheduler.running
            ),
            host_blocks_total=manager.num_host_blocks,
            host_blocks_used=manager.num_host_blocks - manager.num_free_host_blocks,
            blocks_swapped_out=counters.blocks_swapped_out,
            blocks_swapped_in=counters.blocks_swapped_in,
            swap_bytes=(counters.blocks_swapped_out + counters.blocks_swapped_in) * self._bytes_per_block,
            swap_seconds=self.runner.swap_seconds,
            prefix_cache_queried_tokens=counters.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=counters.prefix_cache_hit_tokens,
        )

    def _run(self, out: SchedulerOutput) -> list[RequestOutput]:
        sampling = [self._seqs[item.seq_id] for item in out.scheduled if item.needs_sample]
        requests = [self._requests[seq.request_id] for seq in sampling]
        # A prompt that reaches its first token samples once per sequence of its request.
        fanout = [
            1 if request.beams is not None else request.params.num_sequences - len(request.samples) + 1
            for request in requests
        ]
        rows = [
            SamplingRow(
                params=seq.params,
                seed=seq.seed + k,
                prompt_token_ids=seq.prompt_token_ids,
                output_token_ids=seq.output_token_ids,
                eos_token_ids=self.eos_token_ids,
            )
            for seq, count in zip(sampling, fanout)
            for k in range(count)
        ]
        token_bitmask = None
        if self._grammars is not None and rows:
            matchers = [self._sample_of[seq.seq_id].matcher for seq, count in zip(sampling, fanout) for _ in range(count)]
            token_bitmask = self._grammars.fill_bitmask(matchers)  # while the model runs; the sampler waits for it
        try:
            step = self.runner.execute(out, rows, fanout, token_bitmask)
        finally:
            if token_bitmask is not None:
                wait([token_bitmask])  # a failed step too: the matchers change after this, the fill reads them
        self.counters.generation_tokens += len(rows)
        for seq_id, scored in step.prompt_logprobs.items():
            self._record_prompt_logprobs(self._requests[self._seqs[seq_id].request_id], scored)
        result = step.sampled
        if result is None:
            self.scheduler.update(out, {}, self._seqs)
            return []
        now = time.monotonic()
        for request in requests:
            if request.first_token_time is None:
                request.first_token_time = now
                self.counters.time_to_first_token.observe(now - request.arrival_time)
        token_ids = result.token_ids.tolist()
        token_logprobs = result.logprobs.tolist()
        top = (result.top_logprobs[0].tolist(), result.top_logprobs[1].tolist()) if result.top_logprobs else None
        first_rows = list(accumulate(fanout[:-1], initial=0))
        sampled = {
            seq.seq_id: token_ids[row]
            for seq, request, row in zip(sampling, requests, first_rows)
            if request.beams is None  # a beam's next token is chosen once all its request's beams have log-probs
        }
        self.scheduler.update(out, sampled, self._seqs)

        touched: dict[str, _Request] = {}
        beam_rows = iter(result.beam_logprobs if result.beam_logprobs is not None else ())
        for seq, request, first_row, count in zip(sampling, requests, first_rows, fanout):
            touched[request.request_id] = request
            if request.beams is not None:
                request.beam_logprobs[seq.seq_id] = next(beam_rows)
                continue
            # Fork every sibling before any finish check can free the shared blocks.
            states = [self._sample_of[seq.seq_id]] + [
                self._fork(seq, seq.output_token_ids[:-1] + [token_ids[first_row + k]]) for k in range(1, count)
            ]
            for row, state in enumerate(states, start=first_row):
                token = token_ids[row]
                state.cumulative_logprob += token_logprobs[row]
                if state.logprobs is not None:
                    entry = {token: token_logprobs[row]}
                    if top is not None:
                        wanted = seq.params.logprobs or 0
                        entry.update(zip(top[0][row][:wanted], top[1][row][:wanted]))
                    state.logprobs.append(entry)
                if state.matcher is not None and not state.matcher.accept_token(token):
                    # The bitmask allowed only what the matcher accepts: reaching here is a bug, and this
                    # sample's output can no longer be trusted to match its constraint.
                    state.finish_reason, state.stop_reason = "abort", f"grammar rejected token {token}"
                    self._release(state.seq)
                    continue
                self._check_finish(state, token)
                if state.finish_reason is None and state.matcher is not None and self.config.jump_forward:
                    self._jump_forward(state)

        outputs = []
        for request in touched.values():
            if request.beams is not None and len(request.beam_logprobs) == len(request.samples):
                self._advance_beams(request)
            if request.finished:
                outputs.append(self._finalize(request))
            elif request.stream:
                outputs.append(self._snapshot(request))
        return outputs

    @staticmethod
    def _record_prompt_logprobs(request: _Request, scored: PromptLogprobs) -> None:
        """Append a chunk's prompt log-probs. A prompt recomputed after preemption scores its positions again:
        those already recorded are kept."""
        recorded = request.prompt_logprobs
        assert recorded is not None and scored.first_position <= len(recorded), "prompt log-probs skipped a position"
        token_ids = request.prompt_token_ids
        for offset in range(len(recorded) - scored.first_position, len(scored.token_logprobs)):
            position = scored.first_position + offset
            recorded.append({token_ids[position]: scored.token_logprobs[offset], **scored.top[offset]})

    def _advance_beams(self, request: _Request) -> None:
        """Every live beam has its log-probs: pick the next beams by block-table edits (a parent
        with several children forks, one with none is dropped), or finish the request."""
        assert request.beams is not None
        live = list(request.samples)  # forks append to request.samples
        logprobs = torch.stack([request.beam_logprobs.pop(state.seq.seq_id) for state in live])
        params, first = request.params, live[0].seq
        is_last = (params.max_tokens is not None and len(first.output_token_ids) + 1 >= params.max_tokens) or (
            first.num_tokens + 1 >= self.max_model_len
        )
        beams = [Beam(tuple(state.seq.output_token_ids), state.cumulative_logprob) for state in live]
        next_beams, done = beam_search_step(request.beams, beams, logprobs, is_last)
        if done:
            for state in live:
                self._release(state.seq)
            request.beam_results = [
                CompletionOutput(
                    index=index,
                    text=decode_complete(self.tokenizer, list(h.output_token_ids)) if self.tokenizer else "",
                    token_ids=list(h.output_token_ids),
                    finish_reason="stop" if h.output_token_ids[-1] in request.beams.eos_token_ids else "length",
                    cumulative_logprob=h.cum_logprob,
                )
                for index, h in enumerate(best_hypotheses(request.beams, params.n))
            ]
            return
        children: dict[int, list[NextBeam]] = {}
        for beam in next_beams:
            children.setdefault(beam.parent, []).append(beam)
        state_of: dict[NextBeam, _SampleState] = {}
        for parent, kids in children.items():  # forks copy the parent before it takes its own token
            seq = live[parent].seq
            for kid in kids[1:]:
                state_of[kid] = self._fork(seq, seq.output_token_ids + [kid.token_id])
        for parent, kids in children.items():
            live[parent].seq.output_token_ids.append(kids[0].token_id)
            state_of[kids[0]] = live[parent]
        for index, state in enumerate(live):
            if index not in children:
                self._release(state.seq)
        request.samples = [state_of[beam] for beam in next_beams]
        for beam, state in zip(next_beams, request.samples):
            state.cumulative_logprob = beam.cum_logprob

    def _check_finish(self, state: _SampleState, token: int) -> None:
        seq, params = state.seq, state.seq.params
        num_output = len(seq.output_token_ids)
        # As in vLLM, no stop condition counts before min_tokens, stop strings included.
        may_stop = num_output >= params.min_tokens
        stopped_by_token = may_stop and token in params.stop_token_ids
        stop_string = None
        # A stop token's text stays out of the output unless asked for, like a stop string's (vLLM).
        if state.detokenizer is not None and (not stopped_by_token or params.include_stop_str_in_output):
            stop_string = state.detokenizer.append(token, check_stop=may_stop)
        if stopped_by_token:
            state.finish_reason, state.stop_reason = "stop", token
        elif may_stop and token in self.eos_token_ids and not params.ignore_eos:
            state.finish_reason = "stop"
        elif stop_string is not None:
            state.finish_reason, state.stop_reason = "stop", stop_string
        if state.finish_reason is None and (
            (params.max_tokens is not None and num_output >= params.max_tokens) or seq.num_tokens >= self.max_model_len
        ):
            state.finish_reason = "length"
        if state.finish_reason is not None:
            self._release(seq)

    def _jump_forward(self, state: _SampleState) -> None:
        """Append the one continuation the grammar allows, token by token through the matcher and the
        finish checks, without sampling: the next step computes them all as one chunk. Samples that
        return log-probs do not jump (a forced token has no sampled log-prob)."""
        if state.logprobs is not None:
            return
        text = state.matcher.find_jump_forward_string()
        if not text:
            return
        assert self.tokenizer is not None
        for token in self.tokenizer.encode(text, add_special_tokens=False):
            if not state.matcher.accept_token(token):
                return  # the text tokenized alone split differently from what the grammar takes: stop here
            state.seq.output_token_ids.append(token)
            self.jump_forward_tokens += 1
            self._check_finish(state, token)
            if state.finish_reason is not None:
                return

    def _release(self, seq: Sequence) -> None:
        if seq.request_id in self._awaiting_grammar:
            seq.status = SequenceStatus.FINISHED  # never reached the scheduler
        else:
            self.scheduler.finish(seq)
        del self._seqs[seq.seq_id]
        del self._sample_of[seq.seq_id]

    def _completion(self, state: _SampleState) -> CompletionOutput:
        seq = state.seq
        if state.detokenizer is not None:
            text = state.detokenizer.output_text(finished=state.finish_reason is not None)
        elif self.tokenizer is not None:
            text_ids = seq.output_token_ids
            if isinstance(state.stop_reason, int) and not seq.params.include_stop_str_in_output:
                text_ids = text_ids[:-1]  # the stop token, kept out of the text as in _check_finish
            text = decode_complete(self.tokenizer, text_ids)
        else:
            text = ""
        return CompletionOutput(
            index=seq.sample_index,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            cumulative_logprob=state.cumulative_logprob,
        )

    def _snapshot(self, request: _Request) -> RequestOutput:
        completions = request.beam_results or [self._completion(s) for s in request.samples]
        if len(completions) > request.params.n:  # best_of: only ever at the end (no streaming)
            completions = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[: request.params.n]
            for index, completion in enumerate(completions):
                completion.index = index
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            num_cached_tokens=max((state.seq.num_cached_tokens or 0 for state in request.samples), default=0),
            error=request.error,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
        )

    def _finalize(self, request: _Request) -> RequestOutput:
        del self._requests[request.request_id]
        output = self._snapshot(request)
        generated = max((len(completion.token_ids) for completion in output.outputs), default=0)
        if request.first_token_time is not None and generated > 1:
            per_token = (time.monotonic() - request.first_token_time) / (generated - 1)
            self.counters.time_per_output_token.observe(per_token)
        return output
