"""What a worker's Celery tasks report, from Celery's task signals so that neither the tasks nor the pipeline know:
the log context (batch id, chunk index) while a task runs, each task's outcome, and how long chunks take.

Signals fire on the thread that runs the task (Celery's thread pool here), so the log context set before the task
is the one its log calls see.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from typing import Any

from celery import Task, signals, states
from prometheus_client import CollectorRegistry, Counter, Histogram

from jobs.telemetry.logs import LogContext, set_log_context

RUN_CHUNK_TASK = "conveyor.run_chunk"
# A chunk is CONVEYOR_CHUNK_SIZE requests: seconds on a GPU, minutes on a CPU.
CHUNK_SECONDS_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)


class TaskTelemetry:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.chunk_duration = Histogram(
            "conveyor_chunk_duration_seconds",
            "Wall time of run_chunk tasks that succeeded, from start to the chunk's output written",
            buckets=CHUNK_SECONDS_BUCKETS,
            registry=registry,
        )
        self.tasks = Counter(
            "conveyor_tasks",
            "Celery tasks this worker ran, by task name and outcome (success, retry, failure)",
            ["task", "outcome"],
            registry=registry,
        )
        # Task id -> monotonic start. Each entry is touched by the one thread running that task, and single dict
        # operations are atomic, so the thread pool needs no lock here.
        self._started: dict[str, float] = {}

    def connect(self) -> None:
        signals.task_prerun.connect(self._task_starting, weak=False)
        signals.task_postrun.connect(self._task_finished, weak=False)

    def _task_starting(self, task_id: str, task: Task, args: Sequence[Any], kwargs: dict[str, Any], **_: object) -> None:
        set_log_context(log_context_of(task, args, kwargs))
        self._started[task_id] = time.monotonic()

    def _task_finished(self, task_id: str, task: Task, state: str | None = None, **_: object) -> None:
        set_log_context(LogContext())  # the pool thread's next task must not inherit this one's ids
        started = self._started.pop(task_id, None)
        self.tasks.labels(task=task.name, outcome=(state or "unknown").lower()).inc()
        if task.name == RUN_CHUNK_TASK and state == states.SUCCESS and started is not None:
            self.chunk_duration.observe(time.monotonic() - started)


def log_context_of(task: Task, args: Sequence[Any], kwargs: dict[str, Any]) -> LogContext:
    """The batch and chunk a task works on, from its parameters named `batch_id` and `index` (run_chunk's)."""
    try:
        arguments = inspect.signature(task.run).bind_partial(*args, **kwargs).arguments
    except TypeError:  # arguments that do not fit: the task itself will fail on them, without ids in its logs
        return LogContext()
    batch_id, index = arguments.get("batch_id"), arguments.get("index")
    return LogContext(
        batch_id=batch_id if isinstance(batch_id, str) else None,
        chunk_index=index if isinstance(index, int) else None,
    )
