"""The step walk: the engine's files one `LLMEngine.step()` passes through, and how often it comes back to one it
had left. A reader following a step through the code makes the same walk; fewer returns, an easier read.

    python -m bench.step_walk

Traces (sys.setprofile) the first two steps of one fixed batch on the bundled SmolLM2 (float32, CPU): a prompt
sampled n=2 with a stop string and log-probs, a beam search of width 2, and a greedy prompt asking for its prompt
log-probs. Step 1 computes the prompts and samples their first tokens (siblings fork, prompt log-probs are
recorded); step 2 decodes. The walk is the sequence of project files holding the innermost running project
frame, consecutive repeats merged; the model's layers and the kernels (engine/models/, attention.py,
parallel_layers.py, cuda_graphs.py, conveyor_kernels/) count as one stop, "model and kernels", since the step only hands
them tensors. Printed per step: files visited, moves between files, returns to a file already left, and the
files returned to most; and, of those returns, how many come once the runner has stepped (from the call of
`Requests.update` on: the step's update path, apart from the runner, the model and the sampler). Plain counts
of code paths, so they do not depend on the machine.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from bench.common import run_cli
from engine import SamplingParams
from engine.llm_engine import LLMEngine
from engine.requests import Requests
from engine.scheduler import Scheduler

ROOT = Path(__file__).resolve().parent.parent
MODEL_NODE = "model and kernels"
_MODEL_PARTS = (
    "engine/models/", "engine/attention.py", "engine/parallel_layers.py", "engine/distributed.py", "engine/cuda_graphs.py",
    "conveyor_kernels/",
)


def node_of(filename: str) -> str | None:
    """The walk's stop for a frame's file: a project file relative to the root, the model's one stop, or None
    (not the project's: torch, tokenizers, generated dataclass methods)."""
    path = Path(filename)
    if not path.is_absolute() or ROOT not in path.parents:
        return None
    relative = path.relative_to(ROOT).as_posix()
    if not relative.startswith(("engine/", "conveyor_kernels/")):
        return None
    return MODEL_NODE if relative.startswith(_MODEL_PARTS) else relative


class WalkTracer:
    """Records the reading walk of whatever runs between `start` and `stop` on this thread: each project function
    is followed the first time it is called only (a reader reads a function once, however often a loop calls it),
    so the walk counts code paths, not iterations."""

    def __init__(self) -> None:
        self.walk: list[str] = []
        self._nodes: dict[str, str | None] = {}
        self._read: set[CodeType] = set()
        self._skipping = 0  # the depth inside a call to a function already read
        self.marker: CodeType | None = None  # a function whose first call's place in the walk is kept
        self.marked_at: int | None = None

    def _node(self, frame: FrameType | None) -> str | None:
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename not in self._nodes:
                self._nodes[filename] = node_of(filename)
            node = self._nodes[filename]
            if node is not None:
                return node
            frame = frame.f_back
        return None

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        if self._skipping:
            self._skipping += 1 if event == "call" else -1
            return
        if event == "call":
            code = frame.f_code
            if code is self.marker and self.marked_at is None:
                self.marked_at = len(self.walk)
            if code in self._read:
                self._skipping = 1
                return
            if self._node(frame) is not None and node_of(code.co_filename) is not None:
                self._read.add(code)
            node = self._node(frame)
        else:
            node = self._node(frame.f_back)
        if node is not None and (not self.walk or self.walk[-1] != node):
            self.walk.append(node)

    def start(self, unread: set[CodeType]) -> None:
        """`unread`: functions whose calls the walk passes over, as if already read."""
        self.walk, self._read, self._skipping, self.marked_at = [], set(unread), 0, None
        sys.setprofile(self._profile)

    def stop(self) -> list[str]:
        sys.setprofile(None)
        return self.walk


def summarize(walk: list[str], since: int | None = None) -> dict[str, Any]:
    """`since`: a walk index; "returns_since" counts the returns from there on."""
    seen: set[str] = set()
    returns: Counter[str] = Counter()
    returns_since = 0
    for index, node in enumerate(walk):
        if node in seen:
            returns[node] += 1
            if since is not None and index >= since:
                returns_since += 1
        seen.add(node)
    return {
        "files": len(seen), "moves": max(0, len(walk) - 1), "returns": sum(returns.values()),
        "most": returns.most_common(4), "returns_since": returns_since,
    }


def build_engine() -> LLMEngine:
    engine = LLMEngine(dtype="float32", device="cpu", kv_cache_memory=64 << 20, seed=0)
    assert engine.tokenizer is not None
    encode = engine.tokenizer.encode
    engine.add_request("sampled", encode("The capital of France is"), SamplingParams(
        n=2, temperature=0.8, seed=1, stop=["\n\n"], logprobs=2, max_tokens=8,
    ))
    engine.add_request("beams", encode("Once upon a time"), SamplingParams(
        use_beam_search=True, beam_width=2, temperature=0.0, max_tokens=8,
    ))
    engine.add_request("prompt-logprobs", encode("Water boils at"), SamplingParams(
        temperature=0.0, prompt_logprobs=1, max_tokens=8,
    ))
    return engine


def run(args: argparse.Namespace) -> None:
    engine = build_engine()
    tracer = WalkTracer()
    tracer.marker = Requests.update.__code__
    print(
        "| step | files visited | moves between files | returns to a file already left | of which in the update "
        "| returned to most |"
    )
    print("|---|---|---|---|---|---|")
    totals = Counter()
    for step in (1, 2):
        tracer.start({Scheduler.schedule.__code__})
        try:
            engine.step()
        finally:
            walk = tracer.stop()
        summary = summarize(walk, tracer.marked_at)
        totals.update({"moves": summary["moves"], "returns": summary["returns"], "update": summary["returns_since"]})
        most = ", ".join(f"{name} {count}" for name, count in summary["most"])
        print(
            f"| {step} | {summary['files']} | {summary['moves']} | {summary['returns']} | {summary['returns_since']} "
            f"| {most} |"
        )
        if args.show_walk:
            print(" -> ".join(walk))
    print(
        f"\nboth steps: {totals['moves']} moves, {totals['returns']} returns to a file already left "
        f"({totals['update']} of them in the update)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--show-walk", action="store_true", help="print each step's walk, file by file")


if __name__ == "__main__":
    run_cli(__doc__, add_arguments, run)
