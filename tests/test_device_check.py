"""What a lent GPU machine runs works there: it has torch, triton, transformers, peft and pillow, none of the
service's packages (tests/without_service_packages/sitecustomize.py makes this interpreter look the same)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WITHOUT_SERVICE_PACKAGES = Path(__file__).resolve().parent / "without_service_packages"


def without_service_packages() -> dict[str, str]:
    """The environment of a subprocess in which importing a service package fails."""
    path = os.pathsep.join(filter(None, [str(WITHOUT_SERVICE_PACKAGES), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.slow
def test_dry_run_runs_every_part_and_writes_its_files(tmp_path: Path) -> None:
    """`bench/device_check.sh --dry-run` on the CPU, as a lent GPU would run it: without the service's packages
    and the test-only ones (so collecting the CUDA tests imports none of them), building no C++ CPU kernel."""
    out, extensions = tmp_path / "out", tmp_path / "torch_extensions"  # where torch would build the CPU kernels
    environment = {**without_service_packages(), "OUT": str(out), "PYTHON": sys.executable,
                   "TORCH_EXTENSIONS_DIR": str(extensions)}
    result = subprocess.run(
        ["bash", "bench/device_check.sh", "--dry-run"], cwd=ROOT, env=environment, capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not extensions.exists()

    versions = json.loads((out / "env" / "versions.json").read_text())
    assert versions["torch"] == torch.__version__ and versions["gpu"] is None

    names: dict[str, set[str]] = {}
    for part in ("cuda_engine_tests", "cuda_kernel_tests"):  # every CUDA test collected, skipped here
        suite = ElementTree.parse(out / part / "junit.xml").getroot().find("testsuite")
        assert suite is not None and suite.get("errors") == "0" and suite.get("failures") == "0"
        assert suite.get("tests") == suite.get("skipped")
        names[part] = {case.get("name", "") for case in suite.iter("testcase")}
        assert f"| {suite.get('tests')} | 0 | 0 | 0 |" in (out / part / "summary.md").read_text()
    assert {"test_cuda_engine_matches_hf", "test_cuda_step_waits_for_the_gpu_only_to_read_sampled_tokens"} <= {
        name.partition("[")[0] for name in names["cuda_engine_tests"]}
    assert {"test_decode_matches_reference", "test_prefill_matches_reference", "test_fused_moe_matches_reference"} <= {
        name.partition("[")[0] for name in names["cuda_kernel_tests"]}

    kernel = json.loads((out / "kernel" / "results.json").read_text())
    assert [(run["batch"], run["context"]) for run in kernel["decode_attention_kernel"]["runs"]] == [
        (1, 64), (2, 64), (1, 128), (2, 128)]
    throughput = json.loads((out / "throughput" / "results.json").read_text())
    sides = throughput["models"]["tiny-llama"]["sides"]
    assert list(sides) == ["conveyor", "hf static generate", "hf generate_batch"]
    assert all(side["output_tokens"] > 0 and side["tokens_per_second"] > 0 for side in sides.values())
    assert "| conveyor " in (out / "throughput" / "results.md").read_text()

    rows = [line.split("|")[1:-1] for line in (out / "summary.md").read_text().splitlines() if line.startswith("| ")]
    assert [(part.strip(), status.strip()) for part, status, *_ in rows[2:]] == [
        ("env", "0"), ("cuda_engine_tests", "0"), ("cuda_kernel_tests", "0"), ("kernel", "0"), ("throughput", "0")]


def test_a_failed_cuda_tests_objects_are_freed_before_the_next_test_sets_up(tmp_path: Path) -> None:
    """What a failed test held (on a GPU: its engine and KV cache, in reference cycles) is freed before the next
    test's fixtures build their engine, though pytest keeps the failure's traceback for post-mortem debugging
    until the next test's call."""
    (tmp_path / "test_failing.py").write_text(
        "import weakref\n"
        "import pytest\n"
        "held = []\n"
        "class KVCache:\n"
        "    def __init__(self):\n"
        "        self.engine = self  # a cycle: only the garbage collector frees it\n"
        "@pytest.mark.cuda\n"
        "def test_fails():\n"
        "    cache = KVCache()\n"
        "    held.append(weakref.ref(cache))\n"
        "    assert False\n"
        "@pytest.fixture\n"
        "def engine():\n"
        "    assert held[0]() is None, 'the failed test still holds its cache'\n"
        "def test_next(engine):\n"
        "    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_failing.py")],
        cwd=ROOT, env=without_service_packages(), capture_output=True, text=True, timeout=120,
    )
    assert "1 failed, 1 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
