"""CONVEYOR_CPU_ISA: an AVX-512 machine standing in for an AVX2-only one. The cap names what every C++ kernel may use
(the -march of those built for this machine, the run-time pick of those that compile a body per instruction set) and
takes bf16 off `auto`'s choice, as on a CPU without bf16 instructions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conveyor_kernels import cpu_kernels


def test_the_cap_sets_the_build_flag_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv("CONVEYOR_CPU_ISA", raising=False)
    assert cpu_kernels.cpu_isa_cap() is None and cpu_kernels.march_flag() == "-march=native"
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx2")
    assert cpu_kernels.march_flag() == "-march=x86-64-v3"
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "portable")
    assert cpu_kernels.march_flag() == "-march=x86-64"
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="must be one of avx2, portable"):
        cpu_kernels.cpu_isa_cap()


def test_capped_at_avx2_the_run_time_picks_and_the_dtype_follow():
    """In a process of its own (the C++ side reads the variable once): the quantized matmul's paths, the int8
    activations' path and AVX-512 BF16 as an AVX2-only CPU has them, and `auto` picks float32."""
    pytest.importorskip("gguf")
    from conveyor_kernels import quantized_matmul

    if quantized_matmul.best_isa() == "portable":
        pytest.skip("this CPU has no AVX2: the cap would change nothing")
    script = (
        "from conveyor_kernels import quantized_matmul as q; from engine.dtypes import cpu_has_fast_bf16;"
        "print(q.best_isa(), q.int8_path(), q.has_avx512_bf16(), cpu_has_fast_bf16())"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            env={**os.environ, "CONVEYOR_CPU_ISA": "avx2"})
    assert result.stdout.split() == ["avx2", "avx2", "False", "False"]
