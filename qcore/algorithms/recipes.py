"""The algorithms ``qcore.quantize(..., algorithms=...)`` can run, by name, and when.

Each name maps to a pass on a prepared model (FX or PT2E) and its stage: before
calibration (the pass changes weights the observers then see) or after it (the
pass reads calibrated observers or calibration data). A pass is called as
``function(prepared, **options)`` before calibration, and
``function(prepared, calibration_data, input_fn=input_fn, **options)`` when
``Algorithm.takes_data`` (after calibration, or a pass that measures activations
before it). Its options are its keyword-only parameters.

Adding an algorithm: one
:class:`Algorithm` in :func:`_builtin`, and, if it records what it changed, its
reader in ``changed``. Nothing else needs to know its name.

Example::

    >>> steps = resolve_algorithms(["equalize", ("correct_bias", {})], backend="qnnpack")
    >>> [step.describe() for step in steps]
    ['equalize()', 'correct_bias()']
"""

from __future__ import annotations

import difflib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule

from qcore.config.errors import QCoreWarning, describe
from qcore.plugin.recipes import AlgorithmStep

__all__ = [
    "AFTER_CALIBRATION",
    "ALGORITHMS",
    "BEFORE_CALIBRATION",
    "Algorithm",
    "AppliedAlgorithm",
    "applied_algorithms",
    "recommended_algorithms",
    "resolve_algorithms",
    "run_stage",
]

BEFORE_CALIBRATION = "before calibration"
AFTER_CALIBRATION = "after calibration"
RECOMMENDED = "recommended"
_APPLIED_KEY = "qcore_algorithms"
# What every pass takes positionally or from quantize itself: never an option.
_NOT_OPTIONS = frozenset({"prepared", "calibration_data", "input_fn"})


@dataclass(frozen=True)
class Algorithm:
    """A pass ``qcore.quantize`` can run by name: when, and what it changed.

    ``changed(model)`` lists what the pass changed in the model it returned (the
    pairs equalized, the biases corrected), or is None when it keeps no record.
    """

    name: str
    stage: str
    function: Callable[..., GraphModule]
    takes_data: bool
    summary: str
    changed: Callable[[GraphModule], tuple] | None = None

    @property
    def options(self) -> tuple[str, ...]:
        """The keyword arguments an :class:`AlgorithmStep` may give it."""
        parameters = inspect.signature(self.function).parameters.values()
        return tuple(
            p.name
            for p in parameters
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _NOT_OPTIONS
        )


@dataclass(frozen=True)
class AppliedAlgorithm:
    """An algorithm ``qcore.quantize`` ran: the step, its stage, and how many
    layers or pairs it changed (None when the pass keeps no record)."""

    step: AlgorithmStep
    stage: str
    changed: int | None

    def describe(self) -> str:
        count = "" if self.changed is None else f", changed {self.changed}"
        return f"{self.step.describe()} ({self.stage}{count})"


@functools.cache
def _builtin() -> dict[str, Algorithm]:
    # Imported here: qcore.algorithms imports this module.
    from qcore.algorithms.adaround import adaround
    from qcore.algorithms.bias_correction import correct_bias, corrected_biases
    from qcore.algorithms.equalize import equalize, equalized_pairs
    from qcore.algorithms.smoothquant import smooth_quant

    found = [
        Algorithm(
            "equalize",
            BEFORE_CALIBRATION,
            equalize,
            False,
            "cross-layer equalization of conv/linear pairs (qcore.equalize)",
            equalized_pairs,
        ),
        Algorithm(
            "smooth_quant",
            BEFORE_CALIBRATION,
            smooth_quant,
            True,
            "SmoothQuant of linears after a LayerNorm or linear (qcore.smooth_quant)",
            _smoothed,
        ),
        Algorithm(
            "correct_bias",
            AFTER_CALIBRATION,
            correct_bias,
            True,
            "fast bias correction of each conv/linear (qcore.correct_bias)",
            corrected_biases,
        ),
        Algorithm(
            "adaround",
            AFTER_CALIBRATION,
            adaround,
            True,
            "AdaRound, learned up/down rounding of conv/linear weights (qcore.adaround)",
            _adarounded,
        ),
    ]
    return {algorithm.name: algorithm for algorithm in found}


def _smoothed(model: GraphModule) -> tuple:
    from qcore.algorithms.smoothquant import smoothed_layers

    # Groups left as they were are recorded too, with the reason: not a change.
    return tuple(group for group in smoothed_layers(model) if group.alpha is not None)


def _adarounded(model: GraphModule) -> tuple:
    from qcore.algorithms.adaround import adarounded_layers

    # Layers that kept nearest rounding are recorded too, with the reason: not a change.
    return tuple(layer for layer in adarounded_layers(model) if layer.kept == "learned")


class _Algorithms(Mapping):
    """The registry, built on first use (the passes import torch)."""

    def __getitem__(self, name: str) -> Algorithm:
        return _builtin()[name]

    def __iter__(self):
        return iter(_builtin())

    def __len__(self) -> int:
        return len(_builtin())

    def __repr__(self) -> str:
        return f"ALGORITHMS({sorted(_builtin())})"


#: Every algorithm by name: ``ALGORITHMS["equalize"].stage``, ``.options``.
ALGORITHMS: Mapping[str, Algorithm] = _Algorithms()


def _known() -> str:
    return ", ".join(
        f"{name!r} ({algorithm.stage})" for name, algorithm in sorted(ALGORITHMS.items())
    )


def _check_step(step: AlgorithmStep, where: str) -> None:
    """A clear error when ``step`` names no algorithm or an option it does not take."""
    if step.name not in ALGORITHMS:
        close = difflib.get_close_matches(step.name, list(ALGORITHMS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{where}: unknown algorithm {step.name!r}{hint}; expected one of {_known()}"
        )
    accepted = ALGORITHMS[step.name].options
    unknown = sorted(set(step.options) - set(accepted))
    if unknown:
        raise ValueError(
            f"{where}: {step.name} takes no option {', '.join(map(repr, unknown))}; "
            f"its options are {', '.join(map(repr, accepted)) or 'none'}"
        )


def _as_step(item: Any, where: str) -> AlgorithmStep:
    if isinstance(item, AlgorithmStep):
        return item
    if isinstance(item, str):
        return AlgorithmStep(item)
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
        if not isinstance(item[1], Mapping):
            raise TypeError(
                f"{where}: options of {item[0]!r}: got {describe(item[1])}; expected a dict "
                "of its keyword arguments"
            )
        return AlgorithmStep(item[0], item[1])
    raise TypeError(
        f"{where}: got {describe(item)}; expected an algorithm's name, a (name, options) "
        f"pair or a qcore.AlgorithmStep; algorithms: {_known()}"
    )


def recommended_algorithms(backend: Any) -> tuple[AlgorithmStep, ...]:
    """What ``backend`` (an installed backend's name or ``qcore.Backend``) recommends,
    each step checked: one this qcore cannot run is dropped with a warning.

    Example::

        >>> [step.name for step in recommended_algorithms("qnnpack")]
        ['equalize', 'correct_bias']
    """
    from qcore.plugin import Backend, get_backend

    found = backend if isinstance(backend, Backend) else get_backend(backend)
    steps = []
    for step in found.recommended_algorithms():
        try:
            _check_step(step, f"backend {found.name!r} recommends {step.describe()}")
        except ValueError as error:
            warnings.warn(f"{error}; skipped", QCoreWarning, stacklevel=2)
            continue
        steps.append(step)
    return tuple(steps)


def resolve_algorithms(algorithms: Any, backend: Any = None) -> tuple[AlgorithmStep, ...]:
    """``quantize``'s ``algorithms=`` as checked steps: None (none), ``"recommended"``
    (the backend's, see :func:`recommended_algorithms`), or a list of names,
    ``(name, options)`` pairs and :class:`qcore.AlgorithmStep` objects."""
    if algorithms is None:
        return ()
    if isinstance(algorithms, str):
        if algorithms != RECOMMENDED:
            raise ValueError(
                f"algorithms: got {algorithms!r}; expected None, 'recommended' or a list of "
                f"algorithms (such as ['equalize', 'correct_bias']); algorithms: {_known()}"
            )
        if backend is None:
            backend = "native"  # quantize's default backend, which recommends none
        if not isinstance(backend, str):
            raise ValueError(
                f"algorithms='recommended': backend {describe(backend)} names no installed "
                "backend to ask; name the backend, or list the algorithms"
            )
        return recommended_algorithms(backend)
    if isinstance(algorithms, (Mapping, AlgorithmStep)) or not isinstance(algorithms, Iterable):
        raise TypeError(
            f"algorithms: got {describe(algorithms)}; expected None, 'recommended' or a list "
            f"of algorithms; algorithms: {_known()}"
        )
    steps = []
    for index, item in enumerate(algorithms):
        step = _as_step(item, f"algorithms[{index}]")
        _check_step(step, f"algorithms[{index}]")
        steps.append(step)
    return tuple(steps)


def run_stage(
    prepared: GraphModule,
    steps: Iterable[AlgorithmStep],
    stage: str,
    calibration_data: Iterable[Any] | None = None,
    input_fn: Callable[[Any], Any] | None = None,
) -> tuple[GraphModule, list[AppliedAlgorithm]]:
    """Runs ``steps`` of ``stage`` in order on ``prepared`` (each pass returns a
    new model); the model and what ran. A pass's own error names the step."""
    applied = []
    for step in steps:
        algorithm = ALGORITHMS[step.name]
        if algorithm.stage != stage:
            continue
        try:
            if algorithm.takes_data:
                prepared = algorithm.function(
                    prepared, calibration_data, input_fn=input_fn, **step.options
                )
            else:
                prepared = algorithm.function(prepared, **step.options)
        except (TypeError, ValueError) as error:
            if type(error) not in (TypeError, ValueError):
                raise  # a subclass may take other arguments: left as the pass raised it
            raise type(error)(f"algorithms: {step.describe()}: {error}") from error
        changed = None if algorithm.changed is None else len(algorithm.changed(prepared))
        applied.append(AppliedAlgorithm(step, stage, changed))
    return prepared, applied


def record(model: GraphModule, applied: Iterable[AppliedAlgorithm]) -> None:
    """Keeps what ran on ``model`` for :func:`applied_algorithms` and explain."""
    from qcore.engine.explain import report_of

    applied = tuple(applied)
    model.meta[_APPLIED_KEY] = applied
    setattr(model, _APPLIED_KEY, applied)  # meta does not survive pickling; attributes do
    report = report_of(model)
    if report is not None:
        report.algorithms = tuple(item.describe() for item in applied)


def applied_algorithms(model: Any) -> tuple[AppliedAlgorithm, ...]:
    """The algorithms ``qcore.quantize`` ran to make ``model``, in order (empty if none).

    Example::

        >>> quantized = qcore.quantize(model, example, data, "qnnpack", algorithms="recommended")
        >>> [item.step.name for item in applied_algorithms(quantized)]
        ['equalize', 'correct_bias']
    """
    return tuple(getattr(model, "meta", {}).get(_APPLIED_KEY, getattr(model, _APPLIED_KEY, ())))
