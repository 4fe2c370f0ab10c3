"""Model building blocks whose fast CPU variants must equal their plain torch form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.dtypes import cpu_has_fast_bf16
from engine.models.llama import Linear

needs_onednn = pytest.mark.skipif(not cpu_has_fast_bf16(), reason="oneDNN's bf16 kernels need AVX-512 BF16, AMX or AVX-NE-CONVERT")


@needs_onednn
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(tokens, bias):
    torch.manual_seed(tokens)
    layer = Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(tokens, 96, dtype=torch.bfloat16)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.pack_for_cpu()
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)



def test_engine_runs_a_dummy_weight_model_from_a_config_folder(tiny_dummy_model):
    """Benchmarks run named shapes with random weights: the engine must build and run one from a
    config alone (a tiny Qwen3 here, with q/k norms and an explicit head_dim)."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_dummy_model), load_format="dummy", dtype="bfloat16", device="cpu")
    outputs = llm.generate([[5, 6, 7], [8] * 40], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5]
    assert all(0 <= t < 300 for o in outputs for t in o.outputs[0].token_ids)
