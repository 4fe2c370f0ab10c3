"""EngineLoop: many threads submit, stream and abort while one thread steps the engine.

Every loop here drives the module's one LLMEngine (the LLM's own), one loop at a time; between
tests the engine must be idle with every KV block back in the pool. float32, so a greedy request
gives the same tokens however the loop happened to batch it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import engine.engine_loop
from engine import LLM, EngineLoop, RequestOutput, SamplingParams
from engine.admission import EngineFailed
from engine.tensor_parallel import RankFailure

pytestmark = pytest.mark.slow

TIMEOUT = 120  # seconds: a hung loop fails the test instead of hanging the run
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Name a mammal that can fly.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What does a compiler do?",
    "Hi!",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    """24 different prompts of different lengths: each question as a chat and as raw text."""
    tokenizer = llm.tokenizer
    chats = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]
    return chats + [tokenizer.encode(q) for q in QUESTIONS]


@pytest.fixture()
def loop(llm: LLM):
    loop = EngineLoop(llm.engine).start()
    yield loop
    loop.stop()
    assert_idle(llm)


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()


def first_snapshot(handle) -> RequestOutput:
    """Blocks until a streaming request has produced its first token, i.e. it is running."""
    return next(iter(handle))


def test_concurrent_submitters_get_what_generate_gives(llm: LLM, prompts: list[list[int]]) -> None:
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    num_threads = 4
    start = threading.Barrier(num_threads)

    def submitter(first: int) -> list[tuple[int, RequestOutput]]:
        start.wait()  # all threads submit at once
        handles = [(i, loop.submit(prompts[i], GREEDY)) for i in range(first, len(prompts), num_threads)]
        return [(i, handle.result(TIMEOUT)) for i, handle in handles]

    with EngineLoop(llm.engine) as loop, ThreadPoolExecutor(num_threads) as pool:
        per_thread = [f.result(TIMEOUT) for f in [pool.submit(submitter, t) for t in range(num_threads)]]
    results = dict(pair for pairs in per_thread for pair in pairs)

    assert sorted(results) == list(range(len(prompts)))
    assert len({r.request_id for r in results.values()}) == len(prompts)
    for i, output in results.items():
        assert output.finished and output.prompt_token_ids == prompts[i]
        assert output.outputs[0].token_ids == expected[i], i
    assert_idle(llm)


def test_abort_from_another_thread(llm: LLM, loop: EngineLoop, prompts: list[list[int]]) -> None:
    doomed = loop.submit(prompts[0], LONG, stream=True)
    bystander = loop.submit(prompts[1], GREEDY)
    first_snapshot(doomed)
    aborter = threading.Thread(target=loop.abort, args=(doomed.request_id,))
    aborter.start()
    aborter.join()

    aborted = doomed.result(TIMEOUT)
    assert aborted.finished
    assert aborted.outputs[0].finish_reason == "abort"
    assert 1 <= len(aborted.outputs[0].token_ids) < LONG.max_tokens
    assert bystander.result(TIMEOUT).outputs[0].finish_reason in ("stop", "length")
    # Once both results are out the loop holds nothing: the abort gave its blocks back.
    assert loop.num_in_flight == 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_abort_of_an_unknown_or_finished_request_is_harmless(loop: EngineLoop, prompts: list[list[int]]) -> None:
    loop.abort("no-such-request")
    done = loop.submit(prompts[2], GREEDY)
    finished = done.result(TIMEOUT)
    loop.abort(done.request_id)
    loop.abort("no-such-request")
    assert loop.submit(prompts[3], GREEDY).result(TIMEOUT).outputs[0].finished
    assert done.result() is finished


def test_streaming_snapshots_grow_and_end_with_the_result(llm: LLM, loop: EngineLoop) -> None:
    tokenizer = llm.tokenizer
    apples = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Repeat the word 'apple' 30 times."}]),
        add_special_tokens=False,
    )
    plain = loop.submit(apples, SamplingParams(temperature=0.0, max_tokens=10), stream=True)
    # Matches only after several tokens, once "apple, apple," has been generated: snapshots must not
    # show text that the stop string then cuts away.
    stopped = loop.submit(apples, SamplingParams(temperature=0.0, max_tokens=16, stop=[", apple, apple,"]), stream=True)
    for handle in (plain, stopped):
        snapshots = list(handle)
        final = handle.result(TIMEOUT)
        assert len(snapshots) >= 2
        assert snapshots[-1] is final and final.finished
        assert not any(s.finished for s in snapshots[:-1])
        for before, after in zip(snapshots, snapshots[1:]):
            old, new = before.outputs[0], after.outputs[0]
            assert len(new.token_ids) > len(old.token_ids)
            assert new.token_ids[: len(old.token_ids)] == old.token_ids
            assert new.text.startswith(old.text), (old.text, new.text)
    assert len(plain.result().outputs[0].token_ids) == 10
    stop_output = stopped.result().outputs[0]
    assert (stop_output.text, stop_output.finish_reason, stop_output.stop_reason) == ("apple", "stop", ", apple, apple,")


def test_an_invalid_request_fails_only_its_own_handle(llm: LLM, loop: EngineLoop, prompts: list[list[int]]) -> None:
    good = [loop.submit(p, GREEDY) for p in prompts[:2]]
    empty = loop.submit([], GREEDY)
    too_long = loop.submit([5] * llm.max_model_len, GREEDY)
    out_of_vocab = loop.submit([5, llm.engine.model_config.vocab_size], GREEDY)
    text_not_ids = loop.submit("What is the capital of France?", GREEDY)  # type: ignore[arg-type]
    good.append(loop.submit(prompts[2], GREEDY))

    with pytest.raises(ValueError, match="empty"):
        empty.result(TIMEOUT)
    with pytest.raises(ValueError, match="context"):
        too_long.result(TIMEOUT)
    with pytest.raises(ValueError, match="out of range"):
        out_of_vocab.result(TIMEOUT)
    with pytest.raises((TypeError, ValueError)):
        text_not_ids.result(TIMEOUT)
    with pytest.raises(ValueError):  # a failed streaming handle ends its iteration with the error
        list(loop.submit([], GREEDY, stream=True))
    for handle in good:
        assert handle.result(TIMEOUT).outputs[0].finish_reason in ("stop", "length")


def test_stop_aborts_in_flight_requests_and_joins(llm: LLM, prompts: list[list[int]]) -> None:
    loop = EngineLoop(llm.engine).start()
    running = [loop.submit(p, LONG, stream=True) for p in prompts[:3]]
    first_snapshot(running[0])
    queued = loop.submit(prompts[3], LONG)
    loop.stop()

    for handle in [*running, queued]:
        assert handle.done()  # stop() returns only once every caller has its answer
        assert handle.result().outputs[0].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit(prompts[0], GREEDY)
    assert loop.num_in_flight == 0
    assert_idle(llm)


def test_build_constructs_the_engine_on_the_loop_thread_and_raises_its_errors(llm: LLM, prompts: list[list[int]]) -> None:
    built_on: list[str] = []

    def make_engine():
        built_on.append(threading.current_thread().name)
        return llm.engine

    loop = EngineLoop.build(make_engine)
    try:
        assert built_on == ["engine-loop"]
        assert loop.submit(prompts[0], GREEDY).result(TIMEOUT).outputs[0].finish_reason in ("stop", "length")
    finally:
        loop.stop()
    assert_idle(llm)

    def broken() -> None:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        EngineLoop.build(broken)


class IdleEngineThatDies:
    """An idle LLMEngine's face to the loop, until `die()`: then its health check raises RankFailure, as a sharded
    engine's does once its watchdog has seen a rank exit."""

    def __init__(self) -> None:
        self.dead = threading.Event()

    def has_unfinished_requests(self) -> bool:
        return False

    def check_health(self) -> None:
        if self.dead.is_set():
            raise RankFailure("tensor-parallel rank 1 (pid 4242) exited with code -9")

    def close(self) -> None:
        pass


def test_an_engine_that_fails_while_idle_ends_the_loop_and_fails_every_later_call(monkeypatch) -> None:
    monkeypatch.setattr(engine.engine_loop, "HEALTH_CHECK_SECONDS", 0.01)
    dying = IdleEngineThatDies()
    failures: list[EngineFailed] = []
    loop = EngineLoop(dying, on_failure=failures.append).start()  # type: ignore[arg-type]
    dying.dead.set()
    loop._thread.join(TIMEOUT)
    assert not loop._thread.is_alive()
    assert isinstance(loop.failure, RankFailure) and failures == [loop.failure]
    with pytest.raises(EngineFailed, match="rank 1 .* exited"):
        loop.submit([1, 2, 3], GREEDY)
    with pytest.raises(EngineFailed, match="rank 1 .* exited"):
        loop.stats()
    loop.stop()
