"""What a lent GPU machine runs works there: it has torch, triton, transformers, peft and pillow, none of the
service's packages (tests/without_service_packages/sitecustomize.py makes this interpreter look the same)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WITHOUT_SERVICE_PACKAGES = Path(__file__).resolve().parent / "without_service_packages"


def without_service_packages() -> dict[str, str]:
    """The environment of a subprocess in which importing a service package fails."""
    path = os.pathsep.join(filter(None, [str(WITHOUT_SERVICE_PACKAGES), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def test_cuda_tests_collect_without_service_packages_or_a_cpu_kernel_build(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"  # where torch would build the C++ CPU kernels
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
         "tests/engine", "tests/kernels"],
        cwd=ROOT, env={**without_service_packages(), "TORCH_EXTENSIONS_DIR": str(extensions)},
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " tests collected" in result.stdout and "error" not in result.stdout.lower()
    assert "tests/engine/test_triton_engine.py::test_cuda_engine_matches_hf" in result.stdout
    assert "[cuda-" in result.stdout  # the kernels' CUDA parametrisations
    assert not extensions.exists()


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
