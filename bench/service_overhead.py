"""Service overhead: one batch file through the whole service vs the same file through `conveyor run`, same run.

Workload: `--requests` short chat requests (default 1,000), deterministic from `--seed`: a few question
templates over a list of topics, one in four with a system message, `--max-tokens` (default 16) each,
temperature 0. Both sides use the same model, dtype, engine options and torch thread count.

- offline: `engine.LLM` loaded in this process (load time excluded, and one tiny warm-up request), then
  `run_batch_file` on the file: validation, one `generate` over every request, writing the results.
- service: SeaweedFS, PostgreSQL, Redis, an API process and a worker process (`bench.service_stack`). The worker
  loads its model and runs a one-line warm-up batch through the whole path before the clock starts. Timed: from
  `files.create` (upload) through `batches.create`, polling `batches.retrieve` every `--poll-interval` s until
  the batch completes, to downloading the output file. The engine runs in the worker process with the same
  thread count; this process only uploads, polls and downloads.

The offline model is freed before the service starts (`--order` picks which runs first), so the two never hold
memory at once. The headline is service wall time / offline wall time. A timeline from the batch's own
timestamps (read from PostgreSQL at full precision) shows where the service's extra time goes.

    python -m bench.service_overhead --requests 1000 --max-tokens 16
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import openai
import torch
from sqlalchemy import select

from bench.common import markdown_table, ratio, run_cli
from bench.service_stack import service_stack
from conveyor.run_file import run_batch_file
from engine import LLM, SamplingParams
from engine.model_registry import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from jobs import db
from jobs.models import Batch, Chunk
from jobs.served_models import ModelNames, process_models
from jobs.settings import Settings

TARGET_RATIO = 1.10
CHAT: Final = "/v1/chat/completions"

_TOPICS = (
    "the ocean", "volcanoes", "honeybees", "the moon", "bicycles", "jazz", "glaciers", "coffee", "libraries",
    "lighthouses", "owls", "rainforests", "chess", "trains", "deserts", "octopuses", "bread", "thunderstorms",
    "maps", "gardens", "penguins", "bridges", "telescopes", "autumn", "rivers", "clocks", "mushrooms", "kites",
)
_QUESTIONS = (
    "Write one sentence about {topic} number {i}.",
    "Give me one fun fact about {topic}. (request {i})",
    "In a few words, why do people like {topic}? #{i}",
    "Describe {topic} to a child in one sentence. Item {i}.",
    "Write a haiku about {topic}, variation {i}.",
    "What is the most surprising thing about {topic}? Answer briefly ({i}).",
)
_SYSTEM = "You are a concise assistant. Answer in one short sentence."


def make_batch_file(requests: int, max_tokens: int, seed: int) -> bytes:
    rng = random.Random(seed)
    lines = []
    for i in range(requests):
        messages = [{"role": "user", "content": rng.choice(_QUESTIONS).format(topic=rng.choice(_TOPICS), i=i)}]
        if rng.random() < 0.25:
            messages.insert(0, {"role": "system", "content": _SYSTEM})
        body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        lines.append(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": CHAT, "body": body}))
    return ("\n".join(lines) + "\n").encode()


@dataclass(frozen=True)
class ModeResult:
    name: str
    seconds: float
    outputs: list[dict[str, Any]]  # the output file's lines

    @property
    def output_tokens(self) -> int:
        return sum(line["response"]["body"]["usage"]["completion_tokens"] for line in self.outputs if line["response"])

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    def texts(self) -> dict[str, str]:
        return {
            line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"]
            for line in self.outputs
            if line["response"]
        }


@dataclass(frozen=True)
class Timeline:
    """Wall-clock instants (time.time()) of one service batch: the client's and the batch row's."""

    upload_start: float
    uploaded: float
    created: float  # batches.create returned
    completed_seen: float  # the poll that saw "completed" returned
    downloaded: float
    polls: int
    server: dict[str, float]  # created_at, in_progress_at, finalizing_at, completed_at
    chunks_finished: list[float] = field(default_factory=list)  # by chunk index

    def phases(self) -> list[tuple[str, float, float]]:
        s = self.server
        first_chunk, last_chunk = min(self.chunks_finished), max(self.chunks_finished)
        return [
            ("upload (files.create)", self.upload_start, self.uploaded),
            ("batches.create request", self.uploaded, self.created),
            ("validate (created -> in_progress)", s["created_at"], s["in_progress_at"]),
            ("  in_progress -> first chunk done", s["in_progress_at"], first_chunk),
            ("  first -> last chunk done", first_chunk, last_chunk),
            ("  last chunk done -> finalizing", last_chunk, s["finalizing_at"]),
            ("run chunks (in_progress -> finalizing)", s["in_progress_at"], s["finalizing_at"]),
            ("finalize (finalizing -> completed)", s["finalizing_at"], s["completed_at"]),
            ("poll lag (completed -> seen)", s["completed_at"], self.completed_seen),
            ("download output", self.completed_seen, self.downloaded),
            ("total", self.upload_start, self.downloaded),
        ]


def run_offline(args: argparse.Namespace, input_path: Path, folder: Path) -> ModeResult:
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device)
    print(f"offline: model loaded in {time.perf_counter() - started:.1f} s (not timed)", flush=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    output_path = folder / "offline_output.jsonl"
    start = time.perf_counter()
    models = ModelNames(process_models([llm.model_name], DEFAULT_EMBEDDING_MODEL), {})
    summary = run_batch_file(input_path, output_path, llm, progress=False, models=models)
    seconds = time.perf_counter() - start
    assert summary.failed == 0 and summary.succeeded == args.requests, f"offline run had failures: {summary}"
    del llm
    gc.collect()
    outputs = [json.loads(line) for line in output_path.read_text().splitlines()]
    print(f"offline: {seconds:.1f} s", flush=True)
    return ModeResult("offline (conveyor run)", seconds, outputs)


def run_service(args: argparse.Namespace, data: bytes) -> tuple[ModeResult, Timeline]:
    started = time.perf_counter()
    with service_stack(with_worker=True, torch_threads=args.threads, **_service_settings(args)) as stack:
        print(f"service: stack up, worker ready in {time.perf_counter() - started:.1f} s (not timed)", flush=True)
        client = openai.OpenAI(api_key=stack.api_key, base_url=stack.base_url, max_retries=0, timeout=120)
        _run_batch(client, make_batch_file(1, 2, args.seed), args.poll_interval)  # warm-up, whole path
        start = time.perf_counter()
        outputs, timeline, batch_id = _run_batch(client, data, args.poll_interval)
        seconds = time.perf_counter() - start
        timeline = _with_server_times(stack.settings, batch_id, timeline)
        print(f"service: {seconds:.1f} s", flush=True)
    return ModeResult("service (API + worker)", seconds, outputs), timeline


def _service_settings(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "device": args.device}
    if args.chunk_size is not None:
        settings["chunk_size"] = args.chunk_size
    if args.worker_concurrency is not None:
        settings["worker_concurrency"] = args.worker_concurrency
    return settings


def _run_batch(client: openai.OpenAI, data: bytes, poll_interval: float) -> tuple[list[dict[str, Any]], Timeline, str]:
    upload_start = time.time()
    input_file = client.files.create(file=("bench.jsonl", data), purpose="batch")
    uploaded = time.time()
    batch = client.batches.create(input_file_id=input_file.id, endpoint=CHAT, completion_window="24h")
    created = time.time()
    polls = 0
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(poll_interval)
        batch = client.batches.retrieve(batch.id)
        polls += 1
    completed_seen = time.time()
    assert batch.status == "completed", f"batch ended {batch.status}: {batch.errors}"
    assert batch.output_file_id is not None
    content = client.files.content(batch.output_file_id).text
    downloaded = time.time()
    outputs = [json.loads(line) for line in content.splitlines() if line]
    expected = [json.loads(line)["custom_id"] for line in data.decode().splitlines()]
    counts = Counter(line["custom_id"] for line in outputs)
    missing = [c for c in expected if counts[c] == 0]
    repeated = [c for c, n in counts.items() if n > 1]
    assert not missing and not repeated and len(counts) == len(expected), (
        f"{len(missing)} custom_ids missing, {len(repeated)} repeated, {len(set(counts) - set(expected))} unknown"
    )
    assert batch.error_file_id is None, f"the batch has an error file: {batch.request_counts}"
    timeline = Timeline(upload_start, uploaded, created, completed_seen, downloaded, polls, server={})
    return outputs, timeline, batch.id


def _with_server_times(settings: Settings, batch_id: str, timeline: Timeline) -> Timeline:
    engine = db.make_engine(settings.database_url, pool_size=1)
    try:
        with db.make_session_factory(engine)() as session:
            batch = session.get(Batch, batch_id)
            assert batch is not None
            stamps: dict[str, datetime | None] = {
                name: getattr(batch, name) for name in ("created_at", "in_progress_at", "finalizing_at", "completed_at")
            }
            finished = session.scalars(select(Chunk.finished_at).where(Chunk.batch_id == batch_id).order_by(Chunk.index)).all()
    finally:
        engine.dispose()
    server = {name: stamp.timestamp() for name, stamp in stamps.items() if stamp is not None}
    chunks = [stamp.timestamp() for stamp in finished if stamp is not None]
    return dataclasses.replace(timeline, server=server, chunks_finished=chunks)


def format_table(results: list[ModeResult], baseline: ModeResult) -> str:
    headers = ["mode", "seconds", "requests", "output tokens", "tok/s", "vs offline (time)"]
    rows = [
        [r.name, f"{r.seconds:.2f}", len(r.outputs), r.output_tokens, f"{r.tokens_per_second:.1f}", ratio(r.seconds, baseline.seconds)]
        for r in results
    ]
    return markdown_table(headers, rows)


def format_timeline(timeline: Timeline) -> str:
    rows = [[name, f"{end - start:.2f}"] for name, start, end in timeline.phases()]
    return markdown_table(["service phase", "seconds"], rows)


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, here and in the worker")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--poll-interval", type=float, default=0.2, help="seconds between batches.retrieve calls")
    parser.add_argument("--chunk-size", type=int, help=f"requests per chunk (default: {Settings.chunk_size})")
    parser.add_argument("--worker-concurrency", type=int, help="chunks a worker runs at once (default: automatic)")
    parser.add_argument("--order", choices=["offline-first", "service-first"], default="offline-first")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = make_batch_file(args.requests, args.max_tokens, args.seed)
    print(
        f"model={args.model} dtype={args.dtype} device={args.device} requests={args.requests} "
        f"max-tokens={args.max_tokens} threads={torch.get_num_threads()} (worker: OMP_NUM_THREADS={args.threads}) "
        f"chunk-size={args.chunk_size or Settings.chunk_size} worker-concurrency={args.worker_concurrency or 'auto'} "
        f"poll-interval={args.poll_interval}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as tmp:
        folder = Path(tmp)
        input_path = folder / "input.jsonl"
        input_path.write_bytes(data)
        if args.order == "offline-first":
            offline = run_offline(args, input_path, folder)
            service, timeline = run_service(args, data)
        else:
            service, timeline = run_service(args, data)
            offline = run_offline(args, input_path, folder)

    print()
    print(format_table([offline, service], baseline=offline))
    print()
    print(format_timeline(timeline))
    print()
    offline_texts, service_texts = offline.texts(), service.texts()
    same = sum(service_texts.get(custom_id) == text for custom_id, text in offline_texts.items())
    print(f"outputs identical to offline: {same}/{len(offline_texts)}; polls: {timeline.polls}")
    achieved = service.seconds / offline.seconds
    verdict = "met" if achieved <= TARGET_RATIO else "NOT met"
    print(f"service / offline wall time: {achieved:.2f}x (target <= {TARGET_RATIO:.2f}x): {verdict}")


if __name__ == "__main__":
    main()
