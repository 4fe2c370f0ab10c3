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

Each poller has an `httpx.AsyncClient` of its own with one connection, as separate SDK users would: the API
sees one keep-alive connection per poller, and no request waits for a connection on the client side, so the
latency is the server's plus this process's event loop. (One shared client with a pool of `--pollers`
connections costs this process about as much CPU per request, but opens only as many connections as were ever
busy at once.) Every poller sends one request before the measured window, a few pollers at a time, which
opens its connection. Latency runs from sending the request to having read the whole answer; an error is any
answer but 200, or an exception (timeouts included, after 60 s). CPU columns are cores busy during the window
(1.00 = one core): the API's processes, this process (which shares the machine's cores with the server), and
the whole machine (the difference is mostly PostgreSQL).

`--api-workers 1 2` repeats everything on a fresh stack per uvicorn worker count, one row pair each.

    python -m bench.api_polling --pollers 200 --seconds 20 --interval 1
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx
import openai

from bench.common import markdown_table, percentile, run_cli
from bench.service_stack import ServiceStack, service_stack

TARGET_P99_MS = 50.0
CHAT: Final = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 60.0  # beyond the API's 30 s wait for a database connection, so those show as 500s
WARM_UP_CONCURRENCY = 8
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ShapeResult:
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

    @property
    def requests(self) -> int:
        return len(self.latencies) + self.errors

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds

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


async def _poll(
    client: httpx.AsyncClient, url: str, interval: float | None, start: float, end: float, rng: random.Random
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
            response = await client.get(url)
            ok = response.status_code == 200
        except httpx.HTTPError:
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
    url = f"{stack.base_url}/batches/{batch_id}"
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    clients = [
        httpx.AsyncClient(headers=headers, timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=1))
        for _ in range(pollers)
    ]
    # The load generator must not stall: a full collection of this process's heap (torch and all) pauses
    # every poller for 0.1-0.4 s. Twenty seconds of polling leave little garbage.
    gc.disable()
    try:
        await _open_connections(clients, url)
        rng = random.Random(seed)
        cpu_before = meter.read()
        start = time.perf_counter()
        end = start + seconds
        results = await asyncio.gather(
            *(_poll(client, url, interval, start, end, random.Random(rng.random())) for client in clients)
        )
        # A request sent just before the end still counts: the window lasts until the last answer.
        elapsed = time.perf_counter() - start
        used = meter.read() - cpu_before
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))
        gc.enable()
    latencies = [latency for poller, _ in results for latency in poller]
    return latencies, sum(errors for _, errors in results), elapsed, used


async def _open_connections(clients: list[httpx.AsyncClient], url: str) -> None:
    """One request per client, a few at a time: the measurement is about polling, not connecting, and a burst of
    more first requests than the API has database connections stalls it for its pool timeout."""
    gate = asyncio.Semaphore(WARM_UP_CONCURRENCY)

    async def first_request(client: httpx.AsyncClient) -> bool:
        async with gate:
            try:
                return (await client.get(url)).status_code == 200
            except httpx.HTTPError:
                return False

    failed = (await asyncio.gather(*(first_request(client) for client in clients))).count(False)
    if failed:
        print(f"  warm-up: {failed} of {len(clients)} first requests failed", flush=True)


def measure(
    stack: ServiceStack, api_workers: int, batch_id: str, shape: str, args: argparse.Namespace, interval: float | None
) -> ShapeResult:
    meter = CpuMeter(api_group=stack.api.process.pid)  # the API leads its own process group, uvicorn workers too
    latencies, errors, elapsed, used = asyncio.run(
        _run_shape(stack, batch_id, args.pollers, args.seconds, interval, args.seed, meter)
    )
    return ShapeResult(
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
        return CpuSeconds(api=self._group_seconds(), client=sum(os.times()[:2]), machine=_machine_busy_seconds())

    def _group_seconds(self) -> float:
        total = 0.0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # exited meanwhile
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
            if int(fields[2]) == self.api_group:
                total += (int(fields[11]) + int(fields[12])) / _TICKS_PER_SECOND  # utime + stime
        return total


def _machine_busy_seconds() -> float:
    """Busy time of all cores together, from the first line of /proc/stat (everything but idle and iowait)."""
    ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle, iowait = ticks[3], ticks[4]
    return (sum(ticks[:8]) - idle - iowait) / _TICKS_PER_SECOND


def format_table(results: list[ShapeResult]) -> str:
    headers = [
        "shape", "api workers", "pollers", "offered req/s", "requests", "errors", "req/s",
        "p50 ms", "p99 ms", "max ms", "api CPU", "client CPU", "machine CPU",
    ]
    rows = [
        [
            r.shape, r.api_workers, r.pollers, f"{r.offered:.0f}" if r.offered is not None else "max",
            r.requests, r.errors, f"{r.requests_per_second:.0f}", f"{r.latency_ms(50):.1f}",
            f"{r.latency_ms(99):.1f}", f"{r.latency_ms(100):.1f}",
            f"{r.api_cpu:.2f}", f"{r.client_cpu:.2f}", f"{r.machine_cpu:.2f}",
        ]
        for r in results
    ]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pollers", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window of each load shape")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between a paced poller's requests")
    parser.add_argument(
        "--api-workers", type=int, nargs="+", default=[1], help="uvicorn worker processes; several: a stack each"
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    print(
        f"pollers={args.pollers} seconds={args.seconds:g} interval={args.interval:g} "
        f"api-workers={' '.join(map(str, args.api_workers))} cpus={os.cpu_count()}",
        flush=True,
    )
    results: list[ShapeResult] = []
    for workers in args.api_workers:
        with service_stack(with_worker=False, api_workers=workers) as stack:
            batch_id, status = create_batch(stack)
            print(f"api workers {workers}: polling {batch_id} (status {status!r})", flush=True)
            for shape, interval in (("paced", args.interval), ("closed loop", None)):
                results.append(measure(stack, workers, batch_id, shape, args, interval))
                r = results[-1]
                print(f"  {shape}: {r.requests} requests, p99 {r.latency_ms(99):.1f} ms", flush=True)
    print()
    print(format_table(results))
    print()
    for r in results:
        if r.shape == "paced":
            p99 = r.latency_ms(99)
            verdict = "met" if p99 < TARGET_P99_MS and r.errors == 0 else "NOT met"
            print(
                f"paced p99, {r.api_workers} api worker(s): {p99:.1f} ms, {r.errors} errors "
                f"(target < {TARGET_P99_MS:g} ms, no errors): {verdict}"
            )


if __name__ == "__main__":
    main()
