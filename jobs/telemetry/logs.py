"""Logging for the service's processes (`conveyor api`, `worker`, `beat`): JSON lines or plain text on stderr.

While a task works on a batch, every record logged on its thread carries `batch_id` (and `chunk_index` for a chunk):
`jobs.telemetry.task_metrics` sets the context from the task's arguments when the task starts, so the pipeline's own log
calls need no `extra=`. A record given those fields explicitly through `extra=` keeps its own values.
"""

from __future__ import annotations

import logging
import logging.config
import threading
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from celery import signals
from pythonjsonlogger.json import JsonFormatter

from jobs.settings import Settings


@dataclass(frozen=True)
class LogContext:
    batch_id: str | None = None
    chunk_index: int | None = None


_context: ContextVar[LogContext] = ContextVar("conveyor_log_context", default=LogContext())


def set_log_context(context: LogContext) -> None:
    _context.set(context)


class LogContextFilter(logging.Filter):
    """Copies the current task's batch and chunk onto each record; set on the handler, so it sees every logger's records."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _context.get()
        if context.batch_id is not None and not hasattr(record, "batch_id"):
            record.batch_id = context.batch_id
        if context.chunk_index is not None and not hasattr(record, "chunk_index"):
            record.chunk_index = context.chunk_index
        return True


class ContextTextFormatter(logging.Formatter):
    """Plain text, with ` batch_id=… chunk_index=…` appended when the record has them."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = [f"{name}={getattr(record, name)}" for name in ("batch_id", "chunk_index") if hasattr(record, name)]
        return " ".join([text, *fields])


def logging_config(log_format: str, level: str = "INFO") -> dict[str, Any]:
    """A `logging.config.dictConfig` dictionary; uvicorn takes it as `log_config` and applies it in each worker process."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"log_context": {"()": LogContextFilter}},
        "formatters": {
            "json": {
                "()": JsonFormatter,
                "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s",
                "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"},
            },
            "text": {"()": ContextTextFormatter, "fmt": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
        },
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": log_format,
                "filters": ["log_context"],
            }
        },
        "root": {"level": level.upper(), "handlers": ["stderr"]},
    }


def configure_logging(settings: Settings, level: str = "INFO") -> None:
    """For the worker and beat: configure the root logger, and keep Celery from replacing the configuration with its own."""
    logging.config.dictConfig(logging_config(settings.log_format, level))
    logging.captureWarnings(True)  # warnings too become records in the chosen format, not raw stderr text
    threading.excepthook = _log_uncaught_thread_exception
    # Celery sets up logging itself unless some receiver answers this signal.
    signals.setup_logging.connect(_keep_configured_logging, weak=False)


def _keep_configured_logging(**_: object) -> None:
    pass


def _log_uncaught_thread_exception(hook: threading.ExceptHookArgs) -> None:
    """A helper thread's crash, as one record in the log's format rather than a raw traceback on stderr."""
    if hook.exc_type is SystemExit:
        return
    exc_info = (hook.exc_type, hook.exc_value, hook.exc_traceback)
    thread_name = hook.thread.name if hook.thread is not None else "unknown"
    logging.getLogger(__name__).error("uncaught exception in thread %s", thread_name, exc_info=exc_info)
