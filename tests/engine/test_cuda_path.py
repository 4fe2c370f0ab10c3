"""What the CUDA path gets right, checked on a machine without a GPU: weights born in their dtype,
the KV budget from a profiled step (torch.cuda's memory calls faked), the engine's own device
current while it builds and steps, and no host sync inside a runner step (CPU tensors standing in
for device ones). The Triton-specific checks (warm-ups, graph replay) are in test_triton_engine.py."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import engine.llm_engine
import engine.model_shard
import engine.sampler
from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.dtypes import on_device, resolve_device
from engine.engine_loop import EngineLoop
from engine.kv_cache import DeviceMemory, bytes_per_block, num_kv_blocks, profile_device_memory
from engine.llm_engine import LLMEngine
from engine.model_registry import resolve_model
from engine.model_shard import ShardSpec, largest_step
from engine.model_runner import ModelRunner
from conveyor_kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled

GiB = 1024**3
MiB = 1024**2
REPO = Path(__file__).resolve().parents[2]


# ---- weights in their dtype -------------------------------------------------------------------


class Float32Allocations(TorchDispatchMode):
    """Every float32 tensor of at least 1 MiB that an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.nbytes >= MiB:
                self.found.append((str(func), tuple(tensor.shape)))
        return out


def test_a_bf16_model_is_built_without_float32_weights(tmp_path: Path) -> None:
    """Building in float32 and casting held twice the weights at the peak (~32 GB for Llama-3-8B,
    whose freed half then stayed reserved by the caching allocator)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 1024,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with Float32Allocations() as allocations:
        llm = LLM(model=str(tmp_path), load_format="dummy", dtype="bfloat16", device="cpu", num_kv_blocks=8, cpu_kernels=False)
    # The embedding alone would be 8 MiB in float32 and the MLP projections 2 MiB each.
    assert allocations.found == []
    model = llm.engine.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary.cos.dtype == torch.float32  # positions need the precision
    assert torch.get_default_dtype() == torch.float32  # the build's default is not left behind


# ---- the KV budget from a profiled step -------------------------------------------------------


class FakeGpu:
    """The driver and PyTorch's caching allocator as `profile_device_memory` sees them: freed
    blocks stay reserved until empty_cache; the driver counts reserved memory as used."""

    def __init__(self, total: int, non_torch: int) -> None:
        self.total, self.non_torch = total, non_torch
        self.allocated = self.reserved = self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes  # stays reserved

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls = {
            "mem_get_info": lambda device=None: (self.total - self.non_torch - self.reserved, self.total),
            "memory_reserved": lambda device=None: self.reserved,
            "memory_allocated": lambda device=None: self.allocated,
            "max_memory_allocated": lambda device=None: self.peak,
            "reset_peak_memory_stats": lambda device=None: setattr(self, "peak", self.allocated),
            "empty_cache": lambda: setattr(self, "reserved", self.allocated),
            "synchronize": lambda device=None: None,
        }
        for name, fake in calls.items():
            monkeypatch.setattr(torch.cuda, name, fake)

    def step(self, activations: int) -> None:
        self.allocate(activations)
        self.free(activations)


def test_kv_budget_is_utilization_of_total_less_weights_peak_activations_and_non_torch(monkeypatch):
    gpu = FakeGpu(total=80 * GiB, non_torch=GiB // 2)
    gpu.install(monkeypatch)
    gpu.allocate(16 * GiB)  # bf16 weights
    gpu.allocate(16 * GiB)  # and a float32 build's other half, freed: reserved, not used
    gpu.free(16 * GiB)

    memory = profile_device_memory(torch.device("cuda", 0), lambda: gpu.step(3 * GiB))

    assert memory == DeviceMemory(total=80 * GiB, weights=16 * GiB, peak_activations=3 * GiB, non_torch=GiB // 2)
    assert memory.kv_cache_budget(0.9) == int(80 * GiB * 0.9) - (16 + 3) * GiB - GiB // 2
    # The driver's free memory alone would have counted the reserved 16 GiB as used.
    assert gpu.reserved == gpu.allocated  # and the step's activations went back


def test_an_engine_built_after_another_does_not_count_the_first_ones_freed_cache(monkeypatch):
    gpu = FakeGpu(total=80 * GiB, non_torch=GiB // 2)
    gpu.install(monkeypatch)
    budgets = []
    for _ in range(3):  # engines one after another in one process (benchmarks, tests, model switches)
        gpu.allocate(16 * GiB)
        memory = profile_device_memory(torch.device("cuda", 0), lambda: gpu.step(3 * GiB))
        budgets.append(memory.kv_cache_budget(0.9))
        gpu.allocate(budgets[-1])  # its KV cache
        gpu.free(budgets[-1] + 16 * GiB)  # the engine is dropped: everything stays reserved
    assert budgets[0] > 50 * GiB and budgets == [budgets[0]] * 3


def test_blocks_come_from_the_profiled_budget_on_cuda_and_kv_cache_memory_elsewhere(tiny_dummy_model: Path):
    model = ModelConfig.from_hf(json.loads((tiny_dummy_model / "config.json").read_text()))
    per_block = bytes_per_block(model, 16, torch.bfloat16)
    memory = DeviceMemory(total=10 * GiB, weights=GiB, peak_activations=GiB, non_torch=0)
    config = EngineConfig(gpu_memory_utilization=0.5, kv_cache_memory=GiB)
    assert num_kv_blocks(model, config, torch.bfloat16, memory) == (5 * GiB - 2 * GiB) // per_block
    assert num_kv_blocks(model, config, torch.bfloat16, None) == GiB // per_block
    assert num_kv_blocks(model, EngineConfig(num_kv_blocks=7), torch.bfloat16, memory) == 7


def test_the_profiled_step_is_the_largest_a_step_can_be(tiny_dummy_model: Path, monkeypatch):
    """max_num_batched_tokens tokens over max_num_seqs sequences, each sampling with every filter
    and penalty; on its own one-block cache, so the engine's cache is untouched."""
    llm = LLM(model=str(tiny_dummy_model), load_format="dummy", dtype="float32", device="cpu",
              max_num_batched_tokens=40, max_num_seqs=6, num_kv_blocks=16)
    engine_caches = [c.clone() for layer in llm.engine.runner.kv_caches for c in layer]
    seen: dict[str, object] = {}
    forward, sample = llm.engine.model.forward, engine.sampler.Sampler.__call__

    def record_forward(input_ids, positions, kv_caches, metadata):  # type: ignore[no-untyped-def]
        seen["tokens"], seen["seqs"], seen["cache_blocks"] = input_ids.shape[0], len(metadata.seq_lens), kv_caches[0][0].shape[0]
        return forward(input_ids, positions, kv_caches, metadata)

    def record_sample(self, logits, rows):  # type: ignore[no-untyped-def]
        seen["logit_rows"], seen["top_p"] = logits.shape[0], {row.params.top_p for row in rows}
        return sample(self, logits, rows)

    monkeypatch.setattr(llm.engine.model, "forward", record_forward)
    monkeypatch.setattr(engine.sampler.Sampler, "__call__", record_sample)
    e = llm.engine
    spec = ShardSpec(resolve_model(str(tiny_dummy_model), "dummy"), e.model_config, e.config, e.device, e.dtype, e.kernel_backend)
    largest_step(spec, e.model, e.model_config, e.device)()

    assert seen == {"tokens": 40, "seqs": 6, "cache_blocks": 1, "logit_rows": 6, "top_p": {0.9}}
    assert all(torch.equal(a, b) for a, b in zip(engine_caches, [c for layer in llm.engine.runner.kv_caches for c in layer]))


# ---- the engine's device ----------------------------------------------------------------------


def test_a_gpu_without_an_index_resolves_to_the_current_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_on_device_makes_the_engines_gpu_current(monkeypatch):
    entered: list[torch.device] = []

    @contextmanager
    def fake_cuda_device(device: torch.device) -> Iterator[None]:
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_cuda_device)
    with on_device(torch.device("cuda", 2)):
        assert entered == [torch.device("cuda", 2)]
    with on_device(torch.device("cpu")):
        pass
    assert entered == [torch.device("cuda", 2)]


def test_the_engine_builds_and_steps_on_its_device_from_the_loop_thread(tiny_dummy_model: Path, monkeypatch):
    """The engine loop's thread starts on device 0: the build and every step must enter the
    engine's own device (Triton launches and graph capture go to the current one)."""
    current: dict[int, torch.device | None] = {}
    seen: list[tuple[str, torch.device | None]] = []

    @contextmanager
    def recording_on_device(device: torch.device) -> Iterator[None]:
        current[threading.get_ident()] = device
        try:
            yield
        finally:
            current[threading.get_ident()] = None

    def inside(name: str, method):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen.append((name, current.get(threading.get_ident())))
            return method(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(engine.llm_engine, "on_device", recording_on_device)
    monkeypatch.setattr(engine.model_shard, "on_device", recording_on_device)
    monkeypatch.setattr(engine.model_shard, "_build_model", inside("build", engine.model_shard._build_model))
    monkeypatch.setattr(ModelRunner, "execute", inside("step", ModelRunner.execute))
    loop = EngineLoop.build(
        lambda: LLMEngine(str(tiny_dummy_model), load_format="dummy", dtype="float32", device="cpu", num_kv_blocks=32)
    )
    try:
        loop.submit([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)).result(timeout=60)
    finally:
        loop.stop()
    device = loop.engine.device
    assert seen[0] == ("build", device)
    assert [name for name, _ in seen[1:]] == ["step"] * 3 and {d for _, d in seen} == {device}


# ---- no host sync inside a step ---------------------------------------------------------------


def _caller_in_engine_or_kernels(depth: int = 2) -> str | None:
    """The engine/ or conveyor_kernels/ file that made the call, if one did (transfer.py, the pinned path, excepted)."""
    filename = Path(sys._getframe(depth).f_code.co_filename)
    parts = filename.relative_to(REPO).parts if filename.is_relative_to(REPO) else ()
    if parts and parts[0] in ("engine", "conveyor_kernels") and filename.name != "transfer.py":
        return str(Path(*parts))
    return None


class SyncRecorder(TorchDispatchMode):
    """Ops whose output size the host must read from the device."""

    SYNCING = ("aten._unique2", "aten.unique", "aten.nonzero", "aten.masked_select", "aten._local_scalar_dense")

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        if name.startswith(self.SYNCING) or (name == "aten.repeat_interleave.Tensor" and "output_size" not in (kwargs or {})):
            caller = next((c for depth in range(2, 40) if (c := _safe_caller(depth))), None)
            if caller is not None:
                self.found.append(f"{name} from {caller}")
        return func(*args, **(kwargs or {}))


def _safe_caller(depth: int) -> str | None:
    try:
        return _caller_in_engine_or_kernels(depth + 1)
    except ValueError:  # the stack is shallower
        return None


@pytest.mark.slow
@pytest.mark.skipif(not (TRITON_AVAILABLE and interpreter_enabled()), reason="needs Triton's interpreter")
def test_a_step_with_copy_on_write_swap_penalties_and_top_p_never_waits_on_the_device(tiny_dummy_model, monkeypatch):
    """The CUDA test (test_triton_engine.py) checks this with torch's sync debug mode on a GPU; here
    the same runner code runs on CPU tensors standing in for device ones, and every way a step
    could make the host wait is recorded: reading a value (.item, .tolist, bool, int, float), a
    tensor built from a Python list other than through engine/transfer.py's pinned path, and ops
    whose output size depends on values (unique, nonzero, masked_select, repeat_interleave
    without output_size)."""
    llm = LLM(model=str(tiny_dummy_model), load_format="dummy", dtype="float32", device="cpu", kernel_backend="triton",
              block_size=4, num_kv_blocks=20, max_num_seqs=6, max_num_batched_tokens=32)
    # On a GPU the sampler takes its branch-free paths; make the CPU take them too.
    monkeypatch.setattr(engine.sampler, "_may_wait_on", lambda device: False)
    found: list[str] = []
    recording = threading.local()

    def record(name: str, original):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            if getattr(recording, "on", False) and (caller := _caller_in_engine_or_kernels()):
                found.append(f"{name} from {caller}")
            return original(*args, **kwargs)
        return wrapper

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, record(f"Tensor.{name}", getattr(torch.Tensor, name)))
    for name in ("tensor", "as_tensor"):
        monkeypatch.setattr(torch, name, record(f"torch.{name}", getattr(torch, name)))
    runner, execute = llm.engine.runner, llm.engine.runner.execute
    modes = SyncRecorder()
    moves = {"copy": 0, "swap_out": 0, "swap_in": 0}

    def execute_recording(output, rows, fanout=None, token_bitmask=None):  # type: ignore[no-untyped-def]
        moves["copy"] += len(output.blocks_to_copy)
        moves["swap_out"] += len(output.blocks_to_swap_out)
        moves["swap_in"] += len(output.blocks_to_swap_in)
        recording.on = True
        try:
            with modes:
                return execute(output, rows, fanout, token_bitmask)
        finally:
            recording.on = False

    monkeypatch.setattr(runner, "execute", execute_recording)
    params = SamplingParams(
        n=2, temperature=0.9, top_p=0.8, min_p=0.01, repetition_penalty=1.3, frequency_penalty=0.5,
        presence_penalty=0.4, seed=7, max_tokens=10, ignore_eos=True,
    )
    prompts = [[(7 * i + j) % 290 + 3 for j in range(9 + 2 * i)] for i in range(5)]
    outputs = llm.generate(prompts, params, use_tqdm=False)

    assert all(len(c.token_ids) == 10 for o in outputs for c in o.outputs)
    assert moves["copy"] > 0 and moves["swap_out"] > 0 and moves["swap_in"] > 0, moves
    assert found + modes.found == []


def test_the_samplers_device_path_picks_the_same_tokens(monkeypatch):
    """On a GPU top-p alone sorts the whole vocabulary instead of checking its prefilter on the host:
    the same tokens either way (with penalties, whose counts never need `unique`)."""
    from engine.sampler import Sampler, SamplingRow

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=generator) * 3
    logits[:3] *= 0.05  # flat rows: the nucleus outgrows the 256-token prefilter
    rows = [
        SamplingRow(
            SamplingParams(temperature=0.9, top_p=0.95 if i % 2 else 0.7, top_k=-1 if i < 4 else 50, seed=i,
                           frequency_penalty=0.4 * (i % 3), presence_penalty=0.3, repetition_penalty=1.1),
            seed=i, prompt_token_ids=[1, 2, 3], output_token_ids=[5, 5, 9, i], eos_token_ids=(2,),
        )
        for i in range(6)
    ]
    host = Sampler()(logits, rows)
    monkeypatch.setattr(engine.sampler, "_may_wait_on", lambda device: False)
    device = Sampler()(logits, rows)
    assert torch.equal(host.token_ids, device.token_ids)
