"""The recovery sweep: work whose task was lost is sent again, so that every batch reaches a terminal state.

Beat sends it every few seconds, beside the expiry sweep (`jobs.expiry`), which covers every batch that is still
not terminal when its completion window ends. This one covers the tasks that never ran or never will:

- a batch created while Redis was down has no validate task (`Batch.validate_unsent`): sent now;
- a `cancelling` or `finalizing` batch that has not moved for `STALLED_SECONDS` lost its finalize task (a crash
  between a commit and its enqueue, a task that gave up): sent again. Finalize is idempotent and ends a cancel
  whose validate never ran as well as one whose chunks are gone, so an extra one costs little. The re-sends are
  paced (`Batch.finalize_resent_at`): each waits at least half the time the batch has been stalled, so one whose
  finalize keeps failing gets a handful of them (at 1, 2, 4, 8, ... minutes), not one per sweep, each with its own
  chain of Celery retries;
- an `in_progress` batch's pending chunk whose task is lost (`resend_lost_chunks`): no live lease, no message
  waiting in its queue, and none delivered to a worker within the last lease (a live worker takes a chunk's lease
  the moment it starts it). That is a chunk whose worker died (its message unacknowledged until the visibility
  timeout, 10 minutes by default), or was stalled past its lease, or whose message vanished (a purged queue, a
  Redis that lost its data). Sent again at once: the new task takes the lease and runs it. The queues are read at
  most once per half lease (`jobs.tasks`), so a dead worker's chunk runs again within about 1.5 leases of its
  death plus a beat interval (`Settings.chunk_lease_seconds`, 60 s: under two minutes), not the visibility timeout. The ledger keeps it exactly-once: the old message, when the broker hands it back, finds the chunk done;
  a stalled holder that resumes finds its lease taken and drops its results (`jobs.run.lease`);
- idempotency keys past their lifetime are deleted.

A task that cannot be sent now (Redis still down) is tried again by the next sweep.

Re-sending is not enough when finalize itself keeps failing (an object store refusing the copies, a worker killed
by every attempt): `fail_stalled_finalizes` ends a batch that has been `finalizing` or `cancelling` for longer than
`Settings.finalize_timeout_seconds` as `failed` (`finalize_failed`), naming where its chunks' results are kept.
With the expiry sweep that bounds every batch: terminal at the latest `finalize_timeout_seconds` after its window.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Row, func, or_, select, update

from jobs import idempotency
from jobs.broker_messages import ChunkMessages
from jobs.db import SessionFactory
from jobs.models import Batch, BatchStatus, Chunk, ChunkStatus, utcnow
from jobs.object_keys import batch_prefix
from jobs.run.lease import ChunkLeases
from jobs.run.ledger import fail_locked
from jobs.storage import ObjectStore

log = logging.getLogger(__name__)

STALLED_SECONDS = 60  # a cancelling or finalizing batch unchanged this long has lost its finalize task


def resend_lost_work(
    sessions: SessionFactory,
    enqueue_validate: Callable[[str], None],
    enqueue_finalize: Callable[[str], None],
    now: datetime | None = None,
) -> None:
    now = now or utcnow()
    with sessions.begin() as session:
        unsent = session.scalars(
            select(Batch.id).where(Batch.validate_unsent, Batch.status == BatchStatus.validating)
        ).all()
        stalled = [
            batch
            for batch in session.scalars(
                select(Batch).where(_settling_since(now - timedelta(seconds=STALLED_SECONDS))).with_for_update(skip_locked=True)
            )
            if _resend_due(batch, now)
        ]
        for batch in stalled:
            batch.finalize_resent_at = now
        stalled_ids = [batch.id for batch in stalled]
        forgotten = idempotency.forget_expired(session, now)
    if forgotten:
        log.info("forgot %d expired idempotency keys", forgotten)
    for batch_id in unsent:
        log.info("batch %s: sending the validate task that could not be queued when it was created", batch_id)
        enqueue_validate(batch_id)
        with sessions.begin() as session:
            session.execute(update(Batch).where(Batch.id == batch_id).values(validate_unsent=False))
    for batch_id in stalled_ids:
        log.info("batch %s: sending finalize again, the batch has not moved for %d s", batch_id, STALLED_SECONDS)
        enqueue_finalize(batch_id)


def resend_lost_chunks(
    sessions: SessionFactory,
    leases: ChunkLeases,
    broker_messages: Callable[[set[str | None]], ChunkMessages],
    enqueue_run_chunk: Callable[[str, int, int, str | None], None],
    now: datetime | None = None,
) -> int:
    """Send again the pending chunks of `in_progress` batches whose task is lost; `broker_messages` reads what the
    broker holds for the chunks of these models' queues. Returns how many were sent."""
    now = now or utcnow()
    lease = timedelta(seconds=leases.lease_seconds)
    with sessions() as session:
        pending = session.execute(
            select(Chunk.batch_id, Chunk.index, Batch.priority, Batch.model)
            .join(Batch, Batch.id == Chunk.batch_id)
            # Started a lease ago at least: validate enqueues the chunks just after it commits them.
            .where(Batch.status == BatchStatus.in_progress, Batch.in_progress_at <= now - lease)
            .where(Chunk.status == ChunkStatus.pending)
            .order_by(Chunk.batch_id, Chunk.index)
        ).all()
    unleased = [row for row, leased in zip(pending, _leased(leases, pending)) if not leased]
    if not unleased:
        return 0
    held = broker_messages({row.model for row in unleased})
    delivered_before = (now - lease).timestamp()
    lost = [
        row
        for row in unleased
        if (row.batch_id, row.index) not in held.queued
        and held.delivered_at.get((row.batch_id, row.index), 0.0) <= delivered_before
    ]
    for row in lost:
        log.warning(
            "batch %s chunk %d: no lease, no queued task and none delivered within %g s: sending it again",
            row.batch_id, row.index, leases.lease_seconds,
        )
        enqueue_run_chunk(row.batch_id, row.index, row.priority, row.model)
    return len(lost)


def _leased(leases: ChunkLeases, chunks: list[Row[tuple[str, int, int, str | None]]]) -> list[bool]:
    held: list[bool] = []
    for batch_id, rows in itertools.groupby(chunks, key=lambda row: row.batch_id):
        held += leases.held(batch_id, [row.index for row in rows])
    return held


def _resend_due(batch: Batch, now: datetime) -> bool:
    """Whether a stalled batch's finalize is sent again now: never sent again yet, or the last re-send is at least
    half the batch's stalled time ago (and at least `STALLED_SECONDS`)."""
    if batch.finalize_resent_at is None:
        return True
    settling_since = batch.cancelling_at if batch.status == BatchStatus.cancelling else batch.finalizing_at
    assert settling_since is not None  # `_settling_since` selected it by this time
    wait = max(timedelta(seconds=STALLED_SECONDS), (now - settling_since) / 2)
    return now - batch.finalize_resent_at >= wait


def fail_stalled_finalizes(
    sessions: SessionFactory, store: ObjectStore, timeout_seconds: float, now: datetime | None = None
) -> list[str]:
    """Fail the batches finalizing (or cancelling) for longer than `timeout_seconds`; returns the webhook deliveries
    to enqueue. Nothing is deleted: the error names where the chunks' results are."""
    now = now or utcnow()
    deliveries: list[str] = []
    with sessions.begin() as session:
        stalled = session.scalars(
            select(Batch)
            .where(_settling_since(now - timedelta(seconds=timeout_seconds)))
            # A batch whose row a finalize holds is being settled right now: not stalled.
            .with_for_update(skip_locked=True)
        ).all()
        for batch in stalled:
            done = session.scalar(
                select(func.count()).where(Chunk.batch_id == batch.id, Chunk.status == ChunkStatus.done)
            )
            kept = (
                f"the results of its {done} finished chunks are kept under {store.url(batch_prefix(batch.id))} "
                "(chunks/<index>.output.jsonl and chunks/<index>.errors.jsonl, validation_errors.jsonl)"
                if done
                else f"no chunk had finished; validation's errors, if any, are under {store.url(batch_prefix(batch.id))}"
            )
            message = (
                f"finalize did not complete within {timeout_seconds:g} s (CONVEYOR_FINALIZE_TIMEOUT_SECONDS), so no "
                f"output or error file was made; {kept}"
            )
            log.error("batch %s: %s", batch.id, message)
            deliveries += fail_locked(session, batch, "finalize_failed", message)
    return deliveries


def _settling_since(before: datetime) -> ColumnElement[bool]:
    """Batches that started their finalize (a cancel: its request) at or before `before` and are not settled."""
    return or_(
        (Batch.status == BatchStatus.cancelling) & (Batch.cancelling_at <= before),
        (Batch.status == BatchStatus.finalizing) & (Batch.finalizing_at <= before),
    )
