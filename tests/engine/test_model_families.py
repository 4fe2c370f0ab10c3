"""The families beyond Llama/Qwen against transformers, float32 greedy, token for token: Mistral and
Phi-3 (every layer windowed), Qwen2 with `use_sliding_window` (its later layers windowed), Gemma 2
(alternating windowed and global layers, soft-capped scores and logits), Gemma 3 (q/k norms, a
second RoPE base for the windowed layers) and Phi-3 with LongRoPE (prompts short throughout, long from the
start, and growing past the threshold while generating). Prompts run well past the window, so it matters; the
engine runs batched with chunked prefill, swap preemption and prefix caching."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import FREED
from conveyor_kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled
from tests.conftest import TINY_LONG_ROPE_THRESHOLD, TINY_WINDOW, save_random_hf_model
from tests.engine.hf_oracle import hf_greedy
from tests.engine.test_hf_equivalence import ENGINE_SETUPS, check_against_hf

pytestmark = pytest.mark.slow

FAMILIES = ["mistral", "qwen2-window", "phi3", "gemma2", "gemma3", "phi3-longrope"]
SETUPS = ["default", "chunked_prefill", "preemption_swap", "prefix_caching", "torch_only"]
# Where every layer is windowed a sequence holds few blocks (those behind the window are freed): only a
# smaller pool still forces preemption.
EVERY_LAYER_WINDOWED = {"mistral", "phi3"}
WINDOWED_SETUPS = {**ENGINE_SETUPS, "preemption_swap": {**ENGINE_SETUPS["preemption_swap"], "num_kv_blocks": 16,
                                                         "max_num_batched_tokens": 16}}


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tmp_path_factory):
    import transformers

    folder = save_random_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 60))] for _ in range(12)]
    shared_prefix = [rng.randrange(3, 512) for _ in range(29)]  # longer than the window, for prefix-cache hits
    prompts = [shared_prefix + p if i % 2 else p for i, p in enumerate(prompts)]
    assert max(map(len, prompts)) > 4 * TINY_WINDOW
    if request.param == "phi3-longrope":  # and prompts that stay within LongRoPE's short factors
        prompts += [[rng.randrange(3, 512) for _ in range(length)] for length in (3, 9)]
    # Eager attention: transformers' reference implementation (its SDPA path drops soft-capping).
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    expected = hf_greedy(hf, prompts, 20, eos=None)
    return request.param, (str(folder), prompts, expected)


@pytest.mark.parametrize("setup", SETUPS)
def test_family_matches_hf(family_case, setup):
    family, case = family_case
    setups = WINDOWED_SETUPS if family in EVERY_LAYER_WINDOWED else ENGINE_SETUPS
    llm = check_against_hf(case, setup, ignore_eos=True, options=setups[setup])
    if family == "phi3-longrope":
        lengths, threshold = [len(prompt) for prompt in case[1]], TINY_LONG_ROPE_THRESHOLD
        assert min(lengths) + 20 <= threshold < max(lengths)
        # each prompt that grew past the threshold was computed again with the long factors, once
        crossing = sum(threshold - 20 < length <= threshold for length in lengths)
        assert crossing and llm.engine.scheduler.counters.long_rope_recomputes == crossing


def test_sliding_window_frees_blocks_outside_it(tmp_path):
    """A 100-token prompt on a model windowed in every layer (Mistral, window 12, blocks of 4): from
    the first decode step on the sequence holds at most window / block_size + 1 blocks, the rest of
    its table is released; the output still equals transformers'."""
    import transformers

    folder = save_random_hf_model("mistral", tmp_path)
    prompt = random.Random(3).sample(range(3, 512), 100)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    expected = hf_greedy(hf, [prompt], 20, eos=None)[0]

    llm = LLM(model=str(folder), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16)
    engine, manager = llm.engine, llm.engine.block_manager
    assert manager.sliding_window == TINY_WINDOW
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    held, produced = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            produced = output.outputs[0].token_ids
        seq = next(iter(engine.scheduler.running), None)
        if seq is not None:
            table = manager.block_table(seq.seq_id)
            held.append(manager.num_held_blocks(seq.seq_id))
            assert table[: len(table) - held[-1]] == [FREED] * (len(table) - held[-1])
            manager.check_invariants()
    assert produced == expected
    chunk_bound = -(-(TINY_WINDOW + 16) // 4) + 1  # while prefilling, a 16-token chunk is written besides the window
    assert max(held) <= chunk_bound and held[-1] <= TINY_WINDOW // 4 + 1
    assert manager.num_free_blocks == manager.num_blocks


def test_global_layers_keep_every_block(tmp_path):
    """Gemma's global layers read the whole context: nothing is released."""
    folder = save_random_hf_model("gemma2", tmp_path)
    llm = LLM(model=str(folder), dtype="float32", device="cpu", block_size=4)
    assert llm.engine.block_manager.sliding_window is None


@pytest.mark.skipif(not TRITON_AVAILABLE or not interpreter_enabled(), reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_family_on_triton_matches_hf(family, tmp_path):
    """The Triton kernels' windows (freed blocks included) and soft-capping, in the engine, under the
    interpreter: chunked prefill over cached prefixes, then decode."""
    import transformers

    folder = save_random_hf_model(family, tmp_path)
    rng = random.Random(4)
    shared_prefix = [rng.randrange(3, 512) for _ in range(20)]
    prompts = [shared_prefix + [rng.randrange(3, 512) for _ in range(rng.randint(5, 25))] for _ in range(4)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    expected = hf_greedy(hf, prompts, 8, eos=None)
    llm = LLM(model=str(folder), dtype="float32", device="cpu", kernel_backend="triton", block_size=4,
              max_num_batched_tokens=16, max_num_seqs=2)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert llm.engine.stats().prefix_cache_hit_tokens > 0
    llm.engine.block_manager.check_invariants()
