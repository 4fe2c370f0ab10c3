"""The console's batch list for a project with many batches: server time per page, beside the JSON list it is built
from.

Workload: the API process with PostgreSQL, Redis and SeaweedFS (no worker). `--batches` batch rows (default 10,000)
are inserted for one project, and as many for another (the list must not pay for the tenant next door), in a mix of
statuses (mostly completed, 1% failed, a few running) with counts and usage. Then, signed in to the console as the
first project, each page is requested `--repeat` times one after another over one keep-alive connection, and the
JSON list of the same rows (`GET /v1/batches?limit=50`) likewise. Time runs from sending the request to having read
the whole answer on 127.0.0.1: the server's time plus a loopback round trip. The figure the console promises: the
list renders in under 300 ms.

    python -m bench.console_list --batches 10000 --repeat 50
"""

from __future__ import annotations

import argparse
import platform
import random
import re
import statistics
import time
from datetime import timedelta

import httpx
from sqlalchemy import insert, text

from bench.common import markdown_table, percentile, run_cli
from bench.service_stack import service_stack
from jobs import db
from jobs.keys import create_key_in_database
from jobs.models import Batch, BatchStatus, new_id, utcnow

TARGET_MS = 300.0
PAGE_ROWS = 50  # the console's page; the JSON baseline asks for as many


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, default=10_000, help="batch rows per project (two projects)")
    parser.add_argument("--repeat", type=int, default=50, help="requests per page measured")


def insert_batches(database_url: str, project_id: str, count: int) -> list[str]:
    """`count` batches, one a minute back from now, newest first; returns their ids, newest first."""
    rng = random.Random(project_id)
    now = utcnow()
    rows = []
    for index in range(count):
        roll = rng.random()
        status = BatchStatus.failed if roll < 0.01 else BatchStatus.in_progress if roll < 0.03 else BatchStatus.completed
        total = rng.randint(1, 50_000)
        completed = total if status == BatchStatus.completed else rng.randint(0, total)
        created = now - timedelta(minutes=index)
        rows.append(dict(
            id=new_id("batch_"), project_id=project_id, input_file_id=new_id("file-"), endpoint="/v1/chat/completions",
            completion_window="24h", status=status, model="smollm2-135m-instruct", total_requests=total,
            completed_requests=completed, failed_requests=rng.randint(0, total - completed),
            input_tokens=total * 40, output_tokens=total * 100, cached_tokens=total * 10,
            created_at=created, expires_at=created + timedelta(hours=24), in_progress_at=created,
        ))
    engine = db.make_engine(database_url)
    with engine.begin() as connection:
        for start in range(0, count, 2000):
            connection.execute(insert(Batch), rows[start : start + 2000])
        connection.execute(text("ANALYZE batches"))  # as autovacuum would after such an insert: planner statistics
    engine.dispose()
    return [row["id"] for row in rows]


def timed(client: httpx.Client, path: str, repeat: int) -> list[float]:
    client.get(path).raise_for_status()  # warm: templates compiled, connection open
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        answer = client.get(path)
        times.append((time.perf_counter() - started) * 1000)
        answer.raise_for_status()
    return times


def run(args: argparse.Namespace) -> None:
    with service_stack(with_worker=False) as stack:
        settings = stack.settings
        created = create_key_in_database(settings.database_url, "bench-console")
        neighbour = create_key_in_database(settings.database_url, "bench-console-neighbour")
        ids = insert_batches(settings.database_url, created.project_id, args.batches)
        insert_batches(settings.database_url, neighbour.project_id, args.batches)
        root = f"http://{settings.api_host}:{settings.api_port}"
        with httpx.Client(base_url=root, timeout=60) as browser, httpx.Client(
            base_url=root, timeout=60, headers={"authorization": f"Bearer {created.secret}"}
        ) as sdk:
            signed_in = browser.post("/console/sign-in", data={"api_key": created.secret}, follow_redirects=True)
            signed_in.raise_for_status()
            deep = ids[-PAGE_ROWS - 1]
            pages = [
                ("JSON GET /v1/batches?limit=50 (baseline)", sdk, f"/v1/batches?limit={PAGE_ROWS}"),
                ("console /console/batches", browser, "/console/batches"),
                ("console /console/batches/live (polled fragment)", browser, "/console/batches/live"),
                ("console ?status=completed", browser, "/console/batches?status=completed"),
                ("console ?status=failed (1% of rows)", browser, "/console/batches?status=failed"),
                ("console last page (after=…)", browser, f"/console/batches?after={deep}"),
                ("console /console (overview)", browser, "/console"),
            ]
            results = []
            for name, client, path in pages:
                results.append((name, timed(client, path, args.repeat)))
            rows_shown = len(re.findall(r"data-batch=", browser.get("/console/batches").text))
    baseline = statistics.median(results[0][1])
    print(
        f"Console batch list: {args.batches:,} batches in the project (and {args.batches:,} in another), "
        f"{rows_shown} rows a page, {args.repeat} requests each; CPU: {_cpu_name()}"
    )
    print(markdown_table(
        ["page", "median ms", "p95 ms", "max ms", "median vs JSON", f"< {TARGET_MS:.0f} ms"],
        [
            (name, f"{statistics.median(times):.1f}", f"{percentile(times, 95):.1f}", f"{max(times):.1f}",
             f"{statistics.median(times) / baseline:.2f}x", "yes" if max(times) < TARGET_MS else "NO")
            for name, times in results
        ],
    ))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    run_cli(__doc__, add_arguments, run)
