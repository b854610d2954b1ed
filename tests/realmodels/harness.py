"""Run one (model, path, backend) case of the real-model corpus on qcore and on its peer.

    from realmodels.harness import run_case
    case = run_case("bert", "fx", "x86")
    case.qcore.ok, case.qcore.sqnr, case.peer.ok, case.peer.sqnr, case.workaround

Paths and peers, with the same mapping and bit width on both sides:

* ``fx``: ``qcore.prepare_fx``/``convert_fx`` against torch.ao's ``quantize_fx``, both
  given torch.ao's ``get_default_qconfig_mapping(backend)`` (for onednn on a CPU
  without VNNI, its x86 one with 7-bit activations, as benchmarks/kernels.py does);
  torch.ao's model runs under ``torch.backends.quantized.engine = backend``.
* ``pt2e`` (backend x86): ``qcore.prepare_pt2e(exported, "x86")``/``convert_pt2e``
  against torchao's ``X86InductorQuantizer`` with its default config, ``reduce_range``
  as qcore's X86Quantizer sets it (as tests/test_pt2e_peers.py does).

transformers models rarely trace with torch.fx. The FX workaround is found as a user
would: run qcore's ``prepare_fx``, read the module its ``TraceFailure`` names, mark it
``non_traceable_module_name`` and retry. Where the named module holds most linears and
convs of the model (marking it would quantize little more than a head), the model is swapped for its
traceable body (``models.FX_BODIES``, the same float function). The peer gets the
same model and the same prepare_custom_config. Failures on either side are results
(stage and exception text), never exceptions.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from zoo.baseline import _quiet, backend_config, count_quantized_ops, quantized_engine, sqnr

import qcore
from qcore.engine.kept_float import CONSTANT_MATH_REASON
from qcore.engine.trace import TraceFailure

from .models import FX_BODIES, Case, build

PATHS = ("fx", "pt2e")
FX_BACKENDS = ("fbgemm", "x86", "qnnpack", "onednn")
PT2E_BACKENDS = ("x86",)
SQNR_TOLERANCE_DB = 0.5
_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d)
_TRACE_ADVICE = re.compile(r"symbolic tracing failed in module '([^']+)'")


@dataclass
class SideResult:
    """What one side (qcore or its peer) made of a case, or where and why it failed."""

    side: str  # "qcore" or the peer's name
    ok: bool = False
    stage: str | None = None  # prepare, calibrate, convert, run
    error: str | None = None  # "ExceptionType: first line"
    details: str | None = None  # traceback
    sqnr: float | None = None  # dB, over all the held-out batches' outputs
    weighted_quantized: int = 0  # linear/conv ops running quantized
    # linear/conv ops qcore keeps float because they compute on constants only
    # (SwinV2's position-bias MLP on its coordinates table): no input reaches them
    weighted_on_constants: int = 0
    model: Callable | None = field(default=None, repr=False)  # runs like the float model

    def summary(self) -> str:
        if not self.ok:
            return f"{self.side} FAILED at {self.stage}: {self.error}"
        on_constants = (
            f" (+{self.weighted_on_constants} on constants, float)"
            if self.weighted_on_constants
            else ""
        )
        return (
            f"{self.side} SQNR {self.sqnr:.2f} dB, {self.weighted_quantized} linear/conv "
            f"quantized{on_constants}"
        )


@dataclass
class CaseResult:
    """Both sides of one (model, path, backend) case."""

    model: str
    path: str
    backend: str
    workaround: str  # what FX tracing needed ("-" for none)
    qcore: SideResult
    peer: SideResult
    float_model: nn.Module = field(repr=False)
    inputs: tuple = field(repr=False)  # a held-out batch, for latency

    def summary(self) -> str:
        return (
            f"{self.model}/{self.path}/{self.backend} [{self.workaround}]: "
            f"{self.qcore.summary()}; {self.peer.summary()}"
        )


# ----------------------------------------------------------------------- helpers


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _fail(result: SideResult, stage: str, error: BaseException) -> SideResult:
    result.stage, result.error, result.details = stage, _first_line(error), traceback.format_exc()
    return result


def _score(model: nn.Module, quantized: Callable, evaluation: list[tuple]) -> float:
    """SQNR (dB) of ``quantized`` against ``model`` over all the held-out batches'
    outputs together (not a mean of per-batch values: on a few batches of 20 logits one
    rounding tie early in a net moved that by half a dB, tests/realmodels/FINDINGS.md 3)."""
    with torch.no_grad():
        expected = [model(*batch) for batch in evaluation]
        actual = [quantized(*batch) for batch in evaluation]
    return sqnr(expected, actual)


def mapping_backend(backend: str) -> str:
    """Whose torch.ao default mapping both sides use: the backend's, except onednn on a
    CPU without VNNI, where torch.ao's onednn default keeps 8-bit activations (its int8
    sums saturate there) and both sides take its x86 mapping, 7-bit activations."""
    from qcore.kernels.runtime import int8_products_saturate

    if backend == "onednn" and int8_products_saturate():
        return "x86"
    return backend


def fx_mapping(backend: str) -> Any:
    """torch.ao's own default QConfigMapping for ``backend`` (qcore accepts it as is)."""
    from torch.ao.quantization import get_default_qconfig_mapping

    with _quiet():
        return get_default_qconfig_mapping(mapping_backend(backend))


# ----------------------------------------------------------------------- FX workaround


def custom_config(names: tuple[str, ...] | list[str]) -> Any:
    """torch.ao's PrepareCustomConfig marking ``names`` non-traceable (qcore takes it too)."""
    from torch.ao.quantization.fx.custom_config import PrepareCustomConfig

    return PrepareCustomConfig().set_non_traceable_module_names(list(names))


def _weighted(module: nn.Module) -> int:
    """Linears and convs in ``module``, transformers' Conv1D (GPT-2's linears) included."""
    from transformers.pytorch_utils import Conv1D

    return sum(isinstance(m, (*_WEIGHTED, Conv1D)) for m in module.modules())


def _holds_most_weighted_modules(model: nn.Module, name: str) -> bool:
    """Whether marking ``name`` non-traceable would leave less than half of the model's
    linears and convs to quantize (ViTModel, GPT2Model: all but the head)."""
    inside = model.get_submodule(name) if name not in ("", "<root>") else model
    return 2 * _weighted(inside) > _weighted(model)


@functools.cache
def fx_workaround(name: str) -> tuple[bool, tuple[str, ...]]:
    """(use the model's FX body, non-traceable module names) that let qcore trace ``name``.

    Follows qcore's TraceFailure advice (tracing does not depend on the backend, so
    x86 is asked); stops at the first error that is not a trace failure, which the
    case itself then reports.
    """
    case = build(name)
    use_body, names = False, []
    mapping = fx_mapping("x86")
    for _ in range(64):
        model = FX_BODIES[name](case.model) if use_body else case.model
        config = custom_config(names)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                qcore.prepare_fx(model, mapping, case.example_inputs, "x86", config)
            break
        except TraceFailure as error:
            match = _TRACE_ADVICE.search(str(error))
            if match is None:
                break
            module = match.group(1)
            if _holds_most_weighted_modules(model, module):
                if use_body or name not in FX_BODIES:
                    break  # nothing to quantize left: report the failure as it is
                use_body, names = True, []
                continue
            names.append(module)
        except Exception:
            break
    return use_body, tuple(names)


def describe_workaround(name: str) -> str:
    """The FX workaround of ``name`` in words, for the table."""
    use_body, names = fx_workaround(name)
    parts = ["traceable body (models.FX_BODIES)"] if use_body else []
    if names:
        short = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in names})
        parts.append("non_traceable_module_name: " + ", ".join(short))
    return "; ".join(parts) or "-"


# ----------------------------------------------------------------------- the FX path


def _fx_weighted_qcore(converted: nn.Module) -> int:
    report = qcore.explain(converted)
    return sum(
        e.status.name != "FLOAT" and re.search(r"linear|conv", e.op, re.I) is not None
        for e in report.entries
    )


def _weighted_on_constants(converted: nn.Module) -> int:
    return sum(
        e.reason == CONSTANT_MATH_REASON and re.search(r"linear|conv", e.op, re.I) is not None
        for e in qcore.explain(converted).entries
    )


def _fx_weighted_torch_ao(converted: torch.fx.GraphModule) -> int:
    counts = count_quantized_ops(converted)
    return sum(
        v
        for k, v in counts.items()
        if re.search(r"linear|conv", k) and not k.startswith(("float.", "dynamic."))
    )


def fx_qcore(case: Case, model: nn.Module, config: Any, backend: str) -> SideResult:
    """qcore's FX flow on ``model`` (the float model or its FX body)."""
    result, stage = SideResult("qcore"), "prepare"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's observers (the mapping) warn
            prepared = qcore.prepare_fx(
                model, fx_mapping(backend), case.example_inputs, backend, config
            )
            stage = "calibrate"
            with torch.no_grad():
                for batch in case.calibration:
                    prepared(*batch)
            stage = "convert"
            converted = qcore.convert_fx(prepared)
            stage = "run"
            result.sqnr = _score(case.model, converted, case.evaluation)
            stage = "explain"
            result.weighted_quantized = _fx_weighted_qcore(converted)
            result.weighted_on_constants = _weighted_on_constants(converted)
    except Exception as error:
        return _fail(result, stage, error)
    result.ok, result.model = True, converted
    return result


def fx_torch_ao(case: Case, model: nn.Module, config: Any, backend: str) -> SideResult:
    """torch.ao's FX flow, same model, mapping and prepare_custom_config, under its engine."""
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    result, stage = SideResult("torch.ao"), "prepare"
    try:
        with _quiet(), quantized_engine(backend), torch.no_grad():
            config_ = backend_config(backend)
            prepared = prepare_fx(
                copy.deepcopy(model),
                fx_mapping(backend),
                case.example_inputs,
                prepare_custom_config=config,
                backend_config=config_,
            )
            stage = "calibrate"
            for batch in case.calibration:
                prepared(*batch)
            stage = "convert"
            converted = convert_fx(prepared, backend_config=config_)
            stage = "run"
            result.sqnr = _score(case.model, converted, case.evaluation)
            result.weighted_quantized = _fx_weighted_torch_ao(converted)
    except Exception as error:
        return _fail(result, stage, error)

    def run(*args: torch.Tensor) -> torch.Tensor:
        with quantized_engine(backend), _quiet():
            return converted(*args)

    result.ok, result.model = True, run
    return result


# ----------------------------------------------------------------------- the PT2E path


def _pt2e_weighted(converted: torch.fx.GraphModule) -> int:
    """Linear/conv nodes whose weight is int8: fed by a dequantize (reference form) or
    replaced by a quantized kernel (qcore's lowered form)."""
    count = 0
    for node in converted.graph.nodes:
        if node.op == "call_function":
            name = str(node.target)
            if re.search(r"aten\.(linear|conv\w*)\.", name):
                weight = node.args[1] if len(node.args) > 1 else None
                if isinstance(weight, torch.fx.Node) and "dequantize" in str(weight.target):
                    count += 1
            elif re.search(r"linear|conv", name) and "aten." not in name:
                count += 1  # a backend kernel
        elif node.op == "call_module":
            module = converted.get_submodule(node.target)
            if re.search(r"linear|conv", type(module).__name__, re.I) and not isinstance(
                module, _WEIGHTED
            ):
                count += 1
    return count


def _export(case: Case) -> torch.fx.GraphModule:
    return torch.export.export(case.model, case.example_inputs).module()


def pt2e_qcore(case: Case) -> SideResult:
    """qcore's PT2E flow with the x86 backend by name (the plugin's X86Quantizer)."""
    result, stage = SideResult("qcore"), "export"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exported = _export(case)
            stage = "prepare"
            prepared = qcore.prepare_pt2e(exported, "x86")
            stage = "calibrate"
            with torch.no_grad():
                for batch in case.calibration:
                    prepared(*batch)
            stage = "convert"
            converted = qcore.convert_pt2e(prepared)
            stage = "run"
            result.sqnr = _score(case.model, converted, case.evaluation)
            result.weighted_quantized = _pt2e_weighted(converted)
            result.weighted_on_constants = _weighted_on_constants(converted)
    except Exception as error:
        return _fail(result, stage, error)
    result.ok, result.model = True, converted
    return result


def pt2e_torchao(case: Case) -> SideResult:
    """torchao's PT2E flow: X86InductorQuantizer, default config, qcore's bit width."""
    result, stage = SideResult("torchao"), "import"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

            from qcore_x86.quantizer import X86Quantizer

            # 7-bit activations on CPUs without VNNI, as qcore's X86Quantizer chooses
            reduce_range = X86Quantizer().reduce_range
            quantizer = xiq.X86InductorQuantizer().set_global(
                xiq.get_default_x86_inductor_quantization_config(reduce_range=reduce_range)
            )
            stage = "export"
            exported = _export(case)
            stage = "prepare"
            prepared = prepare_pt2e(exported, quantizer)
            stage = "calibrate"
            with torch.no_grad():
                for batch in case.calibration:
                    prepared(*batch)
            stage = "convert"
            converted = convert_pt2e(prepared)
            stage = "run"
            result.sqnr = _score(case.model, converted, case.evaluation)
            result.weighted_quantized = _pt2e_weighted(converted)
    except Exception as error:
        return _fail(result, stage, error)
    result.ok, result.model = True, converted
    return result


# ----------------------------------------------------------------------- one case


def run_case(name: str, path: str, backend: str) -> CaseResult:
    """Quantize model ``name`` on ``path`` for ``backend`` with qcore and with its peer."""
    case = build(name)
    if path == "fx":
        if backend not in FX_BACKENDS:
            raise ValueError(f"fx backends are {FX_BACKENDS}, not {backend!r}")
        use_body, names = fx_workaround(name)
        model = FX_BODIES[name](case.model) if use_body else case.model
        config = custom_config(names)
        ours = fx_qcore(case, model, config, backend)
        theirs = fx_torch_ao(case, model, config, backend)
        workaround = describe_workaround(name)
    elif path == "pt2e":
        if backend not in PT2E_BACKENDS:
            raise ValueError(f"pt2e backends are {PT2E_BACKENDS}, not {backend!r}")
        ours, theirs, workaround = pt2e_qcore(case), pt2e_torchao(case), "-"
    else:
        raise ValueError(f"paths are {PATHS}, not {path!r}")
    return CaseResult(name, path, backend, workaround, ours, theirs, case.model, case.evaluation[0])


def all_cases() -> list[tuple[str, str, str]]:
    """Every (model, path, backend) of the corpus."""
    from .models import MODELS

    fx = [(m, "fx", b) for m in MODELS for b in FX_BACKENDS]
    return fx + [(m, "pt2e", b) for m in MODELS for b in PT2E_BACKENDS]


def within_tolerance(result: CaseResult) -> bool:
    """The acceptance check: qcore's SQNR at most 0.5 dB below the peer's."""
    ours, theirs = result.qcore.sqnr, result.peer.sqnr
    if ours is None or theirs is None or math.isnan(ours):
        return False
    return ours >= theirs - SQNR_TOLERANCE_DB


def elapsed(function: Callable[[], Any]) -> tuple[Any, float]:
    """(result, seconds) of calling ``function``."""
    start = time.perf_counter()
    return function(), time.perf_counter() - start
