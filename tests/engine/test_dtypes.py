"""`dtype="auto"` on a CPU picks bf16 only where the CPU has bf16 instructions, and never under a CONVEYOR_CPU_ISA
cap (an AVX-512 machine standing in for an AVX2-only one)."""

from __future__ import annotations

import pytest
import torch

from engine import dtypes


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.delenv("CONVEYOR_CPU_ISA", raising=False)  # the flags below decide, even in a capped run
    dtypes.cpu_has_fast_bf16.cache_clear()
    yield
    dtypes.cpu_has_fast_bf16.cache_clear()


@pytest.mark.parametrize(
    ("flags", "fast"),
    [
        (frozenset({"avx512f", "avx512bw", "avx512vl"}), False),  # AVX-512 without BF16: oneDNN emulates bf16
        (frozenset({"avx2"}), False),
        (frozenset({"avx512f", "avx512_bf16"}), True),
        (frozenset({"avx512f", "amx_bf16", "amx_tile"}), True),
        (frozenset({"avx2", "avx_ne_convert"}), True),
    ],
)
def test_bf16_is_fast_only_with_bf16_instructions(monkeypatch, flags, fast) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(dtypes, "_linux_cpu_flags", lambda: flags)
    assert dtypes.cpu_has_fast_bf16() is fast
    assert dtypes.resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if fast else torch.float32)


def test_without_onednn_bf16_nothing_is_fast(monkeypatch) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(dtypes, "_linux_cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert not dtypes.cpu_has_fast_bf16()


def test_off_linux_onednn_decides(monkeypatch) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(dtypes, "_linux_cpu_flags", lambda: None)
    assert dtypes.cpu_has_fast_bf16()


def test_a_cap_stands_in_for_a_cpu_without_bf16(monkeypatch) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(dtypes, "_linux_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx2")
    assert not dtypes.cpu_has_fast_bf16()
    assert dtypes.resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_this_machines_flags_are_read() -> None:
    flags = dtypes._linux_cpu_flags()
    assert flags is None or "fpu" in flags
