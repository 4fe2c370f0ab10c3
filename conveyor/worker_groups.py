"""Several engines on one host: `conveyor worker --devices 0,1,2,3 --tensor-parallel-size 2` runs one worker
process per group of devices (here GPUs 0-1 and 2-3), each with its own engine sharded over its group, all
consuming the same queues.

Each group's worker sees only its GPUs (CUDA_VISIBLE_DEVICES), so its engine's rank r uses cuda:r. A group of
`cpu` entries runs its engine's ranks as CPU processes. The supervisor forwards SIGTERM/SIGINT to every group and,
when one group's worker exits, stops the others and exits with its code: a host with a dead engine restarts as a
whole (the container's restart policy) rather than serving at part strength unnoticed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType

_STOP_SECONDS = 60.0  # a group's worker gets this long to finish its warm shutdown before it is killed


def device_groups(devices: str, tensor_parallel_size: int) -> list[list[str]]:
    """'0,1,2,3' with size 2 -> [['0', '1'], ['2', '3']]. Entries are CUDA device indices or `cpu`."""
    entries = [entry.strip() for entry in devices.split(",") if entry.strip()]
    if not entries:
        raise ValueError("--devices is empty; give CUDA device indices (0,1,2,3) or cpu entries (cpu,cpu)")
    bad = [entry for entry in entries if entry != "cpu" and not entry.isdigit()]
    if bad:
        raise ValueError(f"--devices entries must be CUDA device indices or 'cpu', got {bad}")
    if len(entries) % tensor_parallel_size:
        raise ValueError(
            f"{len(entries)} devices do not split into groups of tensor_parallel_size={tensor_parallel_size}"
        )
    groups = [entries[i : i + tensor_parallel_size] for i in range(0, len(entries), tensor_parallel_size)]
    for group in groups:
        if set(group) != {"cpu"} and ("cpu" in group or len(set(group)) < len(group)):
            raise ValueError(f"a device group mixes cpu and GPUs or repeats a GPU: {group}")
    return groups


def group_environment(
    group: Sequence[str], index: int, tensor_parallel_size: int, metrics_port: int, environ: Mapping[str, str]
) -> dict[str, str]:
    """The variables of group `index`'s worker: its devices, its engine's TP size, its own metrics port."""
    env = dict(environ)
    env.pop("CONVEYOR_WORKER_DEVICES", None)  # the group's worker is one engine
    env["CONVEYOR_ENGINE_TENSOR_PARALLEL_SIZE"] = str(tensor_parallel_size)
    if group[0] == "cpu":
        env["CONVEYOR_DEVICE"] = "cpu"
    else:
        env["CONVEYOR_DEVICE"] = "cuda"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(group)
    if metrics_port:
        env["CONVEYOR_WORKER_METRICS_PORT"] = str(metrics_port + index)
    return env


def run_worker_groups(commands: Sequence[Sequence[str]], environments: Sequence[Mapping[str, str]]) -> int:
    """Start one worker per group and supervise them; returns the exit code of the first that exits."""
    children = [subprocess.Popen(list(command), env=dict(env)) for command, env in zip(commands, environments)]

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            exited = [child for child in children if child.poll() is not None]
            if exited:
                break
            time.sleep(0.5)
        _stop(children)
        return exited[0].returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(children: Sequence[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + _STOP_SECONDS
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def worker_command(queues: str | None, loglevel: str, index: int) -> list[str]:
    return [sys.executable, "-m", "conveyor", "worker", *(["--queues", queues] if queues else []),
            "--loglevel", loglevel, "--node-name", f"engine{index}@%h"]
