"""Giving the memory a chunk freed back to the system, so a worker's resident size follows its work, not its past.

A worker runs chunks on many threads (Celery's thread pool) beside the engine's. glibc's malloc gives every thread
that allocates an arena of its own, up to eight per core, and keeps what Python and torch free in those arenas for
reuse: each chunk's prompts, token lists, detokenised text and records are freed when it ends, but the pages stay
with the process. Two things bound it: the arenas are capped at start (`cap_malloc_arenas`, as MALLOC_ARENA_MAX
would, before the pool's threads exist), and after each chunk `malloc_trim` hands the free pages of every arena
back (`return_freed_memory`). `bench/worker_memory.py` measures both against glibc's default.

On a C library other than glibc (musl, macOS) both are no-ops: their allocators neither keep per-thread arenas
like this nor have these calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
ARENAS = 2  # enough for the engine's thread and the chunk threads' short bursts; the main arena makes one more


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _glibc()


def cap_malloc_arenas(arenas: int = ARENAS) -> None:
    """At most `arenas` malloc arenas from now on (glibc): call before the worker's threads start."""
    if _LIBC is not None and not _LIBC.mallopt(M_ARENA_MAX, arenas):
        log.warning("mallopt(M_ARENA_MAX, %d) failed; malloc keeps its default arenas", arenas)


def return_freed_memory() -> None:
    """Hand the free pages of every malloc arena back to the system (glibc's malloc_trim)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
