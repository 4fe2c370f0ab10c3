"""`bench.kv_cache_dtype`'s decode attention table runs every cache kind and int8 path this CPU has, on a small
shape (the end-to-end rows build engines: the benchmark itself, not a test)."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench.kv_cache_dtype import print_attention_table
from conveyor_kernels.cpu_kernels import load_cpu_kernels, vector_decode_paths


@pytest.mark.skipif("load_cpu_kernels() is None", reason="the C++ CPU kernels could not be built here")
def test_the_attention_table_has_a_row_per_cache_and_path(capsys):
    args = argparse.Namespace(attention_seqs=3, attention_len=37, attention_rounds=2, seed=0)
    print_attention_table(6, 2, 64, torch.bfloat16, args)
    printed = capsys.readouterr().out
    names = ["float32", "bfloat16"] + [f"int8, {path}" for path in vector_decode_paths(64, torch.bfloat16, torch.int8)]
    assert all(f"| {name} " in printed for name in names), printed
