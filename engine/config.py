"""Configuration objects: the model's shape (read from a Hugging Face config.json; its quantization by
engine/quantization/config.py) and engine knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.quantization.config import (
    QUANTIZED_ACTIVATIONS, QuantizationConfig, QuantizedActivations, WeightOnlyMethod, checkpoint_quantization,
    weight_only_quantization, with_quantized_activations,
)


PreemptionMode = Literal["recompute", "swap"]
# The KV cache's storage: "auto" the model's dtype; "int8" (CPU, torch backend) or "fp8_e4m3" (CUDA, Triton backend):
# 8-bit rows with a float32 scale per (token, kv head), 2 * head_dim / (head_dim + 4) times bf16's tokens
KVCacheDtype = Literal["auto", "int8", "fp8_e4m3"]
SchedulingPolicy = Literal["continuous", "static"]
PreemptionVictim = Literal["recency", "least_work"]
KernelBackendChoice = Literal["auto", "torch", "triton"]


# Architectures the decoder models implement (engine/models/__init__.py maps each to its class).
DECODER_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
_MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# transformers' defaults for what a Qwen MoE config.json leaves out
_QWEN_MOE_DEFAULTS = {
    "Qwen2MoeForCausalLM": {
        "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    },
    "Qwen3MoeForCausalLM": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
}


@dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts feed-forward: each token's router picks `top_k` of `num_experts` SwiGLU experts.

    Routing, as Hugging Face transformers does it for all three families: softmax over the experts
    (float32), the top k, then, when `renormalize`, the k weights divided by their sum. Mixtral always
    renormalises; Qwen2-MoE and Qwen3-MoE only with `norm_topk_prob` (false by default).
    """

    num_experts: int
    top_k: int  # experts per token
    expert_intermediate_size: int  # width of one expert's gate/up projections
    renormalize: bool  # divide the top-k weights by their sum
    shared_expert_intermediate_size: int  # Qwen2-MoE's always-on expert, gated by sigmoid; 0: none
    sparse_layers: tuple[int, ...]  # decoder layers with experts; the others keep the dense MLP

    def __post_init__(self) -> None:
        if self.sparse_layers and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], architecture: str) -> "MoeConfig":
        layers = hf["num_hidden_layers"]
        if architecture == "MixtralForCausalLM":
            return cls(
                num_experts=hf.get("num_local_experts", 8),
                top_k=hf.get("num_experts_per_tok", 2),
                expert_intermediate_size=hf["intermediate_size"],
                renormalize=True,
                shared_expert_intermediate_size=0,
                sparse_layers=tuple(range(layers)),
            )
        defaults = _QWEN_MOE_DEFAULTS[architecture]
        # transformers 5 saves Qwen3-MoE's num_experts under its alias, num_local_experts
        num_experts = hf.get("num_experts", hf.get("num_local_experts", defaults["num_experts"]))
        step, dense_only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        return cls(
            num_experts=num_experts,
            top_k=hf.get("num_experts_per_tok", defaults["num_experts_per_tok"]),
            expert_intermediate_size=hf.get("moe_intermediate_size", defaults["moe_intermediate_size"]),
            renormalize=bool(hf.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=(
                hf.get("shared_expert_intermediate_size", defaults["shared_expert_intermediate_size"])
                if architecture == "Qwen2MoeForCausalLM"
                else 0  # Qwen3-MoE has none
            ),
            sparse_layers=tuple(
                i for i in range(layers) if i not in dense_only and num_experts > 0 and (i + 1) % step == 0
            ),
        )


def model_quantization(model: "ModelConfig", engine: "EngineConfig") -> QuantizationConfig | None:
    """What the model runs with: the checkpoint's own quantization, or the weight-only one the engine config asks
    for (only of an unquantized checkpoint: quantizing quantized weights again would silently lose precision), with
    its activations quantized where the engine config asks (refused where the weights are not the CPU kernels')."""
    if engine.quantization is None:
        quantization = model.quantization
    elif model.quantization is not None:
        raise ValueError(
            f"quantization={engine.quantization!r} applies to unquantized checkpoints; this model is already "
            f"quantized ({model.quantization.method})"
        )
    else:
        quantization = weight_only_quantization(engine.quantization, engine.quantization_group_size)
    if engine.quantized_activations is None:
        return quantization
    return with_quantized_activations(quantization, engine.quantized_activations)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder (Llama family and its relatives, dense or mixture-of-experts). Built from a Hugging Face
    `config.json` dict."""

    architecture: str  # e.g. "LlamaForCausalLM", "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Per layer: the sliding attention window in tokens (a query at position p attends keys in
    # (p - window, p], as transformers does), or None for full attention. Default: all None.
    layer_windows: tuple[int | None, ...] = ()
    hidden_activation: Literal["silu", "gelu_tanh"] = "silu"  # of the gated MLP's gate
    # Attention scale is query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the output logits (Gemma 2)
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3); None: rope_theta
    # M-RoPE (Qwen2.5-VL's decoder): the rotary frequencies split in sections of these many, rotated by a token's
    # temporal, height and width position in turn (models/llama.py: RotaryEmbedding); None: one position per token
    mrope_section: tuple[int, ...] | None = None
    moe: MoeConfig | None = None  # mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE); None: dense
    quantization: QuantizationConfig | None = None  # the checkpoint's (a GGUF import's); None: unquantized

    @property
    def long_rope_threshold(self) -> int | None:
        """LongRoPE (Phi-3's 128k models): a sequence of more tokens than this is rotated with the long factors,
        all its positions; one of at most this many with the short factors. None for every other RoPE."""
        if self.rope_scaling is None or self.rope_scaling.get("rope_type") != "longrope":
            return None
        return self.rope_scaling["original_max_position_embeddings"]

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one (then KV blocks outside it are never read
        again by any layer and can be freed); None when any layer attends fully."""
        windows = set(self.layer_windows)
        if len(windows) == 1 and None not in windows:
            return windows.pop()
        return None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in DECODER_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(DECODER_ARCHITECTURES)}")
        quantization = checkpoint_quantization(hf)
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta, rope_scaling, local_rope_theta = _rope_settings(hf, architecture)
        gemma = architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        activations: dict[str, Literal["silu", "gelu_tanh"]] = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
        if activation not in activations:
            raise ValueError(f"unsupported hidden activation {activation!r}; supported: {sorted(activations)}")
        if (hf.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {hf['partial_rotary_factor']} is not supported (only 1.0)")
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            # Qwen2-MoE names it qkv_bias; both Qwen2 families default to biased q/k/v.
            attention_bias=bool(
                hf.get("attention_bias", hf.get("qkv_bias", architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")))
            ),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            layer_windows=_layer_windows(hf, architecture),
            hidden_activation=activations[activation],
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if gemma else None,
            attn_logit_softcapping=hf.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcapping=hf.get("final_logit_softcapping") if gemma else None,
            local_rope_theta=local_rope_theta,
            mrope_section=_mrope_section(hf),
            moe=MoeConfig.from_hf(hf, architecture) if architecture in _MOE_ARCHITECTURES else None,
            quantization=quantization,
        )


def _rope_settings(hf: dict[str, Any], architecture: str) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, the sliding layers' own rope_theta). transformers >= 5 nests theta and
    scaling inside `rope_parameters`, per layer type for Gemma 3 ({"full_attention": ..., "sliding_attention": ...})."""
    params = hf.get("rope_parameters") or {}
    local_theta = None
    if "full_attention" in params:  # per layer type
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"RoPE scaling on sliding-window layers is not supported: {local}")
        local_theta = local.get("rope_theta")
        params = params["full_attention"]
    if architecture == "Gemma3ForCausalLM" and local_theta is None:
        local_theta = hf.get("rope_local_base_freq", 10000.0)
    rope_theta = hf.get("rope_theta") or params.get("rope_theta", 10000.0)
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling is None and params.get("rope_type", "default") != "default":
        rope_scaling = params
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "mrope":
        rope_scaling = None  # the Hub's Qwen2-VL configs: the default rotation, in sections (_mrope_section)
    if rope_scaling is not None and _is_long_rope(rope_scaling, architecture):
        if local_theta is not None:
            raise ValueError("LongRoPE with a second RoPE base for the sliding-window layers is not supported")
        rope_scaling = _long_rope_scaling(hf, rope_scaling, architecture)
    return float(rope_theta), rope_scaling, None if local_theta is None else float(local_theta)


def _mrope_section(hf: dict[str, Any]) -> tuple[int, ...] | None:
    """M-RoPE's sections (Qwen2-VL, Qwen2.5-VL), from `rope_scaling` (the Hub's configs) or `rope_parameters`
    (transformers 5); they must cover head_dim / 2 frequencies."""
    for settings in (hf.get("rope_scaling"), hf.get("rope_parameters")):
        if isinstance(settings, dict) and settings.get("mrope_section"):
            section = tuple(int(size) for size in settings["mrope_section"])
            head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            if len(section) != 3 or sum(section) != head_dim // 2:
                raise ValueError(f"mrope_section {list(section)} must be 3 sections of head_dim / 2 = {head_dim // 2}")
            return section
    return None


def _is_long_rope(scaling: dict[str, Any], architecture: str) -> bool:
    """LongRoPE goes by "su" in the first Phi-3 configs; transformers' Phi-3 also reads "yarn" as LongRoPE."""
    kind = scaling.get("rope_type", scaling.get("type"))
    return kind in ("longrope", "su") or (architecture == "Phi3ForCausalLM" and kind == "yarn")


def _long_rope_scaling(hf: dict[str, Any], scaling: dict[str, Any], architecture: str) -> dict[str, Any]:
    """LongRoPE's parameters completed as transformers completes them, so the dict says everything: the
    pretraining context (Phi-3's top-level `original_max_position_embeddings` wins, 4096 by default; otherwise
    the dict's, else max_position_embeddings) and `factor` (else the ratio of the two contexts, which sets the
    attention factor)."""
    max_positions = hf.get("max_position_embeddings", 4096)
    if architecture == "Phi3ForCausalLM":
        original = hf.get("original_max_position_embeddings") or 4096
    else:
        original = scaling.get("original_max_position_embeddings") or max_positions
    return {
        **scaling,
        "rope_type": "longrope",
        "original_max_position_embeddings": int(original),
        "factor": scaling.get("factor") or max_positions / original,
    }


def _layer_windows(hf: dict[str, Any], architecture: str) -> tuple[int | None, ...]:
    """Each layer's sliding window, following transformers: Mistral, Mixtral and Phi-3 window every layer;
    Qwen2/3 only with `use_sliding_window`, the layers from `max_window_layers` on (Qwen3-MoE: every layer;
    Qwen2-MoE: the even layers below `max_window_layers`); Gemma 2 alternates sliding and global layers,
    Gemma 3 has one global layer in `sliding_window_pattern`; an explicit `layer_types` wins except for
    Mistral, Mixtral, Phi-3 and Qwen3-MoE, whose transformers classes ignore it."""
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    qwen = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    if architecture in qwen and not hf.get("use_sliding_window", False):
        window = None
    if architecture == "LlamaForCausalLM" or window is None:
        return (None,) * layers
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return (window,) * layers
    types = hf.get("layer_types")
    if types is None:
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        elif architecture == "Qwen2MoeForCausalLM":  # every other layer, below max_window_layers
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(layers)]
        else:
            pattern = 2 if architecture == "Gemma2ForCausalLM" else hf.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' for each of {layers} layers")
    return tuple(window if kind == "sliding_attention" else None for kind in types)


@dataclass
class EngineConfig:
    """Engine knobs. Units are in the field names or comments; defaults favour throughput."""

    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # sequences in the running batch at once
    max_num_batched_tokens: int = 8192  # tokens (prefill chunks + decodes) computed in one step
    max_model_len: int | None = None  # tokens per sequence; None = the model's max_position_embeddings
    kv_cache_memory: int = 4 * 1024**3  # bytes of KV cache on CPU
    # the KV cache's storage dtype (see KVCacheDtype): "auto" = the model's; "int8" (CPU) / "fp8_e4m3" (CUDA) hold
    # ~1.9x bf16's tokens in the same memory; one the backend cannot run is refused at engine start
    kv_cache_dtype: KVCacheDtype = "auto"
    gpu_memory_utilization: float = 0.90  # fraction of GPU memory the engine may use in total (CUDA)
    num_kv_blocks: int | None = None  # overrides both memory budgets: exact number of KV blocks
    preemption_mode: PreemptionMode = "swap"  # "recompute" frees a victim's blocks and recomputes them later
    swap_space: int = 4 * 1024**3  # bytes of host memory for swapped-out blocks (pinned on CUDA)
    max_swap_blocks_per_step: int = 1024  # blocks moved per direction per step: a bandwidth cap
    admission_watermark: float = 0.01  # fraction of KV blocks kept free when admitting or swapping in
    # "continuous": admit into any free seat every step; "static": admit a batch, run it until its last
    # member finishes, then admit the next (the baseline continuous batching is measured against)
    scheduling_policy: SchedulingPolicy = "continuous"
    # Within a priority, admit first the waiting prompts with the longest cached prefix, so one
    # document's questions run together and hit the prefix cache (needs enable_prefix_caching)
    prefix_aware_ordering: bool = True
    prefix_ordering_window: int = 1024  # waiting requests (from the head of the queue) ranked per step: bounds its cost
    # The oldest waiting request of the top priority is overtaken by at most this many others, then admitted first
    prefix_ordering_max_overtakes: int = 256
    # Admit a prompt whose chunk does not fit yet, computing what fits now, when running sequences that
    # finish within this many steps (max_tokens reached) will release the rest; 0: off
    lookahead_admission_steps: int = 0
    # "recency": preempt the least recently scheduled, then the newest; "least_work": the one with the
    # fewest computed tokens (cheapest to swap or recompute). Lowest priority goes first either way.
    preemption_victim: PreemptionVictim = "recency"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0  # seeds requests that do not carry their own seed
    cpu_kernels: bool = True  # on CPU, C++ decode attention and RMSNorm where they build; False: torch only
    # torch backend: decode rows sharing cached blocks (one document's chunks, n samples, beams) read those
    # blocks' K/V once together where that saves reading at least this many tokens' K/V; 0: never
    shared_prefix_min_saved_tokens: int = 2048
    kernel_backend: KernelBackendChoice = "auto"  # "auto": Triton on CUDA, torch on CPU; or "torch" / "triton" to force one
    # LoRA adapters (engine/lora.py): enable_lora allocates the device's adapter slots at start, before the KV cache
    # is sized (on CUDA they count inside gpu_memory_utilization); add_lora needs it. max_loras: slots for adapters
    # resident at once (the most distinct adapters one step computes; idle ones are evicted least recently used)
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16  # largest adapter rank (r) accepted; every slot is sized for it
    cuda_graph_max_batch_size: int = 256  # decode steps of up to this many sequences replay CUDA graphs; 0: eager
    # Processes (one device each: GPUs device..device+N-1, or CPU processes) the model is sharded over; 1: none.
    # Budgets above (kv_cache_memory, swap_space) are per rank: each rank holds its share of the KV heads.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 300.0  # seconds a rank waits for the others in a collective before failing
    tensor_parallel_startup_timeout: float = 1800.0  # seconds the ranks may take to start and load their shards
    # Admission limits (engine/admission.py): what one request may ask for before it is queued.
    max_sequences_per_request: int = 128  # largest n, best_of or beam_width of one request (OpenAI's n limit)
    max_tokens_limit: int | None = None  # largest max_tokens admitted; None: what the context leaves
    default_max_tokens: int | None = None  # max_tokens of a request without one; None: the rest of the context
    grammar_compile_threads: int = 2  # threads compiling structured-output grammars, off the step loop
    grammar_cache_size: int = 256  # compiled grammars kept (most recently used), keyed by constraint
    # structured output: where the grammar allows exactly one continuation (keys, punctuation of a fixed
    # schema), append its tokens without a forward pass each. Off by default: the forced text is tokenized
    # on its own, which may split it differently from the model's own tokens (outputs differ from HF's).
    jump_forward: bool = False
    # Weight-only quantization of an unquantized checkpoint, done at load (CPU): "int8" or "int4", symmetric, one
    # float32 scale per `quantization_group_size` input features of each output row; None: the checkpoint's own
    # weights (a GGUF file's blocks as they are). Asking it of an already quantized checkpoint is an error.
    quantization: WeightOnlyMethod | None = None
    quantization_group_size: int = 64  # input features per int8 / int4 scale (divides SmolLM2's 576 and 1536)
    # "int8": the quantized weights' matmuls (GGUF blocks, int8 / int4 above, AWQ / GPTQ; CPU only) quantize each
    # token's activations to int8 at run time, blocks of 32 input features with a float32 scale each, and multiply
    # by integer dot products: faster, but the numbers change (tolerance in README.md), hence an opt-in. None (the
    # default): activations stay in the model's dtype, the exact path. Refused for an unquantized or FP8 model, on
    # CUDA, and with int8 / int4 groups that are not a multiple of 32.
    quantized_activations: QuantizedActivations | None = None
    # Vision-language models: encoder outputs kept by image content, in embedding rows (one per placeholder token;
    # LLaVA-1.5 takes 576 per image), least recently used evicted; 0 keeps none (each chunk reaching an image
    # encodes it again). And images per vision-encoder forward pass, bounding its activations.
    encoder_cache_tokens: int = 16384
    max_images_per_encoder_batch: int = 16

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.swap_space < 0 or self.max_swap_blocks_per_step < 0:
            raise ValueError("swap_space and max_swap_blocks_per_step must be >= 0")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'int8' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel_backend must be 'auto', 'torch' or 'triton', got {self.kernel_backend!r}")
        if self.shared_prefix_min_saved_tokens < 0:
            raise ValueError("shared_prefix_min_saved_tokens must be >= 0")
        if self.cuda_graph_max_batch_size < 0:
            raise ValueError("cuda_graph_max_batch_size must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_timeout <= 0 or self.tensor_parallel_startup_timeout <= 0:
            raise ValueError("tensor_parallel_timeout and tensor_parallel_startup_timeout must be > 0 seconds")
        if self.max_sequences_per_request < 1:
            raise ValueError("max_sequences_per_request must be >= 1")
        if (self.max_tokens_limit is not None and self.max_tokens_limit < 1) or (
            self.default_max_tokens is not None and self.default_max_tokens < 1
        ):
            raise ValueError("max_tokens_limit and default_max_tokens must be >= 1 (or None)")
        if self.scheduling_policy not in ("continuous", "static"):
            raise ValueError(f"scheduling_policy must be 'continuous' or 'static', got {self.scheduling_policy!r}")
        if self.preemption_victim not in ("recency", "least_work"):
            raise ValueError(f"preemption_victim must be 'recency' or 'least_work', got {self.preemption_victim!r}")
        if self.prefix_ordering_window < 1 or self.prefix_ordering_max_overtakes < 0:
            raise ValueError("prefix_ordering_window must be >= 1 and prefix_ordering_max_overtakes >= 0")
        if self.lookahead_admission_steps < 0:
            raise ValueError("lookahead_admission_steps must be >= 0")
        if self.grammar_compile_threads < 1 or self.grammar_cache_size < 1:
            raise ValueError("grammar_compile_threads and grammar_cache_size must be >= 1")
        if self.encoder_cache_tokens < 0 or self.max_images_per_encoder_batch < 1:
            raise ValueError("encoder_cache_tokens must be >= 0 and max_images_per_encoder_batch >= 1")
        if self.quantization is not None:
            weight_only_quantization(self.quantization, self.quantization_group_size)  # raises naming what is supported
        if self.quantized_activations not in (None, *QUANTIZED_ACTIVATIONS):
            raise ValueError(
                f"quantized_activations {self.quantized_activations!r} is not supported; supported: "
                f"{', '.join(QUANTIZED_ACTIVATIONS)} (or none)"
            )
        if not 0.0 <= self.admission_watermark < 1.0:
            raise ValueError(f"admission_watermark must be in [0, 1), got {self.admission_watermark}")


@dataclass(frozen=True)
class EncoderConfig:
    """Shape of a BERT-family encoder (absolute positions, post-LayerNorm). Built from a `config.json` dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int  # tokens per sequence the position table covers
    type_vocab_size: int
    layer_norm_eps: float
    gelu_approximation: Literal["none", "tanh"]  # "none": erf GELU ("gelu"); "tanh": "gelu_new" and kin

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "EncoderConfig":
        if hf.get("model_type") != "bert":
            raise ValueError(f"unsupported encoder model_type {hf.get('model_type')!r}; supported: 'bert'")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {hf['position_embedding_type']!r}")
        gelu_approximations: dict[str, Literal["none", "tanh"]] = {
            "gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh",
        }
        activation = hf.get("hidden_act", "gelu")
        if activation not in gelu_approximations:
            raise ValueError(f"unsupported hidden_act {activation!r}; supported: {sorted(gelu_approximations)}")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            max_position_embeddings=hf.get("max_position_embeddings", 512),
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            gelu_approximation=gelu_approximations[activation],
        )


@dataclass(frozen=True)
class EmbedderConfig:
    """Embedding knobs. Units are in the field names or comments."""

    max_batch_tokens: int = 8192  # tokens (summed over the packed sequences, no padding) per forward pass

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
