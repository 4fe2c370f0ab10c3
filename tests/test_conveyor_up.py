"""`conveyor up` end to end: the whole service from one command, with embedded PostgreSQL, Redis and SeaweedFS,
driven by the official `openai` SDK; then Ctrl-C (SIGINT) stops every process it started, and a second start on
the same data directory finds the batch, its files and their contents again. A worker killed while up runs is
restarted, counted in /metrics, and the batch submitted after completes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from conveyor.local_stack import free_port

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 600.0  # the worker loads the model; on a busy shared machine that takes minutes
STOP_TIMEOUT_S = 120.0
READY_LINE = "Ctrl-C stops everything."
KEY_PATTERN = re.compile(r"sk-conveyor-[\w-]+")
REQUESTS = 8


@dataclass
class UpProcess:
    """One `conveyor up` in a session of its own, its terminal output in a file."""

    process: subprocess.Popen[bytes]
    output_path: Path
    data_dir: Path
    started: list[psutil.Process] = field(default_factory=list)  # what it ran, filled in once it is up

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_until_up(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while READY_LINE not in self.output():
            assert self.process.poll() is None, f"conveyor up exited with {self.process.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"conveyor up not ready after {START_TIMEOUT_S:.0f} s:\n{self.output()}"
            time.sleep(0.5)
        self.started = _started_by(self.process.pid, self.data_dir)
        return self.output()

    def interrupt(self) -> int:
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(STOP_TIMEOUT_S)

    def still_running(self) -> list[str]:
        return [f"{p.pid} {' '.join(p.cmdline())}" for p in self.started if _alive(p)]


def _started_by(pid: int, data_dir: Path) -> list[psutil.Process]:
    """Its descendants, and PostgreSQL, which pg_ctl detaches (found by its data directory on its command line)."""
    processes = psutil.Process(pid).children(recursive=True)
    for candidate in psutil.process_iter(["cmdline"]):
        if any(str(data_dir) in part for part in candidate.info["cmdline"] or []) and candidate not in processes:
            processes.append(candidate)
    names = {p.name() for p in processes}
    assert {"postgres", "redis-server", "weed"} <= names, f"embedded servers missing from {names}"
    return processes


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[Callable[[], UpProcess]]:
    """Starts `conveyor up` on one data directory and API port, with no backing service configured; whatever is
    still running at the end (a failed test) is stopped."""
    # Not under tmp_path: run as root, PostgreSQL runs as another user that must traverse the folders above its data,
    # and pytest closes its temporary root to its owner again whenever a session (another developer's) starts.
    data_dir = Path(tempfile.mkdtemp(prefix="conveyor-up-")) / "data"
    api_port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") or k == "CONVEYOR_CACHE_DIR"}
    # No CONVEYOR_WORKER_METRICS_PORT: up picks a free port for the worker's metrics itself (the default may be taken).
    runs: list[UpProcess] = []

    def start() -> UpProcess:
        output_path = tmp_path / f"up-{len(runs)}.out"
        with output_path.open("wb") as output:
            process = subprocess.Popen(
                [sys.executable, "-m", "conveyor", "up", "--data-dir", str(data_dir), "--port", str(api_port)],
                env=environment,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        runs.append(UpProcess(process, output_path, data_dir))
        return runs[-1]

    yield start
    for run in runs:
        if run.process.poll() is None:
            try:
                run.interrupt()
            except subprocess.TimeoutExpired:
                os.killpg(run.process.pid, signal.SIGKILL)
        for leftover in run.started:
            if _alive(leftover):
                leftover.kill()
    shutil.rmtree(data_dir.parent)


def batch_input() -> bytes:
    lines = [
        {
            "custom_id": f"up-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"Name a fruit. Request {i}."}], "max_tokens": 8},
        }
        for i in range(REQUESTS)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def api_client(banner: str, key: str) -> openai.OpenAI:
    base_url = re.search(r"API\s+(http://\S+/v1)", banner)
    assert base_url is not None, banner
    return openai.OpenAI(api_key=key, base_url=base_url.group(1), max_retries=0, timeout=30)


def run_batch(client: openai.OpenAI) -> tuple[openai.types.Batch, str]:
    """Submit `batch_input()` and wait for it to complete; returns it and its output file's text."""
    input_file = client.files.create(file=("requests.jsonl", batch_input()), purpose="batch")
    batch = client.batches.create(
        input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and batch.request_counts.completed == REQUESTS
    assert batch.output_file_id is not None
    output = client.files.content(batch.output_file_id).text
    assert sorted(json.loads(line)["custom_id"] for line in output.splitlines()) == sorted(
        f"up-{i}" for i in range(REQUESTS)
    )
    return batch, output


def test_conveyor_up_runs_a_batch_stops_cleanly_finds_it_again_and_restarts_a_killed_worker(
    start_up: Callable[[], UpProcess],
) -> None:
    """One life of a local stack (each start of `conveyor up` costs 10-20 s of the suite): a batch, Ctrl-C, a start
    on the same data that finds the batch again, then its worker killed under it, restarted, and a batch run."""
    first = start_up()
    banner = first.wait_until_up()
    keys = KEY_PATTERN.findall(banner)
    assert len(keys) == 1, f"the first start prints one new key:\n{banner}"
    client = api_client(banner, keys[0])
    api = str(client.base_url).removesuffix("/v1/")
    assert f"Console     {api}/console" in banner
    worker_metrics = re.search(rf"Metrics     {api}/metrics \(API\), (http://\S+/metrics) \(worker\)", banner)
    assert worker_metrics is not None, banner
    assert "starting the worker; waiting until it has loaded the model" in banner and "the worker is ready" in banner
    batch, output = run_batch(client)
    input_file = client.files.retrieve(batch.input_file_id)
    assert "conveyor_chunk_duration_seconds_count" in httpx.get(worker_metrics.group(1)).text

    assert first.interrupt() == 0, first.output()
    assert first.still_running() == [], f"left running after Ctrl-C:\n{first.output()}"
    assert first.output().rstrip().endswith("conveyor up: stopped"), first.output()

    second = start_up()
    banner = second.wait_until_up()
    assert KEY_PATTERN.findall(banner) == [], "a restart finds the key it made before and makes no new one"
    client = api_client(banner, keys[0])
    assert batch.id in [listed.id for listed in client.batches.list()]
    assert client.batches.retrieve(batch.id).status == "completed"
    assert {input_file.id, batch.output_file_id} <= {listed.id for listed in client.files.list()}
    assert client.files.content(batch.output_file_id).text == output

    workers = [p for p in second.started if p.cmdline()[-1:] == ["worker"] and p.ppid() == second.process.pid]
    assert len(workers) == 1, [p.cmdline() for p in second.started]
    os.killpg(workers[0].pid, signal.SIGKILL)  # the worker and the processes it forked, as the OOM killer would
    deadline = time.monotonic() + START_TIMEOUT_S
    while "conveyor worker restarted (1 restart(s) so far)" not in second.output():
        assert second.process.poll() is None, f"conveyor up exited:\n{second.output()}"
        assert time.monotonic() < deadline, f"the worker was not restarted:\n{second.output()}"
        time.sleep(0.5)
    assert "conveyor worker stopped unexpectedly; restarting it in 1 s" in second.output()
    run_batch(client)
    metrics = httpx.get(f"{api}/metrics").text
    assert 'conveyor_process_restarts_total{process="conveyor worker"} 1.0' in metrics, metrics

    assert second.interrupt() == 0, second.output()
    assert second.still_running() == [], f"left running after Ctrl-C:\n{second.output()}"
