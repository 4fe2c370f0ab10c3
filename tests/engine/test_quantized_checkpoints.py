"""AWQ, GPTQ and FP8 checkpoints end to end, float32 oracles.

The checkpoints are made here from the tiny random Llama of test_quantized_models: its projections quantized and
packed by reference code following each format's published layout (AutoAWQ's GEMM packing with its [0, 2, 4, 6,
1, 3, 5, 7] nibble order; auto-gptq's sequential packing with zero points stored minus one and act-order g_idx;
compressed-tensors / "fp8" float8_e4m3fn weights with per-channel or per-tensor scales), beside a copy of the
model whose weights are the formats' dequantized values.

- AWQ and GPTQ (weight-only) generate what the dequantized model generates, loaded by conveyor unquantized and
  by transformers, token for token, batched, with chunked prefill;
- FP8 weight-only (compressed-tensors, per-channel) likewise; FP8 W8A8 (per-tensor weights, dynamic per-token
  activations) agrees with the unquantized model teacher-forced (see W8A8_AGREEMENT for what and why);
- two tensor-parallel ranks holding packed shards generate the same; the shards of the packed tensors are the
  shards of the dequantized weight; act-order refuses a row-parallel split by name;
- the quantization shows in /v1/models' terms (`describe`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.quantization.w4a16 import Int4CheckpointTensor, dequantize_piece
from tests.engine.hf_oracle import (  # noqa: F401  (tiny_llama_folder: a fixture)
    GREEDY, PROMPTS, hf_greedy, teacher_forced_agreement, tiny_llama_folder,
)

transformers = pytest.importorskip("transformers")

_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # lm_head stays float
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


def quantize_4bit(weight: torch.Tensor, g_idx: torch.Tensor, groups: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric 4-bit groups as AWQ / GPTQ make them: per output row and group, scale = (max - min) / 15 in
    float16, zero = round(-min / scale); q = clamp(round(w / scale) + zero, 0, 15). Returns q [out, in],
    zeros [out, groups], scales [out, groups] float16."""
    out_features = weight.shape[0]
    zeros = torch.zeros(out_features, groups, dtype=torch.int64)
    scales = torch.zeros(out_features, groups, dtype=torch.float16)
    for group in range(groups):
        members = weight[:, g_idx == group]
        low, high = members.min(dim=1).values.clamp(max=0), members.max(dim=1).values.clamp(min=0)
        scales[:, group] = ((high - low) / 15).clamp_min(1e-5).half()
        zeros[:, group] = torch.round(-low / scales[:, group].float()).clamp(0, 15).long()
    q = torch.round(weight / scales[:, g_idx].float()) + zeros[:, g_idx]
    return q.clamp(0, 15).long(), zeros, scales


def _pack_u32(values: np.ndarray, axis: int, order: list[int]) -> torch.Tensor:
    """Eight 4-bit values along `axis` into one int32: nibble i holds element order[i] of the eight."""
    values = np.moveaxis(values.astype(np.uint32), axis, -1)
    eights = values.reshape(*values.shape[:-1], -1, 8)
    packed = np.zeros(eights.shape[:-1], dtype=np.uint32)
    for i, source in enumerate(order):
        packed |= eights[..., source] << np.uint32(4 * i)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(packed, -1, axis)).view(np.int32))


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [in, out / 8], qzeros [groups, out / 8] packed along the output features in
    the order [0, 2, 4, 6, 1, 3, 5, 7]; scales [groups, out]."""
    return {"qweight": _pack_u32(q.T.numpy(), 1, _AWQ_ORDER), "qzeros": _pack_u32(zeros.T.numpy(), 1, _AWQ_ORDER),
            "scales": scales.T.contiguous()}


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """auto-gptq's (v1) layout: qweight [in / 8, out] packed along the input features in order, qzeros [groups,
    out / 8] holding zero - 1 (4 bits), scales [groups, out], g_idx [in] int32."""
    stored_zeros = (zeros - 1) & 0xF
    return {"qweight": _pack_u32(q.T.numpy(), 0, list(range(8))),
            "qzeros": _pack_u32(stored_zeros.T.numpy(), 1, list(range(8))),
            "scales": scales.T.contiguous(), "g_idx": g_idx.to(torch.int32)}


def _write(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def make_int4_checkpoints(source: Path, out: Path, method: str, group_size: int, act_order: bool) -> tuple[Path, Path]:
    """(the AWQ / GPTQ checkpoint, its dequantized float copy) of the float folder `source`."""
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    quantized, dequantized = {}, {}
    generator = torch.Generator().manual_seed(1)
    orders: dict[str, torch.Tensor] = {}  # act-order: one permutation per input (q/k/v share theirs, as GPTQ's)
    for name, weight in tensors.items():
        module, _, leaf = name.rpartition(".")
        projection = module.rpartition(".")[2]
        if projection not in _QUANTIZED:
            quantized[name] = dequantized[name] = weight
            continue
        in_features = weight.shape[1]
        groups = in_features // group_size
        g_idx = torch.arange(in_features) // group_size
        if act_order:
            shared = module.rpartition(".")[0] + {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(
                projection, projection)
            perm = orders.setdefault(shared, torch.randperm(in_features, generator=generator))
            g_idx = torch.empty_like(g_idx)
            g_idx[perm] = torch.arange(in_features) // group_size
        q, zeros, scales = quantize_4bit(weight, g_idx, groups)
        if method == "awq":
            parts, effective_zeros = pack_awq(q, zeros, scales), zeros
        else:
            parts, effective_zeros = pack_gptq(q, zeros, scales, g_idx), ((zeros - 1) & 0xF) + 1  # v1: stored + 1
        for part, tensor in parts.items():
            quantized[f"{module}.{part}"] = tensor
        # the format's dequantization: (q - z) * s in float32
        dequantized[name] = (q.float() - effective_zeros[:, g_idx].float()) * scales[:, g_idx].float()
    settings = {"awq": {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm",
                        "zero_point": True},
                "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
                         "sym": False, "checkpoint_format": "gptq"}}[method]
    return (_write(out / method, quantized, {**config, "quantization_config": settings}),
            _write(out / f"{method}-dequantized", dequantized, config))


def _generate(llm: LLM, params: SamplingParams = GREEDY) -> list:
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize(("method", "group_size", "act_order"), [("awq", 64, False), ("gptq", 32, True)])
def test_int4_checkpoint_matches_the_dequantized_model(method, group_size, act_order, tiny_llama_folder, tmp_path):
    checkpoint, dequantized = make_int4_checkpoints(tiny_llama_folder, tmp_path, method, group_size, act_order)
    options = dict(dtype="float32", device="cpu", max_num_batched_tokens=64)  # chunked prefill
    reference = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    hf = hf_greedy(reference.eval(), PROMPTS, GREEDY.max_tokens, eos=None)
    want = [o.token_ids for o in _generate(LLM(model=str(dequantized), **options))]
    quantized = LLM(model=str(checkpoint), **options)
    got = [o.token_ids for o in _generate(quantized)]
    assert got == want == hf
    described = quantized.engine.model_config.quantization.describe()
    assert (described["method"], described["bits"], described["group_size"]) == (method, 4, group_size)
    qkv = quantized.engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.uint8 and not hasattr(qkv, "weight")  # 4-bit groups, no float copy
    assert qkv.qweight.numel() == qkv.out_features * qkv.in_features // group_size * (5 + group_size // 2)
    assert (qkv.w4_perm is not None) == act_order
    if act_order:  # act-order's groups are scattered over the input features: a row-parallel split is refused
        tensor = _int4_tensor(checkpoint, method, "model.layers.0.mlp.down_proj", group_size, 1)
        with pytest.raises(ValueError, match=r"act-order \(desc_act\) checkpoint cannot split a row-parallel"):
            tensor.piece((slice(None), slice(0, 128)))


def test_int4_checkpoint_runs_tensor_parallel(tiny_llama_folder, tmp_path):
    """Two ranks, each holding its packed shard (q/k/v and gate/up by output rows, o and down by whole groups of
    input features), generate what the dequantized model generates unsharded."""
    checkpoint, dequantized = make_int4_checkpoints(tiny_llama_folder, tmp_path, "awq", 32, False)
    options = dict(dtype="float32", device="cpu", max_num_batched_tokens=64)
    want = [o.token_ids for o in _generate(LLM(model=str(dequantized), **options))]
    sharded = LLM(model=str(checkpoint), tensor_parallel_size=2, **options)
    try:
        assert [o.token_ids for o in _generate(sharded)] == want
    finally:
        sharded.engine.close()
    # the shards of the packed tensors are the shards of the dequantized weight; a split inside a group is refused
    tensor = _int4_tensor(checkpoint, "awq", "model.layers.0.mlp.down_proj", 32, 0)
    whole = tensor[:]
    assert torch.equal(dequantize_piece(tensor.piece((slice(64, 128),))), whole[64:128])
    assert torch.equal(dequantize_piece(tensor.piece((slice(None), slice(128, 256)))), whole[:, 128:256])
    with pytest.raises(ValueError, match=r"does not fall on the checkpoint's groups of 32"):
        tensor.piece((slice(None), slice(16, 48)))


def _int4_tensor(checkpoint: Path, layout: str, module: str, group_size: int, zero_offset: int) -> Int4CheckpointTensor:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    return Int4CheckpointTensor(layout, module, tensors[f"{module}.qweight"], tensors[f"{module}.qzeros"],
                                tensors[f"{module}.scales"], tensors.get(f"{module}.g_idx"), group_size, zero_offset)


def make_fp8_checkpoints(
    source: Path, out: Path, per_channel: bool, dynamic: bool, dequantized_copy: bool = True
) -> tuple[Path, Path | None]:
    """(the FP8 checkpoint, its dequantized copy): weights float8_e4m3fn, weight_scale = amax / 448 per output
    row ([out, 1], compressed-tensors' channel strategy) or per tensor (a scalar, the "fp8" method's)."""
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    quantized, dequantized = {}, {}
    for name, weight in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module.rpartition(".")[2] not in _QUANTIZED or leaf != "weight":
            quantized[name] = dequantized[name] = weight
            continue
        amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
        scale = (amax / 448).float()
        weight8 = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        quantized[name], quantized[f"{module}.weight_scale"] = weight8, scale
        dequantized[name] = weight8.float() * scale
    if per_channel:
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        tokens = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        settings = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                  "input_activations": tokens if dynamic else None}}}
    else:
        assert dynamic, "the fp8 method's activations are dynamic"
        settings = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    tag = f"fp8-{'channel' if per_channel else 'tensor'}-{'w8a8' if dynamic else 'w8a16'}"
    return (_write(out / tag, quantized, {**config, "quantization_config": settings}),
            _write(out / f"{tag}-dequantized", dequantized, config) if dequantized_copy else None)


def test_fp8_weight_only_matches_the_dequantized_model(tiny_llama_folder, tmp_path):
    checkpoint, dequantized = make_fp8_checkpoints(tiny_llama_folder, tmp_path, per_channel=True, dynamic=False)
    options = dict(dtype="float32", device="cpu", max_num_batched_tokens=64)
    want = [o.token_ids for o in _generate(LLM(model=str(dequantized), **options))]
    quantized = LLM(model=str(checkpoint), **options)
    assert [o.token_ids for o in _generate(quantized)] == want
    assert quantized.engine.model_config.quantization.describe()["activations"] == "unquantized"
    gate_up = quantized.engine.model.model.layers[1].mlp.gate_up_proj
    assert gate_up.fp8_weight.dtype == torch.float8_e4m3fn and gate_up.fp8_scale.shape == (gate_up.out_features,)


# W8A8's oracle. float8 e4m3 keeps 3 mantissa bits: each matmul moves by ~3-4% (measured on random matrices), so
# over free-running generation the tiny random model, whose next-token distributions are near flat (top log-probs
# about -2), parts from the unquantized one within a few tokens (measured: 8 of 36 greedy tokens before the
# prompts' continuations differ; on the real SmolLM2-135M 26 of 64). Asserted, teacher-forced (the unquantized
# model's tokens fed as the prompt, so one difference does not change every later position): the top token agrees
# at >= 95% of the positions (measured 161 / 168) and the fed tokens' log-probs differ by at most this much on
# average (measured 0.092 nats) and at most W8A8_MAX_LOGPROB_DIFFERENCE anywhere (measured 0.41).
W8A8_AGREEMENT, W8A8_MEAN_LOGPROB_DIFFERENCE, W8A8_MAX_LOGPROB_DIFFERENCE = 0.95, 0.12, 0.5


def test_fp8_w8a8_agrees_with_the_unquantized_model(tiny_llama_folder, tmp_path):
    checkpoint, _ = make_fp8_checkpoints(tiny_llama_folder, tmp_path, per_channel=False, dynamic=True,
                                         dequantized_copy=False)
    options = dict(dtype="float32", device="cpu", max_num_batched_tokens=64)
    quantized = LLM(model=str(checkpoint), **options)
    agreement = teacher_forced_agreement(LLM(model=str(tiny_llama_folder), **options), quantized, PROMPTS)
    assert agreement.fraction >= W8A8_AGREEMENT
    assert agreement.mean_logprob_difference <= W8A8_MEAN_LOGPROB_DIFFERENCE
    assert agreement.max_logprob_difference <= W8A8_MAX_LOGPROB_DIFFERENCE
    described = quantized.engine.model_config.quantization.describe()
    assert described == {"method": "fp8", "bits": 8, "group_size": None, "checkpoint_method": "fp8",
                         "weight_scales": "tensor", "activations": "fp8 per token, dynamic"}


def test_fp8_static_activation_scales_are_refused(tiny_llama_folder, tmp_path):
    checkpoint, _ = make_fp8_checkpoints(tiny_llama_folder, tmp_path, per_channel=False, dynamic=True)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.input_scale"] = torch.tensor(0.01)
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"static fp8 activation scales are not supported; supported: dynamic"):
        LLM(model=str(checkpoint), dtype="float32", device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fp8_scaled_mm_matches_the_w8a8_reference_on_cuda():
    """The CUDA path (torch._scaled_mm, Hopper and newer) against the CPU path's numbers: per-token float8
    activations and the per-row-scaled float8 weight, dequantized and multiplied in float32."""
    from engine.quantization.fp8 import FP8, _scaled_mm_linear, dequantize, quantize_per_token

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=generator) * 0.1
    scale = weight.abs().amax(dim=1) / 448
    weight8 = (weight / scale[:, None]).to(FP8)
    x = torch.randn(5, 64, generator=generator).to(torch.bfloat16)
    x8, x_scale = quantize_per_token(x)
    reference = (x8.float() * x_scale) @ dequantize(weight8, scale).T
    got = _scaled_mm_linear(x.cuda(), weight8.cuda(), scale.cuda())
    torch.testing.assert_close(got.float().cpu(), reference, rtol=2e-2, atol=2e-2)
