"""Model building blocks whose fast CPU variants must equal their plain torch form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.llama import Linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not available")


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
