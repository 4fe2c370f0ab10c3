"""API under polling load: many clients asking for one batch's status, as SDK users do while batches run.

Workload: the API process with PostgreSQL (SeaweedFS and Redis too, which the API needs to accept a batch; no
worker, so the batch stays `validating`). One batch is created through the `openai` SDK; then `--pollers`
concurrent pollers send `GET /v1/batches/{id}` (with the API key) for `--seconds`, in two load shapes, one
after the other:

- paced: each poller sends one request every `--interval` s, starting at a random offset within the first
  interval so the pollers do not fire in step: the SDK's polling pattern, pollers / interval req/s offered.
  A poller whose answer comes after its next tick sends at once and drops the ticks it missed, so a slow API
  shows as fewer req/s.
- closed loop: each poller sends its next request as soon as the previous answer arrives: the API's
  saturation throughput, and its latency when that many requests are queued.

Each poller holds one keep-alive HTTP/1.1 connection of its own, as separate SDK users would, and speaks HTTP
itself (`_Connection`, on uvloop): a few tens of microseconds of CPU per request, where httpx took about 2 ms, which
at 1,000 req/s would have needed the machine's cores for the load generator alone. Every poller sends one
request before the measured window, a few pollers at a time, which opens its connection. Latency runs from
sending the request to having read the whole answer; an error is any answer but 200, or a failure (timeouts
included, after 60 s). CPU columns are cores busy during the window (1.00 = one core): the API's processes, this
process (which shares the machine's cores with the server), and the whole machine (the difference is mostly
PostgreSQL); `API CPU ms/req` is the API's CPU time per answered request. `API MB` is the API processes'
resident memory at the end of the window (and its change over the window).

`--api-workers 1 2` repeats everything on a fresh stack per uvicorn worker count. `--compare-checkout DIR` also
runs each on a stack whose API runs another checkout's code (`git worktree add DIR <commit>`), first, so an
earlier read path and this one are measured side by side on the same machine in one run.

    python -m bench.api_polling --pollers 1000 --seconds 20 --interval 1 --api-workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast

import openai
import uvloop

from bench.common import markdown_table, percentile, run_cli
from bench.service_stack import ServiceStack, service_stack

TARGET_P99_MS = 20.0
CHAT: Final = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 60.0  # beyond the API's 30 s wait for a database connection, so those show as 500s
WARM_UP_CONCURRENCY = 8
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ShapeResult:
    code: str  # which code the API ran: "this checkout" or the compared one's
    shape: str
    api_workers: int
    pollers: int
    offered: float | None  # req/s; None for the closed loop
    seconds: float
    latencies: list[float]  # seconds, successful requests only
    errors: int
    api_cpu: float  # cores
    client_cpu: float
    machine_cpu: float
    api_rss_mb: float  # the API's processes, at the end of the window
    api_rss_growth_mb: float  # over the window

    @property
    def requests(self) -> int:
        return len(self.latencies) + self.errors

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds

    @property
    def api_cpu_ms_per_request(self) -> float:
        return 1000 * self.api_cpu * self.seconds / max(1, len(self.latencies))

    def latency_ms(self, q: float) -> float:
        return 1000 * percentile(self.latencies, q) if self.latencies else float("nan")


def create_batch(stack: ServiceStack) -> tuple[str, str]:
    """A batch of one request, through the SDK; returns its id and status."""
    client = openai.OpenAI(api_key=stack.api_key, base_url=stack.base_url, max_retries=0, timeout=30)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    line = json.dumps({"custom_id": "poll-0", "method": "POST", "url": CHAT, "body": body}) + "\n"
    input_file = client.files.create(file=("poll.jsonl", line.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint=CHAT, completion_window="24h")
    return batch.id, client.batches.retrieve(batch.id).status


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time, answers framed by Content-Length (the API's
    JSON answers all have one)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._answer: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        head_end = self._buffer.find(b"\r\n\r\n")
        if head_end < 0 or self._answer is None:
            return
        head = bytes(self._buffer[:head_end]).lower()
        length_at = head.find(b"\r\ncontent-length:")
        if length_at < 0:
            self._fail(ConnectionError("an answer without Content-Length"))
            return
        length_start = length_at + len(b"\r\ncontent-length:")
        length_end = head.find(b"\r\n", length_start)
        length = int(head[length_start : length_end if length_end >= 0 else len(head)])
        if len(self._buffer) < head_end + 4 + length:
            return
        del self._buffer[: head_end + 4 + length]
        if not self._answer.done():
            self._answer.set_result(int(head[9:12]))  # "http/1.1 200 ..."

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("connection closed"))

    def _fail(self, error: Exception) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(error)

    async def request(self, message: bytes) -> int:
        """Send `message`, return the answer's status once the whole answer is read."""
        assert self.transport is not None
        if self.transport.is_closing():
            raise ConnectionError("connection closed")
        self._answer = asyncio.get_running_loop().create_future()
        self.transport.write(message)
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            return await self._answer

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def _connect(host: str, port: int) -> _Connection:
    transport, connection = await asyncio.get_running_loop().create_connection(_Connection, host, port)
    connection.transport = transport  # uvloop may call connection_made only after create_connection returns
    return connection


async def _poll(
    connection: _Connection, message: bytes, interval: float | None, start: float, end: float, rng: random.Random
) -> tuple[list[float], int]:
    """One poller: requests until `end` (perf_counter), paced every `interval` s or back to back (None)."""
    latencies: list[float] = []
    errors = 0
    next_send = start + (rng.uniform(0, interval) if interval is not None else 0.0)
    while next_send < end:
        delay = next_send - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter()
        if sent >= end:
            break
        try:
            ok = await connection.request(message) == 200
        except (OSError, TimeoutError):
            ok = False
        if ok:
            latencies.append(time.perf_counter() - sent)
        else:
            errors += 1
        # Paced: the next tick, or now when the answer came after it (missed ticks are dropped, not made up).
        now = time.perf_counter()
        next_send = max(next_send + interval, now) if interval is not None else now
    return latencies, errors


async def _run_shape(
    stack: ServiceStack,
    batch_id: str,
    pollers: int,
    seconds: float,
    interval: float | None,
    seed: int,
    meter: CpuMeter,
) -> tuple[list[float], int, float, CpuSeconds]:
    settings = stack.settings
    message = (
        f"GET /v1/batches/{batch_id} HTTP/1.1\r\nHost: {settings.api_host}:{settings.api_port}\r\n"
        f"Authorization: Bearer {stack.api_key}\r\n\r\n"
    ).encode()
    # The load generator must not stall: a full collection of this process's heap pauses every poller.
    gc.disable()
    connections = await _open_connections(settings.api_host, settings.api_port, pollers, message)
    try:
        rng = random.Random(seed)
        cpu_before = meter.read()
        start = time.perf_counter()
        end = start + seconds
        results = await asyncio.gather(
            *(_poll(connection, message, interval, start, end, random.Random(rng.random())) for connection in connections)
        )
        # A request sent just before the end still counts: the window lasts until the last answer.
        elapsed = time.perf_counter() - start
        used = meter.read() - cpu_before
    finally:
        for connection in connections:
            connection.close()
        gc.enable()
    latencies = [latency for poller, _ in results for latency in poller]
    return latencies, sum(errors for _, errors in results), elapsed, used


async def _open_connections(host: str, port: int, count: int, message: bytes) -> list[_Connection]:
    """`count` connections, each with one request answered, a few at a time: the measurement is about polling, not
    connecting, and a burst of more first requests than the API has database connections stalls it."""
    gate = asyncio.Semaphore(WARM_UP_CONCURRENCY)

    async def first_request() -> tuple[_Connection, bool]:
        async with gate:
            connection = await _connect(host, port)
            try:
                return connection, await connection.request(message) == 200
            except (OSError, TimeoutError):
                return connection, False

    opened = await asyncio.gather(*(first_request() for _ in range(count)))
    failed = sum(not ok for _, ok in opened)
    if failed:
        print(f"  warm-up: {failed} of {count} first requests failed", flush=True)
    return [connection for connection, _ in opened]


def measure(
    stack: ServiceStack, code: str, api_workers: int, batch_id: str, shape: str, args: argparse.Namespace,
    interval: float | None,
) -> ShapeResult:
    meter = CpuMeter(api_group=stack.api.process.pid)  # the API leads its own process group, uvicorn workers too
    rss_before = meter.api_rss_mb()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        latencies, errors, elapsed, used = runner.run(
            _run_shape(stack, batch_id, args.pollers, args.seconds, interval, args.seed, meter)
        )
    rss_after = meter.api_rss_mb()
    return ShapeResult(
        code=code,
        shape=shape,
        api_workers=api_workers,
        pollers=args.pollers,
        offered=args.pollers / interval if interval is not None else None,
        seconds=elapsed,
        latencies=latencies,
        errors=errors,
        api_cpu=used.api / elapsed,
        client_cpu=used.client / elapsed,
        machine_cpu=used.machine / elapsed,
        api_rss_mb=rss_after,
        api_rss_growth_mb=rss_after - rss_before,
    )


@dataclass(frozen=True)
class CpuSeconds:
    api: float  # the API's processes
    client: float  # this process
    machine: float  # every core of the machine, busy time (PostgreSQL's backends come and go with the pool)

    def __sub__(self, other: CpuSeconds) -> CpuSeconds:
        return CpuSeconds(self.api - other.api, self.client - other.client, self.machine - other.machine)


@dataclass(frozen=True)
class CpuMeter:
    api_group: int

    def read(self) -> CpuSeconds:
        api = sum((int(f[11]) + int(f[12])) / _TICKS_PER_SECOND for f in self._group_stats())  # utime + stime
        return CpuSeconds(api=api, client=sum(os.times()[:2]), machine=_machine_busy_seconds())

    def api_rss_mb(self) -> float:
        return sum(int(f[21]) for f in self._group_stats()) * _PAGE_BYTES / 2**20

    def _group_stats(self) -> list[list[str]]:
        """The /proc/<pid>/stat fields (from the state on) of every process in the API's group."""
        stats = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # exited meanwhile
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
            if int(fields[2]) == self.api_group:
                stats.append(fields)
        return stats


def _machine_busy_seconds() -> float:
    """Busy time of all cores together, from the first line of /proc/stat (everything but idle and iowait)."""
    ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle, iowait = ticks[3], ticks[4]
    return (sum(ticks[:8]) - idle - iowait) / _TICKS_PER_SECOND


def format_table(results: list[ShapeResult]) -> str:
    headers = [
        "code", "shape", "api workers", "pollers", "offered req/s", "requests", "errors", "req/s", "p50 ms", "p99 ms",
        "max ms", "API CPU ms/req", "api CPU", "client CPU", "machine CPU", "API MB",
    ]
    rows = [
        [
            r.code, r.shape, r.api_workers, r.pollers, f"{r.offered:.0f}" if r.offered is not None else "max",
            r.requests, r.errors, f"{r.requests_per_second:.0f}", f"{r.latency_ms(50):.1f}",
            f"{r.latency_ms(99):.1f}", f"{r.latency_ms(100):.1f}", f"{r.api_cpu_ms_per_request:.2f}",
            f"{r.api_cpu:.2f}", f"{r.client_cpu:.2f}", f"{r.machine_cpu:.2f}",
            f"{r.api_rss_mb:.0f} ({r.api_rss_growth_mb:+.0f})",
        ]
        for r in results
    ]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pollers", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window of each load shape")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between a paced poller's requests")
    parser.add_argument(
        "--api-workers", type=int, nargs="+", default=[2], help="uvicorn worker processes; several: a stack each"
    )
    parser.add_argument(
        "--shapes", nargs="+", choices=["paced", "closed"], default=["paced", "closed"], help="load shapes to run"
    )
    parser.add_argument(
        "--compare-checkout", type=Path, help="another checkout of conveyor whose API is measured first, the same way"
    )
    parser.add_argument("--seed", type=int, default=0)


def _describe(checkout: Path) -> str:
    """The checkout's commit, for the table."""
    commit = subprocess.run(
        ["git", "-C", str(checkout), "log", "-1", "--format=%h"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return f"at {commit}" if commit else str(checkout)


def run(args: argparse.Namespace) -> None:
    print(
        f"pollers={args.pollers} seconds={args.seconds:g} interval={args.interval:g} "
        f"api-workers={' '.join(map(str, args.api_workers))} cpus={os.cpu_count()}",
        flush=True,
    )
    codes: list[tuple[str, Path | None]] = [("this checkout", None)]
    if args.compare_checkout is not None:
        codes.insert(0, (_describe(args.compare_checkout), args.compare_checkout.resolve()))
    shapes = [(name, {"paced": args.interval, "closed": None}[name]) for name in args.shapes]
    results: list[ShapeResult] = []
    for workers in args.api_workers:
        for code, checkout in codes:
            with service_stack(with_worker=False, api_workers=workers, api_checkout=checkout) as stack:
                batch_id, status = create_batch(stack)
                print(f"{code}, api workers {workers}: polling {batch_id} (status {status!r})", flush=True)
                for shape, interval in shapes:
                    label = "paced" if interval is not None else "closed loop"
                    results.append(measure(stack, code, workers, batch_id, label, args, interval))
                    r = results[-1]
                    print(f"  {label}: {r.requests} requests, p99 {r.latency_ms(99):.1f} ms", flush=True)
    print()
    print(format_table(results))
    print()
    for r in results:
        if r.shape == "paced":
            p99 = r.latency_ms(99)
            verdict = "met" if p99 < TARGET_P99_MS and r.errors == 0 else "NOT met"
            print(
                f"{r.code}, paced p99 at {r.offered:.0f} req/s, {r.api_workers} api worker(s): {p99:.1f} ms, "
                f"{r.errors} errors, {r.api_cpu_ms_per_request:.2f} ms of API CPU per request "
                f"(target < {TARGET_P99_MS:g} ms, no errors): {verdict}"
            )


if __name__ == "__main__":
    main()
