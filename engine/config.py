"""Configuration objects: the model's shape (read from a Hugging Face config.json) and engine knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


PreemptionMode = Literal["recompute", "swap"]
KernelBackendChoice = Literal["auto", "torch", "triton"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. Built from a Hugging Face `config.json` dict."""

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
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        supported = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
        if architecture not in supported:
            raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(supported)}")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests theta inside rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        if rope_scaling is None and hf.get("rope_parameters"):
            params = hf["rope_parameters"]
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
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
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            qk_norm=architecture == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
        )


@dataclass
class EngineConfig:
    """Engine knobs. Units are in the field names or comments; defaults favour throughput."""

    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # sequences in the running batch at once
    max_num_batched_tokens: int = 8192  # tokens (prefill chunks + decodes) computed in one step
    max_model_len: int | None = None  # tokens per sequence; None = the model's max_position_embeddings
    kv_cache_memory: int = 4 * 1024**3  # bytes of KV cache on CPU
    gpu_memory_utilization: float = 0.90  # fraction of GPU memory the engine may use in total (CUDA)
    num_kv_blocks: int | None = None  # overrides both memory budgets: exact number of KV blocks
    preemption_mode: PreemptionMode = "swap"  # "recompute" frees a victim's blocks and recomputes them later
    swap_space: int = 4 * 1024**3  # bytes of host memory for swapped-out blocks (pinned on CUDA)
    max_swap_blocks_per_step: int = 1024  # blocks moved per direction per step: a bandwidth cap
    admission_watermark: float = 0.01  # fraction of KV blocks kept free when admitting or swapping in
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0  # seeds requests that do not carry their own seed
    cpu_kernels: bool = True  # on CPU, C++ decode attention and RMSNorm where they build; False: torch only
    # torch backend: decode rows sharing cached blocks (one document's chunks, n samples, beams) read those
    # blocks' K/V once together where that saves reading at least this many tokens' K/V; 0: never
    shared_prefix_min_saved_tokens: int = 2048
    kernel_backend: KernelBackendChoice = "auto"  # "auto": Triton on CUDA, torch on CPU; or "torch" / "triton" to force one
    cuda_graph_max_batch_size: int = 256  # decode steps of up to this many sequences replay CUDA graphs; 0: eager

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.swap_space < 0 or self.max_swap_blocks_per_step < 0:
            raise ValueError("swap_space and max_swap_blocks_per_step must be >= 0")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel_backend must be 'auto', 'torch' or 'triton', got {self.kernel_backend!r}")
        if self.shared_prefix_min_saved_tokens < 0:
            raise ValueError("shared_prefix_min_saved_tokens must be >= 0")
        if self.cuda_graph_max_batch_size < 0:
            raise ValueError("cuda_graph_max_batch_size must be >= 0")
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
