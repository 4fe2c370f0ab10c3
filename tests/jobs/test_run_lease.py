"""A chunk's lease (`jobs.run.lease`) against a real Redis: one holder at a time, renewed while held, lapsing when
its holder stops renewing."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
from redis import Redis

from jobs.run.lease import ChunkBusy, ChunkLeases, LeaseLost

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def redis() -> Iterator[Redis]:
    client = Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def leases(redis: Redis) -> Iterator[ChunkLeases]:
    prefix = f"test-lease-{secrets.token_hex(4)}:"
    yield ChunkLeases(redis, prefix, lease_seconds=0.6)
    for key in redis.scan_iter(f"{prefix}*"):
        redis.delete(key)


def test_a_held_chunk_is_busy_for_everyone_else_until_released(leases: ChunkLeases) -> None:
    with leases.hold("batch_a", 0):
        with pytest.raises(ChunkBusy):
            with leases.hold("batch_a", 0):
                pass
        with leases.hold("batch_a", 1):  # another chunk of the same batch is free
            assert leases.held("batch_a", [0, 1, 2]) == [True, True, False]
    assert leases.held("batch_a", [0, 1]) == [False, False]
    with leases.hold("batch_a", 0):  # released: the next delivery takes it
        pass


def test_the_lease_is_renewed_while_its_chunk_runs(leases: ChunkLeases) -> None:
    with leases.hold("batch_b", 0):
        time.sleep(3 * leases.lease_seconds)  # three lease lengths: only renewal keeps it
        assert leases.held("batch_b", [0]) == [True]
        with pytest.raises(ChunkBusy):
            with leases.hold("batch_b", 0):
                pass


def test_a_dead_holders_lease_lapses_and_the_chunk_can_be_taken_over(leases: ChunkLeases, redis: Redis) -> None:
    # A holder that died: it took the lease and never renewed it.
    assert redis.lock(leases.key("batch_c", 0), timeout=leases.lease_seconds, blocking=False).acquire()
    with pytest.raises(ChunkBusy):
        with leases.hold("batch_c", 0):
            pass
    time.sleep(leases.lease_seconds + 0.2)
    with leases.hold("batch_c", 0):
        assert leases.held("batch_c", [0]) == [True]


def test_a_failing_chunk_still_releases_its_lease(leases: ChunkLeases) -> None:
    with pytest.raises(RuntimeError):
        with leases.hold("batch_d", 0):
            raise RuntimeError("the chunk failed")
    assert leases.held("batch_d", [0]) == [False]


def test_a_holder_stalled_past_its_lease_loses_it_to_a_taker_and_keeps_it_otherwise(
    leases: ChunkLeases, redis: Redis
) -> None:
    with leases.hold("batch_e", 0) as stalled:
        redis.delete(leases.key("batch_e", 0))  # its lease lapsed while it was stopped (no renewal could run)
        stalled.renew()  # nobody took the chunk: it is simply held again
        assert leases.held("batch_e", [0]) == [True]
        redis.delete(leases.key("batch_e", 0))
        assert redis.lock(leases.key("batch_e", 0), timeout=60, blocking=False).acquire()  # another worker took it
        with pytest.raises(LeaseLost):
            stalled.renew()  # what the pipeline checks before writing: the results are the taker's to write
    assert leases.held("batch_e", [0]) == [True]  # leaving the block does not release the taker's lease
