"""GGUF import: a Llama-3.1-style model (llama3 RoPE scaling, which llama.cpp stores as the `rope_freqs`
tensor) written by the `gguf` package the way llama.cpp's converter writes it, read back and generating
what the transformers model it was written from generates; likewise each family's layout (Phi-3 with its
LongRoPE factor tensors, the mixtures of experts with their stacked expert tensors); precision kept (F32 stays
F32, quantized blocks kept as they are; an unsupported type refused); RoPE scaling types read from the file; converter version in the cache key."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import pre_tokenizers

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.gguf_import import CONVERTER_VERSION, convert_gguf_to_hf_folder
from engine.model_registry import _gguf_cache_key
from engine.tokenizer import Tokenizer
from tests.engine.hf_oracle import PROMPTS, hf_greedy

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def _llama_cpp_rope_freqs(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py writes as rope_freqs for a llama3-scaled model: per frequency,
    the number its inverse frequency is divided by."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            divisors.append(1.0)
        elif wavelength > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of q/k rows for its `llama` architecture."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, weights.shape[1]).swapaxes(1, 2).reshape(
        weights.shape)


# Hugging Face module -> llama.cpp tensor, per GGUF architecture (what convert_hf_to_gguf.py writes).
_LLAMA_CPP_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_GEMMA_NAMES = {**_LLAMA_CPP_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


# A SentencePiece vocabulary: pieces with scores (higher merges first), byte fallback tokens, and a run of
# spaces stored as spaces (as Gemma's files do).
_PIECES = {"▁": -1.0, "t": -2.0, "h": -3.0, "e": -4.0, "▁t": -5.0, "he": -6.0, "▁the": -7.0, "1": -8.0,
           "2": -9.0, "12": -10.0, "▁1": -11.0, "  ": -12.0, "▁▁": -13.0, "▁h": -14.0}


def _write_vocabulary(writer: gguf.GGUFWriter, size: int, sentencepiece: bool) -> None:
    if sentencepiece:
        tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *_PIECES]
        fillers = [f"x{i}" for i in range(size - len(tokens))]
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens + fillers)
        writer.add_token_scores([0.0] * 259 + list(_PIECES.values()) + [-100.0 - i for i in range(len(fillers))])
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (size - 259))
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        return
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<s>", "</s>", *alphabet, "Ġt"] + [f"x{i}" for i in range(size - 3 - len(alphabet))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


def _write_gguf_from_hf(
    model, path: Path, arch: str = "llama", quantize_matrices: bool = False, sentencepiece: bool = False
) -> None:
    """The model as llama.cpp's converter writes it: q/k rows permuted for `llama`, Gemma's norms stored
    as (1 + weight), Phi-3's fused projections kept, float32 tensors (or Q8_0 matrices)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    theta = config.rope_parameters.get("rope_theta") or config.rope_parameters["full_attention"]["rope_theta"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_key_length(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "sliding_window", None) and arch != "qwen2":
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    _write_vocabulary(writer, config.vocab_size, sentencepiece)
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(theta, head_dim, LLAMA3_SCALING))
    if rope.get("rope_type") == "longrope":  # as llama.cpp's Phi3MiniModel writes it
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(config.max_position_embeddings / original) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch != "llama":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        if arch == "qwen3moe":  # as newer converters write it (qwen2moe: llama.cpp's default, not renormalised)
            writer.add_expert_weights_norm(config.norm_topk_prob)
    names = _GEMMA_NAMES if arch.startswith("gemma") else _LLAMA_CPP_NAMES
    for name, tensor in model.state_dict().items():
        weights = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # stacked experts: llama.cpp's converter splits gate_up into its gate and up halves
            layer = name.split(".")[2]
            if name.endswith("down_proj"):
                writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(weights))
            else:
                gate, up = np.split(weights, 2, axis=1)
                writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, leaf = rest.rpartition(".")
            gguf_name = f"blk.{layer}.{names[module]}.{leaf}"
            if arch == "llama" and module == "self_attn.q_proj":
                weights = _permute(weights, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                weights = _permute(weights, kv_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            weights = weights + 1
        if quantize_matrices and weights.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _random_weights(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)
            elif model.config.model_type.startswith("gemma"):
                param.normal_(0.0, 0.1)
    return model.float().eval()


@pytest.fixture(scope="module")
def llama31():
    """A tiny random Llama with Llama 3.1's RoPE scaling (original context 64, so it matters at test lengths)."""
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=10000.0, rope_scaling=dict(LLAMA3_SCALING), bos_token_id=0, eos_token_id=1,
    )
    return _random_weights(transformers.LlamaForCausalLM(config))


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """Converted folders go to the test's own cache, not the user's."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


def test_gguf_with_rope_freqs_matches_transformers(llama31, tmp_path):
    path = tmp_path / "llama31.gguf"
    _write_gguf_from_hf(llama31, path)
    expected = hf_greedy(llama31, PROMPTS, 30, eos=None)
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    got = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    scaling = llm.engine.model_config.rope_scaling
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0


def _family(arch: str):
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0,
                  eos_token_id=1, pad_token_id=1)
    if arch == "qwen2":  # q/k/v biases
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_theta=10000.0))
    if arch == "phi3":  # fused qkv and gate/up, windowed
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, sliding_window=12, rope_theta=10000.0))
    if arch == "phi3-longrope":  # LongRoPE beyond 32 tokens: PROMPTS are on both sides
        scaling = {"type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(8)],
                   "long_factor": [1.0 + 2.0 * i for i in range(8)]}
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **common, original_max_position_embeddings=32, rope_theta=10000.0, rope_scaling=scaling))
    if arch == "mixtral":  # a `llama` file with experts: q/k rows permuted
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6))
    if arch == "qwen2moe":  # a shared expert, top-k not renormalised, layer 1 dense
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=96, mlp_only_layers=[1], rope_theta=1e6))
    if arch == "qwen3moe":  # q/k norms, top-k renormalised
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=True, rope_theta=1e6))
    # Gemma 2: (1 + weight) norms, four norms a layer, soft-capping, alternating windows; the query scale
    # llama.cpp assumes (head_dim, as every Gemma but the 27B models has)
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **common, head_dim=16, query_pre_attn_scalar=16, sliding_window=12, attn_logit_softcapping=2.0,
        final_logit_softcapping=6.0))


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma2", "phi3-longrope", "mixtral", "qwen2moe", "qwen3moe"])
def test_gguf_family_layouts_match_transformers(family, tmp_path):
    model = _random_weights(_family(family))
    path = tmp_path / f"{family}.gguf"
    arch = {"phi3-longrope": "phi3", "mixtral": "llama"}.get(family, family)
    _write_gguf_from_hf(model, path, arch)
    reference = transformers.AutoModelForCausalLM.from_config(model.config, attn_implementation="eager")
    reference.load_state_dict(model.state_dict())
    expected = hf_greedy(reference.float().eval(), PROMPTS, 20, eos=None)
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    ours = llm.engine.model_config
    theirs = ModelConfig.from_hf({**model.config.to_dict(), "architectures": [type(model).__name__]})
    assert ours.architecture == type(model).__name__
    # the experts' shapes, routing and sparse layers, and LongRoPE's threshold, as the original config says
    assert (ours.moe, ours.long_rope_threshold) == (theirs.moe, theirs.long_rope_threshold)
    got = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected


def test_gguf_keeps_float_precision_and_quantized_blocks(llama31, tmp_path):
    path = tmp_path / "q8.gguf"
    _write_gguf_from_hf(llama31, path, quantize_matrices=True)
    convert_gguf_to_hf_folder(path, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as checkpoint:
        tensors = {name: checkpoint.get_tensor(name) for name in checkpoint.keys()}
    file_tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    # Q8_0 in the file: its blocks, byte for byte (v's rows are not permuted), typed in config.json
    assert torch.equal(tensors["model.layers.0.self_attn.v_proj.weight"],
                       torch.from_numpy(np.array(file_tensors["blk.0.attn_v.weight"].data)))
    config = ModelConfig.from_hf(__import__("json").loads((tmp_path / "out" / "config.json").read_text()))
    assert config.quantization.method == "gguf" and dict(config.quantization.tensor_types) == {"Q8_0": 16}  # 7 matrices a layer, the embedding, the output
    assert tensors["model.norm.weight"].dtype == torch.float32  # F32 in the file
    assert "rope_freqs.weight" not in tensors


def test_gguf_unsupported_type_is_refused_by_name(llama31, tmp_path):
    path = tmp_path / "q2.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 84), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from engine.gguf_tensors import hf_tensors

    tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    with pytest.raises(ValueError, match=r"type Q2_K.*supported: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"):
        hf_tensors("llama", tensors, {"num_attention_heads": 1, "num_key_value_heads": 1})


@pytest.mark.parametrize(("kind", "extra", "expected"), [
    ("linear", {}, {"rope_type": "linear", "factor": 4.0}),
    ("yarn", {"llama.rope.scaling.original_context_length": 128},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
])
def test_gguf_rope_scaling_types_are_read(llama31, tmp_path, kind, extra, expected):
    from engine.gguf_config import _rope_scaling

    metadata = {"llama.rope.scaling.type": kind, "llama.rope.scaling.factor": 4.0, **extra}
    assert _rope_scaling("llama", metadata, {}, 16) == expected


def test_converter_version_is_in_the_cache_key(tmp_path, monkeypatch):
    path = tmp_path / "any.gguf"
    path.write_bytes(b"GGUF")
    key = _gguf_cache_key(path)
    monkeypatch.setattr("engine.gguf_import.CONVERTER_VERSION", CONVERTER_VERSION + 1)
    assert _gguf_cache_key(path) != key


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])
def test_gguf_sentencepiece_tokenizer_matches_transformers(arch, tmp_path):
    """Each family's leading-space rule, merges rebuilt from scores (Gemma: from file order), byte fallback,
    Gemma's stored runs of spaces, against transformers' own GGUF tokenizer."""
    model = _random_weights(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        rope_theta=10000.0, rope_scaling=dict(LLAMA3_SCALING))) if arch == "llama" else _family(arch))
    _write_gguf_from_hf(model, tmp_path / "spm.gguf", arch, sentencepiece=True)
    convert_gguf_to_hf_folder(tmp_path / "spm.gguf", tmp_path / "out")
    ours = Tokenizer.from_folder(tmp_path / "out")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["the the 12 1 x", "  the\n\nthe's 日本", "</s>the<s>", "hthe  he"]:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == reference.decode(
            reference.encode(text), skip_special_tokens=True), text
