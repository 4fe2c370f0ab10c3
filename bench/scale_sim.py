"""Scale-out on paper, measured: the task traffic of many workers against the real Redis and Postgres of this host.

Every chunk a worker runs costs the shared services the same handful of operations, whatever the model:

  broker    the run_chunk message: published by validate (`jobs.enqueue.run_chunk`, through the service's Celery
            app and its Redis transport), fetched by a worker with acks_late (kombu keeps it in its unacked set)
            and acknowledged when the chunk is done
  lease     the chunk's Redis lock (`jobs.run.lease.ChunkLeases.hold`): acquired, renewed every lease/3 seconds
            (counted: one command per renewal; a chunk of `--chunk-seconds` gets chunk-seconds / (lease / 3)), released
  database  run_chunk's reads of the chunk and batch rows, `ledger.finish_chunk` (the chunk's row and the batch's
            counters, one transaction) and `ledger.finish_if_last` (the batch row locked FOR UPDATE, pending
            chunks looked for): the real ledger functions on a scratch database
  S3        a ranged GET of the input, a HEAD and a PUT of the output (not measured here: see docs/scaling.md)

Two measurements, each bounded in time (`--seconds` per row):

  capacity  each path alone, driven as fast as `--threads` client threads can, in chunks/s; the database twice:
            all chunks of one batch (every chunk updates the same batch row: the hot-row case) and chunks
            spread over 100 batches. `workers at saturation` = capacity x `--chunk-seconds` (how long one worker
            takes per chunk): the number of workers this path can feed.
  workers   N simulated workers (up to 1,000), each finishing one chunk every `--chunk-seconds`, the whole chunk
            lifecycle above paced at N / chunk-seconds chunks/s: achieved rate and lifecycle latency.

The broker row is repeated against RabbitMQ when one answers at `--rabbitmq-url` (Celery's amqp transport,
the same messages). Redis commands per chunk are INFO commandstats deltas (other clients of the same server
add noise; the idle baseline of the same length is subtracted).

Client and servers share this machine's cores, so the figures are lower bounds of what dedicated servers do.

    python -m bench.scale_sim --seconds 5
"""

from __future__ import annotations

import argparse
import itertools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from redis import Redis
from sqlalchemy import text

from bench.common import markdown_table, run_cli

POSTGRES_ADMIN_URL = os.environ.get("CONVEYOR_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("CONVEYOR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
HOT_BATCH_CHUNKS = 400_000
SPREAD_BATCHES = 100
SPREAD_BATCH_CHUNKS = 4_000


@dataclass
class Measured:
    operations: int
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.operations / self.seconds

    def latency_ms(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def closed_loop(operation: Callable[[], None], threads: int, seconds: float) -> Measured:
    """`threads` threads each running `operation` back to back for `seconds`."""
    deadline = time.monotonic() + seconds
    latencies: list[list[float]] = [[] for _ in range(threads)]

    def loop(mine: list[float]) -> None:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            operation()
            mine.append(time.perf_counter() - started)

    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(loop, latencies))
    flat = list(itertools.chain.from_iterable(latencies))
    return Measured(len(flat), time.monotonic() - started, flat)


def open_loop(operation: Callable[[], None], rate: float, threads: int, seconds: float) -> Measured:
    """`operation` started at `rate` per second (as N workers finishing chunks would) for `seconds`, run by up to
    `threads` threads; latency counts from the scheduled start, so a backlog shows as latency."""
    total = max(1, int(rate * seconds))
    start = time.monotonic()
    latencies: list[float] = []
    lock = threading.Lock()
    counter = itertools.count()

    def loop() -> None:
        while (index := next(counter)) < total:
            due = start + index / rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            operation()
            with lock:
                latencies.append(time.monotonic() - due)

    with ThreadPoolExecutor(threads) as pool:
        for _ in range(threads):
            pool.submit(loop)
    # Over the paced window at least: a rate finished early is still the demanded one, not more.
    return Measured(len(latencies), max(time.monotonic() - start, total / rate), latencies)


class Chunks:
    """Chunk rows to finish, each once: one hot batch, or many batches taken round-robin."""

    def __init__(self, batch_ids: list[str], per_batch: int) -> None:
        self._next = itertools.count()
        self.batch_ids, self.per_batch = batch_ids, per_batch

    def take(self) -> tuple[str, int]:
        n = next(self._next)
        return self.batch_ids[n % len(self.batch_ids)], n // len(self.batch_ids) % self.per_batch


def seed_database(sessions, batches: dict[str, int]) -> None:  # noqa: ANN001 - a SessionFactory
    with sessions.begin() as session:
        session.execute(text("INSERT INTO projects (id, name) VALUES ('proj_sim', 'scale-sim')"))
        for batch_id, chunks in batches.items():
            session.execute(
                text(
                    "INSERT INTO batches (id, project_id, input_file_id, endpoint, completion_window, priority, status,"
                    " total_requests, completed_requests, failed_requests, created_at, expires_at) VALUES (:id,"
                    " 'proj_sim', 'file_sim', '/v1/chat/completions', '24h', 0, 'in_progress', :total, 0, 0, now(),"
                    " now() + interval '1 day')"
                ),
                {"id": batch_id, "total": chunks * 100},
            )
            session.execute(
                text(
                    "INSERT INTO chunks (batch_id, index, byte_start, byte_end, first_line, num_requests,"
                    " rejected_lines, status, completed_requests, failed_requests)"
                    " SELECT :id, i, i * 1000, i * 1000 + 1000, i * 100 + 1, 100, '[]', 'pending', 0, 0"
                    " FROM generate_series(0, :n - 1) AS i"
                ),
                {"id": batch_id, "n": chunks},
            )


class Simulation:
    def __init__(self, args: argparse.Namespace, database_url: str, prefix: str) -> None:
        # The service's Celery app reads its settings once, at import: point it at this run's Redis prefix first.
        os.environ["CONVEYOR_REDIS_URL"] = args.redis_url
        os.environ["CONVEYOR_REDIS_PREFIX"] = prefix
        os.environ["CONVEYOR_DATABASE_URL"] = database_url
        from jobs import db
        from jobs.celery_app import GPU_QUEUE, celery_app
        from jobs.run.lease import ChunkLeases
        from jobs.settings import Settings

        db.upgrade(database_url)
        self.args = args
        self.settings = Settings.from_env()
        self.sessions = db.make_session_factory(db.make_engine(database_url, pool_size=args.threads))
        seed_database(
            self.sessions,
            {"batch_hot": HOT_BATCH_CHUNKS} | {f"batch_{b:03d}": SPREAD_BATCH_CHUNKS for b in range(SPREAD_BATCHES)},
        )
        self.hot = Chunks(["batch_hot"], HOT_BATCH_CHUNKS)
        self.spread = Chunks([f"batch_{b:03d}" for b in range(SPREAD_BATCHES)], SPREAD_BATCH_CHUNKS)
        self.redis = Redis.from_url(args.redis_url)
        self.leases = ChunkLeases(self.redis, self.settings.redis_prefix, self.settings.chunk_lease_seconds)
        self.celery_app = celery_app
        self.queue = GPU_QUEUE
        self.lease_ids = itertools.count()

    # ---- one chunk's traffic, path by path -------------------------------------------------------------------

    def broker(self, app, queue: str, publish: Callable[[], None]) -> Callable[[], None]:  # noqa: ANN001 - a Celery app
        """Publish one run_chunk message, fetch it with acks_late bookkeeping, acknowledge it."""
        local = threading.local()

        def one_chunk() -> None:
            if not hasattr(local, "connection"):
                local.connection = app.connection_for_read()
                local.channel = local.connection.default_channel
            publish()
            message = None
            while message is None:  # another thread may have taken the one this thread published
                message = local.channel.basic_get(queue, no_ack=False)
            local.channel.basic_ack(message.delivery_tag)

        return one_chunk

    def redis_broker(self) -> Callable[[], None]:
        from jobs import enqueue

        return self.broker(self.celery_app, self.queue, lambda: enqueue.run_chunk("batch_sim", 0, 0))

    def lease(self) -> None:
        """A chunk's lease taken and given back (its renewer thread starts and stops; the renewals it would make
        during a real chunk, one command each, are added to the counts, not run)."""
        with self.leases.hold("batch_sim", next(self.lease_ids)):
            pass

    @property
    def renewals_per_chunk(self) -> int:
        return int(self.args.chunk_seconds // (self.settings.chunk_lease_seconds / 3))

    def database(self, chunks: Chunks) -> Callable[[], None]:
        from jobs.models import Batch, Chunk, ChunkStatus
        from jobs.run import ledger

        def one_chunk() -> None:
            batch_id, index = chunks.take()
            with self.sessions() as session:  # run_chunk's reads
                session.get(Chunk, (batch_id, index))
                session.get(Batch, batch_id)
            ledger.finish_chunk(self.sessions, batch_id, index, ChunkStatus.done, 100, 0)
            ledger.finish_if_last(self.sessions, batch_id)

        return one_chunk

    def whole_chunk(self) -> Callable[[], None]:
        broker, database = self.redis_broker(), self.database(self.spread)

        def one_chunk() -> None:
            broker()
            self.lease()
            database()

        return one_chunk

    def redis_commands_per_chunk(self, operation: Callable[[], None], chunks: int = 200) -> float:
        def total() -> int:
            return sum(stats["calls"] for name, stats in self.redis.info("commandstats").items())

        before = total()
        time.sleep(1.0)
        idle = total() - before - 1  # the INFO call itself
        before = total()
        started = time.monotonic()
        for _ in range(chunks):
            operation()
        busy = total() - before - 1
        background = idle * (time.monotonic() - started)
        return max(0.0, busy - background) / chunks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=5.0, help="per measured row")
    parser.add_argument("--threads", type=int, default=16, help="client threads")
    parser.add_argument("--chunk-seconds", type=float, default=20.0, help="one worker's time per chunk")
    parser.add_argument("--workers", type=int, nargs="+", default=[10, 100, 300, 1000])
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--postgres-admin-url", default=POSTGRES_ADMIN_URL)
    parser.add_argument("--rabbitmq-url", default="amqp://guest:guest@127.0.0.1:5672//")


def rabbitmq_app(url: str):  # noqa: ANN201 - a Celery app, or None when no RabbitMQ answers
    from celery import Celery
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=2) as connection:
            connection.connect()
    except OSError:
        return None
    app = Celery("conveyor-sim", broker=url)
    app.conf.update(task_acks_late=True, task_serializer="json", task_queue_max_priority=10, task_default_priority=5)
    return app


def run(args: argparse.Namespace) -> None:
    from conveyor.local_stack import scratch_database, scratch_redis_prefix

    with scratch_database(args.postgres_admin_url) as database_url, scratch_redis_prefix(args.redis_url) as prefix:
        sim = Simulation(args, database_url, prefix)
        seconds, threads = args.seconds, args.threads
        paths: list[tuple[str, Callable[[], None]]] = [
            ("broker: Redis (Celery message, acks_late)", sim.redis_broker()),
        ]
        rabbit = rabbitmq_app(args.rabbitmq_url)
        if rabbit is not None:

            def publish() -> None:
                rabbit.send_task("conveyor.run_chunk", ("batch_sim", 0), queue="conveyor-sim-gpu", priority=5)

            paths.append(("broker: RabbitMQ (same messages)", sim.broker(rabbit, "conveyor-sim-gpu", publish)))
        paths += [
            ("lease: Redis lock, taken and released", sim.lease),
            ("database: 100 batches", sim.database(sim.spread)),
            ("database: 1 batch (hot row)", sim.database(sim.hot)),
            ("whole chunk (broker + lease + database)", sim.whole_chunk()),
        ]
        capacity_rows = []
        for name, operation in paths:
            measured = closed_loop(operation, threads, seconds)
            capacity_rows.append([
                name, f"{measured.rate:.0f}", f"{measured.latency_ms(0.5):.1f}", f"{measured.latency_ms(0.99):.1f}",
                f"{measured.rate * args.chunk_seconds:.0f}",
            ])
        redis_per_chunk = [
            ("broker", sim.redis_commands_per_chunk(sim.redis_broker())),
            ("lease", sim.redis_commands_per_chunk(sim.lease) + sim.renewals_per_chunk),
        ]
        worker_rows = []
        whole = sim.whole_chunk()
        for workers in args.workers:
            demand = workers / args.chunk_seconds
            measured = open_loop(whole, demand, threads, seconds)
            worker_rows.append([
                f"{workers} workers", f"{demand:.1f}", f"{measured.rate:.1f}",
                f"{measured.latency_ms(0.5):.1f}", f"{measured.latency_ms(0.99):.1f}",
                "no" if measured.rate >= 0.95 * demand and measured.latency_ms(0.99) < 1000 else "yes",
            ])
        sim.redis.close()

    print(
        f"threads={threads} seconds per row={seconds} chunk-seconds={args.chunk_seconds} "
        f"(one worker finishes a chunk every {args.chunk_seconds:g} s)"
    )
    print("\ncapacity, each path alone:")
    print(markdown_table(["path", "chunks/s", "p50 ms", "p99 ms", "workers at saturation"], capacity_rows))
    print("\nRedis commands per chunk: " + ", ".join(f"{name} {count:.1f}" for name, count in redis_per_chunk))
    print("\nN workers, the whole chunk lifecycle paced at N / chunk-seconds:")
    print(markdown_table(["run", "demand chunks/s", "achieved chunks/s", "p50 ms", "p99 ms", "saturated"], worker_rows))


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
