"""Host values to device tensors without stalling the host.

A copy from pageable host memory makes the host wait for the GPU stream, which would serialize the
Python work of a step with the kernels of the step before it. On CUDA the values go into pinned
memory (PyTorch's caching host allocator keeps a pinned block until the copy reading it is done)
and cross by an asynchronous copy, ordered on the stream before the kernels that read it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)

