"""What every benchmark shares: the machine's name and interleaved timing.

Benchmarks run as scripts (``python benchmarks/x.py``), so this sibling module is
importable as ``_machine``.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["cpu_model", "round_medians"]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def round_medians(
    models: dict[str, Callable],
    inputs: tuple,
    rounds: int,
    block_seconds: float = 0.05,
    most_calls: int = 200,
) -> dict[str, list[float]]:
    """Seconds per call of each model, one median per round.

    The models are timed in interleaved rounds, a block of calls each; the order
    rotates every round, because a model following float pays for the float
    kernels' spinning OpenMP threads. A burst of load from other processes thus
    hits one round of every model, not one model.
    """
    with torch.no_grad():
        calls = {}
        for name, model in models.items():
            for _ in range(3):
                model(*inputs)  # warmup
            start = time.perf_counter()
            model(*inputs)
            once = time.perf_counter() - start
            calls[name] = max(3, min(most_calls, int(block_seconds / max(once, 1e-6))))
        medians: dict[str, list[float]] = {name: [] for name in models}
        names = list(models)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                model = models[name]
                for _ in range(2):
                    model(*inputs)  # settle the threads after the previous model
                times = []
                for _ in range(calls[name]):
                    start = time.perf_counter()
                    model(*inputs)
                    times.append(time.perf_counter() - start)
                medians[name].append(statistics.median(times))
    return medians
