"""Porting users' speed: torch.ao's QConfigMapping on qcore, qcore's own, and torch.ao FX.

    python benchmarks/porting_mapping.py [--blocks 100 800] [--rounds 3] [--threads N]

A user porting from torch.ao passes ``torch.ao.quantization.get_default_qconfig_mapping
("x86")``, whose activations are torch.ao's HistogramObserver; qcore builds its own
HistogramObserver for it (``qcore.observers.substitute``: same arguments, same
qparams). Flows, each prepare + calibrate (2 batches) + convert of N conv-bn-relu
blocks (``engine_scaling.Blocks``, input 1x4x8x8), x86 backend:

* ``qcore, torch.ao mapping``: ``qcore.prepare_fx(model, torch.ao's mapping)``;
* ``qcore, torch.ao mapping, torch.ao observers``: the same with the substitution
  switched off (torch.ao's HistogramObserver built as given: qcore before this change);
* ``qcore, qcore mapping``: ``qcore.get_default_qconfig_mapping("x86")``;
* ``torch.ao FX``: torch.ao's ``prepare_fx``/``convert_fx`` with its mapping and x86
  BackendConfig, on a deep copy of the model (not timed; torch.ao prepares in place).

The flows run in interleaved rounds, the order rotating each round, so a burst of
load from other processes hits one round of every flow; the table gives each
flow's fastest round (other processes only add time) and the median. The load
average is read before and after each size. Not a test: timings vary with the machine.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import platform
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch
from _machine import cpu_model
from engine_scaling import blocks_case

import qcore
from qcore.engine import observe

ROOT = Path(__file__).resolve().parent.parent

QCORE_AO = "qcore, torch.ao mapping"
QCORE_AO_SLOW = "qcore, torch.ao mapping, torch.ao observers"
QCORE_OWN = "qcore, qcore mapping"
TORCH_AO = "torch.ao FX"
FLOWS = (QCORE_AO, QCORE_AO_SLOW, QCORE_OWN, TORCH_AO)


def machine() -> str:
    return (
        f"{cpu_model()}, {os.cpu_count()} cores (torch threads {torch.get_num_threads()}), "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _phases(prepare, convert, model, example, batches) -> tuple[float, float, float]:
    gc.collect()
    start = time.perf_counter()
    prepared = prepare(model, example)
    prepared_at = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    calibrated_at = time.perf_counter()
    converted = convert(prepared)
    converted_at = time.perf_counter()
    with torch.no_grad():
        converted(*example)  # runs (not timed)
    return prepared_at - start, calibrated_at - prepared_at, converted_at - calibrated_at


def run_qcore(mapping, model, example, batches, substitute: bool = True):
    original = observe.fast_constructor
    if not substitute:
        observe.fast_constructor = lambda ctr: ctr
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _phases(
                lambda m, ex: qcore.prepare_fx(m, mapping, ex, backend="x86"),
                qcore.convert_fx,
                model,
                example,
                batches,
            )
    finally:
        observe.fast_constructor = original


def run_torch_ao(mapping, model, example, batches):
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
    from zoo.baseline import backend_config  # tests/ is on sys.path (engine_scaling)

    config = backend_config("x86")
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _phases(
                lambda m, ex: prepare_fx(m, mapping, ex, backend_config=config),
                lambda p: convert_fx(p, backend_config=config),
                copy.deepcopy(model),
                example,
                batches,
            )
    finally:
        torch.backends.quantized.engine = previous


def flows() -> dict:
    from torch.ao.quantization import get_default_qconfig_mapping

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao_mapping = get_default_qconfig_mapping("x86")
    own = qcore.get_default_qconfig_mapping("x86")
    return {
        QCORE_AO: lambda *case: run_qcore(ao_mapping, *case),
        QCORE_AO_SLOW: lambda *case: run_qcore(ao_mapping, *case, substitute=False),
        QCORE_OWN: lambda *case: run_qcore(own, *case),
        TORCH_AO: lambda *case: run_torch_ao(ao_mapping, *case),
    }


def measure(blocks: int, rounds: int, runs: dict) -> dict:
    model, example, batches = blocks_case(blocks)
    load_before = os.getloadavg()[0]
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    names = list(runs)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(runs[name](model, example, batches))
    load_after = os.getloadavg()[0]
    return {"blocks": blocks, "times": times, "load": (load_before, load_after)}


HEADER = (
    "| blocks | flow | prepare s | calibrate s | convert s | total s (fastest) | "
    "total s (median) | / qcore mapping | / torch.ao FX | load avg |"
)


def format_rows(result: dict) -> list[str]:
    times = result["times"]
    best = {name: min(times[name], key=sum) for name in times}
    median = {name: statistics.median(sum(t) for t in times[name]) for name in times}
    load = "{:.1f} -> {:.1f}".format(*result["load"])
    rows = []
    for name in times:
        prepare, calibrate, convert = best[name]
        total = sum(best[name])
        rows.append(
            f"| {result['blocks']} | {name} | {prepare:.2f} | {calibrate:.2f} | {convert:.2f} | "
            f"{total:.2f} | {median[name]:.2f} | {total / sum(best[QCORE_OWN]):.2f} | "
            f"{total / sum(best[TORCH_AO]):.2f} | {load} |"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="*", default=[100, 800])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"machine: {machine()}")
    print(f"date: {datetime.date.today().isoformat()}, qcore at commit {commit()}")
    runs = flows()
    # Warm-up: imports, plugin loading, first-call costs of every flow.
    model, example, batches = blocks_case(2)
    for run in runs.values():
        run(model, example, batches)
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    for blocks in args.blocks:
        for row in format_rows(measure(blocks, args.rounds, runs)):
            print(row, flush=True)


if __name__ == "__main__":
    main()
