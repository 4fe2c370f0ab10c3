"""The job kinds (`jobs.run.kinds`) on their own: each turns a chunk's accepted lines into a `ChunkResult`, with the
real SmolLM2 engine, the real embedding model, Redis stop flags and S3, and no pipeline, Celery or database."""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
from redis import Redis

from engine.admission import EngineFailed
from engine.detokenizer import IncrementalDetokenizer
from engine.embedder import Embedder
from engine.engine_loop import EngineLoop, RequestHandle
from engine.llm_engine import LLMEngine
from engine.model_registry import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from engine.outputs import RequestOutput
from engine.request_state import Request
from engine.sequence import Sequence
from engine.tensor_parallel import RankFailure
from jobs.lazy_embedder import LazyEmbedder
from jobs.models import Batch
from jobs.object_keys import chunk_output_key
from jobs.rag.kind import RagKind
from jobs.rag.processing import RagOptions
from jobs.run.embeddings import EmbeddingsKind
from jobs.run.generation import STOP_POLL_SECONDS, GenerationKind
from jobs.run.kinds import ChunkResult, EngineHandle, FinishedChunks
from jobs.run.split import RejectedLine, ValidationTally
from jobs.served_models import ModelNames, process_models
from jobs.settings import S3Settings, Settings
from jobs.stop_flags import StopFlags, StopReason
from jobs.storage import ObjectStore

pytestmark = pytest.mark.slow  # loads SmolLM2 and the embedding model

LIMITS = Settings().batch_limits()


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineHandle]:
    loop = EngineLoop.build(lambda: LLMEngine(DEFAULT_MODEL, dtype="float32", device="cpu"))
    assert loop.engine.tokenizer is not None
    served = ModelNames(process_models([loop.engine.model_name], DEFAULT_EMBEDDING_MODEL), {})
    yield EngineHandle(
        loop,
        loop.engine.tokenizer,
        loop.engine.max_model_len,
        loop.engine.model_name,
        served,
        loop.engine.admission_limits,
    )
    loop.stop()


@pytest.fixture
def stop_flags() -> Iterator[StopFlags]:
    redis = Redis.from_url("redis://127.0.0.1:6379/0")
    yield StopFlags(redis, f"test-kinds-{secrets.token_hex(4)}:")
    redis.close()


def batch(endpoint: str, project_id: str = "proj_kinds") -> Batch:
    return Batch(id=f"batch_{secrets.token_hex(6)}", project_id=project_id, endpoint=endpoint, priority=0)


def line(custom_id: str, url: str, body: dict[str, Any]) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode()


def jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(row) for row in data.splitlines()]


def test_generation_answers_every_line(engine: EngineHandle, stop_flags: StopFlags, object_store: ObjectStore) -> None:
    kind = GenerationKind(engine, object_store, stop_flags, per_chunk=10, limits=LIMITS)
    job = batch("/v1/completions")
    lines = [
        (1, line("a", "/v1/completions", {"model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 4})),
        (3, line("b", "/v1/completions", {"model": DEFAULT_MODEL, "prompt": ["One, two,", "Red, green,"],
                                          "max_tokens": 3, "temperature": 0, "ignore_eos": True})),
    ]
    result = kind.run_chunk(job, 0, lines)
    assert (result.completed, result.failed, result.errors) == (2, 0, b"")
    answers = jsonl(result.output)
    assert [answer["custom_id"] for answer in answers] == ["a", "b"]
    two_prompts = answers[1]["response"]["body"]  # one engine request per prompt, one choice each
    assert [choice["index"] for choice in two_prompts["choices"]] == [0, 1]
    assert two_prompts["usage"]["completion_tokens"] == 6


PER_REQUEST = (Sequence, Request, IncrementalDetokenizer, RequestHandle, RequestOutput)


def live_per_request_objects() -> dict[str, int]:
    gc.collect()
    found: dict[str, int] = {}
    for thing in gc.get_objects():
        if type(thing) in PER_REQUEST:  # not isinstance: some of torch's module objects warn when asked
            found[type(thing).__name__] = found.get(type(thing).__name__, 0) + 1
    return found


def test_a_finished_chunk_leaves_no_request_state_behind(
    engine: EngineHandle, stop_flags: StopFlags, object_store: ObjectStore
) -> None:
    """Worker memory (issue 32): a chunk's sequences, requests, detokenizers, handles and outputs are freed when it
    ends, chunk after chunk, so a worker's Python heap does not grow with the requests it has served (what it keeps
    is the KV pool, bounded by the block manager, and malloc's free pages, trimmed after every chunk). One of a kind
    may outlive its chunk until the next: the loop thread's last command (a handle and its output) and the
    scheduler's last head of the queue (a sequence)."""
    kind = GenerationKind(engine, object_store, stop_flags, per_chunk=8, limits=LIMITS)
    body = {"model": DEFAULT_MODEL, "max_tokens": 2, "temperature": 0.5, "n": 2, "logprobs": True}
    for repeat in range(2):
        lines = [
            (number, line(f"r{repeat}-{number}", "/v1/chat/completions",
                          {**body, "messages": [{"role": "user", "content": f"Count to {number} ({repeat})."}]}))
            for number in range(1, 5)
        ]
        result = kind.run_chunk(batch("/v1/chat/completions"), 0, lines)
        assert (result.completed, result.failed) == (4, 0), result.errors
        left = live_per_request_objects()  # a leak would keep a chunk's 4 requests' (8 sequences') worth
        assert all(count <= 1 for count in left.values()), f"after chunk {repeat + 1}: {left}"

def test_generation_checks_lines_for_validate(engine: EngineHandle, stop_flags: StopFlags, object_store: ObjectStore) -> None:
    lines = GenerationKind(engine, object_store, stop_flags, per_chunk=10, limits=LIMITS).input_lines(batch("/v1/completions"))
    assert lines.per_chunk == 10
    assert lines.check(1, line("a", "/v1/completions", {"model": DEFAULT_MODEL, "prompt": "hi"})) == "a"
    rejected = lines.check(2, line("a", "/v1/completions", {"model": DEFAULT_MODEL, "prompt": "hi"}))
    assert isinstance(rejected, RejectedLine) and rejected.message.startswith("line 2: ") and not rejected.not_json
    assert json.loads(rejected.record)["error"]["code"] == "duplicate_custom_id"
    not_json = lines.check(3, b"not json")
    assert isinstance(not_json, RejectedLine) and not_json.not_json
    expired = json.loads(lines.expired_record("z"))
    assert expired["custom_id"] == "z" and expired["error"]["code"] == "batch_expired"


def test_generation_stops_on_the_batch_flag(engine: EngineHandle, stop_flags: StopFlags, object_store: ObjectStore) -> None:
    kind = GenerationKind(engine, object_store, stop_flags, per_chunk=10, limits=LIMITS)
    job = batch("/v1/completions")
    stop_flags.raise_flag(job.id, StopReason.expired)
    body = {"model": DEFAULT_MODEL, "prompt": "Write a long story about a lighthouse.", "max_tokens": 400, "ignore_eos": True}
    result = kind.run_chunk(job, 0, [(1, line("long", "/v1/completions", body))])
    assert (result.completed, result.failed, result.output) == (0, 1, b"")
    assert jsonl(result.errors)[0]["error"]["code"] == "batch_expired"


def test_a_stop_does_not_wait_for_the_engine_step_in_progress(
    engine: EngineHandle, stop_flags: StopFlags, object_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of thousands of prefill tokens takes seconds on a CPU, tens on a loaded one (bench: 20 s for 8,192
    tokens on 2 busy AVX512-BF16 cores); the chunk of a cancelled batch returns without waiting for its end."""
    long_step_s = 6.0
    real_step = engine.loop.engine.step
    stepping = threading.Event()

    def long_step() -> list[Any]:
        stepping.set()
        time.sleep(long_step_s)
        return real_step()

    monkeypatch.setattr(engine.loop.engine, "step", long_step)
    kind = GenerationKind(engine, object_store, stop_flags, per_chunk=10, limits=LIMITS)
    job = batch("/v1/completions")
    body = {"model": DEFAULT_MODEL, "prompt": "Write a long story about a lighthouse.", "max_tokens": 400, "ignore_eos": True}
    results: list[ChunkResult] = []
    chunk = threading.Thread(target=lambda: results.append(kind.run_chunk(job, 0, [(1, line("long", "/v1/completions", body))])))
    chunk.start()
    assert stepping.wait(60)
    stop_flags.raise_flag(job.id, StopReason.cancelled)
    raised = time.monotonic()
    chunk.join(60)
    took = time.monotonic() - raised
    assert results and (results[0].completed, results[0].failed, results[0].output) == (0, 0, b"")  # no line
    assert took < STOP_POLL_SECONDS + 2.0 < long_step_s, took
    # The engine drops the request at the end of that step: nothing is left running for the next test.
    deadline = time.monotonic() + 60
    while engine.loop.num_in_flight or engine.loop.engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.1)


class FailedEngineLoop:
    """An EngineLoop whose engine failed while the chunk's requests ran: each fails with the engine's error."""

    def submit(self, prompt_token_ids, params, request_id=None, priority=0, stream=False, images=()) -> RequestHandle:
        handle = RequestHandle(request_id, stream)
        handle._fail(RankFailure("a tensor-parallel step failed: tensor-parallel rank 1 (pid 4242) exited with code -9"))
        return handle

    def abort(self, request_id: str) -> None:
        pass


def test_generation_fails_the_whole_chunk_when_the_engine_fails(
    engine: EngineHandle, stop_flags: StopFlags, object_store: ObjectStore
) -> None:
    """Not one error record per line: the lines are not at fault and must run again elsewhere, so the chunk records
    nothing (jobs/tasks.py gives its message back to the queue)."""
    kind = GenerationKind(dataclasses.replace(engine, loop=FailedEngineLoop()), object_store, stop_flags, per_chunk=10, limits=LIMITS)
    body = {"model": DEFAULT_MODEL, "prompt": "One, two,", "max_tokens": 3}
    with pytest.raises(EngineFailed, match="rank 1"):
        kind.run_chunk(batch("/v1/completions"), 0, [(1, line("a", "/v1/completions", body))])


def test_image_lines_are_read_from_the_projects_inbox_and_fail_alone(
    engine: EngineHandle, stop_flags: StopFlags, object_store: ObjectStore
) -> None:
    """The default model reads text only: an image line is read in full (from the project's own inbox in the store,
    nowhere else), then fails with model_not_multimodal, or with its image's own code; the text line beside it runs."""
    from PIL import Image

    from jobs.object_keys import inbox_key

    def png(size: tuple[int, int]) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", size, (1, 2, 3)).save(out, format="PNG")
        return out.getvalue()

    job = batch("/v1/chat/completions", project_id=f"proj_{secrets.token_hex(4)}")
    settings = object_store.settings
    object_store.put_bytes(inbox_key(job.project_id, "cat.png"), png((16, 16)))
    object_store.put_bytes(inbox_key(job.project_id, "strip.png"), png((1, 5000)))
    object_store.put_bytes(inbox_key("proj_other", "cat.png"), png((16, 16)))

    def image_line(custom_id: str, key: str) -> bytes:
        uri = f"s3://{settings.bucket}/{settings.prefix}{key}"
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": uri}}]
        return line(custom_id, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 2})

    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
    lines = [
        (1, image_line("own", inbox_key(job.project_id, "cat.png"))),
        (2, image_line("other-project", inbox_key("proj_other", "cat.png"))),
        (3, image_line("absent", inbox_key(job.project_id, "dog.png"))),
        (4, image_line("strip", inbox_key(job.project_id, "strip.png"))),
        (5, line("text", "/v1/chat/completions", chat)),
    ]
    result = GenerationKind(engine, object_store, stop_flags, per_chunk=10, limits=LIMITS).run_chunk(job, 0, lines)
    assert (result.completed, result.failed) == (1, 4)
    assert jsonl(result.output)[0]["custom_id"] == "text"
    errors = {record["custom_id"]: record["error"] for record in jsonl(result.errors)}
    assert {custom_id: error["code"] for custom_id, error in errors.items()} == {
        "own": "model_not_multimodal",
        "other-project": "image_fetch_failed",
        "absent": "image_fetch_failed",
        "strip": "image_too_large",
    }
    assert f"'{DEFAULT_MODEL}' reads text only" in errors["own"]["message"]
    assert "outside this project's inbox" in errors["other-project"]["message"]


def test_embeddings_answer_a_chunk_in_one_call(engine: EngineHandle, object_store: ObjectStore) -> None:
    embedder = LazyEmbedder(DEFAULT_EMBEDDING_MODEL, lambda: Embedder(DEFAULT_EMBEDDING_MODEL, dtype="float32", device="cpu"))
    kind = EmbeddingsKind(engine, object_store, embedder, per_chunk=10, limits=LIMITS)
    body = {"model": DEFAULT_EMBEDDING_MODEL, "input": ["a lighthouse", "a harbour"]}
    bad = {"model": DEFAULT_EMBEDDING_MODEL, "input": ["x"], "dimensions": 7}  # not the model's dimension: only this line fails
    result = kind.run_chunk(
        batch("/v1/embeddings"), 0, [(1, line("e", "/v1/embeddings", body)), (2, line("f", "/v1/embeddings", bad))]
    )
    assert (result.completed, result.failed) == (1, 1)
    assert len(jsonl(result.output)[0]["response"]["body"]["data"]) == 2


def test_openai_outputs_compose_into_one_file(engine: EngineHandle, stop_flags: StopFlags, object_store: ObjectStore) -> None:
    kind = GenerationKind(engine, object_store, stop_flags, per_chunk=10, limits=LIMITS)
    job = batch("/v1/completions")
    keys = [chunk_output_key(job.id, index) for index in range(2)]
    object_store.put_bytes(keys[0], b'{"custom_id": "a"}\n')
    object_store.put_bytes(keys[1], b'{"custom_id": "b"}\n')
    file = kind.output_file(FinishedChunks(job, keys, stop_reason=None), f"file-{secrets.token_hex(6)}")
    assert file.filename == f"{job.id}_output.jsonl" and file.bytes == 38
    assert object_store.read_bytes(file.object_key) == b'{"custom_id": "a"}\n{"custom_id": "b"}\n'
    assert kind.report_files(FinishedChunks(job, keys, None), failed=0, output_file_id=file.id, error_file_id=None) == []


def test_rag_lines_are_documents_of_the_projects_inbox(engine: EngineHandle, stop_flags: StopFlags, object_store: ObjectStore) -> None:
    settings = Settings(s3=S3Settings(bucket="docs"), rag_documents_per_chunk=4)
    embedder = LazyEmbedder(DEFAULT_EMBEDDING_MODEL, lambda: Embedder(DEFAULT_EMBEDDING_MODEL))
    kind = RagKind(settings=settings, store=object_store, stop_flags=stop_flags, engine=engine, embedder=embedder)
    lines = kind.input_lines(batch("/v1/rag/jobs", project_id="proj_a"))
    assert lines.per_chunk == 4
    # A job reading PDFs as pages fails whole on a worker whose model reads no images (SmolLM2).
    pages = batch("/v1/rag/jobs")
    pages.rag_options = RagOptions(pdf_mode="pages").to_json()
    refused = kind.input_lines(pages).refusal(ValidationTally())
    assert refused is not None and refused[0] == "model_not_multimodal"
    assert lines.refusal(ValidationTally()) is None
    assert lines.check(1, b'{"id": "d1", "text": "hello"}') == "d1"
    assert lines.check(2, b'{"id": "d2", "uri": "s3://docs/inbox/proj_a/notes.md"}') == "d2"
    repeated = lines.check(3, b'{"id": "d1", "text": "again"}')
    assert isinstance(repeated, RejectedLine) and json.loads(repeated.record)["error"]["code"] == "duplicate_document_id"
    outside = lines.check(4, b'{"id": "d3", "uri": "s3://docs/inbox/proj_b/notes.md"}')
    assert isinstance(outside, RejectedLine) and json.loads(outside.record)["error"]["code"] == "uri_outside_inbox"
    # A line refused whole still names its document, when it gave an id.
    for number, refused in enumerate([b'{"id": "d4", "uri": "http://example.com/a"}', b'{"id": "d5", "uri": "file:///etc/passwd"}'], 5):
        record = json.loads(cast(RejectedLine, lines.check(number, refused)).record)
        assert (record["doc_id"], record["error"]["code"]) == (f"d{number - 1}", "invalid_document")


def test_image_lines_run_on_a_vision_model_a_window_at_a_time(
    llava_folder: Any, stop_flags: StopFlags, object_store: ObjectStore
) -> None:
    """A worker whose engine reads images (a tiny LLaVA-1.5) runs a chunk's image lines beside its text lines, one
    image line in flight at a time (`lines_in_flight=1`): the same image and text answer alike, another image
    otherwise, and usage counts each image's 16 placeholders. A batch stopped while image lines wait their turn
    answers the waiting ones as expired, never submitted."""
    import base64

    from jobs.images.inputs import ImageLimits
    from bench.vision_models import image

    def data_url(seed: int) -> str:
        out = io.BytesIO()
        image(seed, 40, 33).save(out, format="PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()

    def image_line(custom_id: str, seed: int) -> bytes:
        content = [{"type": "text", "text": "describe this picture"}, {"type": "image_url", "image_url": {"url": data_url(seed)}}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "min_tokens": 4, "temperature": 0}
        return line(custom_id, "/v1/chat/completions", body)

    loop = EngineLoop.build(lambda: LLMEngine(str(llava_folder), dtype="float32", device="cpu"))
    try:
        assert loop.engine.tokenizer is not None and loop.engine.accepts_images
        served = ModelNames(process_models([loop.engine.model_name], DEFAULT_EMBEDDING_MODEL, accepts_images=True), {})
        handle = EngineHandle(
            loop, loop.engine.tokenizer, loop.engine.max_model_len, loop.engine.model_name, served,
            loop.engine.admission_limits,
        )
        kind = GenerationKind(
            handle, object_store, stop_flags, per_chunk=10, limits=LIMITS, image_limits=ImageLimits(lines_in_flight=1)
        )
        said = {"messages": [{"role": "user", "content": "describe this picture"}], "max_tokens": 4}
        text = line("text", "/v1/chat/completions", said)
        lines = [(1, image_line("a", 1)), (2, text), (3, image_line("b", 2)), (4, image_line("a-again", 1))]
        job = batch("/v1/chat/completions")
        result = kind.run_chunk(job, 0, lines)
        assert (result.completed, result.failed) == (4, 0), result.errors
        bodies = {record["custom_id"]: record["response"]["body"] for record in jsonl(result.output)}
        answer = {custom_id: body["choices"][0]["message"]["content"] for custom_id, body in bodies.items()}
        assert answer["a"] == answer["a-again"] != answer["b"]
        text_prompt = bodies["text"]["usage"]["prompt_tokens"]
        assert bodies["a"]["usage"]["prompt_tokens"] == text_prompt + 16  # the same words and the image's placeholders

        stopped = batch("/v1/chat/completions")
        stop_flags.raise_flag(stopped.id, StopReason.expired)
        result = kind.run_chunk(stopped, 0, lines)
        expired = {record["custom_id"]: record["error"]["code"] for record in jsonl(result.errors)}
        assert set(expired.values()) == {"batch_expired"} and {"b", "a-again"} <= set(expired)  # never submitted
        assert result.completed + result.failed == 4  # "a" and "text" may finish before the flag is read
    finally:
        loop.stop()
