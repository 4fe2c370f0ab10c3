"""Where a CPU engine step's time goes, and how close the run comes to the machine's matmul peak.

The roofline: this CPU's measured matmul peak (a large square matmul in the run's dtype, best of a
few) against the run's useful FLOPs per second (the model's work for the requested tokens: linear
layers for every computed position, the LM head for every sampled token, attention over each
position's context; padding and recomputation are not useful work).

The profile: wall-clock timers on the engine's parts during a separate pass (timing changes nothing
in what runs; on CPU every op is synchronous, so wall time is the op's time). Matmuls are the linear
layers and the LM head; attention is the attention backend (KV writes and paged attention);
"other model ops" is the rest of the forward pass (embedding, norms, rotary, activation); sampling is
the sampler; scheduling is the scheduler's schedule and update; the remainder of the step is the
engine's Python: building the step's tensors, finish checks, outputs. The timers' own cost (a few
microseconds per linear layer call) lands in "other model ops".
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from engine.config import ModelConfig
from engine.llm_engine import LLMEngine
from engine.parallel_layers import QuantizableLinear

CATEGORIES = ("matmuls", "attention", "other model ops", "sampling", "scheduling", "python overhead")


# The machine's peak does not change within a process: measured once per dtype and device (seconds of 2048-wide
# matmuls on a small CPU), however many runs ask for it (tests/test_bench_shapes.py runs every shape in one process).
@functools.cache
def matmul_peak_flops(dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 5) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up: kernel selection, page faults
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def useful_flops(config: ModelConfig, lengths: Sequence[tuple[int, int]]) -> float:
    """FLOPs of generating `output` tokens after a `prompt`, summed over (prompt, output) pairs."""
    hidden, head_dim, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    linear_per_position = layers * (hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * config.intermediate_size)
    total = 0.0
    for prompt, output in lengths:
        positions = prompt + output - 1  # the last sampled token is never fed back
        context_sum = positions * (positions + 1) / 2  # position i attends to i keys
        total += 2 * linear_per_position * positions + 2 * hidden * config.vocab_size * output
        total += 4 * layers * q_size * context_sum  # q.k and p.v per head
    return total


class StepProfile:
    """Timers on one engine's parts: `attach` before the profiled pass, `split` after it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._seconds = dict.fromkeys(("linear", "lm head", "attention", "forward", "sampling", "scheduling", "step"), 0.0)
        self._started = dict.fromkeys(("linear", "forward"), 0.0)
        self._in_forward = False

    def attach(self) -> None:
        engine, runner = self.engine, self.engine.runner
        model = runner.model
        for module in model.modules():
            # The models' projections are QuantizableLinear (float, GGUF blocks, int8/int4...), not nn.Linear.
            if isinstance(module, (nn.Linear, QuantizableLinear)):
                module.register_forward_pre_hook(self._start_linear)
                module.register_forward_hook(self._stop_linear)
        model.register_forward_pre_hook(self._start_forward)
        model.register_forward_hook(self._stop_forward)
        model.compute_logits = self._timed(model.compute_logits, "lm head")
        for layer in model.model.layers:
            layer.self_attn.backend = self._timed(layer.self_attn.backend, "attention")
        runner.sampler = self._timed(runner.sampler, "sampling")
        engine.scheduler.schedule = self._timed(engine.scheduler.schedule, "scheduling")
        engine.scheduler.update = self._timed(engine.scheduler.update, "scheduling")
        engine.step = self._timed(engine.step, "step")

    def split(self) -> dict[str, float]:
        """Seconds per category of CATEGORIES, summing to the steps' wall time."""
        s = self._seconds
        return {
            "matmuls": s["linear"] + s["lm head"],
            "attention": s["attention"],
            "other model ops": s["forward"] - s["linear"] - s["attention"],
            "sampling": s["sampling"],
            "scheduling": s["scheduling"],
            "python overhead": s["step"] - s["forward"] - s["lm head"] - s["sampling"] - s["scheduling"],
        }

    def _timed(self, function: Callable[..., Any], category: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._seconds[category] += time.perf_counter() - start

        return timed

    def _start_linear(self, module: nn.Module, inputs: Any) -> None:
        self._started["linear"] = time.perf_counter()

    def _stop_linear(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if self._in_forward:  # an untied LM head is a linear layer too; it is timed as the LM head
            self._seconds["linear"] += time.perf_counter() - self._started["linear"]

    def _start_forward(self, module: nn.Module, inputs: Any) -> None:
        self._in_forward = True
        self._started["forward"] = time.perf_counter()

    def _stop_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._in_forward = False
        self._seconds["forward"] += time.perf_counter() - self._started["forward"]
