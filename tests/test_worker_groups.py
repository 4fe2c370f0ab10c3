"""`conveyor worker --devices ...`: one worker process (one engine) per device group, supervised together."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.worker_groups import device_groups, group_environment, run_worker_groups


def test_devices_split_into_groups_of_the_tensor_parallel_size() -> None:
    assert device_groups("0,1,2,3,4,5,6,7", 2) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert device_groups("0,1,2,3", 1) == [["0"], ["1"], ["2"], ["3"]]
    assert device_groups("cpu,cpu,cpu,cpu", 2) == [["cpu", "cpu"], ["cpu", "cpu"]]


@pytest.mark.parametrize(
    ("devices", "size", "message"),
    [
        ("0,1,2", 2, "3 devices do not split into groups of tensor_parallel_size=2"),
        ("", 1, "--devices is empty"),
        ("0,gpu1", 1, "must be CUDA device indices or 'cpu'"),
        ("0,cpu", 2, "mixes cpu and GPUs"),
        ("1,1", 2, "repeats a GPU"),
    ],
)
def test_bad_device_lists_are_refused(devices: str, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        device_groups(devices, size)


def test_each_group_sees_only_its_gpus_and_gets_its_own_metrics_port() -> None:
    env = group_environment(["2", "3"], 1, 2, 9464, {"CONVEYOR_WORKER_DEVICES": "0,1,2,3", "PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["CONVEYOR_DEVICE"] == "cuda"
    assert env["CONVEYOR_ENGINE_TENSOR_PARALLEL_SIZE"] == "2"
    assert env["CONVEYOR_WORKER_METRICS_PORT"] == "9465"
    assert "CONVEYOR_WORKER_DEVICES" not in env and env["PATH"] == "/bin"
    cpu = group_environment(["cpu"], 0, 1, 0, {})
    assert cpu["CONVEYOR_DEVICE"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in cpu and "CONVEYOR_WORKER_METRICS_PORT" not in cpu


def test_the_supervisor_runs_every_group_and_stops_them_all_when_one_exits(tmp_path: Path) -> None:
    """Group 1 exits with code 3; group 0, which would run for minutes, is stopped; the supervisor returns 3."""
    script = (
        "import json, os, sys, time; "
        "open(sys.argv[1], 'w').write(json.dumps({k: os.environ.get(k) for k in ('CONVEYOR_DEVICE', 'CUDA_VISIBLE_DEVICES')})); "
        "time.sleep(0.5 if sys.argv[2] == '1' else 300); sys.exit(3)"
    )
    groups = device_groups("0,1,2,3", 2)
    commands = [[sys.executable, "-c", script, str(tmp_path / f"group{i}.json"), str(i)] for i in range(len(groups))]
    environments = [group_environment(group, i, 2, 0, {}) for i, group in enumerate(groups)]
    assert run_worker_groups(commands, environments) == 3
    seen = [json.loads((tmp_path / f"group{i}.json").read_text()) for i in range(2)]
    assert seen == [
        {"CONVEYOR_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "0,1"},
        {"CONVEYOR_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "2,3"},
    ]


def test_the_worker_command_refuses_devices_that_do_not_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--devices", "0,1,2", "--tensor-parallel-size", "2"]) == 1
    assert "3 devices do not split into groups" in capsys.readouterr().err
