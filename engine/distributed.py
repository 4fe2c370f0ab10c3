"""Tensor-parallel groups: which rank of a sharded model this process is, and the collectives its layers use.

A model sharded over `size` ranks runs in `size` processes, one device each (NCCL between GPUs, gloo between CPU
processes). Rank 0 is the engine's own process: it schedules and samples; the other ranks only compute their
shard (engine/tensor_parallel.py starts them). Layers take the group that is current while they are built
(`building_with`), so the model code names no ranks and a model built outside any group is the whole model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


def _nothing_to_check() -> None:
    return None


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int  # 0 schedules and samples
    size: int  # ranks the model is sharded over; 1: not sharded, no collectives at all
    # The rendezvous store, for agreeing on sizes while the ranks start (loading a shard can take minutes, longer
    # than a step's collective may wait); None when size == 1.
    store: dist.Store | None = None
    startup_timeout_seconds: float = 0.0
    # Raises when a rank is known to have died (rank 0's watchdog), so waiting on the others ends at once.
    check_peers: Callable[[], None] = field(default=_nothing_to_check, compare=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; every rank gets the same sum."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor`, concatenated along the last dimension on rank 0; None on the other ranks."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_first else None
        dist.gather(tensor, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_over_ranks(self, name: str, value: int) -> int:
        """The smallest of every rank's `value` of `name`: sizes all ranks must agree on, such as the KV block
        count, computed once each rank has loaded its shard, however long that took (up to the start-up timeout)."""
        if self.size == 1 or self.store is None:
            return value
        self.store.set(f"{name}/{self.rank}", str(value))
        keys = [f"{name}/{rank}" for rank in range(self.size)]
        wait_for_store(lambda: self.store.check(keys), self.startup_timeout_seconds, self.check_peers, name)
        return min(int(self.store.get(key)) for key in keys)


SINGLE = TensorParallelGroup(rank=0, size=1)
ARRIVED_KEY = "ranks-arrived"  # counter in the store: ranks 1..N-1 that reached it, so rank 0 can wait with an eye on them
_building: TensorParallelGroup = SINGLE


@contextmanager
def building_with(group: TensorParallelGroup) -> Iterator[None]:
    """Layers constructed inside take `group`'s rank and size: they hold and load only their shard."""
    global _building
    previous, _building = _building, group
    try:
        yield
    finally:
        _building = previous


def current_group() -> TensorParallelGroup:
    return _building


def open_store(size: int, startup_timeout_seconds: float, port: int | None = None) -> dist.TCPStore:
    """Rank 0 serves the store (port None: on a free port, so several engines on one host never collide); the
    other ranks connect to it and count themselves in."""
    timeout = timedelta(seconds=startup_timeout_seconds)
    if port is None:
        return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=timeout)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    store.add(ARRIVED_KEY, 1)
    return store


def wait_for_store(ready: Callable[[], bool], timeout_seconds: float, check_peers: Callable[[], None], what: str) -> None:
    """Poll `ready` until it holds, checking the other ranks' liveness meanwhile: a blocking store wait would sit
    out its whole timeout for a rank that died."""
    deadline = time.monotonic() + timeout_seconds
    while not ready():
        check_peers()
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel ranks: no {what} from every rank within {timeout_seconds:g} s")
        time.sleep(0.05)


def join_group(
    rank: int,
    size: int,
    store: dist.TCPStore,
    device: torch.device,
    timeout_seconds: float,
    startup_timeout_seconds: float,
    check_peers: Callable[[], None] = _nothing_to_check,
) -> TensorParallelGroup:
    """Join this process to its engine's group. Every collective fails after `timeout_seconds` instead of waiting
    forever for a lost rank."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_seconds))
    return TensorParallelGroup(rank, size, store, startup_timeout_seconds, check_peers)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def abort_group() -> None:
    """Make collectives waiting on a rank that died fail now (NCCL would wait for its timeout; gloo notices the
    closed connection by itself)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()

