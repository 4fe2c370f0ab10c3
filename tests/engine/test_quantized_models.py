"""Quantized models end to end, float32 oracles:

- a GGUF whose matrices are quantized (every supported type, a fused q/k/v of three different types, the K-quants
  as random blocks since gguf-py has no quantizer for them) generates what transformers generates from the same
  file (`from_pretrained(gguf_file=...)`, which dequantizes with gguf-py to float32), token for token, with its
  own output projection or tied to the embedding (whose blocks then run the output projection too, held once);
- int8 / int4 weight-only quantization at load generates what the dequantized model (its weights replaced by
  the dequantized values, loaded unquantized; a tied output projection and so its embedding too) generates,
  token for token, batched and with chunked prefill;
- what the quantization is shows in the engine's config; the wrong asks fail by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.quantization.weight_only import dequantize_rows_reference, quantize_rows
from tests.engine.hf_oracle import GREEDY, PROMPTS, hf_greedy, tiny_llama_folder  # noqa: F401  (a fixture)
from tests.engine.test_gguf_import import _permute, _write_vocabulary

transformers = pytest.importorskip("transformers")

_K_QUANT_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of each block's f16 scales


def random_blocks(rows: int, columns: int, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes] of `type_name`: gguf-py's quantizer where it has one, else random bytes whose f16
    scales are set small (any bytes are valid K-quant blocks)."""
    quant_type = gguf.GGMLQuantizationType[type_name]
    values = rng.standard_normal((rows, columns)).astype(np.float32) * 0.15
    if type_name not in _K_QUANT_SCALES:
        return gguf.quants.quantize(values, quant_type)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[quant_type]
    blocks = rng.integers(0, 256, (rows, columns // block_values, block_bytes), dtype=np.uint8)
    for offset in _K_QUANT_SCALES[type_name]:
        scales = (rng.random(blocks.shape[:2]) * 4e-4 + 1e-4).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


# Each matrix's type: every supported one, q/k/v three different types (one fused projection, three pieces).
_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
          "ffn_up": "Q4_1", "ffn_down": "Q5_0", "output": "Q5_1", "token_embd": "Q8_0"}


def write_quantized_gguf(path: Path, types: dict[str, str] = _TYPES, tied: bool = False) -> None:
    """A two-layer `llama` GGUF (hidden 256, the K-quants' block) with the matrices quantized per `types`
    (`_TYPES`'s keys); `tied`: no output.weight, the embedding is the output projection too."""
    hidden, heads, kv_heads, ffn, vocab = 256, 4, 2, 512, 300
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    _write_vocabulary(writer, vocab, sentencepiece=False)

    def matrix(name: str, kind: str, rows: int, columns: int) -> None:
        blocks = random_blocks(rows, columns, types[kind], rng)
        if kind in ("attn_q", "attn_k"):  # llama.cpp's row order, as its converter writes it; whole rows move
            blocks = _permute(blocks, heads if kind == "attn_q" else kv_heads)
        writer.add_tensor(name, np.ascontiguousarray(blocks), raw_dtype=gguf.GGMLQuantizationType[types[kind]])

    matrix("token_embd.weight", "token_embd", vocab, hidden)
    if not tied:
        matrix("output.weight", "output", vocab, hidden)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    shapes = {"attn_q": (hidden, hidden), "attn_k": (hidden // 2, hidden), "attn_v": (hidden // 2, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    for layer in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        for kind, (rows, columns) in shapes.items():
            matrix(f"blk.{layer}.{kind}.weight", kind, rows, columns)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("tied", [False, True], ids=["output", "tied"])
def test_quantized_gguf_matches_transformers_in_float32(tied, tmp_path):
    path = tmp_path / "mixed.gguf"
    write_quantized_gguf(path, tied=tied)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    expected = hf_greedy(reference.eval(), PROMPTS, GREEDY.max_tokens, eos=None)
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_num_batched_tokens=64)  # chunked prefill
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    quantization = llm.engine.model_config.quantization
    types = {"Q4_0": 2, "Q4_1": 2, "Q4_K": 2, "Q5_0": 2, "Q5_K": 2, "Q6_K": 2, "Q8_0": 3}
    if not tied:
        types["Q5_1"] = 1  # output.weight
    assert quantization.describe()["tensor_types"] == types
    # q, k and v are three pieces of one fused projection; gate and up two; blocks kept, no float copy
    model = llm.engine.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert [piece.weight.dtype for piece in qkv.gguf_pieces] == [torch.uint8] * 3 and not hasattr(qkv, "weight")
    # the embedding keeps its blocks (a lookup dequantizes its rows); tied, the output projection holds them and
    # the embedding reads its rows there (one copy), with or without int8 activations (the blocks repacked)
    embedding = model.model.embed_tokens
    assert not hasattr(embedding, "weight")
    assert [piece.weight.dtype for piece in model.lm_head.gguf_pieces] == [torch.uint8]
    if not tied:
        assert embedding.blocks.dtype == torch.uint8
        return
    assert embedding.blocks is None
    every_id = torch.arange(reference.config.vocab_size)
    expected_rows = reference.get_input_embeddings().weight.detach()
    assert torch.equal(model.embed(every_id), expected_rows)
    repacked = LLM(model=str(path), dtype="float32", device="cpu", quantized_activations="int8").engine.model
    assert repacked.model.embed_tokens.blocks is None and not hasattr(repacked.model.embed_tokens, "weight")
    assert torch.equal(repacked.embed(every_id), expected_rows)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _dequantized_copy(folder: Path, out: Path, bits: int, group_size: int) -> Path:
    """The folder with each projection's weight replaced by its quantize -> dequantize round trip; a tied output
    projection's too, which is the embedding (one quantized matrix serves both)."""
    from safetensors.torch import load_file

    out.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    projections = _PROJECTIONS + (("embed_tokens",) if config.get("tie_word_embeddings") else ())
    for name, weight in tensors.items():
        if any(f"{projection}.weight" in name for projection in projections):
            blocks = quantize_rows(weight, bits, group_size)
            tensors[name] = dequantize_rows_reference(blocks, bits, group_size, weight.shape[1])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def _tied_copy(folder: Path, out: Path) -> Path:
    """The folder with its output projection tied to the embedding (lm_head.weight dropped)."""
    from safetensors.torch import load_file

    out.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return out


@pytest.mark.parametrize("method,tied", [("int8", False), ("int4", False), ("int4", True)])
def test_weight_only_matches_the_dequantized_model(method, tied, tiny_llama_folder, tmp_path):
    group_size = 32
    options = dict(dtype="float32", device="cpu", max_num_batched_tokens=64, quantization_group_size=group_size)
    folder = _tied_copy(tiny_llama_folder, tmp_path / "tied") if tied else tiny_llama_folder
    dequantized = _dequantized_copy(folder, tmp_path / "dequantized", int(method[3:]), group_size)
    expected = LLM(model=str(dequantized), dtype="float32", device="cpu", max_num_batched_tokens=64)
    quantized = LLM(model=str(folder), quantization=method, **options)
    want = [o.outputs[0].token_ids for o in expected.generate(PROMPTS, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in quantized.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    model = quantized.engine.model
    for projection in (model.model.layers[0].mlp.down_proj, model.lm_head):
        assert projection.qweight.dtype == torch.uint8 and not hasattr(projection, "weight")
    if tied:  # the embedding looks its rows up in the quantized output projection: no float copy
        assert not hasattr(model.model.embed_tokens, "weight")


def test_wrong_quantization_asks_fail_by_name(tiny_llama_folder, tmp_path):
    with pytest.raises(ValueError, match=r"quantization 'int3' is not supported; supported: int8, int4"):
        LLM(model=str(tiny_llama_folder), dtype="float32", device="cpu", quantization="int3")
    with pytest.raises(ValueError, match=r"quantization_group_size 48 does not divide a projection's 128 input features"):
        LLM(model=str(tiny_llama_folder), dtype="float32", device="cpu", quantization="int4",
            quantization_group_size=48)
    path = tmp_path / "mixed.gguf"
    write_quantized_gguf(path)
    with pytest.raises(ValueError, match=r"applies to unquantized checkpoints; this model is already quantized \(gguf\)"):
        LLM(model=str(path), dtype="float32", device="cpu", quantization="int8")
    config = json.loads((tiny_llama_folder / "config.json").read_text())
    assert "quantization_config" not in config
