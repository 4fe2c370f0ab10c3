"""The engine on its Triton kernels (attention, KV writes, fused add-RMSNorm, rotary, SiLU-and-mul,
block copies and swaps): greedy output equals Hugging Face transformers' in float32.

Without a GPU the kernels run under Triton's interpreter on CPU tensors, which is slow: a small
model, few prompts and tokens. On CUDA the same checks run on the GPU, with decode steps replayed
from CUDA graphs and without them.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled
from tests.conftest import save_random_hf_model
from tests.engine.test_hf_equivalence import hf_greedy

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


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    import transformers

    folder = save_random_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"))
    rng = random.Random(3)
    shared_prefix = [rng.randrange(3, 512) for _ in range(21)]
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    prompts = [shared_prefix + p if i % 2 else p for i, p in enumerate(prompts)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return str(folder), prompts, hf_greedy(hf, prompts, MAX_TOKENS, eos=None)


def generate(folder: str, prompts: list[list[int]], device: str, **options: object) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=folder, dtype="float32", device=device, kernel_backend="triton", **options)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outputs]


def check_engine(llm: LLM, setup: str) -> None:
    stats = llm.engine.stats()
    if setup == "preemption_swap":
        assert stats.preemptions["swap"] > 0 and stats.blocks_swapped_in > 0
    else:
        assert stats.prefix_cache_hit_tokens > 0
    assert stats.kv_blocks_used == 0 and stats.host_blocks_used == 0
    llm.engine.block_manager.check_invariants()


@pytest.mark.skipif(not interpreter_enabled(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("setup", list(SETUPS))
def test_triton_backend_matches_hf_on_cpu(case, setup):
    folder, prompts, expected = case
    llm, got = generate(folder, prompts, "cpu", **SETUPS[setup])
    assert llm.engine.kernel_backend == "triton"
    assert got == expected
    check_engine(llm, setup)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graphs", "eager"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_cuda_engine_matches_hf(case, setup, graphs):
    folder, prompts, expected = case
    options = {**SETUPS[setup], "cuda_graph_max_batch_size": 8 if graphs else 0}
    llm, got = generate(folder, prompts, "cuda", **options)
    assert (llm.engine.runner.decode_graphs is not None) == graphs
    assert got == expected
    check_engine(llm, setup)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_step_waits_for_the_gpu_only_to_read_sampled_tokens(case):
    """Inside the runner (block moves, inputs, forward pass, graph replay, sampling) nothing makes
    the host wait for the GPU; the engine reads the sampled tokens after the runner returns."""
    folder, prompts, _ = case
    llm = LLM(model=folder, dtype="float32", device="cuda", max_num_batched_tokens=16, max_num_seqs=4)
    runner = llm.engine.runner
    execute = runner.execute

    def execute_without_syncs(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.execute = execute_without_syncs
    outputs = llm.generate(prompts, [GREEDY, SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_TOKENS)] * 4, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)


def test_auto_backend_is_triton_on_cuda_and_torch_on_cpu():
    from engine.dtypes import resolve_kernel_backend

    assert resolve_kernel_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_kernel_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_kernel_backend("torch", torch.device("cuda")) == "torch"
