"""int8 activations (`quantized_activations="int8"`): the quantized weights' matmuls quantize each token's
activations to int8 (blocks of 32 input features, scale max |x| / 127) and multiply by integer dot products. The
numbers change, so it is an opt-in with a stated tolerance; oracles on the tiny random models of
test_quantized_models / test_quantized_checkpoints, float32:

- Tolerance: against the same weights run without it (activations float32, the exact path), teacher-forced
  (`teacher_forced_agreement`): the top token agrees at >= 95% of the positions, and the fed tokens' log-probs
  differ by at most INT8_MEAN_LOGPROB_DIFFERENCE on average and INT8_MAX_LOGPROB_DIFFERENCE anywhere; for a GGUF of
  every block type, a Q8_0 GGUF, weight-only int8 and int4, AWQ and GPTQ (act-order).
- Batching invariance: a token's activations are quantized on their own, so a request's greedy tokens are the same
  run alone or batched with others, with chunked prefill; batched without chunking its log-probs are bit for bit
  the same too (with chunked prefill, attention over a chunk's cached prefix sums in another order: measured up to 1.5e-6).
- Tensor parallel: two ranks generate what one process generates.
- It shows in the quantization's description (the worker's log and /v1/models' metadata).
- Refusals, by name: an unquantized or FP8 model, CUDA, int8 / int4 groups that are not whole blocks of 32, a
  dummy load of a quantized checkpoint, an unknown value.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig, model_quantization
from engine.quantization.config import QuantizationConfig, weight_only_quantization, with_quantized_activations
from conveyor_kernels.quantized_matmul import Int8Weight
from tests.engine.hf_oracle import (  # noqa: F401  (tiny_llama_folder: a fixture)
    GREEDY, PROMPTS, teacher_forced_agreement, tiny_llama_folder,
)
from tests.engine.test_quantized_checkpoints import make_fp8_checkpoints, make_int4_checkpoints
from tests.engine.test_quantized_models import _TYPES, own_cache_dir, write_quantized_gguf  # noqa: F401  (autouse)

# Measured (5 prompts, 262 positions, the AVX-512 VNNI path; its float64 reference gives the same to 4 decimals):
# top tokens agreeing 258-262 (98.5-100%); mean |d log-prob| 0.013-0.048 nats (int4 the most), max 0.078-0.30 (the
# GGUF of every type the most).
INT8_AGREEMENT, INT8_MEAN_LOGPROB_DIFFERENCE, INT8_MAX_LOGPROB_DIFFERENCE = 0.95, 0.08, 0.5
# The shared prompts and two more (12 and 60 random ids): five prompts, 262 scored positions.
SCORED_PROMPTS = PROMPTS + [
    [random.Random(100 + length).randrange(2, 300) for _ in range(length)] for length in (12, 60)
]
OPTIONS = dict(dtype="float32", device="cpu", max_num_batched_tokens=64)  # chunked prefill


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama_folder) -> dict[str, tuple[Path, dict[str, object]]]:
    """name -> (model, engine options) of each kind of weights int8 activations apply to."""
    folder = tmp_path_factory.mktemp("activations")
    write_quantized_gguf(folder / "mixed.gguf")
    write_quantized_gguf(folder / "q8_0.gguf", {kind: "Q8_0" for kind in _TYPES})
    awq, _ = make_int4_checkpoints(tiny_llama_folder, folder / "awq", "awq", 64, act_order=False)
    gptq, _ = make_int4_checkpoints(tiny_llama_folder, folder / "gptq", "gptq", 32, act_order=True)
    return {
        "gguf-every-type": (folder / "mixed.gguf", {}),
        "gguf-q8_0": (folder / "q8_0.gguf", {}),
        "int8-group-64": (tiny_llama_folder, {"quantization": "int8"}),
        "int4-group-32": (tiny_llama_folder, {"quantization": "int4", "quantization_group_size": 32}),
        "awq-group-64": (awq, {}),
        "gptq-group-32-act-order": (gptq, {}),
    }


@pytest.mark.parametrize("name", ["gguf-every-type", "gguf-q8_0", "int8-group-64", "int4-group-32", "awq-group-64",
                                  "gptq-group-32-act-order"])
def test_int8_activations_agree_with_the_exact_path(name, models):
    model, options = models[name]
    exact = LLM(model=str(model), **OPTIONS, **options)
    quantized = LLM(model=str(model), quantized_activations="int8", **OPTIONS, **options)
    agreement = teacher_forced_agreement(exact, quantized, SCORED_PROMPTS)
    assert agreement.fraction >= INT8_AGREEMENT, agreement
    assert agreement.mean_logprob_difference <= INT8_MEAN_LOGPROB_DIFFERENCE, agreement
    assert agreement.max_logprob_difference <= INT8_MAX_LOGPROB_DIFFERENCE, agreement
    assert agreement.max_logprob_difference > 0  # the activations were quantized: the numbers moved
    layer = quantized.engine.model.model.layers[0]
    packed = [piece.weight for piece in layer.self_attn.qkv_proj.gguf_pieces] if name.startswith("gguf") else [
        layer.self_attn.qkv_proj.qweight]
    assert all(isinstance(weight, Int8Weight) for weight in packed)  # repacked once at load, the blocks not kept
    described = model_quantization(quantized.engine.model_config, quantized.engine.config).describe()
    assert described["activations"] == "int8 per token, blocks of 32, dynamic"  # what the log and /v1/models show
    assert "activations" not in model_quantization(exact.engine.model_config, exact.engine.config).describe()


def test_int8_activations_do_not_depend_on_the_batch(models):
    model, _ = models["gguf-every-type"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    alone_engine = LLM(model=str(model), dtype="float32", device="cpu", quantized_activations="int8")
    alone = [alone_engine.generate([prompt], params, use_tqdm=False)[0].outputs[0] for prompt in SCORED_PROMPTS]
    for max_num_batched_tokens in (8192, 64):  # all prompts in one step; chunked prefill
        engine = LLM(model=str(model), dtype="float32", device="cpu", quantized_activations="int8",
                     max_num_batched_tokens=max_num_batched_tokens)
        batched = [o.outputs[0] for o in engine.generate(SCORED_PROMPTS, params, use_tqdm=False)]
        assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
        differences = [abs(ours.logprobs[i][token] - theirs.logprobs[i][token])
                       for ours, theirs in zip(batched, alone) for i, token in enumerate(theirs.token_ids)]
        assert max(differences) <= (0.0 if max_num_batched_tokens == 8192 else 1e-5)


def test_int8_activations_run_tensor_parallel(models):
    """Two ranks, each repacking its shard (row-parallel ones split on whole blocks, so a token's activation blocks
    are the unsharded run's), generate what one process generates."""
    model, _ = models["gguf-every-type"]
    options = dict(OPTIONS, quantized_activations="int8")
    want = [o.outputs[0].token_ids for o in LLM(model=str(model), **options).generate(PROMPTS, GREEDY, use_tqdm=False)]
    sharded = LLM(model=str(model), tensor_parallel_size=2, **options)
    try:
        assert [o.outputs[0].token_ids for o in sharded.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    finally:
        sharded.engine.close()


def test_int8_activations_are_refused_where_they_do_not_apply(models, tiny_llama_folder, tmp_path):
    applies = r"applies to weights the CPU kernels run quantized: GGUF blocks, quantization int8 / int4"
    with pytest.raises(ValueError, match=applies + r".*this model is unquantized"):
        LLM(model=str(tiny_llama_folder), dtype="float32", device="cpu", quantized_activations="int8")
    fp8, _ = make_fp8_checkpoints(tiny_llama_folder, tmp_path, per_channel=False, dynamic=True, dequantized_copy=False)
    with pytest.raises(ValueError, match=applies + r".*this model is fp8, whose activations the checkpoint's own"):
        LLM(model=str(fp8), dtype="float32", device="cpu", quantized_activations="int8")
    for group_size in (16, 48):
        with pytest.raises(ValueError, match=rf"whole activation blocks \(32 input features\); this model's int8 group "
                                             rf"size is {group_size}"):
            LLM(model=str(tiny_llama_folder), dtype="float32", device="cpu", quantization="int8",
                quantization_group_size=group_size, quantized_activations="int8")
    gguf, _ = models["gguf-q8_0"]
    with pytest.raises(ValueError, match=r"needs the checkpoint's quantized weights; load_format 'dummy'"):
        LLM(model=str(gguf), load_format="dummy", dtype="float32", device="cpu", quantized_activations="int8")
    with pytest.raises(ValueError, match=r"quantized_activations 'int4' is not supported; supported: int8"):
        EngineConfig(quantized_activations="int4")  # type: ignore[arg-type]
    # CUDA (checked as a model loads, device by device): the Triton W4A16 and FP8 paths do not quantize activations
    int8 = with_quantized_activations(weight_only_quantization("int8", 64), "int8")
    with pytest.raises(ValueError, match=r"quantized_activations='int8' runs on the CPU only .* device is cuda"):
        int8.check_device("cuda")
    int8.check_device("cpu")
    awq = QuantizationConfig(method="awq", group_size=64)
    awq.check_device("cuda")  # without int8 activations AWQ runs on CUDA
    with pytest.raises(ValueError, match=r"quantized_activations='int8' runs on the CPU only"):
        with_quantized_activations(awq, "int8").check_device("cuda")
