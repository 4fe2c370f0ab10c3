"""LoRA adapters: greedy float32 output of every adapter equals PEFT's PeftModel (and the merged model) token for
token, with lines of four adapters and the base model interleaved in one engine batch, whatever chunked prefill,
preemption (swap, recompute), prefix caching or slot eviction happened. Bad adapters fail at registration."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from conveyor_kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled
from tests.conftest import save_random_hf_model
from tests.engine.hf_oracle import hf_greedy
from tests.engine.test_hf_equivalence import TINY_POOL

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
# Adapters differing in rank, alpha and targets; "rs" scales with rsLoRA (alpha / sqrt(r)).
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "mixed": dict(r=2, lora_alpha=16, target_modules=["v_proj", "down_proj", "up_proj"]),
    "rs": dict(r=16, lora_alpha=8, use_rslora=True,
               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
VARIANTS = [None, *ADAPTERS]  # None: the base model


@pytest.fixture(scope="module")
def lora_case(tmp_path_factory):
    """The base folder, adapter folders, prompts (a shared prefix, so the prefix cache has hits to serve and must
    keep adapters apart), and PEFT's greedy output per (variant, prompt)."""
    import peft
    import transformers

    root = tmp_path_factory.mktemp("lora")
    base = save_random_hf_model("llama", root / "base")
    folders = {}
    for index, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(index)
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        # init_lora_weights=False: B non-zero, so each adapter changes the output
        peft.get_peft_model(model, peft.LoraConfig(**options, init_lora_weights=False)).save_pretrained(root / name)
        folders[name] = str(root / name)
    rng = random.Random(3)
    prefix = [rng.randrange(3, 512) for _ in range(21)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    expected: dict[str | None, list[list[int]]] = {}
    for variant in VARIANTS:
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if variant is not None:
            model = peft.PeftModel.from_pretrained(model, folders[variant])
        expected[variant] = hf_greedy(model, prompts, MAX_TOKENS, eos=None)
        if variant is not None:  # the merged model agrees too
            assert hf_greedy(model.merge_and_unload(), prompts[:1], MAX_TOKENS, eos=None) == expected[variant][:1]
    assert all(expected[name] != expected[None] for name in ADAPTERS), "an adapter that changes nothing tests nothing"
    return str(base), folders, prompts, expected


def _engine(case, device: str = "cpu", **options: object) -> LLM:
    base, folders, _, _ = case
    llm = LLM(model=base, dtype="float32", device=device, enable_lora=True, **options)
    for name, folder in folders.items():
        llm.add_lora(name, folder)
    return llm


SETUPS = {
    "default": {},  # swap preemption, prefix caching, chunked prefill on
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption_swap": {**TINY_POOL, "preemption_mode": "swap"},
    "preemption_recompute": {**TINY_POOL, "preemption_mode": "recompute"},
    "eviction": {"max_loras": 2},  # four adapters through two slots
    "torch_only": {"cpu_kernels": False, "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_interleaved_adapters_match_peft(lora_case, setup):
    """Every prompt on every variant, interleaved in one batch: 30 lines of the base and four adapters."""
    _, _, prompts, expected = lora_case
    llm = _engine(lora_case, **SETUPS[setup])
    lines = [(variant, prompt_index) for prompt_index in range(len(prompts)) for variant in VARIANTS]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, adapter=v) for v, _ in lines]
    outputs = llm.generate([prompts[i] for _, i in lines], params, use_tqdm=False)
    got = [list(output.outputs[0].token_ids) for output in outputs]
    assert got == [expected[variant][i] for variant, i in lines]
    stats = llm.engine.stats()
    if setup.startswith("preemption_"):
        assert stats.preemptions[setup.removeprefix("preemption_")] > 0
    if setup == "default":
        assert stats.prefix_cache_hit_tokens > 0
    slots = llm.engine.scheduler.adapter_slots
    assert slots.loads == len(ADAPTERS)  # each adapter loaded once per residence
    if setup == "eviction":  # never more than two resident: "attn", evicted, comes back into a slot
        assert len(slots.resident()) == 2 and "attn" not in slots.resident()
        again = llm.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                         adapter="attn"), use_tqdm=False)
        assert [list(output.outputs[0].token_ids) for output in again] == expected["attn"][:3]
        assert slots.loads == len(ADAPTERS) + 1
    assert stats.kv_blocks_used == 0 and stats.host_blocks_used == 0


def test_tensor_parallel_adapters_match_peft(lora_case):
    """Two ranks (gloo on CPU), each holding its shard of every adapter cut like the base layers (B's output rows of
    q/k/v and gate/up; A's input columns of o and down, whose terms join the base's all-reduce): three prompts on
    every variant, interleaved in one batch."""
    _, _, prompts, expected = lora_case
    llm = _engine(lora_case, tensor_parallel_size=2)
    try:
        lines = [(variant, prompt_index) for prompt_index in range(3) for variant in VARIANTS]
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, adapter=v) for v, _ in lines]
        outputs = llm.generate([prompts[i] for _, i in lines], params, use_tqdm=False)
        assert [list(output.outputs[0].token_ids) for output in outputs] == [expected[v][i] for v, i in lines]
    finally:
        llm.engine.close()


def test_adapter_lines_keep_sampling_fields(lora_case):
    """An adapter line takes what a base line takes: log-probs, min_tokens and n here (its samples fork the adapter's
    prompt blocks)."""
    _, _, prompts, expected = lora_case
    llm = _engine(lora_case)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, min_tokens=3, n=2,
                            adapter="rs")
    [output] = llm.generate([prompts[0]], params, use_tqdm=False)
    assert [list(sample.token_ids) for sample in output.outputs] == [expected["rs"][0]] * 2
    assert len(output.outputs[0].logprobs) == MAX_TOKENS


def test_unknown_adapter_is_refused(lora_case):
    llm = _engine(lora_case)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        llm.generate([[5, 6, 7]], SamplingParams(adapter="nope"), use_tqdm=False)


def _copy(folder: str, tmp_path, edit_config=None, drop_weights: bool = False) -> str:
    target = tmp_path / "bad"
    shutil.copytree(folder, target)
    if edit_config is not None:
        config = json.loads((target / "adapter_config.json").read_text())
        edit_config(config)
        (target / "adapter_config.json").write_text(json.dumps(config))
    if drop_weights:
        (target / "adapter_model.safetensors").unlink()
    return str(target)


def test_bad_adapters_fail_at_registration(lora_case, tmp_path):
    base, folders, _, _ = lora_case
    llm = LLM(model=base, dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16 is above max_lora_rank"):
        llm.add_lora("rs", folders["rs"])
    with pytest.raises(ValueError, match="not a PEFT LoRA adapter folder"):
        llm.add_lora("x", _copy(folders["attn"], tmp_path / "a", drop_weights=True))
    with pytest.raises(ValueError, match="target_modules"):
        llm.add_lora("x", _copy(folders["attn"], tmp_path / "b", lambda c: c.update(target_modules=["c_attn"])))
    with pytest.raises(ValueError, match="needs lora_A"):  # the weights do not fit the declared rank
        llm.add_lora("x", _copy(folders["attn"], tmp_path / "c", lambda c: c.update(r=3)))
    with pytest.raises(ValueError, match="use_dora"):
        llm.add_lora("x", _copy(folders["attn"], tmp_path / "d", lambda c: c.update(use_dora=True)))
    llm.add_lora("attn", folders["attn"])
    with pytest.raises(ValueError, match="already registered"):
        llm.add_lora("attn", folders["attn"])


def test_bad_adapter_shapes_for_another_base(lora_case, tmp_path):
    """An adapter trained on a model of other widths does not fit this base."""
    import peft
    import transformers

    _, folders, _, _ = lora_case
    other = save_random_hf_model("qwen3", tmp_path / "qwen3")  # head_dim 32: q is 128 wide, not 64
    model = transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "q")
    llm = LLM(model=lora_case[0], dtype="float32", device="cpu", enable_lora=True)
    with pytest.raises(ValueError, match="q_proj needs lora_A"):
        llm.add_lora("q", str(tmp_path / "q"))


def test_adapters_need_slots_allocated_at_start(lora_case):
    """The slots exist before any adapter (allocated before the KV cache is sized); an engine without them refuses
    adapters rather than allocating them later outside its memory budget."""
    base, folders, _, _ = lora_case
    assert LLM(model=base, dtype="float32", device="cpu", enable_lora=True).engine.runner.lora is not None
    plain = LLM(model=base, dtype="float32", device="cpu")
    assert plain.engine.runner.lora is None
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.add_lora("attn", folders["attn"])


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed")
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
])
def test_triton_backend_adapters_match_peft(lora_case, device):
    """The Triton path (conveyor_kernels/lora.py inside the engine; on CUDA decode steps with adapter rows skip the graphs):
    the shortest prompt as a base row, a row of the adapter with a partial target list and one of the full-rank
    rsLoRA adapter over every projection, in one batch, their first tokens. Few rows, as the interpreter runs every
    program of every kernel in Python (the kernels' own tests cover the shapes and slot mixes)."""
    _, _, prompts, expected = lora_case
    # Small steps: the warm-up runs a step of every query-tile height up to max_num_batched_tokens
    llm = _engine(lora_case, device=device, kernel_backend="triton", max_num_batched_tokens=64, max_num_seqs=4)
    shortest = min(range(len(prompts)), key=lambda index: len(prompts[index]))
    variants = [None, "mixed", "rs"]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, adapter=v) for v in variants]
    outputs = llm.generate([prompts[shortest]] * len(variants), params, use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in outputs] == [expected[v][shortest][:3] for v in variants]
