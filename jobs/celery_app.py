"""The Celery application: Redis as broker, late acknowledgement, two queues, and beat's periodic sweeps.

`control` carries validate and finalize (short, any worker); `gpu` carries run_chunk (the engine's work).
Every Redis key Celery writes carries the configured prefix, so deployments and test runs can share a server.
Beat (`conveyor beat`) sends each sweep every `CONVEYOR_BEAT_INTERVAL_SECONDS`; the sweeps themselves are
idempotent (each claims its rows in the database), so two beats or a restarted one do no harm.
"""

from __future__ import annotations

from celery import Celery

from jobs.settings import Settings

CONTROL_QUEUE = "control"
GPU_QUEUE = "gpu"
PERIODIC_TASKS = {  # beat entry -> task name
    "fire-due-schedules": "conveyor.fire_due_schedules",
    "expire-batches": "conveyor.expire_batches",
    "send-due-webhooks": "conveyor.send_due_webhooks",
}


def create_celery_app(settings: Settings) -> Celery:
    app = Celery("conveyor", broker=settings.redis_url, include=["jobs.tasks"])
    app.conf.update(
        broker_transport_options={
            "global_keyprefix": settings.redis_prefix,
            # An unacknowledged task goes back to the queue after this long: how a dead worker's chunks come back.
            "visibility_timeout": settings.task_visibility_timeout,
            # Look for such tasks every few seconds (kombu's default sweep is every ~100 s).
            "unacked_restore_interval": max(1, min(10, int(settings.task_visibility_timeout / 4))),
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        task_acks_late=True,  # acknowledged after the task ran: a crash mid-task means re-delivery, not loss
        task_reject_on_worker_lost=True,
        task_ignore_result=True,  # state lives in Postgres; nothing reads Celery results
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=CONTROL_QUEUE,
        task_routes={"conveyor.run_chunk": {"queue": GPU_QUEUE}},
        # Late acks count running tasks against the prefetch limit: 2 x concurrency keeps one task ready per slot.
        worker_prefetch_multiplier=2,
        # Every entry is an interval; nothing to remember across restarts, so no schedule file.
        beat_scheduler="celery.beat:Scheduler",
        beat_schedule={
            # A sweep nobody ran before the next one was sent is dropped: a stopped worker finds one, not a pile.
            name: {"task": task, "schedule": settings.beat_interval_seconds, "options": {"expires": settings.beat_interval_seconds}}
            for name, task in PERIODIC_TASKS.items()
        },
    )
    return app


celery_app = create_celery_app(Settings.from_env())
