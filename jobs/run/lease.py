"""A chunk's lease: the Redis lock that keeps two workers off one chunk.

Redis re-delivers a task whose worker has not acknowledged it within the visibility timeout, whether that worker
died or is merely slow. The lease tells the two apart: a running chunk holds `chunk-lease:<batch>:<index>` for
`CONVEYOR_CHUNK_LEASE_SECONDS`, renewed by a thread every third of that while it runs, so a second delivery that
finds it held backs off (`ChunkBusy`), and one whose holder died finds it lapsed and takes the chunk over.
Finalize reads the leases too: a stopping batch's pending chunk without a lease has not started and never will.

A holder that was only slow (stopped past its lease, swapped out) may find on resuming that its lease lapsed and
another worker took the chunk over: `HeldLease.renew` then raises `LeaseLost`, and the pipeline confirms the lease
just before writing a chunk's results, so a slow holder's results are dropped, never written beside the new
holder's. A lapsed lease that nobody took is simply taken back. (Only a holder stalled longer than a whole lease
between that check and its write could still write late; the lease's length is what bounds it.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from redis import Redis
from redis.exceptions import LockError, LockNotOwnedError, RedisError
from redis.lock import Lock

log = logging.getLogger(__name__)


class ChunkBusy(Exception):
    """Another worker holds this chunk's lease: try again once it has finished or its lease has lapsed."""


class LeaseLost(Exception):
    """This holder's lease lapsed and another holder has the chunk now: its results are that holder's to write."""


class HeldLease:
    """A lease this worker holds, as the block under `ChunkLeases.hold` sees it."""

    def __init__(self, lock: Lock) -> None:
        self.lock = lock

    def renew(self) -> None:
        """Extend the lease to its full length, taking it back if it lapsed and nobody took it; LeaseLost if another
        holder has it."""
        try:
            self.lock.reacquire()
            return
        except LockNotOwnedError:
            if self.lock.acquire(blocking=False):
                log.warning("%s lapsed while its holder was stalled; nobody took it, so it is held again", self.lock.name)
                return
        raise LeaseLost(f"{self.lock.name!r} lapsed and is held by another worker")


class ChunkLeases:
    def __init__(self, redis: Redis, redis_prefix: str, lease_seconds: float) -> None:
        self.redis = redis
        self.redis_prefix = redis_prefix
        self.lease_seconds = lease_seconds

    def key(self, batch_id: str, index: int) -> str:
        return f"{self.redis_prefix}chunk-lease:{batch_id}:{index}"

    @contextmanager
    def hold(self, batch_id: str, index: int) -> Iterator[HeldLease]:
        """Hold the chunk's lease, renewed, while the block runs; ChunkBusy at once if another holder has it."""
        lease = self.redis.lock(
            self.key(batch_id, index),
            timeout=self.lease_seconds,
            blocking=False,
            thread_local=False,  # the renewer thread must see the token this thread acquired it with
        )
        if not lease.acquire():
            raise ChunkBusy(f"chunk {index} of {batch_id} is running elsewhere")
        held = HeldLease(lease)
        stop_renewing = threading.Event()
        renewer = threading.Thread(
            target=_keep_renewing, args=(held, stop_renewing, self.lease_seconds / 3), daemon=True
        )
        renewer.start()
        try:
            yield held
        finally:
            stop_renewing.set()
            renewer.join()
            try:
                lease.release()
            except LockError:  # it lapsed meanwhile; whoever took it over will find the output and skip
                pass

    def held(self, batch_id: str, indexes: Sequence[int]) -> list[bool]:
        """Whether each of the batch's chunks is leased now (one round trip)."""
        leases = self.redis.pipeline(transaction=False)
        for index in indexes:
            leases.exists(self.key(batch_id, index))
        return [bool(leased) for leased in leases.execute()]


def _keep_renewing(lease: HeldLease, stop: threading.Event, every_seconds: float) -> None:
    while not stop.wait(every_seconds):
        try:
            lease.renew()
        except LeaseLost as lost:  # the block finds out when it confirms the lease before writing
            log.warning("%s", lost)
            return
        except RedisError as unreachable:  # Redis restarting: the lease may survive it, so keep trying
            log.warning("cannot renew %s: %s", lease.lock.name, unreachable)
