"""Does a QConfig satisfy a pattern's DTypeConfigs, and if not, why?

The semantics are torch.ao FX's (``_is_pattern_dtype_config_and_qconfig_supported_by_backend``
and ``_qconfig_satisfies_dtype_config_constraints``): a pattern is quantized
with a QConfig when *one* of its DTypeConfigs accepts it. A DTypeConfig
accepts a QConfig when

* the input activation dtype equals ``qconfig.activation()``'s dtype, and its
  ``is_dynamic`` matches the activation observer's;
* the output dtype equals the activation dtype (``float32`` when the
  activation is dynamic: dynamic quantization keeps the output in float);
* the weight dtype equals ``qconfig.weight()``'s dtype;
* the bias dtype equals the one the QConfig implies (``float16`` for a static
  float16 activation and weight, else ``float32``);
* and, for each of those whose dtype matches, the observer satisfies every
  DTypeWithConstraints field:

  - ``quant_min_lower_bound`` / ``quant_max_upper_bound``: the observer's
    ``quant_min`` / ``quant_max`` lie within them;
  - ``scale_min_lower_bound``: the observer's ``eps`` (the smallest scale it
    can produce) is no smaller;
  - ``scale_max_upper_bound``: the observer's fixed scale, or its ``eps``,
    is no larger (torch.ao does not check this field);
  - ``scale_exact_match`` (with or without ``zero_point_exact_match``): the
    observer is a fixed-qparams one (it has ``scale`` and ``zero_point``) with
    these values;
  - ``zero_point_exact_match`` alone (torch.ao ignores it alone): the observer's
    zero point is that value: fixed, or symmetric (0 for a signed dtype, 128 for
    quint8, the middle of a custom range);
  - ``scale_power_of_two``: the observer rounds its scales to powers of two
    (``power_of_two_scale=True``), or its fixed scale is one.

Unset fields (``None``) accept anything. Unlike torch.ao, each quant bound is
checked on its own (torch.ao checks them only when both are set), and every
failing field is reported, not just the first.

Observers are duck-typed: anything with ``dtype`` and optionally
``is_dynamic``, ``quant_min``, ``quant_max``, ``eps``, ``scale`` and
``zero_point`` works; a fake-quant's observer is read from its
``activation_post_process``. torch.ao QConfigs are used as they are.

Example::

    >>> reasons_rejected(weighted_int8_dtype_config, get_default_qconfig("x86"))
    ['activation eps 1.1920928955078125e-07 is below scale_min_lower_bound
      0.000244140625 (2**-12); ...']
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from qcore.config.backend import BackendConfig
from qcore.config.dtypes import DTypeConfig, DTypeWithConstraints, is_power_of_two
from qcore.config.errors import ConfigError, describe
from qcore.config.pattern import BackendPatternConfig, Pattern, format_pattern, to_complex_format

__all__ = [
    "ObserverFacts",
    "accepts",
    "find_accepting_dtype_config",
    "observer_facts",
    "qconfig_dtypes",
    "reasons_rejected",
    "rejection_reasons",
]


@dataclass(frozen=True)
class ObserverFacts:
    """What the checks need to know about one instantiated observer or fake-quant."""

    dtype: torch.dtype | None
    is_dynamic: bool = False
    quant_min: int | None = None
    quant_max: int | None = None
    eps: float | None = None
    fixed_scale: float | None = None
    fixed_zero_point: int | None = None
    qscheme: Any = None
    has_customized_qrange: bool = False
    power_of_two_scale: bool = False

    @property
    def is_fixed_qparams(self) -> bool:
        return self.fixed_scale is not None and self.fixed_zero_point is not None

    @property
    def zero_point(self) -> int | None:
        """The zero point every scale comes with, where the observer fixes it: its fixed
        one, or a symmetric observer's (as torch's observers compute it); else None."""
        if self.is_fixed_qparams:
            return self.fixed_zero_point
        if self.qscheme not in (torch.per_tensor_symmetric, torch.per_channel_symmetric):
            return None
        if self.dtype in (torch.quint8, torch.uint8):
            customized = self.has_customized_qrange and None not in (self.quant_min, self.quant_max)
            return (self.quant_min + self.quant_max) // 2 if customized else 128
        if self.dtype == getattr(torch, "uint16", None):
            return 2**15
        return 0


def _scalar(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        return value.item()
    return value


def observer_facts(obs_or_fq: Any) -> ObserverFacts:
    """Read dtype, is_dynamic, quant range, eps and fixed qparams from an
    observer or fake-quant instance (duck-typed)."""
    inner = getattr(obs_or_fq, "activation_post_process", None)
    if inner is None:
        inner = obs_or_fq

    def attribute(name: str) -> Any:
        value = getattr(inner, name, None)
        if value is None:
            value = getattr(obs_or_fq, name, None)
        return _scalar(value)

    scale = _scalar(getattr(inner, "scale", None))
    zero_point = _scalar(getattr(inner, "zero_point", None))
    fixed = scale is not None and zero_point is not None
    eps = attribute("eps")
    qscheme = getattr(inner, "qscheme", None) or getattr(obs_or_fq, "qscheme", None)
    return ObserverFacts(
        dtype=getattr(obs_or_fq, "dtype", None) or getattr(inner, "dtype", None),
        is_dynamic=bool(getattr(obs_or_fq, "is_dynamic", False) or attribute("is_dynamic")),
        quant_min=attribute("quant_min"),
        quant_max=attribute("quant_max"),
        eps=None if eps is None else float(eps),
        fixed_scale=float(scale) if fixed else None,
        fixed_zero_point=int(zero_point) if fixed else None,
        qscheme=qscheme if isinstance(qscheme, torch.qscheme) else None,
        has_customized_qrange=bool(attribute("has_customized_qrange")),
        power_of_two_scale=bool(attribute("power_of_two_scale")),
    )


_FACTS_SEEN: ContextVar[dict[int, tuple[Any, ObserverFacts]] | None] = ContextVar(
    "qcore_observer_facts_seen", default=None
)


@contextlib.contextmanager
def observer_facts_reused() -> Iterator[None]:
    """Within this block each observer constructor is built once to read its facts:
    prepare checks one QConfig against the patterns of every node, and a large model
    built thousands of identical HistogramObservers only to read their dtype."""
    token = _FACTS_SEEN.set({})
    try:
        yield
    finally:
        _FACTS_SEEN.reset(token)


def _instantiate(qconfig: Any, role: str) -> ObserverFacts | None:
    constructor = getattr(qconfig, role, None)
    if constructor is None:
        return None
    seen = _FACTS_SEEN.get()
    if seen is not None and id(constructor) in seen:
        return seen[id(constructor)][1]
    facts = _facts_of_constructor(constructor, role)
    if seen is not None:  # the constructor is kept, so its id is not reused meanwhile
        seen[id(constructor)] = (constructor, facts)
    return facts


def _facts_of_constructor(constructor: Any, role: str) -> ObserverFacts:
    if not callable(constructor):
        raise ConfigError(
            f"qconfig.{role}: got {describe(constructor)}; expected an observer or fake-quant "
            "constructor such as MinMaxObserver.with_args(...)"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            instance = constructor()
    except Exception as error:  # a user's constructor: report it, whatever it raised
        raise ConfigError(
            f"qconfig.{role}: got {describe(constructor)}, and calling it raised "
            f"{type(error).__name__}: {error}; expected a constructor that builds an observer"
        ) from error
    facts = observer_facts(instance)
    if facts.dtype is None:
        # not even a duck-typed observer: every op would stay float, for a reason that
        # blames the backend's dtypes
        raise ConfigError(
            f"qconfig.{role}: got {describe(constructor)}, which built {describe(instance)}; "
            "expected an observer or fake quant (an object with a dtype)"
        )
    return facts


def qconfig_dtypes(qconfig: Any) -> tuple[torch.dtype | None, torch.dtype | None, bool]:
    """``(activation dtype, weight dtype, activation is_dynamic)``, as torch.ao's
    ``get_qconfig_dtypes``."""
    activation = _instantiate(qconfig, "activation")
    weight = _instantiate(qconfig, "weight")
    return (
        None if activation is None else activation.dtype,
        None if weight is None else weight.dtype,
        bool(activation is not None and activation.is_dynamic),
    )


def _fmt_dtype(dtype: torch.dtype | None) -> str:
    return "float (no observer)" if dtype is None else str(dtype)


def _fmt_bound(value: Any) -> str:
    text = repr(value)
    if isinstance(value, float) and value > 0 and math.isfinite(value):
        mantissa, exponent = math.frexp(value)
        if mantissa == 0.5 and exponent - 1 != 0:
            text += f" (2**{exponent - 1})"
    return text


def _constraint_reasons(
    facts: ObserverFacts, constraints: DTypeWithConstraints, kind: str
) -> list[str]:
    """Messages (without the role prefix) for each constraint ``facts`` breaks."""
    reasons: list[str] = []
    low, high = constraints.quant_min_lower_bound, constraints.quant_max_upper_bound
    if low is not None:
        if facts.quant_min is None:
            reasons.append(f"{kind} has no quant_min; the backend requires quant_min >= {low}")
        elif facts.quant_min < low:
            reasons.append(
                f"quant_min {facts.quant_min} is below the bound {low}; "
                f"pass quant_min={low} or more to the {kind}"
            )
    if high is not None:
        if facts.quant_max is None:
            reasons.append(f"{kind} has no quant_max; the backend requires quant_max <= {high}")
        elif facts.quant_max > high:
            reasons.append(
                f"quant_max {facts.quant_max} exceeds the bound {high}; "
                f"pass quant_max={high} or less to the {kind}"
            )
    smallest = facts.eps if facts.eps is not None else facts.fixed_scale
    smallest_name = "eps" if facts.eps is not None else "fixed scale"
    scale_min = constraints.scale_min_lower_bound
    if scale_min is not None:
        if smallest is None:
            reasons.append(
                f"{kind} has no eps, so its smallest scale is unknown; the backend requires "
                f"scale_min_lower_bound {_fmt_bound(scale_min)} (use an {kind} with eps)"
            )
        elif smallest < scale_min:
            reasons.append(
                f"{smallest_name} {smallest!r} is below scale_min_lower_bound "
                f"{_fmt_bound(scale_min)}; pass eps={scale_min!r} or more to the {kind}"
            )
    scale_max = constraints.scale_max_upper_bound
    if scale_max is not None:
        largest_known = facts.fixed_scale if facts.is_fixed_qparams else facts.eps
        if largest_known is not None and largest_known > scale_max:
            name = "fixed scale" if facts.is_fixed_qparams else "eps"
            reasons.append(
                f"{name} {largest_known!r} exceeds scale_max_upper_bound {_fmt_bound(scale_max)}"
            )
    exact_scale = constraints.scale_exact_match
    exact_zero_point = constraints.zero_point_exact_match
    if exact_scale is not None:
        reasons += _fixed_qparams_reasons(facts, exact_scale, exact_zero_point, kind)
    elif exact_zero_point is not None:
        reasons += _zero_point_reasons(facts, exact_zero_point, kind)
    if constraints.scale_power_of_two:
        reasons += _power_of_two_reasons(facts, kind)
    return reasons


def _fixed_qparams_reasons(
    facts: ObserverFacts, exact_scale: float, exact_zero_point: int | None, kind: str
) -> list[str]:
    wanted = ", ".join(
        f"{name}={value!r}"
        for name, value in (("scale", exact_scale), ("zero_point", exact_zero_point))
        if value is not None
    )
    if not facts.is_fixed_qparams:
        return [
            f"{kind} is not a fixed-qparams one, but the backend requires fixed qparams "
            f"{wanted} (use FixedQParamsObserver/FixedQParamsFakeQuantize with {wanted}, "
            "e.g. from get_default_qconfig_mapping)"
        ]
    reasons = []
    if not math.isclose(facts.fixed_scale, exact_scale, rel_tol=1e-6, abs_tol=0.0):
        reasons.append(
            f"fixed scale {facts.fixed_scale!r} does not match scale_exact_match "
            f"{_fmt_bound(exact_scale)}"
        )
    if exact_zero_point is not None and facts.fixed_zero_point != exact_zero_point:
        reasons.append(
            f"fixed zero_point {facts.fixed_zero_point} does not match "
            f"zero_point_exact_match {exact_zero_point}"
        )
    return reasons


def _zero_point_reasons(facts: ObserverFacts, wanted: int, kind: str) -> list[str]:
    """zero_point_exact_match alone: the zero point, not fixed qparams."""
    actual = facts.zero_point
    if actual == wanted:
        return []
    if actual is None:
        scheme = "" if facts.qscheme is None else f" (qscheme={facts.qscheme})"
        return [
            f"{kind} computes its zero point from the data{scheme}, but the backend requires "
            f"zero_point_exact_match {wanted}: use a symmetric {kind} (qscheme="
            "torch.per_tensor_symmetric or torch.per_channel_symmetric"
            + (", dtype=torch.qint8" if wanted == 0 else "")
            + ")"
        ]
    how = "fixed" if facts.is_fixed_qparams else f"symmetric {facts.dtype}"
    return [f"{how} zero_point {actual} does not match zero_point_exact_match {wanted}"]


def _power_of_two_reasons(facts: ObserverFacts, kind: str) -> list[str]:
    if facts.is_fixed_qparams:
        if is_power_of_two(facts.fixed_scale):
            return []
        return [
            f"fixed scale {facts.fixed_scale!r} is not a power of two; the backend requires "
            "scale_power_of_two"
        ]
    if facts.power_of_two_scale:
        return []
    return [
        f"{kind} does not round its scales to powers of two; the backend requires "
        f"scale_power_of_two (create the {kind} with power_of_two_scale=True, e.g. "
        "qcore.observers.MinMaxObserver.with_args(power_of_two_scale=True))"
    ]


def _dtype_reason(actual: torch.dtype | None, expected: torch.dtype, note: str = "") -> str:
    return f"dtype is {_fmt_dtype(actual)}{note} but the backend accepts {expected}"


def _activation_side(
    facts: ObserverFacts | None,
    constraints: DTypeWithConstraints,
    qconfig_dtype: torch.dtype | None,
    note: str,
    kind: str,
) -> list[str]:
    expected = constraints.dtype
    if expected is None:
        return []
    if qconfig_dtype != expected:
        return [_dtype_reason(qconfig_dtype, expected, note)]
    if facts is not None and facts.dtype == expected:
        return _constraint_reasons(facts, constraints, kind)
    return []


def reasons_rejected(dtype_config: DTypeConfig, qconfig: Any, *, is_qat: bool = False) -> list[str]:
    """Why ``dtype_config`` does not accept ``qconfig``; ``[]`` means it does.

    ``qconfig`` is anything with ``activation`` and ``weight`` observer
    constructors (a torch.ao ``QConfig`` as is). ``is_qat`` only changes the
    wording of the hints (fake-quant instead of observer).
    """
    if not isinstance(dtype_config, DTypeConfig):
        raise ConfigError(f"dtype_config: got {describe(dtype_config)}; expected a DTypeConfig")
    if qconfig is None:
        return ["no QConfig is set, so the pattern is left in float"]
    kind = "fake-quant" if is_qat else "observer"
    activation = _instantiate(qconfig, "activation")
    act_dtype = None if activation is None else activation.dtype
    act_dynamic = bool(activation is not None and activation.is_dynamic)

    input_reasons: list[str] = []
    if dtype_config.input_dtype is not None:
        input_reasons = _activation_side(
            activation, dtype_config.input_dtype_with_constraints, act_dtype, "", kind
        )
        if not input_reasons and bool(dtype_config.is_dynamic) != act_dynamic:
            input_reasons.append(
                "is dynamically quantized but the backend expects static quantization"
                if act_dynamic
                else "is statically quantized but the backend expects dynamic quantization "
                "(use an activation observer with is_dynamic=True)"
            )
    output_dtype = torch.float32 if act_dynamic else act_dtype
    output_reasons = _activation_side(
        activation,
        dtype_config.output_dtype_with_constraints,
        output_dtype,
        " (dynamic quantization keeps the output in float)" if act_dynamic else "",
        kind,
    )

    reasons: list[str] = []
    for message in input_reasons:
        if message in output_reasons:
            output_reasons.remove(message)
            reasons.append(f"activation {message}")
        else:
            reasons.append(f"input activation {message}")
    reasons.extend(f"output activation {message}" for message in output_reasons)

    weight: ObserverFacts | None = None
    if dtype_config.weight_dtype is not None or dtype_config.bias_dtype is not None:
        weight = _instantiate(qconfig, "weight")
    weight_dtype = None if weight is None else weight.dtype
    if dtype_config.weight_dtype is not None:
        reasons.extend(
            f"weight {message}"
            for message in _activation_side(
                weight, dtype_config.weight_dtype_with_constraints, weight_dtype, "", kind
            )
        )
    if dtype_config.bias_dtype is not None:
        implied = (
            torch.float16
            if act_dtype == torch.float16 and weight_dtype == torch.float16 and not act_dynamic
            else torch.float32
        )
        if implied != dtype_config.bias_dtype:
            reasons.append(
                f"bias dtype is {implied} (implied by the QConfig's activation and weight "
                f"dtypes) but the backend accepts {dtype_config.bias_dtype}"
            )
    return reasons


def find_accepting_dtype_config(
    pattern_config: BackendPatternConfig, qconfig: Any, *, is_qat: bool = False
) -> tuple[DTypeConfig | None, list[str]]:
    """The first of ``pattern_config``'s DTypeConfigs that accepts ``qconfig``,
    and one line per DTypeConfig tried before it (or all, if none accepts)
    saying why it rejected the QConfig."""
    if not isinstance(pattern_config, BackendPatternConfig):
        raise ConfigError(
            f"pattern_config: got {describe(pattern_config)}; expected a BackendPatternConfig"
        )
    if not pattern_config.dtype_configs:
        return None, [
            f"pattern {pattern_config.describe_pattern()} has no DTypeConfig, so it is never "
            "quantized (add one with add_dtype_config)"
        ]
    rejected: list[str] = []
    for dtype_config in pattern_config.dtype_configs:
        reasons = reasons_rejected(dtype_config, qconfig, is_qat=is_qat)
        if not reasons:
            return dtype_config, rejected
        rejected.append(f"{dtype_config!r}: " + "; ".join(reasons))
    return None, rejected


def _lookup(backend_config: BackendConfig, pattern: Pattern) -> BackendPatternConfig | None:
    try:
        key = to_complex_format(pattern)
    except ConfigError:
        key = pattern
    found = backend_config.get(key)
    if found is None and key is not pattern:
        found = backend_config.get(pattern)
    return found


def rejection_reasons(
    backend_config: BackendConfig, pattern: Pattern, qconfig: Any, *, is_qat: bool = False
) -> list[str]:
    """Why ``backend_config`` would not quantize ``pattern`` (simple,
    forward-order form, e.g. ``(nn.Conv2d, nn.ReLU)``) with ``qconfig``;
    ``[]`` means it would."""
    if not isinstance(backend_config, BackendConfig):
        raise ConfigError(
            f"backend_config: got {describe(backend_config)}; expected a BackendConfig"
        )
    pattern_config = _lookup(backend_config, pattern)
    if pattern_config is None:
        return [f"no pattern {format_pattern(pattern)} in backend {backend_config.name!r}"]
    accepted, rejected = find_accepting_dtype_config(pattern_config, qconfig, is_qat=is_qat)
    return [] if accepted is not None else rejected


def accepts(
    backend_config: BackendConfig, pattern: Pattern, qconfig: Any, *, is_qat: bool = False
) -> bool:
    """Whether ``backend_config`` quantizes ``pattern`` (simple form) with ``qconfig``."""
    return not rejection_reasons(backend_config, pattern, qconfig, is_qat=is_qat)
