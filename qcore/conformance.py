"""The conformance suite for backend authors.

From pytest, with one import, in the plugin's own tests::

    from qcore.conformance import BackendConformance

    class TestMyChip(BackendConformance):
        backend = "mychip"

From the command line: ``qcore check mychip``.

The checks: the backend loads; its config validates and round-trips through
dict and JSON; every kernel agrees with the reference form on generated
inputs; the tutorial model and the bundled example models quantize and run
on both paths (FX, and PT2E when available); explain leaves no float node
unexplained.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni

from qcore.config import BackendConfig
from qcore.config.errors import QCoreWarning

__all__ = ["BackendConformance", "CHECKS", "CheckResult", "run_checks"]


class ConformanceFailure(AssertionError):
    """A backend does not meet one of the conformance checks."""


def _fail(message: str) -> None:
    raise ConformanceFailure(message)


def check_loads(name: str) -> str:
    import qcore

    backend = qcore.get_backend(name)
    plugins = ", ".join(p.spec.name for p in backend.plugins)
    return f"{len(backend.config)} patterns, {len(backend.kernels)} kernels from {plugins}"


def check_config_round_trips(name: str) -> str:
    import qcore
    from qcore.config.json import from_json, to_json

    config = qcore.get_backend_config(name)
    if BackendConfig.from_dict(config.to_dict()) != config:
        _fail("to_dict/from_dict does not give back an equal BackendConfig")
    if from_json(to_json(config)) != config:
        _fail("to_json/from_json does not give back an equal BackendConfig")
    return f"{len(config)} patterns through dict and JSON"


# Small modules for the kernels whose pattern is a module class qcore knows how to build.
_KERNEL_MODELS: dict[type, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    torch.nn.Linear: lambda: (torch.nn.Linear(16, 8), (torch.randn(4, 16),)),
    nni.LinearReLU: lambda: (
        torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()),
        (torch.randn(4, 16),),
    ),
    torch.nn.Conv1d: lambda: (torch.nn.Conv1d(3, 4, 3), (torch.randn(2, 3, 12),)),
    nni.ConvReLU1d: lambda: (
        torch.nn.Sequential(torch.nn.Conv1d(3, 4, 3), torch.nn.ReLU()),
        (torch.randn(2, 3, 12),),
    ),
    torch.nn.Conv2d: lambda: (torch.nn.Conv2d(3, 4, 3), (torch.randn(2, 3, 10, 10),)),
    nni.ConvReLU2d: lambda: (
        torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()),
        (torch.randn(2, 3, 10, 10),),
    ),
    torch.nn.Conv3d: lambda: (torch.nn.Conv3d(2, 3, 3), (torch.randn(1, 2, 6, 6, 6),)),
    nni.ConvReLU3d: lambda: (
        torch.nn.Sequential(torch.nn.Conv3d(2, 3, 3), torch.nn.ReLU()),
        (torch.randn(1, 2, 6, 6, 6),),
    ),
}


def _quantize_fx(
    name: str, model: torch.nn.Module, inputs: tuple, calibration: list, mapping: Any = None
) -> Any:
    import qcore

    if mapping is None:
        mapping = qcore.get_default_qconfig_mapping(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCoreWarning)
        prepared = qcore.prepare_fx(model.eval(), mapping, inputs, name)
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    return prepared


def _kernel_mappings(name: str, engine: str) -> list[tuple[str, Any]]:
    """The QConfigMappings a kernel may be meant for: the backend's default (static),
    then dynamic int8 (a dynamic kernel's pattern is the static one's module class).
    Dynamic inputs are 7-bit where the kernel's int8 sums saturate, as the kernel
    quantizes them there (``qcore.kernels.dynamic``)."""
    import qcore
    from qcore.config.qconfig import QConfig, QConfigMapping, default_dynamic_qconfig
    from qcore.kernels.runtime import SATURATING_ENGINES, int8_products_saturate
    from qcore.observers import PlaceholderObserver

    dynamic, label = default_dynamic_qconfig, "a dynamic int8 QConfig"
    if engine in SATURATING_ENGINES and int8_products_saturate():
        seven_bits = PlaceholderObserver.with_args(
            dtype=torch.quint8, quant_min=0, quant_max=127, is_dynamic=True
        )
        dynamic = QConfig(activation=seven_bits, weight=default_dynamic_qconfig.weight)
        label = "a dynamic 7-bit QConfig (int8 sums saturate on this CPU)"
    return [
        ("the default QConfigMapping", qcore.get_default_qconfig_mapping(name)),
        (label, QConfigMapping().set_global(dynamic)),
    ]


def _lower_with_only(prepared: Any, kernel: Any, name: str) -> Any:
    """``prepared`` converted and lowered with ``kernel`` alone: a kernel that the
    backend lists after another one for the same pattern (a specialised one, taking
    what the first refuses) is checked too."""
    from qcore.engine.convert import convert_to_reference
    from qcore.engine.lower import lower

    return lower(convert_to_reference(prepared), (kernel,), name)


def check_kernels_match_reference(name: str) -> str:
    """Every kernel, alone, takes a model of its own pattern, and its lowered output
    is within two quantization steps of the reference form's (one for the activation
    rounding, one for the kernel's own); a kernel with a float output (dynamic)
    agrees to 0.1% of the output's range."""
    import qcore

    backend = qcore.get_backend(name)
    checked, skipped = [], []
    generator = torch.Generator().manual_seed(0)
    for kernel in backend.kernels:
        build = _KERNEL_MODELS.get(kernel.pattern)
        if build is None:
            skipped.append(kernel.name)
            continue
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        layer, inputs = build()
        # In a container, as in a user's model: traced as a call of the layer (a
        # layer traced as the root is traced through, into torch.nn.functional).
        model = torch.nn.Sequential(layer)
        calibration = [tuple(torch.randn_like(x) for x in inputs) for _ in range(4)]
        tried = []
        for label, mapping in _kernel_mappings(name, kernel.engine):
            prepared = _quantize_fx(name, model, inputs, calibration, mapping)
            lowered = _lower_with_only(prepared, kernel, name)
            report = qcore.explain(lowered)
            if any(e.kernel == kernel.name for e in report.quantized):
                break
            tried.append(f"with {label}:\n{report}")
        else:
            _fail(
                f"kernel {kernel.name} was not used for a model of its own pattern\n"
                + "\n".join(tried)
            )
        reference = qcore.convert_to_reference_fx(prepared)
        # Under whatever global engine the process has: a kernel carries its engine.
        with torch.no_grad():
            got, expected = lowered(*inputs), reference(*inputs)
        error = float((got - expected).abs().max())
        step = float(getattr(_kernel_module(lowered, kernel.name, report), "scale", 0.0) or 0.0)
        if step and error > 2 * step + 1e-6:
            _fail(
                f"kernel {kernel.name}: max difference {error:.3g} from the reference form "
                f"exceeds two output quantization steps ({2 * step:.3g})"
            )
        if not step and error > 1e-3 * float(expected.abs().max()):
            _fail(
                f"kernel {kernel.name}: max difference {error:.3g} from the reference form "
                f"exceeds 0.1% of the largest output ({float(expected.abs().max()):.3g})"
            )
        checked.append(kernel.name)
    note = f"; {len(skipped)} without a generated model: {', '.join(skipped)}" if skipped else ""
    return f"{len(checked)} kernels agree with the reference form{note}"


def _kernel_module(model: torch.nn.Module, kernel_name: str, report: Any) -> Any:
    for entry in report.quantized:
        if entry.kernel == kernel_name:
            node = next(n for n in model.graph.nodes if n.name == entry.node)
            return model.get_submodule(node.target) if node.op == "call_module" else None
    return None


def _models() -> list[tuple[str, torch.nn.Module, tuple, list]]:
    from qcore.examples import ZOO

    result = []
    for entry in ZOO.values():
        if entry.dynamic:
            continue
        result.append(
            (entry.name, entry.make_model(), entry.example_inputs(), entry.calibration_data(4))
        )
    return result


def _tutorial_model() -> tuple[str, torch.nn.Module, tuple, list]:
    class TutorialModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(10, 3)
            self.conv = torch.nn.Conv2d(3, 3, 3)
            self.relu = torch.nn.ReLU()
            self.sigmoid = torch.nn.Sigmoid()

        def forward(self, x):
            return self.sigmoid(self.relu(self.conv(self.linear(x))))

    torch.manual_seed(0)
    inputs = (torch.rand(2, 3, 10, 10),)
    return (
        "tutorial",
        TutorialModel().eval(),
        inputs,
        [(torch.rand(2, 3, 10, 10),) for _ in range(4)],
    )


def _check_explained(label: str, report: Any) -> None:
    for entry in report.entries:
        if entry.status.value in ("float", "reference") and not entry.reason:
            _fail(f"{label}: node {entry.node} ({entry.op}) is {entry.status.value} with no reason")


def check_models_quantize_fx(name: str) -> str:
    import qcore

    done = []
    for label, model, inputs, calibration in [_tutorial_model(), *_models()]:
        converted = qcore.convert_fx(_quantize_fx(name, model, inputs, calibration))
        with torch.no_grad():
            output = converted(*inputs)
        if not torch.isfinite(output).all():
            _fail(f"{label}: the converted model's output is not finite")
        _check_explained(label, qcore.explain(converted))
        done.append(label)
    return f"FX: {', '.join(done)} quantize, run and are explained"


def check_models_quantize_pt2e(name: str) -> str:
    try:
        from qcore.pt2e import convert_pt2e, prepare_pt2e
    except ImportError:
        return "skipped: qcore's PT2E path is not available"
    import qcore
    from qcore.examples import export_batch_free

    done = []
    for label, model, inputs, calibration in [_tutorial_model(), *_models()]:
        exported = export_batch_free(model, calibration[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QCoreWarning)
            prepared = prepare_pt2e(exported, name)
        with torch.no_grad():
            for batch in calibration:
                prepared(*batch)
            converted = convert_pt2e(prepared)
            output = converted(*inputs)
        if not torch.isfinite(output).all():
            _fail(f"{label}: the converted model's output is not finite (PT2E)")
        _check_explained(label, qcore.explain(converted))
        done.append(label)
    return f"PT2E: {', '.join(done)} quantize, run and are explained"


CHECKS: dict[str, Callable[[str], str]] = {
    "loads": check_loads,
    "config round-trips": check_config_round_trips,
    "kernels match reference": check_kernels_match_reference,
    "models quantize (FX)": check_models_quantize_fx,
    "models quantize (PT2E)": check_models_quantize_pt2e,
}


@dataclass(frozen=True)
class CheckResult:
    check: str
    passed: bool
    detail: str


def run_checks(name: str) -> list[CheckResult]:
    """Run every check on backend ``name``; a failing check does not stop the others."""
    results = []
    for label, check in CHECKS.items():
        try:
            results.append(CheckResult(label, True, check(name)))
        except Exception as error:  # report every check, whatever it raised
            results.append(CheckResult(label, False, f"{type(error).__name__}: {error}"))
    return results


class BackendConformance:
    """Subclass in a plugin's tests and set ``backend``; pytest collects one test per check."""

    backend: str = ""

    def _run(self, check: Callable[[str], str]) -> None:
        if not self.backend:
            raise ConformanceFailure(f"{type(self).__name__}.backend is not set")
        check(self.backend)

    def test_loads(self) -> None:
        self._run(check_loads)

    def test_config_round_trips(self) -> None:
        self._run(check_config_round_trips)

    def test_kernels_match_reference(self) -> None:
        self._run(check_kernels_match_reference)

    def test_models_quantize_fx(self) -> None:
        self._run(check_models_quantize_fx)

    def test_models_quantize_pt2e(self) -> None:
        self._run(check_models_quantize_pt2e)
