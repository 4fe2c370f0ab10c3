"""`conveyor up` repeats its children's errors on its console: each error line once, in either log format, with the
log's path; nothing from before the child started."""

from __future__ import annotations

import json
from pathlib import Path

from conveyor.child_logs import ChildLog


def test_errors_are_repeated_once_with_the_log_path_and_old_ones_are_not(tmp_path: Path) -> None:
    path = tmp_path / "worker.log"
    path.write_text("2026-01-01 10:00:00,000 ERROR jobs.worker: an error of an earlier run\n")
    child_log = ChildLog.from_now("worker", path)
    assert child_log.new_errors() == []

    with path.open("a") as log:
        log.write("2026-01-01 10:00:01,000 INFO conveyor_kernels.cpu_kernels: building the C++ CPU kernels\n")
        log.write(
            "2026-01-01 10:00:02,000 ERROR jobs.telemetry.worker_metrics: cannot serve metrics on 127.0.0.1:9464 "
            "([Errno 98] Address already in use); set CONVEYOR_WORKER_METRICS_PORT to a free port, or 0\n"
        )
        log.write("Traceback (most recent call last):\n")  # a traceback's lines are the log's to keep
        log.write(json.dumps({"time": "t", "level": "CRITICAL", "logger": "x", "message": "the engine failed"}) + "\n")
        log.write(json.dumps({"time": "t", "level": "INFO", "message": "an ERROR in a message is no error"}) + "\n")
        log.write("2026-01-01 10:00:03,000 ERROR half a line")  # not yet whole: read when its newline comes

    errors = child_log.new_errors()
    assert errors == [
        f"worker: 2026-01-01 10:00:02,000 ERROR jobs.telemetry.worker_metrics: cannot serve metrics on 127.0.0.1:9464 "
        f"([Errno 98] Address already in use); set CONVEYOR_WORKER_METRICS_PORT to a free port, or 0 (see {path})",
        f"worker: CRITICAL x: the engine failed (see {path})",
    ]
    assert child_log.new_errors() == []
    with path.open("a") as log:
        log.write(" written\n")
    assert child_log.new_errors() == [f"worker: 2026-01-01 10:00:03,000 ERROR half a line written (see {path})"]
    assert child_log.last_line == "2026-01-01 10:00:03,000 ERROR half a line written"
