"""The processes of a tensor-parallel engine: rank 0 (the engine's own process) starts ranks 1..N-1, hands each
step to them, and fails loudly when one dies.

Rank 0 alone schedules and samples. Each step it pickles the SchedulerOutput once and writes it down a pipe to
every other rank (and each LoRA adapter registered, once: every rank loads its own shard of it into its slots); each rank then moves its own KV blocks (swap, copy-on-write) and runs its shard of the forward
pass, meeting the others in the layers' collectives. A vision-language model's step carries, per prefill chunk, the
images it reaches (preprocessed pixels, M-RoPE grid positions, bidirectional spans: `ScheduledSequence.images`):
every rank encodes them with its own whole copy of the encoder and splices the rows into its input embeddings, as a
single engine does, with no collective of its own. The pipes carry plain data only and a rank blocks on its
pipe while the engine is idle, so an idle engine has no collective waiting to time out.

Failure is bounded in time: a watchdog thread on rank 0 waits on the ranks' process sentinels and records the
first one that exits (aborting an NCCL group so a collective waiting on it fails now; gloo sees the closed
socket by itself); every step checks that record first; every collective has the group's timeout. A rank whose
pipe closes (rank 0 died) exits. Ranks ignore SIGINT and SIGTERM: sent to the whole process group (Ctrl-C, a
service manager stopping the worker), they are rank 0's to answer with an orderly shutdown that stops the ranks,
not a rank's death that fails the engine.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import pickle
import signal
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.admission import EngineFailed
from engine.distributed import (
    ARRIVED_KEY,
    TensorParallelGroup,
    abort_group,
    join_group,
    leave_group,
    open_store,
    wait_for_store,
)
from engine.lora import LoRAAdapter
from engine.model_runner import ModelRunner, StepResult
from engine.model_shard import ModelShard, ShardSpec, build_model_shard
from engine.multimodal.encoder_step import EncoderStep
from engine.sampler import SamplingRow
from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

_STOP = pickle.dumps(None)
_JOIN_SECONDS = 10.0  # a rank told to stop gets this long to leave its group before it is killed


class RankFailure(EngineFailed):
    """A tensor-parallel rank died or stopped answering: the engine cannot step any more."""


class TensorParallelRanks:
    """Ranks 1..N-1 of one engine, seen from rank 0."""

    def __init__(self, spec: ShardSpec) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel engine per process")
        config = spec.config
        size = config.tensor_parallel_size
        store = open_store(size, config.tensor_parallel_startup_timeout)
        context = mp.get_context("spawn")
        self._pipes: list[Connection] = []
        self.processes: list[mp.Process] = []
        for rank in range(1, size):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_run_rank, args=(rank, spec, store.port, receiver), name=f"conveyor-tp-rank-{rank}", daemon=True
            )
            process.start()
            receiver.close()  # the child holds its own end; ours closing lets it see EOF if we die
            self._pipes.append(sender)
            self.processes.append(process)
        self.failure: str | None = None
        self._closing = False
        self._failed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()
        self._finalizer = weakref.finalize(self, _stop_ranks, self._pipes, self.processes)
        try:
            wait_for_store(
                lambda: store.add(ARRIVED_KEY, 0) == size - 1, config.tensor_parallel_startup_timeout, self.check, "start"
            )
            self.group = join_group(
                0, size, store, spec.device_of(0), config.tensor_parallel_timeout,
                config.tensor_parallel_startup_timeout, self.check,
            )
        except Exception as error:
            self.close()
            raise RankFailure(f"the tensor-parallel ranks did not join: {self.failure or error}") from error

    def _watch(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ready[0]]
        process = self.processes[rank - 1]
        process.join(timeout=1.0)
        self.failure = f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        log.error("%s; the engine can no longer step", self.failure)
        self._failed.set()
        abort_group()

    def check(self) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)

    def send(self, output: SchedulerOutput | LoRAAdapter) -> None:
        message = pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for pipe in self._pipes:
                pipe.send_bytes(message)
        except OSError as error:  # a rank's end of its pipe is gone: it died
            self._failed.wait(timeout=5.0)
            raise RankFailure(self.failure or f"a tensor-parallel rank is gone: {error}") from error

    def failed_step(self, error: BaseException) -> RankFailure:
        """The error to raise for a step whose collective failed: names the rank that died when there is one."""
        self._failed.wait(timeout=5.0)
        return RankFailure(f"a tensor-parallel step failed: {self.failure or error}")

    def close(self) -> None:
        """Stop every rank (told first, killed if it does not leave in time) and leave the group. Idempotent."""
        self._closing = True
        self._finalizer()
        leave_group()


def _stop_ranks(pipes: list[Connection], processes: list[mp.Process]) -> None:
    for pipe in pipes:
        try:
            pipe.send_bytes(_STOP)
        except OSError:
            pass
        pipe.close()
    for process in processes:
        process.join(timeout=_JOIN_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()


class TensorParallelRunner:
    """Rank 0's runner: hands each step to the other ranks, then runs its own shard and samples."""

    def __init__(self, local: ModelRunner, ranks: TensorParallelRanks) -> None:
        self.local = local
        self.ranks = ranks

    @property
    def swap_seconds(self) -> float:
        return self.local.swap_seconds

    @property
    def adapters(self) -> dict[str, LoRAAdapter]:
        return self.local.adapters

    @property
    def vision(self) -> EncoderStep | None:
        """Rank 0's encoder pass: every rank runs its own over the same steps, so its counts are every rank's."""
        return self.local.vision

    def register_adapter(self, adapter: LoRAAdapter) -> None:
        """Every rank keeps the adapter (its slots hold their own shard of it when a step loads it)."""
        self.ranks.check()
        self.ranks.send(adapter)
        self.local.register_adapter(adapter)

    def execute(
        self,
        output: SchedulerOutput,
        rows: Sequence[SamplingRow],
        fanout: Sequence[int] | None = None,
        token_bitmask: Future[torch.Tensor | None] | None = None,
    ) -> StepResult:
        self.ranks.check()
        self.ranks.send(output)
        try:  # the grammar's bitmask stays on rank 0: only rank 0 samples
            return self.local.execute(output, rows, fanout, token_bitmask)
        except RuntimeError as error:
            if isinstance(error, RankFailure):
                raise
            raise self.ranks.failed_step(error) from error

    def close(self) -> None:
        self.ranks.close()


def _run_rank(rank: int, spec: ShardSpec, store_port: int, steps: Connection) -> None:
    """A non-zero rank's process: build the shard, then run each step rank 0 sends until told to stop."""
    # Stopped by rank 0 alone (or by its pipe closing): a SIGINT or SIGTERM sent to the whole process group (Ctrl-C,
    # a service manager) is rank 0's to answer with an orderly shutdown, not a dead rank that fails its engine.
    for ask_to_stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(ask_to_stop, signal.SIG_IGN)
    config = spec.config
    store = open_store(config.tensor_parallel_size, config.tensor_parallel_startup_timeout, store_port)
    group: TensorParallelGroup = join_group(
        rank, config.tensor_parallel_size, store, spec.device_of(rank), config.tensor_parallel_timeout,
        config.tensor_parallel_startup_timeout,
    )
    try:
        shard: ModelShard = build_model_shard(spec, group)
        with torch.inference_mode():
            while True:
                try:
                    output = pickle.loads(steps.recv_bytes())
                except EOFError:  # rank 0 is gone
                    return
                if output is None:
                    return
                if isinstance(output, LoRAAdapter):
                    shard.runner.register_adapter(output)
                    continue
                shard.runner.execute(output, ())
    finally:
        leave_group()
