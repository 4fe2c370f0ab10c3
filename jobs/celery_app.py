"""The Celery application: Redis as broker, late acknowledgement, queues by model, and beat's periodic sweeps.

`control` carries validate and finalize (short, any worker); `gpu.<model>` carries run_chunk of that model's batches
(and validate of a batch read with that model's tokenizer), `gpu` the chunks of jobs bound to no model
(`jobs.served_models`, `jobs.enqueue`).
Every Redis key Celery writes carries the configured prefix, so deployments and test runs can share a server.
Beat (`conveyor beat`) sends each sweep every `CONVEYOR_BEAT_INTERVAL_SECONDS`; the sweeps themselves are
idempotent (each claims its rows in the database), so two beats or a restarted one do no harm.
"""

from __future__ import annotations

from celery import Celery

from jobs.batches import MAX_PRIORITY as MAX_BATCH_PRIORITY
from jobs.batches import MIN_PRIORITY as MIN_BATCH_PRIORITY
from jobs.settings import Settings

CONTROL_QUEUE = "control"
# The Redis transport's message priorities, 0 the most urgent (one Redis list per level, polled in order). Tasks
# sent without one (validate, finalize, the sweeps) get 0: a freed worker thread takes them before any chunk.
# Chunks get 1..9 from their batch's priority (lower runs first), the default batch priority 0 the middle level:
# an urgent batch's chunks are fetched before queued bulk ones.
MESSAGE_PRIORITIES = list(range(10))
DEFAULT_CHUNK_MESSAGE_PRIORITY = 5


class TaskName:
    """The tasks' names: what a message carries. The tasks are defined by `jobs.tasks`, in workers only; everyone
    else sends them by name (`jobs.enqueue`, beat)."""

    validate = "conveyor.validate"
    run_chunk = "conveyor.run_chunk"
    finalize = "conveyor.finalize"
    expire_batches = "conveyor.expire_batches"
    recover_lost_work = "conveyor.recover_lost_work"
    fire_due_schedules = "conveyor.fire_due_schedules"
    deliver_webhook = "conveyor.deliver_webhook"
    send_due_webhooks = "conveyor.send_due_webhooks"
    delete_expired_files = "conveyor.delete_expired_files"


PERIODIC_TASKS = {  # beat entry -> task name
    "fire-due-schedules": TaskName.fire_due_schedules,
    "expire-batches": TaskName.expire_batches,
    "recover-lost-work": TaskName.recover_lost_work,
    "send-due-webhooks": TaskName.send_due_webhooks,
    "delete-expired-files": TaskName.delete_expired_files,
}


def create_celery_app(settings: Settings) -> Celery:
    app = Celery("conveyor", broker=settings.redis_url)
    app.conf.update(
        broker_transport="jobs.broker:Transport",  # kombu's Redis transport, surviving a Redis restart
        broker_transport_options={
            "global_keyprefix": settings.redis_prefix,
            # An unacknowledged task goes back to the queue after this long: how a dead worker's chunks come back.
            "visibility_timeout": settings.task_visibility_timeout,
            # Look for such tasks every few seconds (kombu's default sweep is every ~100 s).
            "unacked_restore_interval": max(1, min(10, int(settings.task_visibility_timeout / 4))),
            "unacked_restore_throttle": 1,
            "priority_steps": MESSAGE_PRIORITIES,
        },
        broker_connection_retry_on_startup=True,
        task_acks_late=True,  # acknowledged after the task ran: a crash mid-task means re-delivery, not loss
        task_reject_on_worker_lost=True,
        task_ignore_result=True,  # state lives in Postgres; nothing reads Celery results
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=CONTROL_QUEUE,
        # A worker fetches a task only when a thread is free. Tasks prefetched into a worker would wait there in
        # arrival order behind its chunks, out of reach of a priority batch's chunks, validate, finalize and the
        # sweeps. Fetching costs a round trip; the engine does not notice, as a worker runs chunks for twice its
        # running batch (Settings.effective_worker_concurrency).
        worker_disable_prefetch=True,
        # Every entry is an interval; nothing to remember across restarts, so no schedule file.
        beat_scheduler="celery.beat:Scheduler",
        beat_schedule={
            # A sweep nobody ran before the next one was sent is dropped: a stopped worker finds one, not a pile.
            name: {"task": task, "schedule": settings.beat_interval_seconds, "options": {"expires": settings.beat_interval_seconds}}
            for name, task in PERIODIC_TASKS.items()
        },
    )
    return app


def message_priority(batch_priority: int) -> int:
    """The message priority of a batch's chunk tasks. The default batch priority 0 has a level of its own, so
    any negative priority goes ahead of default work and any positive one behind it."""
    clamped = min(max(batch_priority, MIN_BATCH_PRIORITY), MAX_BATCH_PRIORITY)
    default = DEFAULT_CHUNK_MESSAGE_PRIORITY
    if clamped < 0:  # -1 .. MIN over the levels between the control tasks' and the default
        return default - 1 - (-clamped - 1) * (default - 1) // -MIN_BATCH_PRIORITY
    if clamped > 0:  # 1 .. MAX over the levels after the default
        return default + 1 + (clamped - 1) * (MESSAGE_PRIORITIES[-1] - default) // MAX_BATCH_PRIORITY
    return default


celery_app = create_celery_app(Settings.from_env())
