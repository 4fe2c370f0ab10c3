"""Workloads and a timed driver for the scheduling report: requests arrive at given times (all at t=0
for a batch job, Poisson for online-like traffic), the engine is stepped while work exists, and each
request's time to first token and latency, and each step's seats and KV blocks in use, are recorded.

Every request is greedy with `ignore_eos`, so it produces exactly the tokens it asked for whatever
the policy: the policies differ in time, never in work.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from bench.throughput import BenchRequest
from engine import LLM, SamplingParams

# Output-length spreads, from all equal to a long tail, each with the same mean.
SPREADS = ("equal", "uniform ±50%", "uniform 1..2x", "long tail")


class WallClock:
    """Seconds since the run started; waiting for an arrival sleeps."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start

    def wait_until(self, moment: float) -> None:
        time.sleep(max(0.0, moment - self.now()))


class CpuClock:
    """This process's CPU seconds since the run started, plus the idle gaps it skipped waiting for
    arrivals: on a shared machine, single-threaded, the time the run takes on one quiet core (wall time
    there counts the other tenants too)."""

    def __init__(self) -> None:
        self._start = time.process_time()
        self._skipped = 0.0

    def now(self) -> float:
        return time.process_time() - self._start + self._skipped

    def wait_until(self, moment: float) -> None:
        self._skipped += max(0.0, moment - self.now())


CLOCKS: dict[str, type[WallClock] | type[CpuClock]] = {"wall": WallClock, "cpu": CpuClock}


@dataclass(frozen=True)
class Arrival:
    time: float  # seconds after the run starts
    request: BenchRequest


@dataclass(frozen=True)
class StepPoint:
    time: float  # seconds after the run started, at the end of the step
    kv_blocks_used: int  # held by sequences (cached blocks nobody holds count as free)
    sampled: int  # tokens sampled in the step: one per seat doing useful work


@dataclass
class Measured:
    """One run: what the report tabulates and plots."""

    experiment: str
    label: str  # the run's row name, e.g. the policy
    x: str  # the swept value: a spread, an arrival rate, a chunk size
    seconds: float
    output_tokens: int
    seats: int  # max_num_seqs (HF: the static batch size)
    seat_steps: int  # seats x steps (HF: seats x decode steps of every batch)
    latencies: list[float]  # per request: arrival to last token
    ttfts: list[float]  # per request: arrival to first token (empty where not measured)
    prefill_tokens: int = 0  # prompt positions computed
    preemptions: int = 0
    kv_blocks_total: int = 0
    steps: list[StepPoint] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_second(self) -> float:
        return len(self.latencies) / self.seconds

    @property
    def utilisation(self) -> float:
        """Useful tokens per seat-step: 1.0 when every seat samples a wanted token every step."""
        return self.output_tokens / self.seat_steps if self.seat_steps else 0.0


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def output_lengths(spread: str, count: int, mean: int, rng: random.Random) -> list[int]:
    if spread == "equal":
        return [mean] * count
    if spread == "uniform ±50%":
        return [rng.randint(mean - mean // 2, mean + mean // 2) for _ in range(count)]
    if spread == "uniform 1..2x":
        return [rng.randint(1, 2 * mean - 1) for _ in range(count)]
    if spread == "long tail":  # lognormal, sigma 1.2, with the same mean; capped at 8x the mean
        mu = math.log(mean) - 1.2**2 / 2
        return [max(1, min(8 * mean, round(rng.lognormvariate(mu, 1.2)))) for _ in range(count)]
    raise ValueError(f"unknown spread {spread!r}; known: {SPREADS}")


def random_prompts(count: int, length: tuple[int, int], vocab_size: int, rng: random.Random) -> list[list[int]]:
    # Skip the low ids, where tokenizers keep their special tokens.
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(*length))] for _ in range(count)]


def all_at_once(requests: list[BenchRequest]) -> list[Arrival]:
    return [Arrival(0.0, r) for r in requests]


def poisson(requests: list[BenchRequest], rate: float, rng: random.Random) -> list[Arrival]:
    """Exponential gaps of mean 1/rate seconds between consecutive arrivals."""
    arrivals, now = [], 0.0
    for request in requests:
        arrivals.append(Arrival(now, request))
        now += rng.expovariate(rate)
    return arrivals


def document_job(
    documents: int, questions: int, document_len: int, question_len: int, answer_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """A RAG-like job: every question of every document, as one prompt each (document, then question),
    shuffled as a job's lines arrive in no useful order."""
    rng = random.Random(seed)
    texts = random_prompts(documents, (document_len, document_len), vocab_size, rng)
    job = [
        BenchRequest(text + prompt, answer_len)
        for text in texts
        for prompt in random_prompts(questions, (question_len, question_len), vocab_size, rng)
    ]
    rng.shuffle(job)
    return job


def run_engine(experiment: str, label: str, x: str, llm: LLM, arrivals: list[Arrival], clock_name: str) -> Measured:
    """Warm up, then replay the arrivals on the clock and step the engine until every request is done."""
    engine = llm.engine
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    start_stats = engine.stats()
    manager = engine.block_manager
    pending = deque(sorted(arrivals, key=lambda a: a.time))
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    steps: list[StepPoint] = []
    sampled_before = engine.counters.generation_tokens
    clock = CLOCKS[clock_name]()
    while pending or engine.has_unfinished_requests():
        now = clock.now()
        while pending and pending[0].time <= now:
            arrival = pending.popleft()
            request_id = f"{label}-{len(arrived)}"
            params = SamplingParams(temperature=0.0, max_tokens=arrival.request.output_len, ignore_eos=True)
            engine.add_request(request_id, arrival.request.prompt_token_ids, params)
            arrived[request_id] = arrival.time
        if not engine.has_unfinished_requests():
            clock.wait_until(pending[0].time)
            continue
        outputs = engine.step()
        now = clock.now()
        for output in outputs:
            first_token.setdefault(output.request_id, now)
            finished[output.request_id] = now
        for seq in engine.scheduler.running:
            if seq.output_token_ids:
                first_token.setdefault(seq.request_id, now)
        sampled = engine.counters.generation_tokens
        steps.append(StepPoint(now, manager.num_blocks - manager.num_free_blocks, sampled - sampled_before))
        sampled_before = sampled
    seconds = clock.now()
    assert len(finished) == len(arrived), "a request did not finish"
    end_stats = engine.stats()
    seats = engine.config.max_num_seqs
    return Measured(
        experiment=experiment,
        label=label,
        x=x,
        seconds=seconds,
        output_tokens=sum(a.request.output_len for a in arrivals),
        seats=seats,
        seat_steps=seats * len(steps),
        latencies=[finished[r] - arrived[r] for r in arrived],
        ttfts=[first_token[r] - arrived[r] for r in arrived],
        prefill_tokens=end_stats.counters.prompt_tokens_computed - start_stats.counters.prompt_tokens_computed,
        preemptions=sum(end_stats.preemptions.values()) - sum(start_stats.preemptions.values()),
        kv_blocks_total=manager.num_blocks,
        steps=steps,
    )
