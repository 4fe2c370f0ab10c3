#!/usr/bin/env bash
# The GPU run in one command, for a lent GPU (an H100 or H200 for a few minutes; docs/performance.md, "Running on a
# GPU for a few minutes"). From the repository root:
#
#     OUT=device-run bash bench/device_check.sh            # <= 8 minutes on an H100
#     OUT=dry-run bash bench/device_check.sh --dry-run     # every part on the CPU, tiny shapes, a minute or two
#
# Parts, in order, each under its own `timeout`, each writing under $OUT as soon as it has results, so a part
# that dies or runs out of time loses nothing that came before:
#   env/                nvidia-smi, versions (versions.json), the commit
#   cuda_engine_tests/  the engine's `cuda`-marked tests (on CUDA, with and without CUDA graphs, against HF
#                       greedy; no host sync in a step; swap and prefix caching)
#   cuda_kernel_tests/  the kernels' `cuda`-marked tests, against their torch references
#                       each: junit.xml, summary.md, and the log with one line per test as it finished
#   kernel/       the decode attention kernel against the copy bandwidth: results.json, results.md
#   throughput/   conveyor vs HF static generate vs HF generate_batch on the Llama-3-8B shape (dummy weights
#                 built on the GPU), decode steps against the bandwidth floor: results.json, results.md
#   summary.md    one row per part: exit status, seconds, where its results are
#
# It needs only what a lent machine has (python3, torch, triton, transformers; pytest for the tests part, see
# docs/performance.md): no service package is imported and no C++ CPU kernel is built. PYTHON picks the
# interpreter (default python3); a .device-deps/ folder at the root (pip install --target) goes on PYTHONPATH.
# Per-part limits in seconds: ENV_SECONDS, ENGINE_TESTS_SECONDS, KERNEL_TESTS_SECONDS, KERNEL_SECONDS,
# THROUGHPUT_SECONDS. The commit goes in
# env/ from git, or from CONVEYOR_COMMIT where the copy has no .git.
set -u

DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    *) echo "usage: OUT=folder bash bench/device_check.sh [--dry-run]" >&2; exit 2 ;;
esac
if [ -z "${OUT:-}" ]; then
    echo "set OUT to the folder for the results: OUT=folder bash bench/device_check.sh" >&2
    exit 2
fi
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || exit 2
if [ -d .device-deps ]; then
    export PYTHONPATH="$ROOT/.device-deps${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

# The limits add up to 8 minutes with each part's 3-second grace to stop: 15 + 90 + 75 + 50 + 225 + 5 x 3 = 470.
# Llama-3-8B's part is estimated at 3.1 minutes on an H100 (bench.gpu_throughput prints its estimate).
ENV_SECONDS=${ENV_SECONDS:-15}
ENGINE_TESTS_SECONDS=${ENGINE_TESTS_SECONDS:-90}
KERNEL_TESTS_SECONDS=${KERNEL_TESTS_SECONDS:-75}
KERNEL_SECONDS=${KERNEL_SECONDS:-50}
THROUGHPUT_SECONDS=${THROUGHPUT_SECONDS:-225}

SUMMARY="$OUT/summary.md"
{
    echo "# bench/device_check.sh$([ "$DRY_RUN" = 1 ] && echo " --dry-run (CPU, tiny shapes: not GPU figures)")"
    echo
    echo "Started $(date -u +%Y-%m-%dT%H:%M:%SZ)."
    echo
    echo "| part | exit status | seconds | limit | results |"
    echo "| :--- | ----------: | ------: | ----: | :------ |"
} > "$SUMMARY"

FAILED=0
# run_part NAME LIMIT COMMAND...: runs COMMAND under `timeout`, its output in $OUT/NAME/NAME.log, then appends
# its row to summary.md. Exit status 124 means it ran out of time.
run_part() {
    local name=$1 limit=$2
    shift 2
    mkdir -p "$OUT/$name"
    local start=$SECONDS
    echo "== $name (limit ${limit} s)"
    timeout -k 3 "$limit" "$@" > "$OUT/$name/$name.log" 2>&1
    local status=$?
    local files
    files=$(cd "$OUT" && find "$name" -type f | sort | tr '\n' ' ')
    echo "| $name | $status$([ "$status" = 124 ] && echo " (timed out)") | $((SECONDS - start)) | $limit | $files |" >> "$SUMMARY"
    echo "   exit status $status after $((SECONDS - start)) s"
    [ "$status" = 0 ] || FAILED=1
}

environment() {
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi > "$OUT/env/nvidia-smi.txt" 2>&1
    else
        echo "nvidia-smi: not found (no NVIDIA driver here)" > "$OUT/env/nvidia-smi.txt"
    fi
    local commit=${CONVEYOR_COMMIT:-$(git rev-parse HEAD 2> /dev/null || echo unknown)}
    "$PYTHON" - "$OUT/env/versions.json" "$commit" <<'PY'
import importlib.metadata, json, platform, sys

import torch

def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None

cuda = torch.cuda.is_available()
versions = {
    "commit": sys.argv[2], "python": platform.python_version(), "platform": platform.platform(),
    "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "gpu": torch.cuda.get_device_name(0) if cuda else None,
    "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
    **{name: version(name) for name in ("triton", "transformers", "peft", "pillow", "pytest", "numpy", "safetensors")},
}
with open(sys.argv[1], "w") as out:
    json.dump(versions, out, indent=2)
print(json.dumps(versions, indent=2))
PY
}

# cuda_tests NAME PATHS...: the `cuda`-marked tests among PATHS, into $OUT/NAME/junit.xml and its summary.md.
cuda_tests() {
    local name=$1
    shift
    if ! "$PYTHON" -c "import pytest" 2> /dev/null; then
        echo "pytest is not installed for $PYTHON: pip install --target .device-deps pytest beside the tree," \
            "and copy .device-deps/ over with it (docs/performance.md)"
        return 1
    fi
    # -v: one line per test as it finishes, in the log, for a run the limit stops before the JUnit XML is written.
    "$PYTHON" -m pytest -m cuda -v -rs -p no:cacheprovider --junitxml="$OUT/$name/junit.xml" "$@"
    local status=$?
    "$PYTHON" - "$OUT/$name/junit.xml" "$OUT/$name/summary.md" <<'PY'
import sys
import xml.etree.ElementTree as ElementTree

suite = ElementTree.parse(sys.argv[1]).getroot().find("testsuite")
counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
lines = ["| tests | passed | failed | errors | skipped |", "| ----: | -----: | -----: | -----: | ------: |",
         "| {tests} | {passed} | {failures} | {errors} | {skipped} |".format(**counts), ""]
for case in suite.iter("testcase"):
    for outcome in ("failure", "error"):
        if case.find(outcome) is not None:
            lines.append(f"- {outcome}: {case.get('classname')}::{case.get('name')}")
with open(sys.argv[2], "w") as out:
    out.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
    return "$status"
}

if [ "$DRY_RUN" = 1 ]; then
    # Tiny shapes on the CPU; Triton's interpreter runs the kernels the GPU would compile, so conveyor takes the
    # GPU path's kernels (and builds no C++ CPU kernel).
    export TRITON_INTERPRET=1
    KERNEL=(--smoke --kernels)
    # Prompts within one 16-token block and two or three tokens out (a decode step still runs): the interpreted
    # prefill's time grows with the prompts' tokens: prompts of 8-24 tokens took 16 s of this part's 44 s, prompts of
    # 4-8 7 s of 38 s (2 cores at load average 5-6).
    THROUGHPUT=(--smoke --models tiny-llama --kernel-backend triton --num-requests 4 --prompt-len 4 8
                --output-len 2 3 --hf-batch-size 2 --hf-max-requests 4)
else
    KERNEL=(--kernels)
    THROUGHPUT=(--models llama-3-8b)
fi

# `timeout` runs programs, not shell functions: the two functions run in a bash of their own.
export OUT PYTHON
export -f environment cuda_tests
run_part env "$ENV_SECONDS" bash -c environment
# The engine's test files that hold `cuda` tests: the others import test-only packages (hypothesis) that a lent
# machine lacks, and have no CUDA test to give.
mapfile -t ENGINE_TEST_FILES < <(grep -l "pytest.mark.cuda" tests/engine/test_*.py)
run_part cuda_engine_tests "$ENGINE_TESTS_SECONDS" bash -c 'cuda_tests "$@"' _ cuda_engine_tests "${ENGINE_TEST_FILES[@]}"
run_part cuda_kernel_tests "$KERNEL_TESTS_SECONDS" bash -c 'cuda_tests "$@"' _ cuda_kernel_tests tests/kernels
run_part kernel "$KERNEL_SECONDS" "$PYTHON" -m bench.gpu_throughput "${KERNEL[@]}" --out "$OUT/kernel"
run_part throughput "$THROUGHPUT_SECONDS" "$PYTHON" -m bench.gpu_throughput "${THROUGHPUT[@]}" --out "$OUT/throughput"

echo >> "$SUMMARY"
echo "Finished $(date -u +%Y-%m-%dT%H:%M:%SZ)." >> "$SUMMARY"
cat "$SUMMARY"
exit "$FAILED"
