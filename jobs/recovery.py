"""The recovery sweep: work whose task was lost is sent again, so that every batch reaches a terminal state.

Beat sends it every few seconds, beside the expiry sweep (`jobs.expiry`), which covers every batch that is still
not terminal when its completion window ends. This one covers the tasks that never ran or never will:

- a batch created while Redis was down has no validate task (`Batch.validate_unsent`): sent now;
- a `cancelling` or `finalizing` batch that has not moved for `STALLED_SECONDS` lost its finalize task (a crash
  between a commit and its enqueue, a task that gave up): sent again. Finalize is idempotent and ends a cancel
  whose validate never ran as well as one whose chunks are gone, so an extra one costs little;
- idempotency keys past their lifetime are deleted.

A task that cannot be sent now (Redis still down) is tried again by the next sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update

from jobs import idempotency
from jobs.db import SessionFactory
from jobs.models import Batch, BatchStatus, utcnow

log = logging.getLogger(__name__)

STALLED_SECONDS = 60  # a cancelling or finalizing batch unchanged this long has lost its finalize task


def resend_lost_work(
    sessions: SessionFactory,
    enqueue_validate: Callable[[str], None],
    enqueue_finalize: Callable[[str], None],
    now: datetime | None = None,
) -> None:
    now = now or utcnow()
    stalled_before = now - timedelta(seconds=STALLED_SECONDS)
    with sessions.begin() as session:
        unsent = session.scalars(
            select(Batch.id).where(Batch.validate_unsent, Batch.status == BatchStatus.validating)
        ).all()
        stalled = session.scalars(
            select(Batch.id).where(
                or_(
                    (Batch.status == BatchStatus.cancelling) & (Batch.cancelling_at <= stalled_before),
                    (Batch.status == BatchStatus.finalizing) & (Batch.finalizing_at <= stalled_before),
                )
            )
        ).all()
        forgotten = idempotency.forget_expired(session, now)
    if forgotten:
        log.info("forgot %d expired idempotency keys", forgotten)
    for batch_id in unsent:
        log.info("batch %s: sending the validate task that could not be queued when it was created", batch_id)
        enqueue_validate(batch_id)
        with sessions.begin() as session:
            session.execute(update(Batch).where(Batch.id == batch_id).values(validate_unsent=False))
    for batch_id in stalled:
        log.info("batch %s: sending finalize again, the batch has not moved for %d s", batch_id, STALLED_SECONDS)
        enqueue_finalize(batch_id)
