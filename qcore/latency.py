"""Keep a layer float where its int8 form is measured slower.

``qcore.quantize(..., keep_float_if_slower=True)`` runs this module.

int8 kernels carry fixed costs (quantizing activations, requantizing outputs,
packing) that small layers do not earn back: on a CPU without VNNI a 64-wide
linear at batch 16 runs about 2x slower in int8 than in float. No table predicts
that across machines, so qcore measures: the converted model, then the model with
each weighted layer in turn kept float (its QConfig set to None, the rest
recalibrated), keeping each choice that makes the whole model faster, and last
the model with every such layer float. Each candidate is timed on the example
inputs, best of several runs; a choice must gain more than ``margin`` to count,
so noise alone keeps int8. Explain gives each kept layer the two timings.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from qcore.engine.explain import attach_report, report_of
from qcore.keep_float import Build, mark_kept_float, weighted_layers

__all__ = ["LatencyChoice", "keep_faster", "measure_latency", "weighted_layers"]

Measure = Callable[[torch.nn.Module], float]


@dataclass(frozen=True)
class LatencyChoice:
    """A layer kept float: the model's measured latency with it int8 and float."""

    module: str
    int8_seconds: float
    float_seconds: float

    def reason(self) -> str:
        int8_us, float_us = self.int8_seconds * 1e6, self.float_seconds * 1e6
        return (
            f"kept float (keep_float_if_slower): the model measured {int8_us:.0f} us with it "
            f"int8, {float_us:.0f} us float"
        )


def measure_latency(example_inputs: tuple, *, runs: int = 3, min_seconds: float = 0.01) -> Measure:
    """A timer: best of ``runs`` runs, each at least ``min_seconds`` of calls."""

    def measure(model: torch.nn.Module) -> float:
        with torch.no_grad():
            model(*example_inputs)  # warm: packing, allocator
            start, calls = time.perf_counter(), 0
            while time.perf_counter() - start < min_seconds:
                model(*example_inputs)
                calls += 1
            best = (time.perf_counter() - start) / calls
            for _ in range(runs - 1):
                start = time.perf_counter()
                for _ in range(calls):
                    model(*example_inputs)
                best = min(best, (time.perf_counter() - start) / calls)
        return best

    return measure


def keep_faster(
    build: Build,
    candidates: Sequence[str],
    measure: Measure,
    *,
    margin: float = 0.05,
    float_model: torch.nn.Module | None = None,
) -> torch.nn.Module:
    """The fastest model ``build`` gives, over which of ``candidates`` are kept float.

    ``build(kept_float)`` returns the converted model with those modules' QConfigs
    set to None. Greedy: each candidate in order is kept float if that makes the
    model faster by more than ``margin``; then every candidate float is tried too.
    The result's explain names each layer kept float with both timings.

    When that leaves nothing quantized, ``float_model`` (the user's model) is
    measured too: a converted graph of float modules pays a few microseconds a
    call for its graph and fused modules, which shows on a model that runs in tens
    of them. Unless the converted graph is faster by more than ``margin``, a copy
    of the user's model is returned, carrying the explain report that says why
    each layer is float.
    """
    kept: frozenset[str] = frozenset()
    best = build(kept)  # measured anew beside each trial (_side_by_side)
    choices: dict[str, LatencyChoice] = {}
    for name in candidates:
        trial = build(kept | {name})
        seconds, best_seconds = _side_by_side(measure, trial, best)
        if seconds < best_seconds * (1 - margin):
            choices[name] = LatencyChoice(name, best_seconds, seconds)
            kept, best = kept | {name}, trial
    remaining = [name for name in candidates if name not in kept]
    if remaining:
        all_float = build(frozenset(candidates))
        seconds, best_seconds = _side_by_side(measure, all_float, best, rounds=5)
        if seconds < best_seconds * (1 - margin):
            choices = {name: LatencyChoice(name, best_seconds, seconds) for name in candidates}
            best = all_float
    chosen = mark_kept_float(best, {name: choice.reason() for name, choice in choices.items()})
    if float_model is None or not choices or _quantizes_anything(chosen):
        return chosen
    own = copy.deepcopy(float_model)
    # both float: a tie goes to the user's own model (only a clear gain, as from
    # batch norms folded into convs, keeps the converted graph). Five rounds, as for
    # the all-float step: with two, a converted float graph that runs 0.83x the
    # user's model once measured 5% faster (x86 mlp, batch 1, a shared machine)
    own_seconds, best_seconds = _side_by_side(measure, own, chosen, rounds=5)
    if own_seconds <= best_seconds * (1 + margin):
        attach_report(own, report_of(chosen))
        return own
    return chosen


def _side_by_side(measure: Measure, trial: torch.nn.Module, best: torch.nn.Module, rounds: int = 2):
    """(trial's, best's) seconds, each the fastest of ``rounds`` measurements taken
    in turn: on a shared machine a spike of load during one model's measurement
    would otherwise decide the comparison (an earlier, luckier figure for ``best``,
    or a slower spell for every trial after it)."""
    trial_seconds, best_seconds = [], []
    for _ in range(rounds):
        trial_seconds.append(measure(trial))
        best_seconds.append(measure(best))
    return min(trial_seconds), min(best_seconds)


def _quantizes_anything(model: torch.nn.Module) -> bool:
    report = report_of(model)
    return report is None or bool(report.quantized or report.reference)
