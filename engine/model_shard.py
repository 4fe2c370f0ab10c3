"""What one device of an engine holds: the model (or its tensor-parallel shard), its KV cache pools and the runner.

Rank 0 builds its shard inside LLMEngine; every other rank builds its own the same way in its own process
(engine/tensor_parallel.py), from the same `ShardSpec`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import TorchAttention, TritonAttention
from engine.config import EngineConfig, ModelConfig, model_quantization
from engine.cuda_graphs import DecodeGraphs
from engine.distributed import TensorParallelGroup, building_with
from engine.dtypes import KernelBackend, building_on, cpu_has_fast_bf16, on_device
from engine.kv_cache import (
    allocate_host_kv_cache, allocate_kv_cache, bytes_per_block, num_host_blocks, num_kv_blocks, profile_device_memory,
    resolve_kv_cache_dtype,
)
from engine.loader import init_dummy_weights, iter_checkpoint
from engine.model_registry import ModelSource
from engine.model_runner import ModelRunner
from engine.models import MODEL_CLASSES
from engine.lora import LoRASlotWeights
from engine.models.llama import LlamaForCausalLM
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.encoder_step import EncoderStep
from engine.multimodal.kind import VisionLanguageKind, split_checkpoint
from engine.multimodal.registry import vision_kind_for
from engine.quantization.linear_method import building_quantized
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from conveyor_kernels.cpu_kernels import load_cpu_kernels, load_vector_decode_kernels, vector_decode_reads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSpec:
    """Everything a rank needs to build its part; plain data, sent to the ranks the engine starts."""

    source: ModelSource
    model_config: ModelConfig
    config: EngineConfig
    device: torch.device  # rank 0's; rank r computes on the r-th device after it (CUDA) or on the CPU
    dtype: torch.dtype
    kernel_backend: KernelBackend

    @property
    def vision_kind(self) -> VisionLanguageKind | None:
        """The vision-language family of the checkpoint; None for a text-only one."""
        return vision_kind_for(self.source.hf_config, self.source.path)

    def device_of(self, rank: int) -> torch.device:
        if self.device.type != "cuda":
            return self.device
        return torch.device("cuda", (self.device.index or 0) + rank)


@dataclass
class ModelShard:
    model: LlamaForCausalLM
    runner: ModelRunner
    num_blocks: int  # KV blocks of the device pool, the same on every rank
    num_host_blocks: int  # blocks of the host (swap) pool, the same on every rank
    bytes_per_block: int  # of this rank's share of the KV heads
    max_model_len: int  # tokens per sequence


def rank_model_config(model: ModelConfig, size: int) -> ModelConfig:
    """The attention shape one of `size` ranks computes, for sizing its KV cache: its share of the heads. Raises
    when a width the ranks split is not divisible by `size`, before any rank's process starts."""
    for name, width in _sharded_widths(model).items():
        if width % size:
            raise ValueError(
                f"{name} ({width}) is not divisible by tensor_parallel_size ({size}); "
                "pick a size that divides the model's heads and MLP widths"
            )
    return dataclasses.replace(
        model, num_attention_heads=model.num_attention_heads // size, num_key_value_heads=model.num_key_value_heads // size
    )


def _sharded_widths(model: ModelConfig) -> dict[str, int]:
    """The widths tensor parallelism splits across ranks, named as its errors name them: the heads, the dense MLP's
    width where some layer has one, and a mixture of experts' expert widths (engine/models/moe.py)."""
    widths = {"num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_key_value_heads}
    moe = model.moe
    if moe is None or len(moe.sparse_layers) < model.num_hidden_layers:
        widths["intermediate_size"] = model.intermediate_size
    if moe is not None:
        widths["the experts' intermediate size"] = moe.expert_intermediate_size
        if moe.shared_expert_intermediate_size:
            widths["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    return widths


def build_model_shard(spec: ShardSpec, group: TensorParallelGroup) -> ModelShard:
    """Build this rank's model and cache pools, on its device (current while this runs). With several ranks,
    every rank runs the same steps in lockstep (the profiled step and the warm-up run the layers' collectives),
    and the block counts are agreed on (the smallest any rank can hold), since the one block manager on rank 0
    hands out block ids valid on every rank."""
    with on_device(spec.device_of(group.rank)):
        return _build_model_shard(spec, group)


def _build_model_shard(spec: ShardSpec, group: TensorParallelGroup) -> ModelShard:
    config, device = spec.config, spec.device_of(group.rank)
    model = _build_model(spec, device, group)
    vision = _build_vision(spec, device)
    # The adapter slots before the profile: on CUDA they are then weights the KV cache budget leaves room for
    lora = (
        LoRASlotWeights(model, config.max_loras, config.max_lora_rank, spec.kernel_backend == "triton")
        if config.enable_lora else None
    )
    shape = rank_model_config(spec.model_config, group.size)
    device_memory = None
    if device.type == "cuda" and config.num_kv_blocks is None:
        step = largest_step(spec, model, shape, device)
        if vision is not None:  # the encoder's largest batch runs in a step too (before the decoder, not with it)
            step = _then(vision.run_largest_batch, step)
        device_memory = profile_device_memory(device, step)
    cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, spec.dtype, spec.kernel_backend)
    num_blocks = group.min_over_ranks("kv-blocks", num_kv_blocks(shape, config, cache_dtype, device_memory))
    num_host = group.min_over_ranks("host-blocks", num_host_blocks(shape, config, cache_dtype))
    kv_caches = allocate_kv_cache(shape, num_blocks, config.block_size, cache_dtype, device)
    host_caches = allocate_host_kv_cache(shape, num_host, config.block_size, cache_dtype, device)
    max_model_len = min(
        config.max_model_len or spec.model_config.max_position_embeddings,
        spec.model_config.max_position_embeddings,
        _pool_context_limit(spec.model_config, config, num_blocks),
    )
    max_blocks_per_seq = -(-max_model_len // config.block_size)
    runner = ModelRunner(model, kv_caches, host_caches, config.block_size, device, spec.kernel_backend, vision, lora)
    if spec.kernel_backend == "triton":
        runner.warm_up(config.max_num_batched_tokens, max_blocks_per_seq)
    graph_batch = min(config.cuda_graph_max_batch_size, config.max_num_seqs)
    if device.type == "cuda" and spec.kernel_backend == "triton" and graph_batch > 0:
        runner.decode_graphs = DecodeGraphs(model, kv_caches, graph_batch, max_blocks_per_seq, device)
    return ModelShard(
        model=model,
        runner=runner,
        num_blocks=num_blocks,
        num_host_blocks=num_host,
        bytes_per_block=bytes_per_block(shape, config.block_size, cache_dtype),
        max_model_len=max_model_len,
    )


def largest_step(
    spec: ShardSpec, model: LlamaForCausalLM, shape: ModelConfig, device: torch.device
) -> Callable[[], None]:
    """A throwaway step as large as any the scheduler can build: max_num_batched_tokens tokens over as many
    sequences as may run, each sampling with every filter and penalty (the sampler's largest temporaries, on rank
    0), over a one-block cache of this rank's heads."""
    config = spec.config
    num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
    tokens, extra = divmod(config.max_num_batched_tokens, num_seqs)
    query_lens = [tokens + (i < extra) for i in range(num_seqs)]
    heaviest = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=spec.model_config.vocab_size - 1, min_p=0.01,
        repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1, logit_bias={0: 0.0}, max_tokens=2,
    )
    rows = [SamplingRow(heaviest, seed=0, prompt_token_ids=[0], output_token_ids=[0], eos_token_ids=()) for _ in query_lens]
    cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, spec.dtype, spec.kernel_backend)
    caches = allocate_kv_cache(shape, 1, config.block_size, cache_dtype, device)
    probe = ModelRunner(model, caches, [], config.block_size, device, spec.kernel_backend)
    return lambda: probe.run_dummy_step(query_lens, -(-max(query_lens) // config.block_size), rows)


def _pool_context_limit(model: ModelConfig, config: EngineConfig, num_blocks: int) -> int:
    """Tokens one sequence can reach in a pool of `num_blocks`: all of it, unless every layer is windowed
    and the pool holds the window plus the largest step (blocks behind the window are freed as it goes)."""
    blocks_per_sequence = windowed_blocks_per_sequence(model, config)
    if blocks_per_sequence is not None and blocks_per_sequence <= num_blocks:
        return model.max_position_embeddings
    return num_blocks * config.block_size


def windowed_blocks_per_sequence(model: ModelConfig, config: EngineConfig) -> int | None:
    """The most blocks one sequence holds when every layer is windowed (the window plus the largest step);
    None when some layer reads the whole context."""
    if model.uniform_window is None:
        return None
    return -(-(model.uniform_window - 1 + config.max_num_batched_tokens) // config.block_size) + 1


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


def _build_vision(spec: ShardSpec, device: torch.device) -> EncoderStep | None:
    """A vision-language model's encoder and projector, with its output cache; None for a text-only model.

    Built outside the tensor-parallel group (`building_with`): every rank holds the whole encoder and encodes the
    images of each step itself, from the pixels in the step data every rank receives. The encoders are small beside
    their decoders (a few hundred million parameters, run once per image), so this costs each rank that memory and
    the encoder's time in parallel, and needs no collective and no divisibility of the encoder's heads; the ranks'
    encoder caches see the same steps, so they hold the same images."""
    kind = spec.vision_kind
    if kind is None:
        return None
    with building_on(device, spec.dtype):
        encoder = kind.build_encoder()
    if spec.source.load_format == "dummy":
        init_dummy_weights(encoder, seed=spec.config.seed)
    else:
        assert spec.source.path is not None
        encoder.load_weights(split_checkpoint(kind, iter_checkpoint(spec.source.path, spec.source.hf_config), "vision"))
    cache = EncoderCache(spec.config.encoder_cache_tokens)
    return EncoderStep(encoder.eval(), cache, spec.config.max_images_per_encoder_batch, kind.pixel_shape)


def _build_model(spec: ShardSpec, device: torch.device, group: TensorParallelGroup) -> LlamaForCausalLM:
    config = spec.config
    use_cpu_kernels = (
        spec.kernel_backend == "torch" and config.cpu_kernels and device.type == "cpu" and load_cpu_kernels() is not None
    )
    cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, spec.dtype, spec.kernel_backend)
    if use_cpu_kernels and vector_decode_reads(spec.dtype, cache_dtype):
        load_vector_decode_kernels()  # built (once per source version and CPU) at load, not in the first step
    if spec.kernel_backend == "triton":
        backend, kernels = TritonAttention(), "triton"
    else:
        # The shared-prefix groups run on torch's CPU flash-attention kernel.
        shared_prefix = config.shared_prefix_min_saved_tokens if device.type == "cpu" else 0
        backend = TorchAttention(use_cpu_kernels, shared_prefix)
        kernels = "cpu" if use_cpu_kernels else "torch"
    quantization = model_quantization(spec.model_config, config)
    if spec.source.load_format == "dummy" and spec.model_config.quantization is not None:
        # Random weights of the quantized checkpoint's shape: there are no blocks to keep, nor to quantize activations
        # for (model_quantization has refused a weight-only ask of this quantized checkpoint).
        if config.quantized_activations is not None:
            raise ValueError(
                f"quantized_activations={config.quantized_activations!r} needs the checkpoint's quantized weights; "
                f"load_format 'dummy' runs random unquantized weights of its shape"
            )
        quantization = None
    if quantization is not None:
        quantization.check_device(device.type)
    # Parameters are created in their final dtype on the device, and filled in place: building in float32 and
    # casting would hold twice the weights at the peak.
    with building_on(device, spec.dtype), building_with(group), building_quantized(quantization):
        model = MODEL_CLASSES[spec.model_config.architecture](spec.model_config, backend, kernels)
    if spec.source.load_format == "dummy":
        init_dummy_weights(model, seed=config.seed)
    else:
        assert spec.source.path is not None, "a safetensors source always has a folder"
        checkpoint = iter_checkpoint(spec.source.path, spec.source.hf_config)
        kind = spec.vision_kind
        model.load_weights(checkpoint if kind is None else split_checkpoint(kind, checkpoint, "text"))
    # The rotary tables stay float32 whatever the weights' dtype: positions need the precision.
    for rotary in (model.model.rotary, model.model.local_rotary):
        if rotary is not None:
            rotary.float()
    model.process_weights_after_loading(
        pack_for_cpu=use_cpu_kernels and spec.dtype == torch.bfloat16 and cpu_has_fast_bf16()
    )
    if quantization is not None and group.rank == 0:
        log.info("model weights quantized: %s", quantization.describe())
    return model.eval()
