"""Post-training algorithms (issue 17): each one's SQNR gain, qcore against NNCF.

    python benchmarks/algorithms.py [--models a,b] [--backends x86,qnnpack]
                                    [--out benchmarks/ALGORITHMS.md]

Needs transformers and nncf beside torch (a venv of its own: see ALGORITHMS.md).
Per model (qcore's example models, and from tests/realmodels MobileNetV2,
EfficientNet, ConvNeXt and BERT built from tiny configs with random weights) and
backend: torch.export, ``qcore.prepare_pt2e(exported, backend)``, each recipe of
``RECIPES`` run at its stage (``qcore.algorithms.recipes.run_stage``, what
``qcore.quantize(algorithms=...)`` runs), calibrate, ``convert_pt2e`` (lowered to
the backend's kernels); SQNR in dB against the float model, mean over held-out
batches. NNCF: ``nncf.quantize`` on the same exported graph (its Torch FX backend)
with the same calibration batches, 8-bit weights and activations as qcore, in the
variants of ``nncf_variants``; its model is NNCF's reference graph (quantize and
dequantize ops around float ops), run eagerly. A benchmark, not a check.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from _machine import cpu_model  # noqa: E402

import qcore  # noqa: E402
from qcore.accuracy import sqnr  # noqa: E402
from qcore.algorithms.recipes import (  # noqa: E402
    AFTER_CALIBRATION,
    BEFORE_CALIBRATION,
    resolve_algorithms,
    run_stage,
)
from qcore.examples import EVAL_SEED, ZOO  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

THREADS = 2
ZOO_MODELS = ("resnet18_like", "mobilenetv2_like", "mlp", "transformer_block")
REAL_MODELS = ("mobilenet_v2", "efficientnet", "convnext", "bert")
#: Depthwise-separable nets: where issue 17 asks equalize + correct_bias for >= 2 dB.
DEPTHWISE = ("mobilenetv2_like", "mobilenet_v2", "efficientnet", "convnext")
BACKENDS = ("x86", "qnnpack")
#: qcore's recipes, in table order: name -> quantize's algorithms=.
RECIPES: dict[str, list] = {
    "plain": [],
    "+equalize": ["equalize"],
    "+equalize(relu6)": [("equalize", {"relu6_to_relu": True})],
    "+correct_bias": ["correct_bias"],
    "equalize+correct_bias": ["equalize", "correct_bias"],
    "equalize(relu6)+correct_bias": [("equalize", {"relu6_to_relu": True}), "correct_bias"],
    "+smooth_quant(0.5)": [("smooth_quant", {"alpha": 0.5})],
    "smooth_quant(search)+correct_bias": [("smooth_quant", {"alpha": "search"}), "correct_bias"],
    # A time budget keeps a shared 2-core machine's run in minutes (the paper: 10k steps).
    "+adaround(20 s)": [("adaround", {"time_budget_s": 20.0, "progress": False})],
}


@dataclass
class Case:
    name: str
    model: torch.nn.Module
    example: tuple
    calibration: list[tuple]
    evaluation: list[tuple]
    transformer: bool = False


@dataclass
class Row:
    model: str
    backend: str
    sqnr: dict[str, float] = field(default_factory=dict)  # recipe -> dB (nan: failed)
    errors: dict[str, str] = field(default_factory=dict)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def zoo_case(name: str) -> Case:
    entry = ZOO[name]
    calibration = entry.calibration_data(8)
    return Case(
        name,
        entry.make_model().eval(),
        calibration[0],  # exported at the calibration batch size (example_inputs: 1)
        calibration,
        entry.calibration_data(4, seed=EVAL_SEED),
        transformer=name == "transformer_block",
    )


def real_case(name: str) -> Case:
    from realmodels.models import build

    case = build(name)
    return Case(
        name,
        case.model,
        case.example_inputs,
        case.calibration,
        case.evaluation,
        transformer=case.family == "text",
    )


def score(model: torch.nn.Module, quantized: Callable, evaluation: list[tuple]) -> float:
    with torch.no_grad():
        values = [sqnr(model(*batch), quantized(*batch)) for batch in evaluation]
    return sum(values) / len(values)


def qcore_sqnr(case: Case, exported: torch.fx.GraphModule, backend: str, recipe: list) -> float:
    steps = resolve_algorithms(recipe)
    prepared = qcore.prepare_pt2e(exported, backend)
    prepared, _ = run_stage(prepared, steps, BEFORE_CALIBRATION, case.calibration)
    with torch.no_grad():
        for batch in case.calibration:
            prepared(*batch)
    prepared, _ = run_stage(prepared, steps, AFTER_CALIBRATION, case.calibration)
    return score(case.model, qcore.convert_pt2e(prepared), case.evaluation)


#: FX (qcore.quantize itself) on the example models: what algorithms= feeds.
FX_RECIPES: dict[str, object] = {
    "plain": None,
    "equalize+correct_bias": ["equalize", "correct_bias"],
    "recommended": "recommended",
}


def fx_rows(names: list[str], backends: tuple[str, ...]) -> list[Row]:
    """qcore.quantize(model, ..., algorithms=recipe) per example model and backend."""
    from qcore.algorithms import recommended_algorithms

    rows = []
    for name in names:
        case = zoo_case(name)
        for backend in backends:
            row = Row(name, backend)
            for label, recipe in FX_RECIPES.items():
                try:
                    quantized = qcore.quantize(
                        case.model, case.example, case.calibration, backend, algorithms=recipe
                    )
                    row.sqnr[label] = score(case.model, quantized, case.evaluation)
                except Exception as error:
                    row.sqnr[label] = math.nan
                    row.errors[label] = first_line(error)
                print(f"fx {name} {backend} {label}: {row.sqnr[label]:.2f} dB", flush=True)
            steps = recommended_algorithms(backend)
            row.errors["(recommended)"] = ", ".join(s.describe() for s in steps) or "none"
            rows.append(row)
    return rows


def render_fx(rows: list[Row]) -> str:
    """The FX table (``--fx-only``): SQNR per recipe, and what "recommended" ran."""
    labels = list(FX_RECIPES)
    lines = [
        "| model | backend | " + " | ".join(labels) + " | recommended is |",
        "|---" * (len(labels) + 3) + "|",
    ]
    for row in rows:
        cells = [_db(row.sqnr.get(label)) for label in labels]
        what = row.errors.get("(recommended)", "")
        lines.append(f"| {row.model} | {row.backend} | " + " | ".join(cells) + f" | {what} |")
    return "\n".join(lines)


def nncf_variants(case: Case) -> dict[str, dict]:
    """nncf.quantize's keyword arguments per variant: its default (preset
    PERFORMANCE: symmetric activations; fast bias correction on), without bias
    correction, preset MIXED (asymmetric activations, as qcore's), and for
    transformers model_type=TRANSFORMER (SmoothQuant, its default alpha)."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters

    variants = {
        "nncf default": {},
        "nncf no bias correction": {
            "advanced_parameters": AdvancedQuantizationParameters(disable_bias_correction=True)
        },
        "nncf preset MIXED": {"preset": nncf.QuantizationPreset.MIXED},
    }
    if case.transformer:
        variants["nncf TRANSFORMER (SmoothQuant)"] = {"model_type": nncf.ModelType.TRANSFORMER}
    # NNCF's main PyTorch path: the nn.Module itself (its Torch backend, FakeQuantize
    # hooks; needs its C++ extension built), default parameters.
    variants["nncf nn.Module default"] = {MODULE: True}
    return variants


MODULE = "nn.Module"


def nncf_sqnr(case: Case, exported: torch.fx.GraphModule, options: dict) -> float:
    import copy

    import nncf

    options = dict(options)
    model = case.model if options.pop(MODULE, False) else exported
    dataset = nncf.Dataset(case.calibration, lambda batch: batch)
    quantized = nncf.quantize(
        copy.deepcopy(model), dataset, subset_size=len(case.calibration), **options
    )
    return score(case.model, quantized, case.evaluation)


def measure(case: Case, backends: tuple[str, ...], with_nncf: bool) -> list[Row]:
    exported = torch.export.export(case.model, case.example).module()
    has_relu6 = any(isinstance(m, torch.nn.ReLU6) for m in case.model.modules())
    rows = []
    for backend in backends:
        row = Row(case.name, backend)
        for label, recipe in RECIPES.items():
            if "smooth_quant" in label and not case.transformer and case.name != "mlp":
                continue  # SmoothQuant smooths linears after a LayerNorm or linear
            if "relu6" in label and not has_relu6:
                continue  # the same model as without relu6_to_relu
            started = time.perf_counter()
            try:
                row.sqnr[label] = qcore_sqnr(case, exported, backend, recipe)
            except Exception as error:  # a benchmark reports, never stops
                row.sqnr[label], row.errors[label] = math.nan, first_line(error)
            print(
                f"{case.name} {backend} {label}: {row.sqnr[label]:.2f} dB "
                f"({time.perf_counter() - started:.1f} s)",
                flush=True,
            )
        rows.append(row)
    if with_nncf:
        row = Row(case.name, "nncf")
        for label, options in nncf_variants(case).items():
            try:
                row.sqnr[label] = nncf_sqnr(case, exported, options)
            except Exception as error:
                row.sqnr[label], row.errors[label] = math.nan, first_line(error)
            print(f"{case.name} {label}: {row.sqnr[label]:.2f} dB", flush=True)
        rows.append(row)
    return rows


def _db(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1f}"


def best(row: Row) -> tuple[str, float]:
    found = {k: v for k, v in row.sqnr.items() if not math.isnan(v)}
    if not found:
        return "all failed", math.nan
    label = max(found, key=found.get)
    return label, found[label]


def render(rows: list[Row], nncf_version: str | None) -> str:
    labels = list(RECIPES)
    lines = [
        "# Post-training algorithms: SQNR gain per algorithm, qcore against NNCF",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores (shared), "
        f"torch.set_num_threads({THREADS}); torch {torch.__version__}, Python "
        f"{platform.python_version()}, NNCF {nncf_version or 'not installed'}.",
        "",
        "Generated by `python benchmarks/algorithms.py` (see its docstring and the notes "
        "below). SQNR: dB against the float model, mean over held-out batches; higher is "
        "better. `-`: not run (SmoothQuant on conv nets) or failed (listed below).",
        "",
        "## qcore, per backend (PT2E path, lowered)",
        "",
        "| model | backend | " + " | ".join(labels) + " | best |",
        "|---" * (len(labels) + 3) + "|",
    ]
    for row in rows:
        if row.backend == "nncf":
            continue
        label, value = best(row)
        cells = [_db(row.sqnr.get(name)) for name in labels]
        lines.append(
            f"| {row.model} | {row.backend} | " + " | ".join(cells) + f" | {value:.1f} ({label}) |"
        )
    nncf_rows = [row for row in rows if row.backend == "nncf"]
    if nncf_rows:
        nncf_labels = list(dict.fromkeys(label for row in nncf_rows for label in row.sqnr))
        lines += [
            "",
            "## NNCF (nncf.quantize on the same exported graph, or on the float nn.Module "
            "where the column says so; the same calibration batches)",
            "",
            "| model | " + " | ".join(nncf_labels) + " | best |",
            "|---" * (len(nncf_labels) + 2) + "|",
        ]
        for row in nncf_rows:
            label, value = best(row)
            cells = [_db(row.sqnr.get(name)) for name in nncf_labels]
            lines.append(f"| {row.model} | " + " | ".join(cells) + f" | {value:.1f} ({label}) |")
    lines += ["", "## Targets", ""]
    for row in rows:
        if row.backend == "nncf":
            continue
        notes = []
        if row.model in DEPTHWISE:
            gain = max(
                row.sqnr.get("equalize+correct_bias", math.nan),
                row.sqnr.get("equalize(relu6)+correct_bias", math.nan),
            ) - row.sqnr.get("plain", math.nan)
            notes.append(
                f"equalize + correct_bias over plain: {gain:+.1f} dB "
                f"({'met' if gain >= 2.0 else 'NOT met'}, target >= 2 dB)"
            )
        peer = next((r for r in nncf_rows if r.model == row.model), None)
        if peer is not None:
            ours, theirs = best(row)[1], best(peer)[1]
            if math.isnan(ours):
                notes.append(f"qcore failed, NNCF's best {theirs:.1f} dB (NOT met: never below)")
            else:
                notes.append(
                    f"best {ours:.1f} vs NNCF's best {theirs:.1f} dB "
                    f"({'met' if ours >= theirs else 'NOT met'}: never below NNCF)"
                )
        lines.append(f"- {row.model} / {row.backend}: " + "; ".join(notes))
    failed = [(row, label, error) for row in rows for label, error in row.errors.items()]
    if failed:
        lines += ["", "## Failures", ""]
        lines += [
            f"- {row.model} / {row.backend} / {label}: {error}" for row, label, error in failed
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ZOO_MODELS + REAL_MODELS))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "ALGORITHMS.md"))
    parser.add_argument(
        "--fx-only", action="store_true", help="only qcore.quantize (FX) on the example models"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    warnings.simplefilter("ignore")
    try:
        import nncf

        nncf_version = nncf.__version__
    except ImportError:
        nncf_version = None
    backends = tuple(name for name in args.backends.split(",") if name)  # "": NNCF alone
    if args.fx_only:
        rows = fx_rows([n for n in args.models.split(",") if n in ZOO], backends)
        print(render_fx(rows))
        return
    rows: list[Row] = []
    for name in args.models.split(","):
        case = zoo_case(name) if name in ZOO else real_case(name)
        torch.manual_seed(0)
        rows += measure(case, backends, nncf_version is not None)
        write(Path(args.out), render(rows, nncf_version))  # a long run keeps what it has
    print(render(rows, nncf_version))


NOTES = "<!-- notes: written by hand, kept when the tables are regenerated -->"


def write(path: Path, tables: str) -> None:
    """The tables, then the hand-written notes the file already has, if any."""
    old = path.read_text() if path.exists() else ""
    notes = old[old.index(NOTES) :] if NOTES in old else ""
    path.write_text(tables + ("\n" + notes if notes else ""))


if __name__ == "__main__":
    main()
