"""Prepare and convert time: qcore's FX engine against torch.ao's FX flow.

    python benchmarks/engine_scaling.py [--blocks 100 400 800] [--no-zoo] [--repeat 3]

One process, fbgemm backend, the default fbgemm post-training QConfigMapping
(histogram activations, per-channel weights): qcore's own
(``qcore.get_default_qconfig_mapping("fbgemm")``) for qcore, torch.ao's
(``torch.ao.quantization.get_default_qconfig_mapping("fbgemm")``) for torch.ao;
the two have the same structure, each with its own observers. Models: chains
of N conv-bn-relu blocks on a small input, then each zoo model (tests/zoo).
Each model is calibrated with the same batches (not timed); each phase is the
fastest of --repeat runs. qcore's prepare time includes the deep copy it makes
of the user's model (torch.ao prepares the model in place). Times are per
graph node of the float model's traced graph (the same count for both), so a
flat column means linear scaling. Not a test: timings vary with the machine.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from _machine import cpu_model  # noqa: E402
from torch import nn

import qcore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from zoo import ZOO  # noqa: E402
from zoo.baseline import _quiet, convert_fx, prepare_fx, quantized_engine  # noqa: E402


def machine() -> str:
    return (
        f"{cpu_model()}, {os.cpu_count()} cores (torch threads {torch.get_num_threads()}), "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


class Blocks(nn.Module):
    """N conv-bn-relu blocks, 4 channels, on 1x4x8x8 inputs."""

    def __init__(self, blocks: int, channels: int = 4) -> None:
        super().__init__()
        layers = []
        for _ in range(blocks):
            layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)]
            layers.append(nn.ReLU())
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def blocks_case(blocks: int) -> tuple:
    torch.manual_seed(0)
    model = Blocks(blocks).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(1, 4, 8, 8, generator=generator),) for _ in range(2)]
    return model, batches[0], batches


def graph_nodes(model: nn.Module) -> int:
    return len(torch.fx.symbolic_trace(model).graph.nodes)


def _timed(function, *args, **kwargs):
    gc.collect()
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - start


def run_qcore(model, example_inputs, batches, dynamic: bool) -> tuple[float, float]:
    mapping = qcore.get_default_qconfig_mapping("fbgemm")
    if dynamic:
        from qcore.config.qconfig import QConfigMapping, default_dynamic_qconfig

        mapping = QConfigMapping().set_object_type(nn.LSTM, default_dynamic_qconfig)
        mapping.set_object_type(nn.Linear, default_dynamic_qconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared, prepare_time = _timed(
            qcore.prepare_fx, model, mapping, example_inputs, backend="fbgemm"
        )
        with torch.no_grad():
            for batch in batches:
                prepared(*batch)
        converted, convert_time = _timed(qcore.convert_fx, prepared)
        with torch.no_grad():
            converted(*example_inputs)
    return prepare_time, convert_time


def run_torch_ao(model, example_inputs, batches, dynamic: bool) -> tuple[float, float]:
    from zoo.baseline import default_qconfig_mapping

    with _quiet(), quantized_engine("fbgemm"):
        from zoo.baseline import backend_config

        mapping = default_qconfig_mapping("fbgemm", dynamic=dynamic)
        config = backend_config("fbgemm")
        # torch.ao prepares the model it is given (qcore copies it, inside its time).
        model = copy.deepcopy(model)
        prepared, prepare_time = _timed(
            prepare_fx, model, mapping, example_inputs, backend_config=config
        )
        with torch.no_grad():
            for batch in batches:
                prepared(*batch)
        converted, convert_time = _timed(convert_fx, prepared, backend_config=config)
        with torch.no_grad():
            converted(*example_inputs)
    return prepare_time, convert_time


def measure(
    name: str, model, example_inputs, batches, dynamic: bool = False, repeat: int = 3
) -> dict:
    """The fastest of ``repeat`` runs of each phase (other processes only add time)."""
    nodes = graph_nodes(model)
    qcore_runs = [run_qcore(model, example_inputs, batches, dynamic) for _ in range(repeat)]
    ao_runs = [run_torch_ao(model, example_inputs, batches, dynamic) for _ in range(repeat)]
    q_prepare, q_convert = (min(times) for times in zip(*qcore_runs, strict=True))
    a_prepare, a_convert = (min(times) for times in zip(*ao_runs, strict=True))
    row = {
        "model": name,
        "nodes": nodes,
        "qcore_prepare": q_prepare,
        "qcore_convert": q_convert,
        "ao_prepare": a_prepare,
        "ao_convert": a_convert,
    }
    print(format_row(row), flush=True)
    return row


HEADER = (
    "| model | nodes | prepare qcore ms/node | prepare torch.ao ms/node | ratio | "
    "convert qcore ms/node | convert torch.ao ms/node | ratio | "
    "total qcore s | total torch.ao s |"
)


def format_row(row: dict) -> str:
    n = row["nodes"]

    def per(seconds: float) -> str:
        return f"{seconds * 1000 / n:.3f}"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b > 0 else "-"

    return (
        f"| {row['model']} | {n} | {per(row['qcore_prepare'])} | {per(row['ao_prepare'])} | "
        f"{ratio(row['qcore_prepare'], row['ao_prepare'])} | {per(row['qcore_convert'])} | "
        f"{per(row['ao_convert'])} | {ratio(row['qcore_convert'], row['ao_convert'])} | "
        f"{row['qcore_prepare'] + row['qcore_convert']:.2f} | "
        f"{row['ao_prepare'] + row['ao_convert']:.2f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="*", default=[100, 400, 800])
    parser.add_argument("--no-zoo", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="runs per phase; the fastest counts")
    args = parser.parse_args(argv)

    print(f"machine: {machine()}")
    print(f"date: {datetime.date.today().isoformat()}")
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    # Warm-up: imports, plugin loading, first-call costs of both flows.
    model, example, batches = blocks_case(2)
    run_qcore(model, example, batches, False)
    run_torch_ao(model, example, batches, False)
    for blocks in args.blocks:
        model, example, batches = blocks_case(blocks)
        measure(f"{blocks} conv-bn-relu blocks", model, example, batches, repeat=args.repeat)
    if not args.no_zoo:
        for name in sorted(ZOO):
            entry = ZOO[name]
            model = entry.make_model()
            measure(
                name,
                model,
                entry.example_inputs(),
                entry.calibration_data(2),
                dynamic=entry.dynamic,
                repeat=args.repeat,
            )


if __name__ == "__main__":
    main()
