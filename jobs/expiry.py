"""The expiry sweep: batches still validating, running or cancelling when their completion window ends become
`expired`.

Not `finalizing` ones. OpenAI's `expired` says requests did not run in time, and keeps the completed ones' results;
a finalizing batch has every request answered (or already stopped by a cancel or this sweep), so there is nothing
left to stop, and its finalize would compose the same files whatever the status said. What can still go wrong there
is finalize itself, which expiring cannot help: `jobs.recovery` re-sends it, and fails the batch (results kept) once
it has been finalizing for `finalize_timeout_seconds`. So no batch stays non-terminal past its window by more than
that.

Beat sends the sweep every few seconds. It stops each such batch the way a cancel does: `expired_at` is set and
the batch moves to `finalizing` under its row lock (so two sweeps, or a sweep and a cancel, cannot both claim
it), the stop flag aborts its requests in the engine, and finalize drops its queued chunks, keeps what finished
and reports every unfinished request as a `batch_expired` error line, then sets `expired`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import select

from jobs.db import SessionFactory
from jobs.models import Batch, BatchStatus, utcnow
from jobs.stop_flags import StopFlags, StopReason

log = logging.getLogger(__name__)

EXPIRABLE_STATUSES = (BatchStatus.validating, BatchStatus.in_progress, BatchStatus.cancelling)


def expire_due_batches(
    sessions: SessionFactory,
    stop_flags: StopFlags,
    enqueue_finalize: Callable[[str], None],
    now: datetime | None = None,
) -> list[str]:
    """Stop every batch past its `expires_at`; returns their ids."""
    now = now or utcnow()
    with sessions.begin() as session:
        due = session.scalars(
            select(Batch)
            .where(Batch.status.in_(EXPIRABLE_STATUSES), Batch.expires_at <= now)
            .order_by(Batch.expires_at)
            # A batch another sweep (or a cancel) holds is that one's to settle.
            .with_for_update(skip_locked=True)
        ).all()
        for batch in due:
            batch.status, batch.expired_at, batch.finalizing_at = BatchStatus.finalizing, now, now
        expired = [batch.id for batch in due]
    for batch_id in expired:
        log.info("batch %s expired: stopping it", batch_id)
        stop_flags.raise_flag(batch_id, StopReason.expired)
        enqueue_finalize(batch_id)
    return expired
