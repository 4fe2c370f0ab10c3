"""One tenant's poison beside another tenant's normal batch, on one worker (the shared stack: a real API and worker
on SmolLM2, PostgreSQL, Redis, SeaweedFS).

The poison batch holds a line of every class that used to hurt others: a huge `n`, JSON nested 100,000 levels
deep, a lone surrogate in a custom_id, a 50 MB line; the same tenant runs a RAG job whose document URI the object
store refuses (a backslash in its key), and cancels a batch while it validates. The other tenant's batch completes
with every result; every poison job reaches a terminal state within `TERMINAL_WITHIN_S`, each bad line answered by
its own error; and the worker's memory after the 50 MB line stays within `RSS_GROWTH_BOUND_BYTES` of what it was
before (its line reader never holds more than the line limit, 16 MiB, and a read block).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import psutil
import pytest

from jobs.object_keys import inbox_key
from tests.api.test_batch_service import chat_line, client_for, jsonl, read_jsonl, wait_for
from tests.stack_fixtures import Stack

pytestmark = pytest.mark.slow

TERMINAL_WITHIN_S = 300.0
RSS_GROWTH_BOUND_BYTES = 256 * 1024 * 1024  # the line limit and read blocks, and the allocator's slack
NORMAL_REQUESTS = 24
HUGE_LINE_BYTES = 50 * 1000 * 1000
TERMINAL = ("completed", "failed", "cancelled", "expired")


def worker_rss(stack: Stack) -> int:
    assert stack.worker is not None
    process = psutil.Process(stack.worker.process.pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def poison_lines() -> list[dict[str, Any] | str]:
    deep = "[" * 100_000 + "]" * 100_000
    return [
        chat_line("good-1", "Say hi."),
        chat_line("huge-n", "Say hi.", n=10**9, temperature=1.0),
        '{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": ' + deep + "}}",
        '{"custom_id": "\\ud800", "method": "POST", "url": "/v1/chat/completions", '
        '"body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}',
        json.dumps(chat_line("huge-line", "x" * HUGE_LINE_BYTES)),
        chat_line("good-2", "Say bye."),
    ]


def test_a_poison_batch_reaches_a_terminal_state_and_hurts_no_other_tenant(stack: Stack) -> None:
    normal = client_for(stack, stack.new_key("poison-neighbour"))
    poisoner = client_for(stack, stack.new_key("poisoner"))
    poisoner_http = httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {poisoner.api_key}"}, timeout=120
    )

    def normal_batch(prefix: str) -> str:
        lines = [chat_line(f"{prefix}-{i}", f"Name a colour. ({i})") for i in range(NORMAL_REQUESTS)]
        upload = normal.files.create(file=("normal.jsonl", jsonl(lines)), purpose="batch")
        return normal.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id

    warm = wait_for(normal, normal_batch("warm"))  # the worker at its working size: model loaded, engine warm
    assert warm.status == "completed"
    rss_before = worker_rss(stack)

    # --- the poison, all at once, beside the neighbour's batch
    poison_file = poisoner.files.create(file=("poison.jsonl", jsonl(poison_lines())), purpose="batch")
    poison = poisoner.batches.create(
        input_file_id=poison_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    bucket_root = f"s3://{stack.settings.s3.bucket}/{stack.settings.s3.prefix}"
    refused_key = inbox_key(project_of(stack, poisoner), "docs\\..\\secret.md")  # SeaweedFS: 400 InvalidRequest
    documents = [
        {"id": "refused", "uri": f"{bucket_root}{refused_key}"},
        {"id": "fine", "text": "A short document that is fine."},
    ]
    rag_file = poisoner.files.create(file=("docs.jsonl", jsonl(documents)), purpose="batch")
    rag_job = poisoner_http.post("/rag/jobs", json={"input_file_id": rag_file.id})
    assert rag_job.status_code == 200, rag_job.text
    cancelled_file = poisoner.files.create(file=("c.jsonl", jsonl([chat_line("c", "Hi")])), purpose="batch")
    to_cancel = poisoner.batches.create(
        input_file_id=cancelled_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    poisoner.batches.cancel(to_cancel.id)
    neighbour = normal_batch("beside")

    # --- the neighbour gets every result
    done = wait_for(normal, neighbour, timeout_s=TERMINAL_WITHIN_S)
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == NORMAL_REQUESTS and done.request_counts.failed == 0
    answered = {record["custom_id"] for record in read_jsonl(normal, done.output_file_id)}
    assert answered == {f"beside-{i}" for i in range(NORMAL_REQUESTS)}

    # --- every poison job ends, each bad line with its own error
    started = time.monotonic()
    settled = wait_for(poisoner, poison.id, timeout_s=TERMINAL_WITHIN_S)
    assert settled.status == "completed", settled
    assert settled.request_counts is not None
    assert (settled.request_counts.completed, settled.request_counts.failed) == (2, 4)
    errors = {
        record["error"]["message"].split(":")[0]: (record["custom_id"], record["error"]["code"])
        for record in read_jsonl(poisoner, settled.error_file_id)
    }
    assert errors == {
        "line 2": ("huge-n", "request_too_large"),
        "line 3": (None, "invalid_line"),  # nested too deeply to read, custom_id included
        "line 4": (None, "invalid_line"),  # the lone surrogate
        "line 5": (None, "request_too_large"),  # the 50 MB line, refused unread
    }
    assert {record["custom_id"] for record in read_jsonl(poisoner, settled.output_file_id)} == {"good-1", "good-2"}
    assert wait_for(poisoner, to_cancel.id, timeout_s=TERMINAL_WITHIN_S).status == "cancelled"
    deadline = time.monotonic() + TERMINAL_WITHIN_S - (time.monotonic() - started)
    while (job := poisoner_http.get(f"/rag/jobs/{rag_job.json()['id']}").json())["status"] not in TERMINAL:
        assert time.monotonic() < deadline, job
        time.sleep(1)
    assert job["status"] == "completed" and job["request_counts"] == {"total": 2, "completed": 1, "failed": 1}, job
    rag_errors = [json.loads(line) for line in poisoner.files.content(job["error_file_id"]).text.splitlines()]
    assert [(e["doc_id"], e["error"]["code"]) for e in rag_errors] == [("refused", "unreadable_document")]

    rss_after = worker_rss(stack)
    assert rss_after - rss_before < RSS_GROWTH_BOUND_BYTES, (
        f"worker grew {(rss_after - rss_before) / 2**20:.0f} MiB over the poison"
    )


def project_of(stack: Stack, client: openai.OpenAI) -> str:
    """The project id behind a client's key (inbox URIs are per project)."""
    from sqlalchemy import create_engine, select

    from jobs.keys import hash_key
    from jobs.models import ApiKey

    engine = create_engine(stack.settings.database_url)
    try:
        with engine.connect() as connection:
            return connection.scalar(select(ApiKey.project_id).where(ApiKey.key_hash == hash_key(client.api_key)))
    finally:
        engine.dispose()
