"""The report's plots (matplotlib, written as PNG files without a display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)
import numpy as np  # noqa: E402

from bench.scheduling_runs import Measured, percentile  # noqa: E402

COLOURS = {"static": "tab:orange", "continuous": "tab:blue", "hf static": "tab:gray"}


def plot_throughput_vs_spread(path: Path, runs: list[Measured], spreads: Sequence[str]) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    labels = [label for label in COLOURS if any(r.label == label for r in runs)]
    width = 0.8 / len(labels)
    for index, label in enumerate(labels):
        values = [next(r.tokens_per_second for r in runs if r.label == label and r.x == x) for x in spreads]
        positions = np.arange(len(spreads)) + (index - (len(labels) - 1) / 2) * width
        axis.bar(positions, values, width, label=label, color=COLOURS[label])
    axis.set_xticks(np.arange(len(spreads)), spreads)
    axis.set_xlabel("output-length spread (same mean)")
    axis.set_ylabel("output tokens / s")
    axis.set_title("Throughput, all requests at t=0")
    axis.legend()
    _save(figure, path)


def plot_latency_vs_rate(path: Path, runs: list[Measured]) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    for label in ("static", "continuous"):
        mine = sorted((r for r in runs if r.label == label), key=lambda r: float(r.x))
        rates = [float(r.x) for r in mine]
        axis.plot(rates, [percentile(r.latencies, 50) for r in mine], "o-", color=COLOURS[label], label=f"{label} p50")
        axis.plot(rates, [percentile(r.latencies, 99) for r in mine], "s--", color=COLOURS[label], label=f"{label} p99")
    axis.set_xlabel("arrival rate (requests / s, Poisson)")
    axis.set_ylabel("latency (s)")
    axis.set_title("Request latency against arrival rate")
    axis.legend()
    _save(figure, path)


def plot_chunk_sizes(path: Path, runs: list[Measured]) -> None:
    figure, throughput_axis = plt.subplots(figsize=(7, 4))
    chunks = [int(r.x) for r in runs]
    throughput_axis.plot(chunks, [r.tokens_per_second for r in runs], "o-", color="tab:blue", label="throughput")
    throughput_axis.set_xscale("log", base=2)
    throughput_axis.set_xlabel("max_num_batched_tokens (prefill chunk)")
    throughput_axis.set_ylabel("output tokens / s", color="tab:blue")
    ttft_axis = throughput_axis.twinx()
    ttft_axis.plot(chunks, [percentile(r.ttfts, 50) for r in runs], "s--", color="tab:red", label="TTFT p50")
    ttft_axis.plot(chunks, [percentile(r.ttfts, 99) for r in runs], "^:", color="tab:red", label="TTFT p99")
    ttft_axis.set_ylabel("time to first token (s)", color="tab:red")
    throughput_axis.set_title("Throughput and time to first token against the chunk size")
    figure.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
    _save(figure, path)


def plot_over_time(path: Path, runs: list[Measured]) -> None:
    """Seat utilisation (useful tokens / seats per step, smoothed) and KV blocks in use, per policy."""
    figure, (seats_axis, kv_axis) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for run in runs:
        times = [p.time for p in run.steps]
        used = np.array([p.sampled for p in run.steps]) / run.seats
        window = max(1, len(used) // 50)
        smoothed = np.convolve(used, np.ones(window) / window, mode="same")
        colour = COLOURS[run.label]
        seats_axis.plot(times, smoothed, color=colour, label=f"{run.label} (mean {run.utilisation:.2f})")
        occupancy = [p.kv_blocks_used / run.kv_blocks_total for p in run.steps]
        kv_axis.plot(times, occupancy, color=colour, drawstyle="steps-post", label=run.label)
    seats_axis.set_ylabel("useful tokens / seat")
    seats_axis.set_ylim(0, 1.05)
    seats_axis.set_title(f"One run of each policy (spread: {runs[0].x})")
    seats_axis.legend()
    kv_axis.set_ylabel("KV blocks in use")
    kv_axis.set_ylim(0, 1.05)
    kv_axis.set_xlabel("time (s)")
    kv_axis.legend()
    _save(figure, path)


def _save(figure: plt.Figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
