"""C++ kernels for the CPU path, built on first use: one extension of a file per concept (`cpu_decode_attention.cpp`,
`cpu_prefill_attention.cpp`, `cpu_layer_ops.cpp`, `cpu_sampling.cpp`, `cpu_encoder.cpp`; `cpu_kernels.h` what they
share, `cpu_kernels.cpp` the Python bindings), which ninja compiles in parallel.

Decode on a CPU is bound by memory bandwidth, and torch's composite ops pass over the data several
times: the paged decode attention here reads K/V once straight through the block tables (the torch
path gathers a padded copy first: three passes), with an online softmax per block and all query
heads of a kv head at a time (in bf16 on a CPU with AVX-512 BF16: q.k and p.v both by dpbf16ps straight
from the cache's bf16, the probabilities rounded to bf16 as torch's bf16 attention rounds them, one
softmax step per 64 positions, the next rows prefetched since blocks lie anywhere in the cache: 64
sequences of 400 positions in SmolLM2-135M's shape, two threads, 0.79 ms a layer where widening the
values to float32 for p.v took 2.0, and a plain read of the K/V 0.56; an int8 cache, conveyor_kernels/kv_quant.py, and
a float32 one go to `vector_decode.cpp`, a separate build with AVX-512 and AVX2 paths (`vector_decode_avx512.cpp`,
`_avx2.cpp`) picked at run time (`load_vector_decode_kernels`; float32 in SmolLM2-135M's shape, 14 sequences of
110 positions, one thread on the AVX2-only EPYC: 0.52x the portable kernel's time), else to the portable kernel
here, which dequantizes each row as it widens it);
the RMSNorm fuses the residual add and the float32 statistics into one pass per row; the rotary embedding
(in place, bit for bit the torch expression, float32 included), the K/V cache writes and, in bf16 and fp16, SwiGLU's
silu(gate) * up are one pass each instead of several torch ops. Their oracles are
`paged_attention_reference`, the model's torch RMSNorm and the torch expressions they replace. The
encoder attention of the embedding models attends packed sequences of any lengths with AMX tile
matmuls, unpadded and unmasked: over the 17 batches of `bench.embeddings`' 1,000 chunks (16-256
tokens, one thread) 215 ms against 458 ms for torch's flash attention on groups padded to multiples
of 16; its oracle is exact attention per sequence, which it meets as closely as torch's flash kernel.
Their bf16 LayerNorm reads each row once (torch's: 1.7x the time); its oracle is torch's. The structured-output
bitmask kernel sets the logits of disallowed tokens to -inf a 32-token word at a time (256 rows of a 49k vocabulary:
1.4 ms against 38 ms for xgrammar's CPU kernel); its oracle is a masked_fill of the unpacked bits.
The bf16 prefill attention (AVX-512 BF16) attends every prefill chunk of a step in one call straight from the
paged cache (bf16, or int8 rows dequantized to bf16 as they are packed): each sequence's K/V packed once per kv head
into dpbf16ps' pair layout, then tiles of query rows
with an online softmax per 64-key span (33 prompts of 32-512 tokens, SmolLM2's heads: about half the machine's
bf16 matmul peak, 7-16x torch's flash attention called per sequence); its oracle is `paged_attention_reference`
in float32, which it meets as closely as torch's bf16 path. The greedy sampler's pass finds each row's first
maximum and its log-probability (max - logsumexp) in three passes over the row while it sits in L2 (64 rows of a
49k vocabulary: 0.8 ms against 8 ms for torch's float copy, max and logsumexp); its oracle is those torch ops.

The extension compiles with torch's cpp_extension (ninja + the system C++ compiler) into
`$TORCH_EXTENSIONS_DIR`, once per source version, checkout and CPU, its files in parallel (ninja's default jobs: 3 on
2 cores; MAX_JOBS overrides): on an AVX-512 BF16 EPYC, 35 CPU-seconds in one file before the split, 37 in six files
of 4-9 since, so two idle cores take about half as long. Each file includes only the headers it uses:
torch/extension.h's C++ frontend alone cost the bindings 20 CPU-seconds. Where it cannot be built,
`load_cpu_kernels()` returns None and the engine keeps the torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import time
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

log = logging.getLogger(__name__)

# One extension, a file per concept (cpu_kernels.h: what they share), which ninja compiles in parallel: the
# Python module's bindings first, the kernels after.
_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_kernels.cpp", "cpu_decode_attention.cpp", "cpu_prefill_attention.cpp", "cpu_layer_ops.cpp",
        "cpu_sampling.cpp", "cpu_encoder.cpp",
    )
]
# The vector decode attention of int8 and float32 caches: the module, then its body's build per instruction set
# (vector_decode.h).
_VECTOR_DECODE_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("vector_decode.cpp", "vector_decode_avx512.cpp", "vector_decode_avx2.cpp")
]
# `#include "name"` in a source or header: the kernels' own headers, which build_digest follows.
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

# The decode attention's paths for an int8 or float32 cache: `auto` the widest this CPU runs for the call's head_dim,
# dtype and cache.
DecodePath = Literal["auto", "avx512", "avx2", "portable"]


# CONVEYOR_CPU_ISA: caps the instruction sets every C++ kernel uses below what the CPU runs ("avx2": AVX2 + FMA,
# "portable": baseline x86-64), so that an AVX-512 machine stands in for an AVX2-only one; unset: what the CPU runs.
# isa_dispatch.h reads the same variable for the kernels that pick a body at run time.
CPU_ISA_CAPS = ("avx2", "portable")


def cpu_isa_cap() -> str | None:
    """CONVEYOR_CPU_ISA's cap, or None; any other value is refused."""
    cap = os.environ.get("CONVEYOR_CPU_ISA", "")
    if cap and cap not in CPU_ISA_CAPS:
        raise ValueError(f"CONVEYOR_CPU_ISA must be one of {', '.join(CPU_ISA_CAPS)} (or unset); got {cap!r}")
    return cap or None


def march_flag() -> str:
    """The -march of the kernels built for this machine: native, or the cap's baseline (x86-64-v3 is AVX2 + FMA)."""
    return {None: "-march=native", "avx2": "-march=x86-64-v3", "portable": "-march=x86-64"}[cpu_isa_cap()]


@cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None where it cannot be built (no compiler, no ninja)."""
    try:
        return load_extension(
            f"conveyor_cpu_kernels_{build_digest(*_SOURCES)}",
            "the C++ CPU kernels",
            _SOURCES,
            extra_cflags=["-O3", march_flag(), "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # any build failure means: use the torch path
        log.warning("CPU kernels unavailable, using the torch path: %s", error)
        return None


@cache
def load_vector_decode_kernels() -> ModuleType | None:
    """The AVX-512 / AVX2 decode attention of int8 and float32 caches (`vector_decode.cpp`, one build for any x86-64,
    the path picked at run time), or None where it cannot be built: the portable kernel then reads those caches."""
    try:
        return load_extension(
            f"conveyor_vector_decode_{build_digest(*_VECTOR_DECODE_SOURCES)}",
            "the vector decode attention",
            _VECTOR_DECODE_SOURCES,
            extra_cflags=["-O3", "-fopenmp"],  # no -march=native: each path is compiled for its instruction set
            extra_ldflags=["-fopenmp"],  # at::parallel_for runs its threads through OpenMP
        )
    except Exception as error:  # any build failure means: the portable kernel
        log.warning("vector decode attention kernels unavailable, using the portable kernel: %s", error)
        return None


def vector_decode_reads(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the vector kernels have a body for `dtype` queries over a `cache_dtype` cache: float32 or bf16 queries
    over an int8 cache, float32 queries over a float32 one."""
    int8_cache = cache_dtype == torch.int8 and dtype in (torch.float32, torch.bfloat16)
    return int8_cache or cache_dtype == dtype == torch.float32


@cache  # asked by every layer of every step
def vector_decode_paths(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> tuple[str, ...]:
    """The paths `paged_decode_attention` can take here for `dtype` queries over a `cache_dtype` cache, narrowest
    first: `portable` (the C++ kernels' own, any head_dim and dtype), then `avx2` and `avx512` for head_dim
    32/64/128/256 on a CPU that runs them, where `vector_decode_reads` the pair (only then is the vector build
    loaded: a bf16 cache never builds it)."""
    if not vector_decode_reads(dtype, cache_dtype):
        return ("portable",)
    kernels = load_vector_decode_kernels()
    if kernels is None or not kernels.supports(head_dim):
        return ("portable",)
    order = ("portable", "avx2", "avx512")
    return order[: order.index(kernels.best_isa()) + 1]


def load_extension(
    name: str, what: str, sources: list[Path], extra_cflags: list[str], extra_ldflags: list[str] | None = None
) -> ModuleType:
    """torch's `cpp_extension.load`, said before and after when it really builds: the first build on a machine
    compiles for minutes in silence (torch prints nothing). `what` names the kernels for a person."""
    from torch.utils import cpp_extension

    # Where load() builds (TORCH_EXTENSIONS_DIR or its default, per Python and CUDA version); private, but the one
    # place that knows the layout.
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    building = not any(build_dir.glob(f"{name}*.so"))
    if building:
        log.info(
            "building %s into %s: a one-time step per source version and CPU (minutes on a busy 2-core CPU); later "
            "starts load the build", what, build_dir,
        )
    started = time.monotonic()
    module = cpp_extension.load(
        name=name, sources=[str(source) for source in sources], extra_cflags=extra_cflags, extra_ldflags=extra_ldflags
    )
    if building:
        log.info("built %s in %.0f s", what, time.monotonic() - started)
    return module


def build_digest(*sources: Path) -> str:
    """Names the build after what it depends on. The sources and every header they include (`_with_local_headers`):
    checkouts of different versions on one machine (a CI clone beside a working tree) neither load nor rebuild one
    another's. The checkout's path: torch's build file records the sources' absolute paths, so two checkouts of one
    version sharing a build would rebuild it in turn. The CPU: `-march=native` code from another CPU (a home
    directory moved between an AMX and an AVX-512 machine) could stop on an illegal instruction; and its cap
    (`march_flag`), whose builds differ on one CPU."""
    digest = hashlib.sha256()
    for source in _with_local_headers(sources):
        digest.update(source.read_bytes())
        digest.update(str(source.resolve()).encode())
    digest.update(_cpu_identity().encode())
    digest.update(march_flag().encode())
    return digest.hexdigest()[:12]


def _with_local_headers(sources: tuple[Path, ...]) -> list[Path]:
    """The sources, then each header they include with quotes, transitively, once each: found beside the file that
    includes it, as the compiler looks first."""
    found: list[Path] = []
    pending = list(sources)
    while pending:
        path = pending.pop(0)
        if path not in found:
            found.append(path)
            pending += [path.with_name(name) for name in _LOCAL_INCLUDE.findall(path.read_text())]
    return found


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux), else what the platform module knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags")
    return "\n".join(dict.fromkeys(line for line in lines if line.split(":")[0].strip() in wanted))


def _kernels() -> ModuleType:
    kernels = load_cpu_kernels()
    if kernels is None:
        raise RuntimeError("the CPU kernels could not be built")
    return kernels


def paged_decode_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]; head_dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], or int8 rows of head_dim + 4 (kv_quant)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length of each decode row
    token_index: torch.Tensor,  # [B] int64: the query row of each decode sequence
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim] contiguous: rows in token_index are written
    window: int | None = None,  # sliding window: the row attends its last `window` positions only
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    path: DecodePath = "auto",  # the kernel (tests and the benchmarks force each of `vector_decode_paths`)
) -> None:
    paths = vector_decode_paths(query.shape[-1], query.dtype, k_cache.dtype)
    chosen = paths[-1] if path == "auto" else path
    if chosen not in paths:
        raise ValueError(
            f"no {chosen} decode attention here for head_dim {query.shape[-1]}, {query.dtype} queries, a {k_cache.dtype} "
            f"cache; here: {', '.join(paths)}"
        )
    if chosen != "portable":
        vector = load_vector_decode_kernels()
        assert vector is not None  # vector_decode_paths offers a vector path only where it was built
        vector.decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, token_index, out, scale, window or 0, softcap or 0.0, chosen
        )
        return
    _kernels().paged_decode_attention(
        query, k_cache, v_cache, block_tables, seq_lens, token_index, out, scale, window or 0, softcap or 0.0
    )


def prefill_attention_available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `paged_prefill_attention` runs here: bf16, a CPU with AVX-512 BF16, head_dim 32, 64, 128 or 256."""
    kernels = load_cpu_kernels()
    return dtype == torch.bfloat16 and kernels is not None and kernels.prefill_attention_available(head_dim)


def paged_prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim] bf16; head_dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16, or int8 rows of head_dim + 4
    # (conveyor_kernels/kv_quant.py, dequantized to bf16 as read); the chunks' K/V already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length of each sequence after its chunk
    query_starts: torch.Tensor,  # [B] int64: sequence i's chunk is query rows query_starts[i]..query_ends[i]
    query_ends: torch.Tensor,  # [B] int64
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim] contiguous: only the chunks' rows are written
    window: int | None = None,  # sliding window: a query at position p attends keys in (p - window, p]
) -> None:
    """Causal attention of prefill chunks (after any cached prefix) straight from the paged cache."""
    _kernels().paged_prefill_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_starts, query_ends, out, scale, window or 0
    )


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (+ residual, which is then updated in place to x + residual)."""
    return _kernels().rms_norm(x, residual, weight, eps)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Logits [rows, vocab] float32: where bit j of word w of a row's bitmask [rows, ceil(vocab / 32)] int32 is
    clear, token 32 * w + j's logit becomes -inf, in place."""
    _kernels().apply_token_bitmask(logits, bitmask)


def rotary_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox-style rotary embedding of x ([T, heads, head_dim], float32, bf16 or fp16; rows may be strided) in place, with
    cos and sin ([T, head_dim / 2], contiguous) already in x's dtype; bit for bit torch's
    `cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin))`."""
    _kernels().rotary_in_place(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of contiguous [.., 2 * width] rows laid out [gate | up] (bf16 or fp16), rounded as
    `F.silu(gate) * up` rounds."""
    return _kernels().silu_and_mul(gate_up)


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]; heads contiguous within a row
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], key's dtype
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = drop
) -> None:
    """Each token's K/V rows into its cache slot: `write_kv_cache_reference` in one pass."""
    _kernels().write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def encoder_kernels_available() -> bool:
    """Whether `encoder_attention` and `layer_norm` run here: the kernels built with AMX on a CPU that has it."""
    kernels = load_cpu_kernels()
    return kernels is not None and kernels.encoder_kernels_available()


def encoder_attention(
    qkv: torch.Tensor,  # [rows, 3 * heads * 32] bf16: q, k, v of each token
    seq_starts: torch.Tensor,  # [B + 1] int64: sequence i is rows seq_starts[i]:seq_starts[i + 1], from row 0
    num_heads: int,  # at most 16
    scale: float,
) -> torch.Tensor:  # [rows, heads * 32]; rows past the last sequence are zero
    """Bidirectional attention within each sequence; bf16, head_dim 32, AMX only."""
    return _kernels().encoder_attention(qkv, seq_starts, num_heads, scale)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension (bf16, a multiple of 16 wide, at most 1024), float32 inside."""
    return _kernels().layer_norm(x, weight, bias, eps)


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's first maximum [rows] int64, its log-probability [rows] float32) of logits [rows, vocab]
    (float32 or bf16, contiguous rows): `max(dim=-1)` and `max - logsumexp` in one kernel."""
    return _kernels().greedy_sample(logits)
