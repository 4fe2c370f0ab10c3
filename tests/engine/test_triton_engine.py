"""The engine on its Triton kernels (attention, KV writes, fused add-RMSNorm, rotary, SiLU-and-mul,
fused MoE, block copies and swaps): greedy output equals Hugging Face transformers' in float32.

Without a GPU the kernels run under Triton's interpreter on CPU tensors, which is slow: a small
model, few prompts and tokens. On CUDA the same checks run on the GPU, with decode steps replayed
from CUDA graphs and without them.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from conveyor_kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled
from tests.conftest import save_random_hf_model
from tests.engine.hf_oracle import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed")]

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SETUPS = {
    # prefill in chunks over cached prefixes, and prompts admitted over many steps find earlier
    # ones' blocks in the prefix cache
    "chunked_prefill_prefix_cache": {"max_num_batched_tokens": 16, "max_num_seqs": 3},
    # 24 blocks of 4 tokens cannot hold every sequence: swap-outs and swap-ins
    "preemption_swap": {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 32},
}


# Qwen3, and Qwen3-MoE through the fused MoE kernel (q/k norms, a dense layer beside a sparse one)
@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def case(request, tmp_path_factory):
    import transformers

    folder = save_random_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    rng = random.Random(3)
    shared_prefix = [rng.randrange(3, 512) for _ in range(21)]
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    prompts = [shared_prefix + p if i % 2 else p for i, p in enumerate(prompts)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return str(folder), prompts, hf_greedy(hf, prompts, MAX_TOKENS, eos=None)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_engine(llm: LLM, setup: str) -> None:
    stats = llm.engine.stats()
    if setup == "preemption_swap":
        assert stats.preemptions["swap"] > 0 and stats.blocks_swapped_in > 0
    else:
        assert stats.prefix_cache_hit_tokens > 0
    assert stats.kv_blocks_used == 0 and stats.host_blocks_used == 0
    llm.engine.block_manager.check_invariants()


# Under the interpreter the MoE model's greedy rows are checked against HF by the warm-up test below, whose one run
# chunks prefills, hits the prefix cache and swaps (its fused MoE kernel is the slowest to interpret: one run, not
# three); on CUDA it runs every setup, below.
INTERPRETED_CASES = [("qwen3", "chunked_prefill_prefix_cache"), ("qwen3", "preemption_swap")]


@pytest.mark.skipif(not interpreter_enabled(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize(("case", "setup"), INTERPRETED_CASES, indirect=["case"])
def test_triton_backend_matches_hf_on_cpu(case, setup):
    folder, prompts, expected = case
    llm = LLM(model=folder, dtype="float32", device="cpu", kernel_backend="triton", **SETUPS[setup])
    got = generate(llm, prompts)
    assert llm.engine.kernel_backend == "triton"
    assert got == expected
    check_engine(llm, setup)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graphs", "eager"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_cuda_engine_matches_hf(case, setup, graphs, cuda_llm):
    folder, prompts, expected = case
    options = {**SETUPS[setup], "cuda_graph_max_batch_size": 8 if graphs else 0}
    llm = cuda_llm(folder, dtype="float32", kernel_backend="triton", **options)
    got = generate(llm, prompts)
    assert (llm.engine.runner.decode_graphs is not None) == graphs
    assert got == expected
    check_engine(llm, setup)


# Every way a step moves blocks or samples on the device: copy-on-write (n > 1 forks share a
# partial block), swaps (a pool too small for the batch), penalties, min-p and top-p.
SYNC_FREE_SETUPS = {
    "greedy_and_seeded": ({"max_num_batched_tokens": 16, "max_num_seqs": 4}, [
        GREEDY, SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True)]),
    "cow_swap_penalties_top_p": (
        {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 32, "max_num_seqs": 6},
        [SamplingParams(n=2, temperature=0.9, top_p=0.8, min_p=0.01, repetition_penalty=1.3, frequency_penalty=0.5,
                        presence_penalty=0.4, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True),
         SamplingParams(temperature=0.7, top_p=0.9, seed=4, max_tokens=MAX_TOKENS, ignore_eos=True)],
    ),
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("setup", list(SYNC_FREE_SETUPS))
def test_cuda_step_waits_for_the_gpu_only_to_read_sampled_tokens(case, setup, cuda_llm):
    """Inside the runner (block moves, inputs, forward pass, graph replay, sampling) nothing makes
    the host wait for the GPU; the engine reads the sampled tokens after the runner returns.
    tests/engine/test_cuda_path.py guards the same on the CPU."""
    folder, prompts, _ = case
    options, params = SYNC_FREE_SETUPS[setup]
    llm = cuda_llm(folder, dtype="float32", **options)
    runner = llm.engine.runner
    execute = runner.execute
    moved = {"copy": 0, "swap": 0}

    def execute_without_syncs(output, *args, **kwargs):
        moved["copy"] += len(output.blocks_to_copy)
        moved["swap"] += len(output.blocks_to_swap_out) + len(output.blocks_to_swap_in)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(output, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.execute = execute_without_syncs
    outputs = llm.generate(prompts, [params[i % len(params)] for i in range(len(prompts))], use_tqdm=False)
    assert all(len(c.token_ids) == MAX_TOKENS for o in outputs for c in o.outputs)
    if setup == "cow_swap_penalties_top_p":
        assert moved["copy"] > 0 and moved["swap"] > 0


class EagerGraph:
    """Stands in for a captured CUDA graph: keeps the captured callable and runs it eagerly on
    replay, reading the static buffers as a real replay would."""

    replays: list[int] = []

    def __init__(self, forward, pool) -> None:
        self.forward = forward

    def replay(self) -> None:
        EagerGraph.replays.append(1)
        self.forward()

    def pool(self) -> None:
        return None


@pytest.mark.skipif(not interpreter_enabled(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
# The dense model only: the graphs' buffers are the same for a MoE model, whose layers are row-wise too (a padding
# row's garbage reaches no other row); on CUDA the MoE model's decode graphs are replayed in test_cuda_engine_matches_hf.
@pytest.mark.parametrize("case", ["qwen3"], indirect=True)
def test_graph_replay_equals_eager_even_over_garbage_buffers(case, monkeypatch):
    """The decode-graph logic without a GPU: buffers are filled with garbage before every replay
    (what an earlier, larger batch may leave behind), so the output must depend only on what
    `DecodeGraphs.run` writes: padding rows' slot -1 and length 0, this step's tables."""
    from engine import cuda_graphs

    folder, prompts, expected = case
    monkeypatch.setattr(cuda_graphs, "capture_graph", EagerGraph)
    EagerGraph.replays = []
    llm = LLM(model=folder, dtype="float32", device="cpu", kernel_backend="triton", max_num_seqs=3,
              max_num_batched_tokens=64)
    engine = llm.engine
    k_cache = engine.runner.kv_caches[0][0]
    graphs = cuda_graphs.DecodeGraphs(engine.model, engine.runner.kv_caches, 4, -(-engine.max_model_len // 16), k_cache.device)
    assert graphs.batch_sizes == [1, 2, 4]
    run = graphs.run
    generator = torch.Generator().manual_seed(0)
    batches = []

    def run_over_garbage(input_ids, positions, metadata):
        batches.append(input_ids.shape[0])
        for buffer, high in (
            (graphs.input_ids, engine.model_config.vocab_size),
            (graphs.positions, engine.model_config.max_position_embeddings),
            (graphs.slot_mapping, k_cache.shape[0] * k_cache.shape[1]),
            (graphs.seq_lens, engine.max_model_len),
            (graphs.block_tables, k_cache.shape[0]),
        ):
            buffer.copy_(torch.randint(0, high, buffer.shape, generator=generator))
        graphs.hidden.normal_(generator=generator)
        return run(input_ids, positions, metadata)

    graphs.run = run_over_garbage
    engine.runner.decode_graphs = graphs
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)

    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert 3 in batches  # a batch padded up to its bucket
    assert len(EagerGraph.replays) == len(batches) > 0


def _specialisation(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton's JIT keys a compile on: constexpr values, and for every other argument its
    type and specialisation (== 1, divisible by 16, pointer alignment) unless do_not_specialize
    exempts it; plus the launch options."""
    import inspect

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    parameters = inspect.signature(kernel.fn).parameters
    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in parameters}
    exempt = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name in kernel.arg_names:
        if "constexpr" in str(parameters[name].annotation):
            key.append((name, values[name]))
        else:
            key.append((name, native_specialize_impl(BaseBackend, values[name], False, name not in exempt, True)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in parameters))
    return (kernel.fn.__name__, tuple(key), options)


@pytest.mark.skipif(not interpreter_enabled(), reason="records launches under Triton's interpreter")
def test_every_kernel_variant_a_run_launches_was_compiled_by_the_warm_up(case, monkeypatch):
    """Each launch's compile key is recorded while the engine builds (its warm-up) and while it
    serves prefill chunks of every length, prefix-cache hits, forks with copy-on-write, swaps and
    decodes: on a GPU a key first seen in the second phase is a compile inside a running engine. Its greedy rows equal
    HF's (for the MoE model, the interpreter's only check of its Triton path against HF)."""
    from triton.runtime.interpreter import InterpretedFunction

    folder, prompts, expected = case
    phase = {"name": "build"}
    launches: dict[str, set] = {"build": set(), "run": set()}
    interpret = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        launches[phase["name"]].add(_specialisation(self, args, kwargs))
        return interpret(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    llm = LLM(model=folder, dtype="float32", device="cpu", kernel_backend="triton", block_size=4, num_kv_blocks=24,
              max_num_batched_tokens=32, max_num_seqs=4)
    phase["name"] = "run"
    sampled = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, [GREEDY if i % 2 else sampled for i in range(len(prompts))], use_tqdm=False)
    greedy_rows = range(1, len(prompts), 2)
    assert [list(outputs[i].outputs[0].token_ids) for i in greedy_rows] == [expected[i] for i in greedy_rows]

    stats = llm.engine.stats()
    assert stats.preemptions["swap"] > 0 and stats.prefix_cache_hit_tokens > 0
    kernels_run = {key[0] for key in launches["run"]}
    assert {"_prefill_attention_kernel", "_decode_partition_kernel", "_copy_blocks_kernel"} <= kernels_run
    assert launches["run"] - launches["build"] == set()


def test_auto_backend_is_triton_on_cuda_and_torch_on_cpu():
    from engine.dtypes import resolve_kernel_backend

    assert resolve_kernel_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_kernel_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_kernel_backend("torch", torch.device("cuda")) == "torch"
