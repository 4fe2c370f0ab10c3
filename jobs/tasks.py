"""Celery tasks: thin wrappers that hand each step to the worker's `Pipeline`.

Defined only in a worker, by `register_tasks` at its start, over the pipeline it built: no module global holds the
pipeline, and nothing imports this module to send a task (`jobs.enqueue` sends them by name).
"""

from __future__ import annotations

import functools

from celery import Celery, Task
from celery.exceptions import Ignore, Reject

from engine.admission import EngineFailed
from jobs import enqueue, files
from jobs.celery_app import TaskName
from jobs.expiry import expire_due_batches
from jobs.broker_messages import chunk_messages
from jobs.recovery import fail_stalled_finalizes, resend_lost_chunks, resend_lost_work
from jobs.models import utcnow
from jobs.run.lease import ChunkBusy
from jobs.run.memory import return_freed_memory
from jobs.run.pipeline import ChunkCannotRun, Pipeline
from jobs.schedules.firing import fire_due_schedules
from jobs.webhooks.delivery import DeliveryPolicy, attempt_delivery, send_due_deliveries


def register_tasks(app: Celery, pipeline: Pipeline) -> None:
    settings = pipeline.settings
    # Not shared: Celery adds a shared task to every app created afterwards, where the first pipeline's would then
    # answer for another app's (a second app in one process: the tests' eager apps, each over its own database).
    task = functools.partial(app.task, shared=False)

    def give_up_validate(
        task: Task, error: BaseException, task_id: str, args: tuple[str], kwargs: dict[str, object], einfo: object
    ) -> None:
        # Celery calls this (the task's on_failure) only once no retry is left (9 attempts over a few minutes of
        # backoff): nothing would validate the batch again, so it fails now instead of at its expiry.
        pipeline.give_up_validate(args[0], task.request.retries + 1, error)

    @task(
        name=TaskName.validate,
        autoretry_for=(Exception,),
        retry_backoff=True,
        max_retries=8,
        on_failure=give_up_validate,
    )
    def validate(batch_id: str) -> None:
        pipeline.validate(batch_id)

    def give_up_chunk(
        task: Task, error: BaseException, task_id: str, args: tuple[str, int], kwargs: dict[str, object], einfo: object
    ) -> None:
        # As for validate: no retry is left (or none could succeed: ChunkCannotRun is not retried), so the chunk's
        # requests fail now and the batch finalizes, instead of the batch waiting in `in_progress` for its expiry.
        pipeline.give_up_chunk(args[0], args[1], task.request.retries + 1, error)

    @task(
        name=TaskName.run_chunk, bind=True, autoretry_for=(Exception,), dont_autoretry_for=(Reject, ChunkCannotRun),
        retry_backoff=True, max_retries=8, on_failure=give_up_chunk,
    )
    def run_chunk(self: Task, batch_id: str, index: int) -> None:
        try:
            pipeline.run_chunk(batch_id, index)
        except ChunkBusy:
            # Not an error: the chunk is running elsewhere. Come back when its lease would have lapsed, then skip or
            # take over; sent again as the same attempt, since waiting spends none of the chunk's retries (Celery's
            # retry() would count it and stop after max_retries, and the chunk would then give up while another
            # thread runs it).
            self.signature_from_request(countdown=settings.chunk_lease_seconds / 2, retries=self.request.retries).apply_async()
            raise Ignore() from None
        except EngineFailed as failed:
            # Not the chunk's fault either: this worker's engine can never step again, and the worker is stopping
            # (jobs.worker). The chunk wrote nothing and released its lease; its message goes back to the queue now,
            # for a worker whose engine runs, without spending one of its retries.
            raise Reject(failed, requeue=True) from failed
        finally:
            return_freed_memory()  # what the chunk's requests and records held goes back to the system (jobs.run.memory)

    # Its retries spent, a finalize is sent again by the recovery sweep until `finalize_timeout_seconds` fail it.
    @task(name=TaskName.finalize, autoretry_for=(Exception,), retry_backoff=True, max_retries=8)
    def finalize(batch_id: str) -> None:
        pipeline.finalize(batch_id)

    @task(name=TaskName.expire_batches)
    def expire_batches() -> None:
        # No retries: beat sends the next sweep in a few seconds anyway.
        expire_due_batches(pipeline.sessions, pipeline.stop_flags, enqueue.finalize)

    @task(name=TaskName.delete_expired_files)
    def delete_expired_files() -> None:
        # No retries: beat sends the next sweep in a few seconds anyway.
        files.delete_expired_files(pipeline.sessions, pipeline.store)

    @task(name=TaskName.recover_lost_work)
    def recover_lost_work() -> None:
        # No retries: beat sends the next sweep in a few seconds anyway.
        resend_lost_work(pipeline.sessions, enqueue.validate, enqueue.finalize)
        leases = pipeline.leases
        # Reading the queues costs a pass over every queued chunk message: at most once per half lease, whichever
        # worker's sweep comes first (a dead worker's chunk still runs again within about 1.5 leases of its death).
        scan_key = f"{settings.redis_prefix}lost-chunk-scan"
        if leases.redis.set(scan_key, 1, nx=True, ex=max(1, int(leases.lease_seconds / 2))):
            resend_lost_chunks(
                pipeline.sessions,
                leases,
                lambda models: chunk_messages(
                    leases.redis, settings.redis_prefix, {enqueue.chunk_queue(model) for model in models}
                ),
                enqueue.run_chunk,
            )
        pipeline.enqueue_webhook_deliveries(
            fail_stalled_finalizes(pipeline.sessions, pipeline.store, settings.finalize_timeout_seconds)
        )

    @task(name=TaskName.fire_due_schedules)
    def fire_schedules() -> None:
        # No retry: beat sends the next sweep within seconds, and a schedule that failed stays due for it.
        fire_due_schedules(
            pipeline.sessions,
            pipeline.store,
            enqueue.validate,
            embedding_model=settings.embedding_model,
            served_models=pipeline.models.registry.served,
            window_seconds=settings.completion_window_seconds,
        )

    # No retries for the webhook tasks: a failed attempt is recorded with its next time in the database, and an
    # attempt that never happened (a crash, Redis down) is still due there, where beat's sweep finds it.
    @task(name=TaskName.deliver_webhook)
    def deliver_webhook(delivery_id: str) -> None:
        attempt_delivery(pipeline.sessions, DeliveryPolicy.from_settings(settings), due_by=utcnow(), delivery_id=delivery_id)

    @task(name=TaskName.send_due_webhooks)
    def send_due_webhooks() -> None:
        send_due_deliveries(pipeline.sessions, DeliveryPolicy.from_settings(settings))
