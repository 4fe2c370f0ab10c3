"""Admission limits and failed-step isolation, on a tiny random Qwen3 (dummy weights) on CPU.

A request the engine could never pay for is refused before it is queued, with an error naming the limit; a step
that fails anyway fails only its costliest request, and the engine loop keeps serving the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import EngineLoop, SamplingParams
from engine.admission import AdmissionRefused, StepFailed, blocks_needed
from engine.llm_engine import LLMEngine
from tests.conftest import save_random_hf_model

NUM_KV_BLOCKS = 64
BLOCK_SIZE = 16
TIMEOUT_S = 60


def make_engine(folder: Path, **options: object) -> LLMEngine:
    return LLMEngine(
        str(folder), dtype="float32", device="cpu", load_format="dummy", num_kv_blocks=NUM_KV_BLOCKS, **options
    )


@pytest.fixture
def engine(tiny_dummy_model: Path) -> LLMEngine:
    return make_engine(tiny_dummy_model)


def prompt(length: int) -> list[int]:
    return [(7 * i + 3) % 290 + 5 for i in range(length)]


def run_alone(engine: LLMEngine, request_id: str, tokens: list[int], params: SamplingParams) -> list[list[int]]:
    engine.add_request(request_id, tokens, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return [completion.token_ids for completion in output.outputs]
    raise AssertionError("finished without an output")


def test_more_sequences_than_the_limit_is_refused_by_name(engine: LLMEngine) -> None:
    for params, name in [
        (SamplingParams(n=129, max_tokens=1), "n is 129"),
        (SamplingParams(n=2, best_of=1000, max_tokens=1), "best_of is 1000"),
        (SamplingParams(n=1, use_beam_search=True, beam_width=10**6, temperature=0.0, max_tokens=1), "beam_width"),
    ]:
        with pytest.raises(AdmissionRefused, match=name):
            engine.add_request("huge", prompt(4), params)
    assert not engine.has_unfinished_requests()


def test_a_request_that_can_outgrow_the_whole_pool_is_refused(engine: LLMEngine) -> None:
    # 64 blocks of 16 tokens: 8 sequences of up to 4 + 200 tokens need 8 * 13 blocks.
    assert blocks_needed(4, 8, 200, BLOCK_SIZE) > NUM_KV_BLOCKS
    with pytest.raises(AdmissionRefused, match="KV blocks"):
        engine.add_request("wide", prompt(4), SamplingParams(n=8, max_tokens=200))
    # Without max_tokens a request may use the whole remaining context (256 - 4 tokens here): 5 such sequences do not fit.
    with pytest.raises(AdmissionRefused, match="KV blocks"):
        engine.add_request("open", prompt(4), SamplingParams(n=5, max_tokens=None))
    engine.add_request("fits", prompt(4), SamplingParams(n=1, max_tokens=None))


def test_a_windowed_model_is_admitted_past_its_pool(tmp_path: Path) -> None:
    """Every layer windowed (Mistral, window 12): a sequence holds the window plus one step whatever its length, so a
    request longer than the pool, or without max_tokens, is admitted and runs."""
    folder = save_random_hf_model("mistral", tmp_path)
    engine = LLMEngine(
        str(folder), dtype="float32", device="cpu", load_format="dummy", num_kv_blocks=16, block_size=4,
        max_num_batched_tokens=16,
    )
    assert blocks_needed(100, 1, 20, 4) > 16
    tokens = run_alone(engine, "long", prompt(100), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert [len(t) for t in tokens] == [20]
    engine.add_request("open", prompt(100), SamplingParams(max_tokens=None))
    with pytest.raises(AdmissionRefused, match="KV blocks"):
        engine.add_request("wide", prompt(100), SamplingParams(n=3, max_tokens=20))


def test_the_deployment_default_and_limit_of_max_tokens(tiny_dummy_model: Path) -> None:
    engine = make_engine(tiny_dummy_model, default_max_tokens=5, max_tokens_limit=9)
    unbounded = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    assert [len(t) for t in run_alone(engine, "default", prompt(6), unbounded)] == [5]
    explicit = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    assert [len(t) for t in run_alone(engine, "explicit", prompt(6), explicit)] == [9]
    with pytest.raises(AdmissionRefused, match="at most 9"):
        engine.add_request("over", prompt(6), SamplingParams(max_tokens=10))


def test_without_an_operator_default_a_request_runs_to_the_end_of_the_context(engine: LLMEngine) -> None:
    tokens = run_alone(engine, "open", prompt(200), SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert [len(t) for t in tokens] == [engine.max_model_len - 200]


def test_without_chunked_prefill_a_prompt_longer_than_a_step_is_refused(tiny_dummy_model: Path) -> None:
    engine = make_engine(tiny_dummy_model, enable_chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(AdmissionRefused, match="without chunked prefill"):
        engine.add_request("long", prompt(40), SamplingParams(max_tokens=1))


@pytest.fixture
def oom_loop(tiny_dummy_model: Path) -> Iterator[EngineLoop]:
    """A loop whose runner runs out of memory whenever a step samples more than 8 rows at once, as a step that
    forks a wide request's samples would on a real device."""
    engine = make_engine(tiny_dummy_model)
    execute = engine.runner.execute

    def execute_within_memory(out, rows, *more):  # type: ignore[no-untyped-def]
        if len(rows) > 8:
            raise torch.OutOfMemoryError(f"cannot allocate logits for {len(rows)} rows")
        return execute(out, rows, *more)

    engine.runner.execute = execute_within_memory  # type: ignore[method-assign]
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


def test_a_failed_step_fails_only_its_costliest_request(oom_loop: EngineLoop) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = make_engine_outputs(oom_loop, greedy)
    small = [oom_loop.submit(prompt(10 + i), greedy) for i in range(3)]
    wide = oom_loop.submit(prompt(8), SamplingParams(n=16, max_tokens=12, seed=1))
    with pytest.raises(StepFailed, match="OutOfMemoryError"):
        wide.result(TIMEOUT_S)
    assert [handle.result(TIMEOUT_S).outputs[0].token_ids for handle in small] == reference
    after = oom_loop.submit(prompt(10), greedy)  # the loop keeps serving
    assert after.result(TIMEOUT_S).outputs[0].token_ids == reference[0]
    assert oom_loop.num_in_flight == 0


def make_engine_outputs(loop: EngineLoop, params: SamplingParams) -> list[list[int]]:
    handles = [loop.submit(prompt(10 + i), params) for i in range(3)]
    return [handle.result(TIMEOUT_S).outputs[0].token_ids for handle in handles]
