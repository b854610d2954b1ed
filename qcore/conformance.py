"""The conformance suite for backend authors.

From pytest, with one import, in the plugin's own tests::

    from qcore.conformance import BackendConformance

    class TestMyChip(BackendConformance):
        backend = "mychip"

From the command line: ``qcore check mychip``.

The checks: the backend loads; its config validates and round-trips through
dict and JSON; every kernel, alone, takes a model generated from its pattern
(``qcore.conformance_models``) and agrees with the reference form there (a
kernel no model can be built for, or that takes nothing of its model, fails
unless it declares why in ``Kernel.no_model_reason``); the tutorial model and
the bundled example models quantize and run on both paths (FX, and PT2E when
available), at least one op of each quantized wherever the backend declares
patterns for its modules; explain leaves no float node unexplained.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from qcore.config import BackendConfig
from qcore.config.errors import QCoreWarning
from qcore.engine.kernel_check import OUTPUT_QPARAMS_KEY, wrong_qparams

__all__ = ["BackendConformance", "CHECKS", "CheckResult", "run_checks"]


class ConformanceFailure(AssertionError):
    """A backend does not meet one of the conformance checks."""


class _NotUsed(ConformanceFailure):
    """A kernel took nothing of a model of its own pattern."""


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


def _kernel_mappings(name: str, engine: str, kinds: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The QConfigMappings a kernel may be meant for, of the ``kinds`` its model allows
    (``qcore.conformance_models.KernelModel.quantization``): the backend's default
    (static), its global QConfig for every op, dynamic int8 (a dynamic kernel's
    pattern is the static one's module class), weight-only (embeddings). Dynamic
    inputs are 7-bit where the kernel's int8 sums saturate, as the kernel quantizes
    them there (``qcore.kernels.dynamic``)."""
    import qcore
    from qcore.config.qconfig import (
        QConfig,
        QConfigMapping,
        default_dynamic_qconfig,
        float_qparams_weight_only_qconfig,
    )
    from qcore.kernels.runtime import SATURATING_ENGINES, int8_products_saturate
    from qcore.observers import PlaceholderObserver

    dynamic, label = default_dynamic_qconfig, "a dynamic int8 QConfig"
    if engine in SATURATING_ENGINES and int8_products_saturate():
        seven_bits = PlaceholderObserver.with_args(
            dtype=torch.quint8, quant_min=0, quant_max=127, is_dynamic=True
        )
        dynamic = QConfig(activation=seven_bits, weight=default_dynamic_qconfig.weight)
        label = "a dynamic 7-bit QConfig (int8 sums saturate on this CPU)"
    default = qcore.get_default_qconfig_mapping(name)
    mappings = {
        "static": ("the default QConfigMapping", lambda: default),
        # A fused chain whose ops the default maps apart (linear + tanh's fixed
        # qparams) is quantized with one QConfig for all.
        "static_global": (
            "the default global QConfig for every op",
            lambda: QConfigMapping().set_global(default.global_qconfig),
        ),
        "dynamic": (label, lambda: QConfigMapping().set_global(dynamic)),
        "weight_only": (
            "a weight-only QConfig (float_qparams_weight_only_qconfig)",
            lambda: QConfigMapping().set_global(float_qparams_weight_only_qconfig),
        ),
    }
    return [(mappings[kind][0], mappings[kind][1]()) for kind in kinds]


def _lower_with_only(prepared: Any, kernel: Any, name: str) -> Any:
    """``prepared`` converted and lowered with ``kernel`` alone: a kernel that the
    backend lists after another one for the same pattern (a specialised one, taking
    what the first refuses) is checked too."""
    from qcore.engine.convert import convert_to_reference
    from qcore.engine.lower import lower

    return lower(convert_to_reference(prepared), (kernel,), name)


def describe_op(op: Any) -> str:
    """A short, unambiguous name for one op of a kernel's pattern: ``nn.Linear``,
    ``nni.ConvReLU2d``, ``F.relu``, ``torch.relu``, ``'relu'`` (a method),
    ``aten.relu.default``."""
    if isinstance(op, tuple):
        return "(" + ", ".join(describe_op(item) for item in op) + ")"
    if isinstance(op, str):
        return repr(op)
    if isinstance(op, torch._ops.OpOverload):
        return f"aten.{op.__name__}" if op.namespace == "aten" else str(op)
    module = getattr(op, "__module__", "") or ""
    prefixes = (
        ("torch.ao.nn.intrinsic.qat", "nniqat."),
        ("torch.ao.nn.intrinsic", "nni."),
        ("torch.nn.modules", "nn."),
        ("torch.nn.functional", "F."),
        ("_operator", "operator."),
        ("operator", "operator."),
        ("torch", "torch."),
    )
    prefix = next((short for long, short in prefixes if module.startswith(long)), "")
    if not prefix and module:
        prefix = module.rsplit(".", 1)[-1] + "."
    # torch.relu's __qualname__ is "_VariableFunctionsClass.relu": classes by qualname only
    name = op.__qualname__ if isinstance(op, type) else getattr(op, "__name__", None)
    return prefix + (name or repr(op))


def _check_one_kernel(name: str, kernel: Any, built: Any) -> None:
    """``kernel``, alone, takes ``built``'s model and agrees with the reference form;
    raises :class:`ConformanceFailure` saying how it does not."""
    import qcore

    pattern = describe_op(kernel.pattern)
    calibration = built.calibration()
    if built.path == "pt2e":
        lowered, reference, report = _lowered_pt2e(name, kernel, built, calibration)
        if lowered is None:
            raise _NotUsed(f"{pattern}: not used (PT2E): {_summary(report)}")
    else:
        # In a container, as in a user's model: traced as a call of the layer (a
        # layer traced as the root is traced through, into torch.nn.functional).
        tried = []
        for label, mapping in _kernel_mappings(name, kernel.engine, built.quantization):
            prepared = _quantize_fx(name, built.model, built.inputs, calibration, mapping)
            lowered = _lower_with_only(prepared, kernel, name)
            report = qcore.explain(lowered)
            if any(e.kernel == kernel.name for e in report.quantized):
                break
            tried.append(f"with {label}: {_summary(report)}")
        else:
            raise _NotUsed(f"{pattern}: not used; " + "; ".join(tried))
        reference = qcore.convert_to_reference_fx(prepared)
    node = _kernel_node(lowered, kernel.name, report)
    recorded = node.meta.get(OUTPUT_QPARAMS_KEY) if node is not None else None
    # Under whatever global engine the process has: a kernel carries its engine.
    with torch.no_grad(), _outputs_of(lowered, node) as kernel_outputs:
        got, expected = lowered(*built.inputs), reference(*built.inputs)
    if recorded is not None:
        _check_output_qparams(kernel.name, pattern, kernel_outputs, recorded)
    if isinstance(got, torch.Tensor) and got.is_quantized:
        got = got.dequantize()
    error = float((got - expected).abs().max())
    # The step of the qparams lowering recorded, never one the kernel claims: a
    # kernel requantizing at a coarser scale must not widen its own tolerance.
    step = recorded.scale if recorded is not None else 0.0
    if step and error > 2 * step + 1e-6:
        _fail(
            f"{pattern}: max difference {error:.3g} from the reference form "
            f"exceeds two output quantization steps ({2 * step:.3g})"
        )
    largest = float(expected.abs().max())
    # torch's dynamic LSTM/GRU also quantize the hidden state at every step, which
    # the reference form (a float recurrence on dequantized weights) does not:
    # measured up to 0.16% of the largest output on the generated GRU; allowed 1%.
    # torch's dynamic cell ops (LSTMCell, GRUCell, RNNCell) quantize their input to
    # 7 bits on fbgemm/x86 whatever the QConfig says (8 in the reference form; with
    # a 7-bit QConfig they agree to 1e-7): measured up to 2.8% on the generated
    # cells; allowed 5%.
    modules = list(built.model.modules())
    recurrent = any(isinstance(m, torch.nn.RNNBase) for m in modules)
    cell = any(isinstance(m, torch.nn.RNNCellBase) for m in modules)
    relative = 5e-2 if cell else 1e-2 if recurrent else 1e-3
    if not step and error > relative * largest + 2 * _output_step(reference):
        _fail(
            f"{pattern}: max difference {error:.3g} from the reference form "
            f"exceeds {relative:.1%} of the largest output ({largest:.3g})"
        )


@contextlib.contextmanager
def _outputs_of(model: torch.nn.Module, node: Any) -> Iterator[list[Any]]:
    """The outputs of the kernel module ``node`` calls, collected while the block runs."""
    outputs: list[Any] = []
    if node is None or node.op != "call_module":
        yield outputs
        return
    handle = model.get_submodule(node.target).register_forward_hook(
        lambda _module, _args, output: outputs.append(output)
    )
    try:
        yield outputs
    finally:
        handle.remove()


def _check_output_qparams(
    kernel_name: str, pattern: str, outputs: list[Any], recorded: Any
) -> None:
    """Each int8 output of the kernel has the dtype and qparams lowering recorded: the
    next op reads its integers at those, so values right at other qparams are wrong."""
    for output in outputs:
        if not (isinstance(output, torch.Tensor) and output.is_quantized):
            continue
        problem = wrong_qparams(output, recorded)
        if problem is not None:
            _fail(f"{pattern}: kernel {kernel_name}: {problem}")


def _output_step(reference: Any) -> float:
    """The step the reference form quantizes its output to (0 for a float output): a
    kernel that runs the op unchanged (SameOp) has no module of its own to read it from."""
    (output,) = (node for node in reference.graph.nodes if node.op == "output")
    result = output.args[0]
    if not isinstance(result, torch.fx.Node) or "dequantize" not in str(result.target):
        return 0.0
    quantize = result.args[0] if result.args else None
    if not isinstance(quantize, torch.fx.Node) or "quantize_per_tensor" not in str(quantize.target):
        return 0.0
    scale = quantize.args[1] if len(quantize.args) > 1 else None
    if getattr(scale, "op", None) == "get_attr":
        scale = getattr(reference, scale.target)
    return float(scale) if isinstance(scale, (float, torch.Tensor)) else 0.0


def _prepared_pt2e(name: str, model: torch.nn.Module, inputs: tuple, calibration: list) -> Any:
    """``model`` exported at ``inputs`` (batch left free), prepared for backend ``name``
    and calibrated."""
    from qcore.examples import export_batch_free
    from qcore.pt2e import prepare_pt2e

    exported = export_batch_free(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCoreWarning)
        prepared = prepare_pt2e(exported, name)
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    return prepared


def _lowered_pt2e(name: str, kernel: Any, built: Any, calibration: list) -> tuple[Any, Any, Any]:
    """(lowered with ``kernel`` alone, reference form, explain report) of ``built``
    through PT2E; lowered is None where the kernel took nothing."""
    import qcore
    from qcore.pt2e import convert_pt2e
    from qcore.pt2e.prepare import PT2E_STATE_KEY

    prepared = _prepared_pt2e(name, built.model, built.inputs, calibration)
    reference = convert_pt2e(prepared, lower=False)
    prepared.meta[PT2E_STATE_KEY].kernels = (kernel,)
    lowered = convert_pt2e(prepared, lower=True)
    report = qcore.explain(lowered)
    if not any(e.kernel == kernel.name for e in report.quantized):
        return None, reference, report
    return lowered, reference, report


def _summary(report: Any, width: int = 110) -> str:
    """What happened to each op of a small model, on one line."""
    parts = []
    for entry in report.entries:
        if entry.status.value == "-":
            continue
        why = entry.kernel or entry.reason
        # A kernel's refusal is what its author must read whole (what it returned,
        # what was expected); QConfig rejections name a long DTypeConfig first.
        if not why.startswith("kernel "):
            why = _shortened(why, width)
        parts.append(
            f"{entry.op} {entry.status.value} ({why})"
            if why
            else f"{entry.op} {entry.status.value}"
        )
    return ", ".join(dict.fromkeys(parts))  # each distinct outcome once


def _shortened(text: str, width: int) -> str:
    """``text`` within about ``width`` characters: its start (what) and its end (why:
    a rejected QConfig's reason follows the long DTypeConfig it names)."""
    if len(text) <= width:
        return text
    head = width // 3
    return f"{text[:head]} ... {text[len(text) - (width - head - 5) :]}"


def _patterns(by_kernel: dict[str, list[str]]) -> str:
    count = sum(map(len, by_kernel.values()))
    return f"{count} kernel pattern{'s' if count != 1 else ''}"


def _add(by_kernel: dict[str, list[str]], kernel: str, item: str) -> None:
    by_kernel.setdefault(kernel, []).append(item)


def _grouped(items: dict[str, list[str]]) -> str:
    """``kernel (pattern, pattern)`` per kernel, each kernel once."""
    return "; ".join(f"{kernel} ({', '.join(patterns)})" for kernel, patterns in items.items())


def check_kernels_match_reference(name: str) -> str:
    """Every kernel, alone, takes a model of its own pattern (built by
    :func:`qcore.conformance_models.model_for`), and its lowered output is within
    two quantization steps of the reference form's (one for the activation rounding,
    one for the kernel's own); a kernel with a float output (dynamic) agrees to 0.1%
    of the output's range. A kernel whose pattern no model can be built for fails,
    unless it declares why in ``Kernel.no_model_reason``."""
    import qcore
    from qcore.conformance_models import model_for

    backend = qcore.get_backend(name)
    checked = 0
    failed: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {}
    declared: dict[str, dict[str, list[str]]] = {}
    for index, kernel in enumerate(backend.kernels):
        built = model_for(kernel.pattern, seed=index)
        pattern = describe_op(kernel.pattern)
        if built is None:
            if kernel.no_model_reason:
                _add(declared.setdefault(kernel.no_model_reason, {}), kernel.name, pattern)
            else:
                _add(missing, kernel.name, pattern)
            continue
        try:
            try:
                _check_one_kernel(name, kernel, built)
            except _NotUsed:
                # Backends that quantize max pooling, a reshape, ... only after a
                # quantized op: the same pattern, its input coming out of a 1x1 conv.
                produced = model_for(kernel.pattern, seed=index, produced=True)
                if produced is None:
                    raise
                _check_one_kernel(name, kernel, produced)
        except _NotUsed as failure:
            if kernel.no_model_reason:  # declared: the backend never gives it this pattern
                _add(declared.setdefault(kernel.no_model_reason, {}), kernel.name, pattern)
            else:
                _add(failed, kernel.name, str(failure))
            continue
        except ConformanceFailure as failure:
            _add(failed, kernel.name, str(failure))
            continue
        except (Exception, SystemExit) as error:  # a kernel's or model's: report it with the rest
            first_line = f"{type(error).__name__}: {error}".splitlines()[0]
            _add(failed, kernel.name, f"{pattern}: {first_line}")
            continue
        checked += 1
    problems = []
    if failed:
        problems.append(
            f"{_patterns(failed)} disagree with the reference form or were not used:\n"
            + "\n".join(f"{kernel}: " + "\n  ".join(why) for kernel, why in failed.items())
        )
    if missing:
        problems.append(
            "no generated model and no declared reason (Kernel.no_model_reason) for "
            f"{_patterns(missing)}: {_grouped(missing)}"
        )
    if problems:
        _fail("\n".join(problems))
    note = "".join(
        f"\n  not checked, {reason}: "
        + ", ".join(
            f"{kernel} ({len(patterns)} patterns)"
            if len(patterns) > 1
            else f"{kernel} ({patterns[0]})"
            for kernel, patterns in kernels.items()
        )
        for reason, kernels in declared.items()
    )
    return f"{checked} kernel patterns agree with the reference form{note}"


def _kernel_node(model: torch.nn.Module, kernel_name: str, report: Any) -> Any:
    """The graph node the kernel ``kernel_name`` runs at, or None."""
    for entry in report.quantized:
        if entry.kernel == kernel_name:
            return next(n for n in model.graph.nodes if n.name == entry.node)
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


def _declared_modules(name: str, model: torch.nn.Module) -> list[str]:
    """The module classes of ``model`` that a pattern of backend ``name`` starts with."""
    import qcore

    roots = set()
    for config in qcore.get_backend_config(name).configs:
        pattern = config.pattern
        first = pattern[0] if isinstance(pattern, tuple) else pattern
        if isinstance(first, type):
            roots.add(first)
    return sorted({type(m).__name__ for m in model.modules() if type(m) in roots})


def _check_quantizes_something(name: str, label: str, model: torch.nn.Module, report: Any) -> int:
    """How many ops ``report`` shows quantized (by a kernel or in reference form); fails
    when that is none although the backend declares patterns for the model's modules."""
    count = len(report.quantized) + len(report.reference)
    declared = _declared_modules(name, model)
    if declared and not count:
        floats = "; ".join(
            f"{entry.node}: {_shortened(entry.reason, 160)}" for entry in report.float[:3]
        )
        _fail(
            f"{label}: backend {name!r} declares patterns for {', '.join(declared)} in this "
            f"model, yet quantized none of its {len(report.float)} ops ({floats})"
        )
    return count


def check_models_quantize_fx(name: str) -> str:
    import qcore

    done = []
    for label, model, inputs, calibration in [_tutorial_model(), *_models()]:
        converted = qcore.convert_fx(_quantize_fx(name, model, inputs, calibration))
        with torch.no_grad():
            output = converted(*inputs)
        if not torch.isfinite(output).all():
            _fail(f"{label}: the converted model's output is not finite")
        report = qcore.explain(converted)
        _check_explained(label, report)
        count = _check_quantizes_something(name, label, model, report)
        done.append(f"{label} ({count} of {count + len(report.float)} ops)")
    return f"FX: {', '.join(done)} quantize, run and are explained"


def check_models_quantize_pt2e(name: str) -> str:
    try:
        from qcore.pt2e import convert_pt2e
    except ImportError:
        return "skipped: qcore's PT2E path is not available"
    import qcore

    done = []
    for label, model, inputs, calibration in [_tutorial_model(), *_models()]:
        prepared = _prepared_pt2e(name, model, calibration[0], calibration)
        with torch.no_grad():
            converted = convert_pt2e(prepared)
            output = converted(*inputs)
        if not torch.isfinite(output).all():
            _fail(f"{label}: the converted model's output is not finite (PT2E)")
        report = qcore.explain(converted)
        _check_explained(label, report)
        count = _check_quantizes_something(name, f"{label} (PT2E)", model, report)
        done.append(f"{label} ({count} of {count + len(report.float)} ops)")
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
        except (Exception, SystemExit) as error:  # report every check (a plugin never ends it)
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
