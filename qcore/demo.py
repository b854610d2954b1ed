"""`qcore demo`: every installed backend on the bundled example models.

For each backend and model, on each path (FX graph mode; PT2E when qcore's
PT2E path is available): operators quantized out of all, SQNR against float,
float and int8 latency and the speedup, model size; then the explain report
of whatever stayed in float. With a minimum SQNR (``--min-sqnr DB``), also the
layers ``qcore.quantize(accuracy_budget=DB)`` keeps float on the FX path, and why.
"""

from __future__ import annotations

import io
import math
import statistics
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from qcore.accuracy import sqnr
from qcore.config.errors import QCoreWarning
from qcore.engine.explain import WIDTH, brief
from qcore.examples import EVAL_SEED, ZOO, ZooEntry, export_batch_free
from qcore.plugin import NATIVE, BackendLoadError, default_registry

__all__ = ["DemoResult", "run_demo"]


@dataclass
class DemoResult:
    backend: str
    model: str
    path: str
    ops_quantized: int = 0
    ops_on_kernels: int = 0
    ops_total: int = 0
    sqnr_db: float = float("nan")
    float_ms: float = float("nan")
    int8_ms: float = float("nan")
    float_bytes: int = 0
    int8_bytes: int = 0
    float_ops: dict[str, list[str]] = field(default_factory=dict)
    """What stayed in float: reason -> the nodes ("name (op)") it applies to."""
    error: str = ""
    kept_float: dict[str, str] | None = None
    """With a minimum SQNR: node -> why ``accuracy_budget`` kept it float; else None."""
    budget_sqnr_db: float = float("nan")
    """That model's SQNR, measured as ``sqnr_db`` is."""
    budget_note: str = ""
    """Why there is no such model ("FX only", the error), or "not met"."""
    faster_speedup: float = float("nan")
    """Where int8 measured slower than float: float's latency over that of
    ``qcore.quantize(keep_float_if_slower=True)``'s model (FX), the two measured
    in turn; else NaN."""
    kept_for_speed: dict[str, str] = field(default_factory=dict)
    """That model's layers kept float: node -> its two timings."""

    @property
    def speedup(self) -> float:
        return self.float_ms / self.int8_ms if self.int8_ms else float("nan")

    @property
    def recommended_speedup(self) -> float:
        """The speedup as qcore recommends running the model: int8 where it is
        faster, each layer whose int8 form is slower kept float."""
        if math.isnan(self.faster_speedup):
            return self.speedup
        return max(self.speedup, self.faster_speedup)


def _first_tensor(output: Any) -> torch.Tensor:
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output


def _latency_ms(model: Callable, inputs: tuple, repeats: int) -> float:
    with torch.no_grad():
        for _ in range(2):
            model(*inputs)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(*inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _size_bytes(model: torch.nn.Module) -> int:
    buffer = io.BytesIO()
    try:
        torch.save(model.state_dict(), buffer)
    except Exception:  # a module whose state cannot be saved: count nothing
        return 0
    return buffer.tell()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _Progress:
    """A one-line progress bar on a terminal; elsewhere (a log, a pipe) one plain
    line when calibration starts, and no ``\\r`` frames."""

    def __init__(self, stream: TextIO, label: str, total: int) -> None:
        self.stream, self.label, self.total, self.done = stream, label, total, 0
        self.interactive = _is_terminal(stream)
        if not self.interactive:
            stream.write(f"  {label}: {total} batches\n")
            stream.flush()

    def step(self) -> None:
        self.done += 1
        if not self.interactive:
            return
        filled = round(20 * self.done / self.total)
        self.stream.write(
            f"\r  [{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} {self.label}"
        )
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def _mapping(backend: str, entry: ZooEntry) -> Any:
    from qcore.api import get_default_qconfig_mapping

    if not entry.dynamic:
        return get_default_qconfig_mapping(backend)
    from qcore.config.qconfig import QConfigMapping, default_dynamic_qconfig

    return (
        QConfigMapping()
        .set_object_type(torch.nn.Linear, default_dynamic_qconfig)
        .set_object_type(torch.nn.LSTM, default_dynamic_qconfig)
    )


def _quantize_fx(backend: str, entry: ZooEntry, model: torch.nn.Module, progress: _Progress):
    from qcore.api import convert_fx, prepare_fx

    prepared = prepare_fx(model, _mapping(backend, entry), entry.example_inputs(), backend=backend)
    with torch.no_grad():
        for batch in entry.calibration_data(progress.total):
            prepared(*batch)
            progress.step()
    return convert_fx(prepared)


def _quantize_pt2e(backend: str, entry: ZooEntry, model: torch.nn.Module, progress: _Progress):
    from qcore.pt2e import convert_pt2e, prepare_pt2e

    batches = list(entry.calibration_data(progress.total))
    exported = export_batch_free(model, batches[0])
    prepared = prepare_pt2e(exported, backend)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
            progress.step()
    return convert_pt2e(prepared)


def pt2e_available() -> bool:
    try:
        import qcore.pt2e  # noqa: F401
    except ImportError:
        return False
    return True


def _measure(
    backend: str, entry: ZooEntry, path: str, batches: int, repeats: int, stream: TextIO
) -> DemoResult:
    from qcore.api import explain

    result = DemoResult(backend, entry.name, path)
    model = entry.make_model()
    progress = _Progress(stream, f"calibrating {entry.name} for {backend} ({path})", batches)
    quantize = _quantize_fx if path == "fx" else _quantize_pt2e
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QCoreWarning)  # the report below says it all
            converted = quantize(backend, entry, model, progress)
    except Exception as error:  # one failure must not end the demo
        result.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return result
    report = explain(converted)
    ops = report.ops
    result.ops_total = len(ops)
    result.ops_on_kernels = len(report.quantized)
    result.ops_quantized = len(report.quantized) + len(report.reference)
    for stayed in report.float:
        result.float_ops.setdefault(stayed.reason, []).append(f"{stayed.node} ({stayed.op})")
    result.sqnr_db = _eval_sqnr(entry, model, converted)
    inputs = entry.example_inputs()
    result.float_ms = _latency_ms(model, inputs, repeats)
    result.int8_ms = _latency_ms(converted, inputs, repeats)
    result.float_bytes = _size_bytes(model)
    result.int8_bytes = _size_bytes(converted)
    return result


def _eval_sqnr(entry: ZooEntry, model: torch.nn.Module, converted: torch.nn.Module) -> float:
    """Mean SQNR against float over four held-out batches."""
    evals = entry.calibration_data(4, seed=EVAL_SEED)
    with torch.no_grad():
        scores = [sqnr(_first_tensor(model(*b)), _first_tensor(converted(*b))) for b in evals]
    return statistics.mean(scores)


def _keep_float_for(result: DemoResult, entry: ZooEntry, batches: int, min_sqnr: float) -> None:
    """``qcore.quantize(accuracy_budget=MinSQNR(min_sqnr))`` on the FX path: which
    layers and function calls it keeps float, and the SQNR that model reaches."""
    from qcore.accuracy import AccuracyBudgetNotMet, MinSQNR

    result.kept_float = {}
    if result.path != "fx":
        result.budget_note = "FX only"
        return
    model = entry.make_model()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AccuracyBudgetNotMet)
            chosen = _quantize_with(
                result, entry, model, batches, accuracy_budget=MinSQNR(min_sqnr)
            )
    except Exception as error:  # one failure must not end the demo
        result.budget_note = f"failed: {type(error).__name__}"
        return
    if any(issubclass(w.category, AccuracyBudgetNotMet) for w in caught):
        result.budget_note = "not met"
    result.kept_float = _kept_float(chosen, "accuracy budget")
    result.budget_sqnr_db = _eval_sqnr(entry, model, chosen)


def _quantize_with(
    result: DemoResult, entry: ZooEntry, model: torch.nn.Module, batches: int, **option: Any
) -> torch.nn.Module:
    """``qcore.quantize`` of the row's model, backend and mapping with one ``option``
    (``accuracy_budget=``, ``keep_float_if_slower=``); QCoreWarnings are the report's."""
    from qcore.api import quantize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCoreWarning)
        return quantize(
            model,
            entry.example_inputs(),
            entry.calibration_data(batches),
            result.backend,
            _mapping(result.backend, entry),
            **option,
        )


def _kept_float(model: torch.nn.Module, option: str) -> dict[str, str]:
    """node -> reason, for each layer ``option`` ("accuracy budget") kept float."""
    from qcore.api import explain

    prefix = f"kept float ({option}"
    return {
        kept.node: kept.reason for kept in explain(model).float if kept.reason.startswith(prefix)
    }


def _keep_float_where_slower(
    result: DemoResult, entry: ZooEntry, batches: int, repeats: int
) -> None:
    """Where int8 measured slower than float on the FX path: the model
    ``qcore.quantize(keep_float_if_slower=True)`` returns, its latency measured as
    the others are, and the layers it keeps float."""
    model = entry.make_model()
    try:
        faster = _quantize_with(result, entry, model, batches, keep_float_if_slower=True)
    except Exception:  # noqa: BLE001 - the row keeps its int8 figure; one failure must not end the demo
        return
    result.kept_for_speed = _kept_float(faster, "keep_float_if_slower")
    inputs = entry.example_inputs()
    float_ms, faster_ms = [], []
    for _ in range(3):  # in turn, so a burst of load hits both alike
        float_ms.append(_latency_ms(model, inputs, repeats))
        faster_ms.append(_latency_ms(faster, inputs, repeats))
    result.faster_speedup = min(float_ms) / min(faster_ms)


def _demo_backends(requested: Iterable[str] | None) -> list[str]:
    if requested:
        return list(requested)
    registry = default_registry()
    names = []
    for name in registry.names():
        if name == NATIVE:
            continue
        try:
            registry.get(name)
        except BackendLoadError:
            continue  # `qcore backends` shows why
        names.append(name)
    return names


def _sqnr_cell(result: DemoResult) -> str:
    """SQNR in dB; "n/a, all float" when nothing was quantized (the output is the
    float model's), "exact" when the quantized output equals float's."""
    if result.ops_quantized == 0:
        return "n/a, all float"
    if math.isinf(result.sqnr_db):
        return "exact"
    return f"{result.sqnr_db:.1f}"


def _row(result: DemoResult) -> list[str]:
    if result.error:
        return [
            result.backend,
            result.model,
            result.path,
            "failed: " + result.error,
            "",
            "",
            "",
            "",
            "",
        ]
    return [
        result.backend,
        result.model,
        result.path,
        f"{result.ops_quantized}/{result.ops_total} ({result.ops_on_kernels} on kernels)",
        _sqnr_cell(result),
        f"{result.float_ms:.2f}",
        f"{result.int8_ms:.2f}",
        _speedup_cell(result),
        f"{result.float_bytes / 1024:.0f} -> {result.int8_bytes / 1024:.0f} KiB",
    ]


def _speedup_cell(result: DemoResult) -> str:
    """float / int8 latency; where int8 was slower, that and the speedup with the
    slower layers kept float (``keep_float_if_slower``), marked *."""
    if math.isnan(result.faster_speedup):
        return f"{result.speedup:.2f}x"
    return f"{result.speedup:.2f}x -> {result.recommended_speedup:.2f}x*"


def _budget_cell(result: DemoResult) -> str:
    """How many candidates ``accuracy_budget`` kept float (not counting the
    activations that went float with them), and the SQNR it then reaches."""
    if result.kept_float is None:
        return ""
    if result.budget_note and result.budget_note != "not met":
        return result.budget_note
    met = " (not met)" if result.budget_note else ""
    kept = sum("(with " not in reason for reason in result.kept_float.values())
    return f"{kept} -> {result.budget_sqnr_db:.1f} dB{met}"


def format_results(results: list[DemoResult]) -> str:
    header = [
        "BACKEND",
        "MODEL",
        "PATH",
        "OPS QUANTIZED",
        "SQNR dB",
        "FLOAT ms",
        "INT8 ms",
        "SPEEDUP",
        "SIZE",
    ]
    rows = [header] + [_row(result) for result in results]
    if any(result.kept_float is not None for result in results):
        header.append("KEPT FLOAT")
        for row, result in zip(rows[1:], results, strict=True):
            row.append(_budget_cell(result))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _wrap(text: str, indent: str) -> str:
    """``text`` as lines within the terminal width the explain table keeps to."""
    return (
        "\n".join(textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent))
        + "\n"
    )


def _write_kept(results: list[DemoResult], min_sqnr: float, stream: TextIO) -> None:
    stream.write(
        f"\nKEPT FLOAT: what qcore.quantize(accuracy_budget={min_sqnr:g}) keeps float for an "
        "SQNR of at least that on the calibration data (the SQNR shown is on held-out data):\n"
    )
    for result in results:
        if not result.kept_float:
            continue
        stream.write(f"  {result.backend} / {result.model} ({result.path}):\n")
        for node, reason in result.kept_float.items():
            stream.write(_wrap(f"{node}: {reason}", "    "))


def _write_slower(results: list[DemoResult], stream: TextIO) -> None:
    """Rows whose int8 model ran slower than float, and the way out."""
    slower = [r for r in results if not r.error and r.speedup < 1.0]
    if not slower:
        return
    stream.write(
        "\n"
        + _wrap(
            "SLOWER IN INT8 than float on this machine (small layers do not earn back "
            "quantizing their inputs). * is qcore.quantize(..., keep_float_if_slower=True), "
            "which measures each conv/linear and keeps float those faster in float:",
            "",
        )
    )
    for result in slower:
        where = f"  {result.backend} / {result.model} ({result.path}): "
        if result.path != "fx":
            stream.write(
                _wrap(
                    where + f"{result.speedup:.2f}x; keep_float_if_slower is on the FX path "
                    "(its row shows what it gives)",
                    "",
                )
            )
            continue
        if math.isnan(result.faster_speedup):
            stream.write(_wrap(where + "keep_float_if_slower failed; int8 kept", ""))
            continue
        kept = ", ".join(result.kept_for_speed) or "nothing (no layer is faster float)"
        stream.write(_wrap(where + f"{result.recommended_speedup:.2f}x with float: {kept}", ""))


def run_demo(
    backends: Iterable[str] | None = None,
    models: Iterable[str] | None = None,
    paths: Iterable[str] | None = None,
    *,
    batches: int = 8,
    repeats: int = 20,
    stream: TextIO = sys.stdout,
    progress_stream: TextIO = sys.stderr,
    min_sqnr: float | None = None,
) -> list[DemoResult]:
    """Quantize the example models with each backend and path; print and return the results.

    ``min_sqnr``: also quantize each model on the FX path with
    ``accuracy_budget=qcore.MinSQNR(min_sqnr)`` and show the layers it keeps float
    (a column, and each layer's reason): about two conversions per conv/linear.
    """
    names = _demo_backends(backends)
    entries = [ZOO[name] for name in (models or ZOO)]
    chosen_paths = list(paths) if paths else (["fx", "pt2e"] if pt2e_available() else ["fx"])
    torch.manual_seed(0)
    if not names:
        stream.write(
            "No backend plugins are installed: nothing to quantize for. Install one, e.g.\n"
            "  pip install qcore-x86      (or qcore-fbgemm, qcore-qnnpack)\n"
        )
        return []
    results = []
    for name in names:
        progress_stream.write(f"{name}:\n")
        for entry in entries:
            for path in chosen_paths:
                result = _measure(name, entry, path, batches, repeats, progress_stream)
                if path == "fx" and not result.error and result.speedup < 1.0:
                    progress_stream.write(
                        f"  {entry.name}: int8 slower than float; measuring which layers "
                        "to keep float\n"
                    )
                    _keep_float_where_slower(result, entry, batches, repeats)
                if min_sqnr is not None and not result.error:
                    if path == "fx":
                        progress_stream.write(
                            f"  keeping layers of {entry.name} float for SQNR >= {min_sqnr:g} dB\n"
                        )
                    _keep_float_for(result, entry, batches, min_sqnr)
                results.append(result)
    stream.write(
        f"\nqcore demo: {len(names)} backend(s), torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)\n\n"
    )
    stream.write(format_results(results) + "\n")
    _write_slower(results, stream)
    if min_sqnr is not None:
        _write_kept(results, min_sqnr, stream)
    floats = [r for r in results if r.float_ops]
    if floats:
        stream.write("\nWhat stayed in float, and why:\n")
        for result in floats:
            stream.write(f"  {result.backend} / {result.model} ({result.path}):\n")
            for reason, nodes in result.float_ops.items():
                stream.write(_wrap(brief(reason) + ":", "    ") + _wrap(", ".join(nodes), "      "))
        if any(brief(reason) != reason for result in floats for reason in result.float_ops):
            stream.write(
                "  (…) marks details left out: qcore.explain(model).details(node) has them all\n"
            )
    return results
