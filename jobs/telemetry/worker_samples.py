"""Each worker's engine gauges over the last minutes, kept in Redis for the console's workers page.

A worker's `/metrics` (`worker_metrics.py`) answers a scraper with the engine's numbers of the moment; the console
has no scraper, does not know where workers listen, and wants a history. So every worker also takes the same
`EngineStats` every `SAMPLE_SECONDS` and appends a sample to a short Redis list of its own (the last
`SAMPLES_KEPT`), and names itself, with the models it serves, in a sorted set by last sample time. A worker that
stops leaves the page once its list has aged out. One small Redis write per worker every few seconds.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from redis import Redis
from redis.exceptions import RedisError

from engine.metrics import EngineStats

log = logging.getLogger(__name__)

SAMPLE_SECONDS = 5.0  # between two samples of one worker
SAMPLES_KEPT = 120  # per worker: ten minutes at SAMPLE_SECONDS
HISTORY_SECONDS = SAMPLE_SECONDS * SAMPLES_KEPT


def _workers_key(prefix: str) -> str:
    """Sorted set: worker name -> unix seconds of its latest sample."""
    return f"{prefix}workers_sampled"


def _samples_key(prefix: str, worker: str) -> str:
    return f"{prefix}worker_samples:{worker}"


def _models_key(prefix: str, worker: str) -> str:
    return f"{prefix}worker_models:{worker}"


@dataclass(frozen=True)
class WorkerSample:
    at: float  # unix seconds
    running: int  # sequences
    waiting: int
    swapped: int
    kv_utilization: float  # share of the device KV blocks held by sequences, 0..1
    generation_tokens: int  # sampled since the worker started
    prompt_tokens: int  # prompt positions computed since the worker started
    preemptions: int  # since the worker started, every mode

    @classmethod
    def of(cls, stats: EngineStats, at: float) -> WorkerSample:
        return cls(
            at=at,
            running=stats.num_running,
            waiting=stats.num_waiting,
            swapped=stats.num_swapped,
            kv_utilization=stats.kv_utilization,
            generation_tokens=stats.counters.generation_tokens,
            prompt_tokens=stats.counters.prompt_tokens_computed,
            preemptions=sum(stats.preemptions.values()),
        )


@dataclass(frozen=True)
class WorkerHistory:
    name: str
    models: list[str]  # the ids of the models it serves
    samples: list[WorkerSample]  # oldest first

    def rates(self, counter: str) -> list[float]:
        """Per second between consecutive samples, of a cumulative field such as "generation_tokens" (one value
        fewer than samples; a restarted worker's drop counts as 0)."""
        pairs = zip(self.samples, self.samples[1:])
        return [
            max(0.0, getattr(b, counter) - getattr(a, counter)) / max(b.at - a.at, 1e-9) for a, b in pairs
        ]


class SampleRecorder:
    """The worker's side: a thread that appends a sample every `interval_seconds` until stopped."""

    def __init__(
        self,
        redis: Redis,
        prefix: str,
        worker: str,
        models: list[str],
        read_stats: Callable[[], EngineStats],
        interval_seconds: float = SAMPLE_SECONDS,
    ) -> None:
        self._redis, self._prefix, self._worker, self._models = redis, prefix, worker, models
        self._read_stats = read_stats
        self._interval = interval_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-samples", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def record(self) -> None:
        sample = WorkerSample.of(self._read_stats(), time.time())
        ttl_ms = int(self._interval * SAMPLES_KEPT * 1000)
        samples_key = _samples_key(self._prefix, self._worker)
        with self._redis.pipeline() as write:
            write.rpush(samples_key, json.dumps(asdict(sample)))
            write.ltrim(samples_key, -SAMPLES_KEPT, -1)
            write.pexpire(samples_key, ttl_ms)
            write.set(_models_key(self._prefix, self._worker), json.dumps(self._models), px=ttl_ms)
            write.zadd(_workers_key(self._prefix), {self._worker: sample.at})
            write.execute()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.record()
            except (TimeoutError, RuntimeError, RedisError) as skipped:  # a long step, a stopped loop, Redis away
                log.warning("engine sample skipped: %r", skipped)


def worker_histories(redis: Redis, prefix: str) -> list[WorkerHistory]:
    """Every worker that sampled within HISTORY_SECONDS, by name, with its samples; forgets the older ones."""
    workers_key = _workers_key(prefix)
    redis.zremrangebyscore(workers_key, "-inf", time.time() - HISTORY_SECONDS)
    names = sorted(member.decode() for member in redis.zrange(workers_key, 0, -1))
    with redis.pipeline(transaction=False) as read:
        for name in names:
            read.lrange(_samples_key(prefix, name), 0, -1)
            read.get(_models_key(prefix, name))
        answers = read.execute()
    histories = []
    for index, name in enumerate(names):
        raw_samples, raw_models = answers[2 * index], answers[2 * index + 1]
        samples = [WorkerSample(**json.loads(raw)) for raw in raw_samples]
        histories.append(WorkerHistory(name, json.loads(raw_models) if raw_models else [], samples))
    return histories
