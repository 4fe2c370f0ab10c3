"""LLMEngine: owns the model, KV cache, scheduler and requests; `step()` runs one iteration.

    out = scheduler.schedule()                        # which sequences compute how many tokens
    batch = requests.batch(out)                       # the sampler's rows for those that sample
    step = runner.execute(out, batch.rows, ...)       # block moves, the forward pass, sampling
    outputs = requests.update(out, batch, step)       # tokens appended, forks, stops, beams, frees

Everything a step changes in a request happens in `Requests.update` (engine/requests.py).
Single-threaded by design; `EngineLoop` drives it from its own thread for concurrent callers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import fields
from pathlib import Path

import torch

from engine.admission import AdmissionLimits, EngineFailed, StepFailed, admit, cost
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.distributed import SINGLE
from engine.dtypes import on_device, resolve_device, resolve_dtype, resolve_kernel_backend
from engine.lora import load_adapter
from engine.model_registry import DEFAULT_MODEL, resolve_model
from engine.metrics import EngineStats, StepCounters
from engine.kv_cache import resolve_kv_cache_dtype
from engine.model_runner import ModelRunner, StepResult
from engine.multimodal.inputs import ImageInput, PlacedImage
from engine.multimodal.kind import VisionLanguageKind
from engine.multimodal.registry import vision_kind_for
from engine.multimodal.prompt import expand_image_prompt
from engine.model_shard import ShardSpec, build_model_shard, rank_model_config, windowed_blocks_per_sequence
from engine.outputs import RequestOutput
from engine.request_state import StepBatch
from engine.requests import Requests
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.tensor_parallel import TensorParallelRanks, TensorParallelRunner
from engine.structured_output import GrammarCompilerPool
from engine.tokenizer import Tokenizer


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
        # A vision-language checkpoint: its text decoder is an ordinary decoder (sharded like any other under tensor
        # parallelism), its encoder runs in the step (whole on every rank: engine/model_shard.py, _build_vision).
        self.vision_kind: VisionLanguageKind | None = vision_kind_for(source.hf_config, source.path)
        text_config = source.hf_config if self.vision_kind is None else self.vision_kind.text_config()
        self.model_config = ModelConfig.from_hf(text_config)
        has_tokenizer = source.path is not None and (source.path / "tokenizer.json").exists()
        self.tokenizer: Tokenizer | None = Tokenizer.from_folder(source.path) if has_tokenizer else None
        eos = self.model_config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids: tuple[int, ...] = eos

        spec = ShardSpec(source, self.model_config, self.config, self.device, self.dtype, self.kernel_backend)
        tp_size = self.config.tensor_parallel_size
        rank_model_config(self.model_config, tp_size)  # sizes not divisible: fail before starting any process
        resolve_kv_cache_dtype(self.config.kv_cache_dtype, self.dtype, self.kernel_backend)  # and a cache it cannot run
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

        self._seed_rng = random.Random(self.config.seed)
        self.counters = StepCounters()
        self.requests = Requests(
            self.scheduler, self.tokenizer, self.eos_token_ids, self.max_model_len, self.config.jump_forward, self.counters
        )
        self._grammars: GrammarCompilerPool | None = None  # built with the first constrained request

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any. The engine cannot step afterwards."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()

    def check_health(self) -> None:
        """Raises EngineFailed (RankFailure) if a tensor-parallel rank is known to have died, without stepping: how
        an idle engine's driver learns it, before any request fails on it."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.ranks.check()

    # ---- LoRA adapters --------------------------------------------------------------------

    def add_lora(self, name: str, folder: str | Path) -> None:
        """Register the PEFT LoRA adapter in `folder` as `name`, for requests to name in SamplingParams.adapter. Its
        weights are read and checked now (ValueError naming what does not fit this model), once; they are copied
        into one of the `max_loras` device slots when a request needs them."""
        if not self.config.enable_lora:
            raise ValueError(
                "LoRA adapters need an engine built with enable_lora=True (its adapter slots are allocated at start, "
                "inside the memory budget)"
            )
        if name in self.adapter_names:
            raise ValueError(f"adapter {name!r} is already registered")
        adapter = load_adapter(name, folder, self.model_config, self.config.max_lora_rank)
        self.runner.register_adapter(adapter)

    @property
    def adapter_names(self) -> list[str]:
        return list(self.runner.adapters)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        stream: bool = False,
        images: Sequence[ImageInput | PlacedImage] = (),
    ) -> None:
        """Queue a request. `prompt_token_ids` as the chat template renders them: with `images`, one image token per
        image (in order), which the engine expands into the image's placeholder tokens; those count in the context,
        the admission limits and the KV budget like any prompt token. Or a prompt and images `place_images` already
        expanded and preprocessed (off the engine's thread)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids, placed = self.place_images(prompt_token_ids, images)
        self._validate_prompt(prompt_token_ids)
        if params.adapter is not None and params.adapter not in self.adapter_names:
            raise ValueError(f"unknown LoRA adapter {params.adapter!r}; registered: {self.adapter_names}")
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
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        grammar = self._grammar_pool().compiled(params.structured_output) if params.structured_output is not None else None
        self.requests.add(request_id, prompt_token_ids, params, stream, priority, base_seed, grammar, placed)

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

    @property
    def jump_forward_tokens(self) -> int:
        """Structured-output tokens appended without a forward pass each (`jump_forward`)."""
        return self.requests.jump_forward_tokens

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
        if request_id not in self.requests:
            return None
        self.counters.requests_finished += 1
        return self.requests.abort(request_id)

    def place_images(
        self, prompt_token_ids: list[int], images: Sequence[ImageInput | PlacedImage]
    ) -> tuple[list[int], tuple[PlacedImage, ...]]:
        """The prompt with each image token expanded into its placeholders, and the images preprocessed and hashed
        (ValueError for a mismatch, a non-RGB image, a refused detail, or images for a text-only model). Reads only
        the model's processor settings: safe to call from any thread, so that the pixels are not prepared on the
        engine's."""
        if self.vision_kind is None:
            if images:
                raise ValueError(f"model {self.model_name!r} does not take images (model_not_multimodal)")
            return prompt_token_ids, ()
        expanded, placed = expand_image_prompt(self.vision_kind, prompt_token_ids, images)
        step = self.config.max_num_batched_tokens
        for image in placed:
            if image.bidirectional and image.length > step:  # computed in one step (scheduler._whole_images)
                raise ValueError(
                    f"an image takes {image.length} placeholder tokens, computed in one step, but "
                    f"max_num_batched_tokens is {step}; raise it to at least {image.length}"
                )
        return expanded, placed

    @property
    def accepts_images(self) -> bool:
        """Whether requests may carry images (a vision-language model)."""
        return self.vision_kind is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. Returns outputs of requests that finished, plus snapshots of streaming ones."""
        started = time.perf_counter()
        failed = self.requests.admit_compiled(self._grammars.matcher) if self._grammars is not None else []
        out = self.scheduler.schedule()
        if out.is_empty:
            if not failed and (compiling := self.requests.compiling()):
                # Nothing to run but grammars compiling: wait for one instead of spinning on the CPU it needs.
                wait(compiling, 0.05, FIRST_COMPLETED)
            self.counters.requests_finished += len(failed)
            return failed
        try:
            with on_device(self.device):  # the loop thread's current device is 0 whatever the engine's is
                batch = self.requests.batch(out)
                step = self._execute(out, batch)
                outputs = failed + self.requests.update(out, batch, step)
        except EngineFailed:
            raise  # the engine cannot step any more: no request is to blame
        except Exception as error:
            suspect = self.requests.blame(out, cost)
            if suspect is None:
                raise
            raise StepFailed(suspect, error) from error
        self._count_step(out, batch, outputs, time.perf_counter() - started)
        return outputs

    def _execute(self, out: SchedulerOutput, batch: StepBatch) -> StepResult:
        """The runner's step, with the grammar's bitmask filled while the model runs (the sampler waits for it)."""
        token_bitmask = None
        if self._grammars is not None and batch.rows:
            token_bitmask = self._grammars.fill_bitmask(batch.matchers)
        try:
            return self.runner.execute(out, batch.rows, batch.fanout, token_bitmask)
        finally:
            if token_bitmask is not None:
                wait([token_bitmask])  # a failed step too: the matchers change after this, the fill reads them

    def _count_step(self, out: SchedulerOutput, batch: StepBatch, outputs: list[RequestOutput], seconds: float) -> None:
        counters = self.counters
        counters.steps += 1
        counters.last_step_seconds = seconds
        counters.step_seconds += seconds
        counters.step_time.observe(seconds)
        counters.prompt_tokens_computed += batch.prompt_tokens
        counters.generation_tokens += len(batch.rows)
        counters.batched_tokens += out.num_batched_tokens
        counters.requests_finished += sum(output.finished for output in outputs)
        counters.last_step_tokens = out.num_batched_tokens
        counters.last_step_sequences = len(out.scheduled)
        counters.last_step_context_tokens = sum(item.start_position + item.num_new_tokens for item in out.scheduled)

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
            **self._vision_stats(),
        )

    def _vision_stats(self) -> dict[str, int]:
        vision = self.runner.vision
        if vision is None:
            return {}
        return {"images_encoded": vision.images_encoded, "encoder_cache_hits": vision.cache.hits}
