"""What `conveyor run` tells the person watching it: the engine's and the kernels' log lines (a model conversion, a
kernel build: long one-time steps) and the requests' progress, as a tqdm bar on a terminal, as whole lines
every LOG_LINE_INTERVAL_S where stderr is a file or a pipe (a log, CI), and none at all with --quiet."""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

from tqdm import tqdm

LOG_LINE_INTERVAL_S = 10.0  # at most one progress line this often when stderr is not a terminal

ProgressMode = Literal["bar", "lines", "none"]
# The loggers of the long steps before the first request runs: the model's resolution and conversion, the kernel build.
_WATCHED_LOGGERS = ("conveyor", "engine", "conveyor_kernels")


def progress_mode(quiet: bool) -> ProgressMode:
    if quiet:
        return "none"
    return "bar" if sys.stderr.isatty() else "lines"


def show_progress_logs(mode: ProgressMode) -> None:
    """Send the watched loggers' INFO records to stderr as plain lines; with `none`, only their warnings and errors."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in _WATCHED_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING if mode == "none" else logging.INFO)
        for earlier in [each for each in logger.handlers if isinstance(each, _StderrHandler)]:
            logger.removeHandler(earlier)  # a second run in one process (tests) writes each line once
        logger.addHandler(handler)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is when a record comes, as logging's last-resort handler does: a stream that was
    replaced since (a test's capture) is not written to after it closed."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def request_progress(mode: ProgressMode) -> bool | type[tqdm]:
    """What `LLM.generate(use_tqdm=...)` takes for `mode`."""
    return {"bar": True, "lines": ProgressLines, "none": False}[mode]


class ProgressLines(tqdm):
    """tqdm's meter as whole lines, at most one every LOG_LINE_INTERVAL_S, and one when it closes: a terminal bar
    redraws its line with carriage returns, which a log file shows as one garbled line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.update(
            mininterval=LOG_LINE_INTERVAL_S,
            smoothing=0,  # rates over the whole run: a line every few seconds needs no recent-speed estimate
            leave=False,  # close() writes the last line itself (below); tqdm's own would end with a bare newline
            bar_format="{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed} elapsed, ETA {remaining}, "
            "{rate_fmt}{postfix}]",
        )
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm erasing a bar that does not stay: a line once written stays
            return False
        self.fp.write(f"{self if msg is None else msg}\n")
        self.fp.flush()
        return True

    def close(self) -> None:
        if not self.disable:
            self.display()  # the final count, however recent the last line
        super().close()
