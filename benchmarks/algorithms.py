"""Post-training algorithms (issue 17): each one's SQNR gain, qcore against NNCF.

    python benchmarks/algorithms.py [--models a,b] [--backends x86,qnnpack]
                                    [--out benchmarks/ALGORITHMS.md] [--merge] [--no-nncf]

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

A model named ``<model>+trained_bn`` is ``<model>`` with batch-norm statistics as
training leaves them (:func:`plant_trained_bn`): the per-channel range imbalance
equalization is for, which random weights do not have. The backend name
``"qnnpack per-channel"`` is qnnpack with per-channel weights, ``"qnnpack
residual-float"`` qnnpack with its adds left float, ``"qnnpack linears/convs only"``
qnnpack quantizing nothing else (:func:`its_quantizer`).
``--merge`` keeps the rows ``--out`` has for what this run does not measure.
"""

from __future__ import annotations

import argparse
import math
import operator
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
#: The depthwise nets with batch norms, planted with trained-like statistics (make_case).
PLANTED = ("mobilenetv2_like+trained_bn", "mobilenet_v2+trained_bn", "efficientnet+trained_bn")
#: Depthwise-separable nets: where issue 17 asks equalize + correct_bias for >= 2 dB.
DEPTHWISE = ("mobilenetv2_like", "mobilenet_v2", "efficientnet", "convnext")
BACKENDS = ("x86", "qnnpack")
#: A row beside the backends: qnnpack with per-channel weights (its_quantizer).
QNNPACK_PER_CHANNEL = "qnnpack per-channel"
#: Another: qnnpack with every add float.
QNNPACK_RESIDUAL_FLOAT = "qnnpack residual-float"
#: Another: qnnpack quantizing linears and convs only (their input, weight and output),
#: every other op float: the user guide's scope for transformers (NNCF's TRANSFORMER
#: preset quantizes linear and matmul inputs only).
QNNPACK_WEIGHTED_ONLY = "qnnpack linears/convs only"
#: qcore's recipes, in table order: name -> quantize's algorithms=.
RECIPES: dict[str, list] = {
    "plain": [],
    "+equalize": ["equalize"],
    "+equalize(relu6)": [("equalize", {"relu6_to_relu": True})],
    "+correct_bias": ["correct_bias"],
    "equalize+correct_bias": ["equalize", "correct_bias"],
    "equalize(relu6)+correct_bias": [("equalize", {"relu6_to_relu": True}), "correct_bias"],
    "+correct_bias(empirical)": [("correct_bias", {"method": "empirical"})],
    "equalize+correct_bias(empirical)": ["equalize", ("correct_bias", {"method": "empirical"})],
    "equalize(relu6)+correct_bias(empirical)": [
        ("equalize", {"relu6_to_relu": True}),
        ("correct_bias", {"method": "empirical"}),
    ],
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
        case.evaluation[:REAL_EVAL_BATCHES],
        transformer=case.family == "text",
    )


#: Held-out batches of a transformers model here: this benchmark's protocol (the
#: first 3 of the corpus's evaluation batches, the ones it had when ALGORITHMS.md
#: was measured; the corpus now scores on 16).
REAL_EVAL_BATCHES = 3


#: Suffix of a model name whose batch norms get trained-like statistics (plant_trained_bn).
TRAINED_BN = "+trained_bn"
#: Seeds of the planting: the gammas' draw, and the batches the running statistics settle on
#: (neither the weights' 0, the calibration's 1 nor the evaluation's 2).
PLANT_SEED, SETTLE_SEED = 17, 3
#: log10 of the factor each BatchNorm channel's gamma is multiplied by: uniform in
#: [-2, 0], two decades below the model's own gammas, never above: a trained
#: MobileNetV2 loses next to nothing when its ReLU6s become ReLUs (Nagel et al.), so
#: its activations rarely reach 6, and planting must not push them there.
GAMMA_DECADES = (-2.0, 0.0)
#: The batch norms' eps, at most: torch's default. transformers' TF ports use 1e-3,
#: above the variance their random convs (normal, std 0.02) give, so a planted small
#: gamma would leave channels eps-dominated, fading to nothing through the depth.
EPS = 1e-5


def plant_trained_bn(model: torch.nn.Module, settle_batches: list[tuple]) -> None:
    """Give ``model``'s BatchNorms the per-channel spread training leaves them (in place).

    Each channel's gamma is multiplied by ``10 ** U(GAMMA_DECADES)`` (seeded), its beta
    kept; then every running mean and variance is set to the exact average over
    ``settle_batches`` (the batch norms alone in train mode, twice, so each sees the
    previous ones' planted output): the statistics a trained net's channels really
    produce. After folding, a conv's output channel ``c`` is scaled by
    ``gamma_c / sqrt(var_c + eps)``; trained MobileNetV2's first depthwise layer has
    per-channel weight ranges spanning two to three decades that way (Nagel et al.,
    Data-Free Quantization, 2019, Fig. 2), from small and dead channels (small gammas,
    small input variance). Setting ``running_var`` apart from the data would only be
    another gamma (the conv's weight scale cancels in the fold), so the variances are
    the data's. The float model is a valid function and is the reference SQNR is
    measured against.
    """
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    generator = torch.Generator().manual_seed(PLANT_SEED)
    low, high = GAMMA_DECADES
    with torch.no_grad():
        for norm in norms:
            exponent = torch.rand(norm.num_features, generator=generator) * (high - low) + low
            norm.weight.mul_(10.0**exponent)
            norm.eps = min(norm.eps, EPS)
        for _ in range(2):
            for norm in norms:
                norm.reset_running_stats()
                norm.momentum = None  # cumulative average over the batches
                norm.train()
            for batch in settle_batches:
                model(*batch)
        for norm in norms:
            norm.momentum = 0.1
            norm.eval()


def folded_depthwise_spreads(model: torch.nn.Module) -> list[float]:
    """Per depthwise conv directly followed by a BatchNorm (module order): the largest
    over the smallest per-channel range of its weight with the BatchNorm folded in."""
    spreads, previous = [], None
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d) and previous is not None:
            gain = module.weight / torch.sqrt(module.running_var + module.eps)
            ranges = (previous.weight.flatten(1).abs().amax(1) * gain.abs()).detach()
            spreads.append(float(ranges.max() / ranges.min()))
        is_depthwise = (
            isinstance(module, torch.nn.Conv2d)
            and module.groups > 1
            and module.groups == module.in_channels == module.out_channels
        )
        if isinstance(module, torch.nn.Conv2d):
            previous = module if is_depthwise else None
        elif not isinstance(module, torch.nn.BatchNorm2d) and not list(module.children()):
            previous = None
    return spreads


def make_case(name: str) -> Case:
    """The case ``name``: an example model, a transformers model, or either with
    ``TRAINED_BN`` appended (its batch norms planted, :func:`plant_trained_bn`)."""
    base = name.removesuffix(TRAINED_BN)
    case = zoo_case(base) if base in ZOO else real_case(base)
    if base != name:
        if not folded_depthwise_spreads(case.model):
            raise ValueError(
                f"model {name!r}: {base} has no depthwise conv followed by a BatchNorm to plant"
            )
        if base in ZOO:
            settle = ZOO[base].calibration_data(4, seed=SETTLE_SEED)
        else:
            from realmodels.models import BUILDERS, CALIBRATION_BATCHES

            settle = BUILDERS[base][2](SETTLE_SEED, CALIBRATION_BATCHES)
        plant_trained_bn(case.model, settle)
        case.name = name
    spreads = folded_depthwise_spreads(case.model)
    if spreads:
        SPREADS[name] = spreads
    return case


#: Per model run with depthwise convs and batch norms: folded per-channel range spreads.
SPREADS: dict[str, list[float]] = {}
SPREAD_HEADING = "## Depthwise weight ranges after batch-norm folding"
SPREAD_KEY = "spread: "  # their lines' keys among render's kept lines


def score(model: torch.nn.Module, quantized: Callable, evaluation: list[tuple]) -> float:
    with torch.no_grad():
        values = [sqnr(model(*batch), quantized(*batch)) for batch in evaluation]
    return sum(values) / len(values)


def its_quantizer(backend: str) -> object:
    """What ``prepare_pt2e`` gets for a row: the backend's name (its default Quantizer),
    or for ``QNNPACK_PER_CHANNEL`` qnnpack's Quantizer compiled with its default
    QConfigMapping whose global QConfig takes per-channel symmetric weights, what a
    user writes for torchao's ``XNNPACKQuantizer(is_per_channel=True)``: torch's
    qnnpack conv and linear kernels take per-channel weights; for
    ``QNNPACK_RESIDUAL_FLOAT`` the same mapping with every add left float; for
    ``QNNPACK_WEIGHTED_ONLY`` a mapping quantizing linears and convs alone."""
    if backend not in (QNNPACK_PER_CHANNEL, QNNPACK_RESIDUAL_FLOAT, QNNPACK_WEIGHTED_ONLY):
        return backend
    from qcore.observers import default_per_channel_weight_observer
    from qcore.pt2e.backend_quantizer import BackendQuantizer

    mapping = qcore.get_default_qconfig_mapping("qnnpack")
    if backend == QNNPACK_WEIGHTED_ONLY:
        qconfig, mapping = mapping.global_qconfig, qcore.QConfigMapping().set_global(None)
        functional = torch.nn.functional
        for op in (torch.nn.Linear, functional.linear, torch.nn.Conv1d, torch.nn.Conv2d):
            mapping.set_object_type(op, qconfig)
        for op in (functional.conv1d, functional.conv2d):
            mapping.set_object_type(op, qconfig)
    elif backend == QNNPACK_PER_CHANNEL:
        activation = mapping.global_qconfig.activation
        mapping.set_global(qcore.QConfig(activation, default_per_channel_weight_observer))
    else:
        for add in (operator.add, torch.add):
            mapping.set_object_type(add, None)
    return BackendQuantizer.for_backend("qnnpack", mapping)


def qcore_sqnr(case: Case, exported: torch.fx.GraphModule, backend: str, recipe: list) -> float:
    steps = resolve_algorithms(recipe)
    prepared = qcore.prepare_pt2e(exported, its_quantizer(backend))
    prepared, _ = run_stage(prepared, steps, BEFORE_CALIBRATION, case.calibration)
    with torch.no_grad():
        for batch in case.calibration:
            prepared(*batch)
    prepared, _ = run_stage(prepared, steps, AFTER_CALIBRATION, case.calibration)
    return score(case.model, qcore.convert_pt2e(prepared), case.evaluation)


#: The recipes issue 17's ">= 2 dB on depthwise nets" target reads: equalization
#: (across ReLU6 or not) followed by bias correction (fast or empirical).
EQUALIZE_AND_CORRECT = (
    "equalize+correct_bias",
    "equalize(relu6)+correct_bias",
    "equalize+correct_bias(empirical)",
    "equalize(relu6)+correct_bias(empirical)",
)


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
    correction, preset MIXED (asymmetric activations, as qcore's), with per-tensor
    activations only (``PER_TENSOR_NNCF``), and for transformers
    model_type=TRANSFORMER (SmoothQuant, its default alpha)."""
    import nncf
    from nncf.quantization.advanced_parameters import (
        AdvancedQuantizationParameters,
        QuantizationParameters,
    )

    per_tensor = QuantizationParameters(per_channel=False)
    variants = {
        "nncf default": {},
        "nncf no bias correction": {
            "advanced_parameters": AdvancedQuantizationParameters(disable_bias_correction=True)
        },
        "nncf preset MIXED": {"preset": nncf.QuantizationPreset.MIXED},
        PER_TENSOR_NNCF: {
            "advanced_parameters": AdvancedQuantizationParameters(
                activations_quantization_params=per_tensor
            )
        },
    }
    if case.transformer:
        variants["nncf TRANSFORMER (SmoothQuant)"] = {"model_type": nncf.ModelType.TRANSFORMER}
    # NNCF's main PyTorch path: the nn.Module itself (its Torch backend, FakeQuantize
    # hooks; needs its C++ extension built), default parameters.
    variants["nncf nn.Module default"] = {MODULE: True}
    return variants


MODULE = "nn.Module"
#: NNCF's CPU target quantizes a depthwise conv's input per channel (one scale per
#: channel of an activation), which no int8 conv of torch's runs: the variant
#: restricted to per-tensor activations, the form qcore's backends (and torchao's
#: x86 quantizer) execute, is the like-for-like comparison on depthwise nets.
PER_TENSOR_NNCF = "nncf per-tensor activations"


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


def _per_tensor_note(row: Row, peer: Row | None) -> str:
    """On a depthwise net, qcore's best against NNCF restricted to per-tensor
    activations (``PER_TENSOR_NNCF``), where that was measured; else ""."""
    like = math.nan if peer is None else peer.sqnr.get(PER_TENSOR_NNCF, math.nan)
    ours = best(row)[1]
    if row.model.removesuffix(TRAINED_BN) not in DEPTHWISE or math.isnan(like + ours):
        return ""
    return (
        f"vs NNCF with per-tensor activations (what torch's int8 convs run) {like:.1f} dB "
        f"({'met' if ours >= like else 'NOT met'})"
    )


def render(rows: list[Row], nncf_version: str | None, kept: dict[str, str] | None = None) -> str:
    """The generated part of ALGORITHMS.md. ``kept``: qcore table lines (by
    "| model | backend |") and range-spread lines
    (by ``SPREAD_KEY`` + model) to print as they are: rows merged from an earlier
    run, whose numbers the file holds rounded (:func:`earlier_rows`)."""
    kept = kept or {}
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
        if f"| {row.model} | {row.backend} |" in kept:  # as printed: ties stay as they were
            lines.append(kept[f"| {row.model} | {row.backend} |"])
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
        # recomputed from the rows (merged ones as the tables print them): a re-run NNCF
        # row moves its "best", which a kept line would not follow
        peer = next((r for r in nncf_rows if r.model == row.model), None)
        notes = []
        if row.model.removesuffix(TRAINED_BN) in DEPTHWISE:
            # either equalize variant, either bias correction method
            tried = {
                label: row.sqnr[label]
                for label in EQUALIZE_AND_CORRECT
                if not math.isnan(row.sqnr.get(label, math.nan))
            }
            label = max(tried, key=tried.get) if tried else "equalize+correct_bias"
            gain = tried.get(label, math.nan) - row.sqnr.get("plain", math.nan)
            notes.append(
                f"equalize + correct_bias over plain: {gain:+.1f} dB ({label}; "
                f"{'met' if gain >= 2.0 else 'NOT met'}, target >= 2 dB)"
            )
        if peer is not None:
            ours, theirs = best(row)[1], best(peer)[1]
            if math.isnan(ours):
                notes.append(f"qcore failed, NNCF's best {theirs:.1f} dB (NOT met: never below)")
            else:
                notes.append(
                    f"best {ours:.1f} vs NNCF's best {theirs:.1f} dB "
                    f"({'met' if ours >= theirs else 'NOT met'}: never below NNCF)"
                )
                if like := _per_tensor_note(row, peer):
                    notes.append(like)
        lines.append(f"- {row.model} / {row.backend}: " + "; ".join(notes))
    spread_lines = {key: line for key, line in kept.items() if key.startswith(SPREAD_KEY)}
    for name, spreads in SPREADS.items():
        shown = ", ".join(f"{value:.0f}" for value in spreads)
        median = sorted(spreads)[len(spreads) // 2]
        spread_lines[SPREAD_KEY + name] = f"- {name}: {shown} (median {median:.0f})"
    if spread_lines:
        lines += [
            "",
            SPREAD_HEADING + " (`" + TRAINED_BN + "`: planted)",
            "",
            "Per depthwise conv followed by a BatchNorm, in model order: its largest over "
            "smallest per-channel weight range once the BatchNorm is folded in.",
            "",
            *spread_lines.values(),
        ]
    failed = [(row, label, error) for row in rows for label, error in row.errors.items()]
    if failed:
        lines += ["", "## Failures", ""]
        lines += [
            f"- {row.model} / {row.backend} / {label}: {error}" for row, label, error in failed
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ZOO_MODELS + REAL_MODELS + PLANTED))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "ALGORITHMS.md"))
    parser.add_argument(
        "--fx-only", action="store_true", help="only qcore.quantize (FX) on the example models"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows --out already has for the models and backends not run now",
    )
    parser.add_argument("--no-nncf", action="store_true", help="run qcore only")
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
    out = Path(args.out)
    earlier, kept = earlier_rows(out.read_text()) if args.merge and out.exists() else ([], {})
    rows: list[Row] = []
    for name in args.models.split(","):
        case = make_case(name)
        torch.manual_seed(0)
        rows += measure(case, backends, nncf_version is not None and not args.no_nncf)
        fresh = {f"{row.model} / {row.backend}" for row in rows}
        fresh |= {f"| {row.model} | {row.backend} |" for row in rows}
        tables = render(
            merged(earlier, rows),
            nncf_version,
            {key: line for key, line in kept.items() if key not in fresh},
        )
        write(out, tables)  # a long run keeps what it has
    print(tables)


NOTES = "<!-- notes: written by hand, kept when the tables are regenerated -->"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def earlier_rows(text: str) -> tuple[list[Row], dict[str, str]]:
    """``--merge``: the rows of an ALGORITHMS.md's generated tables (numbers as printed,
    one decimal; a ``-`` cell left out, a failure back in ``errors``), and its qcore
    table lines as printed (see :func:`render`); the target lines are recomputed."""
    rows: dict[tuple[str, str], Row] = {}
    kept: dict[str, str] = {}
    section, header = "", []
    generated = text[: text.index(NOTES)] if NOTES in text else text
    for line in generated.splitlines():
        if line.startswith("## "):
            section, header = line, []
        elif line.startswith("| model |"):
            header = _cells(line)
        elif line.startswith("|") and header and not line.startswith("|---"):
            cells = _cells(line)
            nncf = "NNCF" in section
            model, backend = cells[0], "nncf" if nncf else cells[1]
            row = rows.setdefault((model, backend), Row(model, backend))
            if not nncf:
                kept[f"| {model} | {backend} |"] = line
            for label, cell in zip(
                header[1 if nncf else 2 : -1], cells[1 if nncf else 2 : -1], strict=True
            ):
                if cell != "-":
                    row.sqnr[label] = float(cell)
        elif section.startswith(SPREAD_HEADING) and line.startswith("- "):
            kept[SPREAD_KEY + line[2:].split(":", 1)[0]] = line
        elif section == "## Failures" and line.startswith("- "):
            model, backend, rest = line[2:].split(" / ", 2)
            label, error = rest.split(": ", 1)
            row = rows.setdefault((model, backend), Row(model, backend))
            row.sqnr[label], row.errors[label] = math.nan, error
    return list(rows.values()), kept


def merged(old: list[Row], new: list[Row]) -> list[Row]:
    """``old`` with the rows ``new`` measured again replaced in place, then the others
    of ``new``; qcore rows first, NNCF rows after (the order render prints)."""
    fresh = {(row.model, row.backend): row for row in new}
    rows = [fresh.pop((row.model, row.backend), row) for row in old]
    return rows + list(fresh.values())


def write(path: Path, tables: str) -> None:
    """The tables, then the hand-written notes the file already has, if any."""
    old = path.read_text() if path.exists() else ""
    notes = old[old.index(NOTES) :] if NOTES in old else ""
    path.write_text(tables + ("\n" + notes if notes else ""))


if __name__ == "__main__":
    main()
