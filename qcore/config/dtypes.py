"""What a backend accepts: ObservationType, DTypeWithConstraints, DTypeConfig.

API-compatible with ``torch.ao.quantization.backend_config``, but
validated on construction: a wrong type or a contradictory bound raises a
:class:`~qcore.config.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import enum
import math
import re
import sys
from dataclasses import dataclass, fields
from typing import Any

import torch

from qcore.config.errors import invalid

__all__ = [
    "ObservationType",
    "DTypeWithConstraints",
    "DTypeConfig",
    "is_power_of_two",
    "value_range",
]


class ObservationType(enum.Enum):
    """How the input and output of a pattern are observed.

    The values match torch.ao's so a torch.ao config converts one to one.
    """

    OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT = 0
    """Input and output get their own observers (conv, linear, softmax)."""

    OUTPUT_SHARE_OBSERVER_WITH_INPUT = 1
    """The output shares the input's observer instance (cat, maxpool)."""

    INPUT_OUTPUT_NOT_OBSERVED = 2
    """Neither input nor output is observed (x.shape, x.size)."""


_NUMBER = (int, float)

# Quantized dtypes packing several values in a byte: torch.iinfo reports the
# byte's range (0..255), not the values'.
_PACKED_RANGES = {torch.quint4x2: (0, 15), torch.quint2x4: (0, 3)}

# Without a dtype, quant bounds still lie within the widest integer storage
# (int64 below, uint64 above); anything beyond is no quantization at all.
_NO_DTYPE_RANGE = (-(2**63), 2**64 - 1)


def value_range(dtype: torch.dtype) -> tuple[int | float, int | float, bool] | None:
    """The values ``dtype`` holds, as ``(lowest, highest, integral)``; None for a
    dtype without a numeric range (bool, complex, the ``bits*`` containers)."""
    if dtype in _PACKED_RANGES:
        low, high = _PACKED_RANGES[dtype]
        return low, high, True
    # torch.int1..int7 and uint1..uint7 have no iinfo.
    sub_byte = re.fullmatch(r"torch\.(u?)int([1-7])", str(dtype))
    if sub_byte:
        bits = int(sub_byte[2])
        if sub_byte[1]:
            return 0, 2**bits - 1, True
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1, True
    if dtype.is_complex or dtype == torch.bool:
        return None
    try:
        if dtype.is_floating_point:
            finfo = torch.finfo(dtype)
            return float(finfo.min), float(finfo.max), False
        iinfo = torch.iinfo(dtype)
        return int(iinfo.min), int(iinfo.max), True
    except TypeError:
        return None


def _is_nan(value: Any) -> bool:
    # math.isnan(int) converts to float, which overflows for ints past 1e308.
    return isinstance(value, float) and math.isnan(value)


def _as_float(value: int | float) -> float | None:
    """``value`` as a float, or None if a float cannot hold it."""
    try:
        return float(value)
    except OverflowError:
        return None


def _check_optional_number(owner: str, name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, _NUMBER) or _is_nan(value):
        raise invalid(f"{owner}.{name}", value, "an int, a float or None")


def _check_optional_dtype(field_name: str, value: Any) -> None:
    if value is not None and not isinstance(value, torch.dtype):
        raise invalid(field_name, value, "a torch.dtype (e.g. torch.quint8) or None")


@dataclass(frozen=True)
class DTypeWithConstraints:
    """A dtype plus the limits a backend places on the QConfig that uses it.

    * ``quant_min_lower_bound`` / ``quant_max_upper_bound``: the observer's
      quant_min and quant_max must lie within these bounds.
    * ``scale_min_lower_bound`` / ``scale_max_upper_bound``: the observer's
      smallest scale (its ``eps``) must not fall below the lower bound; the
      largest must not exceed the upper one.
    * ``scale_exact_match`` (with or without ``zero_point_exact_match``): fixed
      qparams, for ops such as sigmoid; the observer must be a fixed-qparams one
      with these exact values.
    * ``zero_point_exact_match`` alone: the zero point every scale comes with,
      e.g. ``0`` for symmetric int8. A fixed-qparams observer with that zero
      point meets it, and so does a symmetric one (``qscheme`` per-tensor or
      per-channel symmetric) whose zero point is that value: 0 for a signed
      dtype, 128 for quint8 (the middle of a custom range). torch.ao reads the
      field only together with ``scale_exact_match`` and ignores it alone.
    * ``scale_power_of_two`` (qcore's own, not in torch.ao): every scale is a
      power of two (shift-based requantization on NPUs and DSPs). Met by an
      observer created with ``power_of_two_scale=True`` (qcore's observers round
      each scale up to the next power of two) or fixed qparams with such a scale.

    Example::

        >>> DTypeWithConstraints(dtype=torch.quint8, quant_min_lower_bound=0,
        ...                      quant_max_upper_bound=255, scale_min_lower_bound=2**-12)
        >>> symmetric_int8 = DTypeWithConstraints(dtype=torch.qint8, zero_point_exact_match=0)
        >>> shift_scales = DTypeWithConstraints(dtype=torch.quint8, scale_power_of_two=True)
    """

    dtype: torch.dtype | None = None
    quant_min_lower_bound: int | float | None = None
    quant_max_upper_bound: int | float | None = None
    scale_min_lower_bound: int | float | None = None
    scale_max_upper_bound: int | float | None = None
    scale_exact_match: float | None = None
    zero_point_exact_match: int | None = None
    scale_power_of_two: bool | None = None

    def __post_init__(self) -> None:
        owner = "DTypeWithConstraints"
        _check_optional_dtype(f"{owner}.dtype", self.dtype)
        for f in fields(self)[1:]:
            if f.name != "scale_power_of_two":
                _check_optional_number(owner, f.name, getattr(self, f.name))
        if self.scale_power_of_two is not None and not isinstance(self.scale_power_of_two, bool):
            raise invalid(
                f"{owner}.scale_power_of_two", self.scale_power_of_two, "True, False or None"
            )
        if self.scale_power_of_two is False:  # no constraint: equal to leaving it unset
            object.__setattr__(self, "scale_power_of_two", None)
        self._check_quant_values()
        self._check_ordered("quant_min_lower_bound", "quant_max_upper_bound")
        self._check_scales()
        self._check_ordered("scale_min_lower_bound", "scale_max_upper_bound")
        # Fixed qparams outside the other bounds could never be met by any observer.
        self._check_within(
            "zero_point_exact_match", "quant_min_lower_bound", "quant_max_upper_bound"
        )
        self._check_within("scale_exact_match", "scale_min_lower_bound", "scale_max_upper_bound")
        self._check_power_of_two()

    def _check_power_of_two(self) -> None:
        """A fixed scale that is no power of two, or scale bounds no power of two lies
        within, could never be met."""
        if not self.scale_power_of_two:
            return
        exact = self.scale_exact_match
        if exact is not None and not is_power_of_two(float(exact)):
            raise invalid(
                "DTypeWithConstraints.scale_exact_match",
                exact,
                "a power of two (scale_power_of_two=True), such as 2**-7",
            )
        low, high = self.scale_min_lower_bound, self.scale_max_upper_bound
        if low is not None and high is not None and math.isfinite(float(high)):
            smallest = 2.0 ** math.ceil(math.log2(float(low)))
            if smallest > float(high):
                raise invalid(
                    "DTypeWithConstraints.scale_max_upper_bound",
                    high,
                    f"a bound that admits a power of two at or above scale_min_lower_bound={low} "
                    f"(scale_power_of_two=True; the smallest is {smallest!r})",
                )

    def _check_quant_values(self) -> None:
        """Quant bounds and the fixed zero point are values of the dtype: within its
        range, and whole numbers for an integer dtype."""
        known = None if self.dtype is None else value_range(self.dtype)
        if known is None and self.dtype is not None:
            return  # bool, complex, bits: nothing to measure against
        low, high, integral = known if known is not None else (*_NO_DTYPE_RANGE, False)
        of_what = f"{self.dtype}'s range" if self.dtype is not None else "the int64/uint64 range"
        for name in ("quant_min_lower_bound", "quant_max_upper_bound", "zero_point_exact_match"):
            value = getattr(self, name)
            if value is None:
                continue
            field_name = f"DTypeWithConstraints.{name}"
            if name == "zero_point_exact_match" and not isinstance(value, int):
                raise invalid(field_name, value, "an int zero point")
            if isinstance(value, float) and not math.isfinite(value):
                raise invalid(field_name, value, "a finite number")
            if integral and isinstance(value, float) and not value.is_integer():
                raise invalid(field_name, value, f"a whole number ({self.dtype} holds integers)")
            if not low <= value <= high:
                raise invalid(field_name, value, f"a value within {of_what} [{low}, {high}]")

    def _check_scales(self) -> None:
        for name in ("scale_min_lower_bound", "scale_max_upper_bound", "scale_exact_match"):
            value = getattr(self, name)
            if value is None:
                continue
            as_float = _as_float(value)
            # An upper bound may be infinite ("no limit"); a scale itself may not.
            finite_needed = name != "scale_max_upper_bound"
            if as_float is None or (finite_needed and not math.isfinite(as_float)):
                raise invalid(f"DTypeWithConstraints.{name}", value, "a finite scale")
            if as_float <= 0:
                raise invalid(f"DTypeWithConstraints.{name}", value, "a scale greater than 0")

    def _check_ordered(self, low_name: str, high_name: str) -> None:
        low, high = getattr(self, low_name), getattr(self, high_name)
        if low is not None and high is not None and low > high:
            raise invalid(
                f"DTypeWithConstraints.{low_name}",
                low,
                f"a value no greater than {high_name}={high}",
            )

    def _check_within(self, name: str, low_name: str, high_name: str) -> None:
        value = getattr(self, name)
        low, high = getattr(self, low_name), getattr(self, high_name)
        if value is None:
            return
        if (low is not None and value < low) or (high is not None and value > high):
            raise invalid(
                f"DTypeWithConstraints.{name}",
                value,
                f"a value within {low_name}={low} and {high_name}={high}",
            )

    def __repr__(self) -> str:
        # torch.ao's fields always (as torch.ao prints them); qcore's own only when set
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name != "scale_power_of_two" or self.scale_power_of_two is not None
        ]
        return f"DTypeWithConstraints({', '.join(parts)})"

    @property
    def has_constraints(self) -> bool:
        """True when any field other than ``dtype`` is set."""
        return any(getattr(self, f.name) is not None for f in fields(self)[1:])


def is_power_of_two(scale: float) -> bool:
    """Whether ``scale`` is exactly 2**k for an integer k (negative k included)."""
    if not (math.isfinite(scale) and scale > 0):
        return False
    mantissa, _ = math.frexp(scale)
    return mantissa == 0.5


def _with_constraints(field_name: str, value: Any) -> DTypeWithConstraints:
    if isinstance(value, DTypeWithConstraints):
        return value
    _check_optional_dtype(field_name, value)
    return DTypeWithConstraints(dtype=value)


class DTypeConfig:
    """The dtypes a pattern's quantize ops take, with optional constraints.

    In the reference pattern ``quant1 - [dequant1 - fp32_op - quant2] - dequant2``
    ``input_dtype`` is the dtype of quant1 and ``output_dtype`` that of quant2.
    A QConfig whose dtypes match (and which satisfies the constraints) makes the
    pattern quantized; otherwise the pattern stays in float and ``qcore.explain``
    says why.

    Example::

        >>> DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8,
        ...             weight_dtype=torch.qint8, bias_dtype=torch.float)
    """

    __slots__ = (
        "input_dtype_with_constraints",
        "output_dtype_with_constraints",
        "weight_dtype_with_constraints",
        "bias_dtype",
        "is_dynamic",
    )

    def __init__(
        self,
        input_dtype: torch.dtype | DTypeWithConstraints | None = None,
        output_dtype: torch.dtype | DTypeWithConstraints | None = None,
        weight_dtype: torch.dtype | DTypeWithConstraints | None = None,
        bias_dtype: torch.dtype | None = None,
        is_dynamic: bool | None = None,
    ) -> None:
        self.input_dtype_with_constraints = _with_constraints(
            "DTypeConfig.input_dtype", input_dtype
        )
        self.output_dtype_with_constraints = _with_constraints(
            "DTypeConfig.output_dtype", output_dtype
        )
        self.weight_dtype_with_constraints = _with_constraints(
            "DTypeConfig.weight_dtype", weight_dtype
        )
        _check_optional_dtype("DTypeConfig.bias_dtype", bias_dtype)
        if is_dynamic is not None and not isinstance(is_dynamic, bool):
            raise invalid("DTypeConfig.is_dynamic", is_dynamic, "True, False or None")
        self.bias_dtype = bias_dtype
        self.is_dynamic = is_dynamic

    @property
    def input_dtype(self) -> torch.dtype | None:
        return self.input_dtype_with_constraints.dtype

    @property
    def output_dtype(self) -> torch.dtype | None:
        return self.output_dtype_with_constraints.dtype

    @property
    def weight_dtype(self) -> torch.dtype | None:
        return self.weight_dtype_with_constraints.dtype

    def _key(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DTypeConfig) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        parts = []
        for name in ("input", "output", "weight"):
            constrained = getattr(self, f"{name}_dtype_with_constraints")
            if constrained.has_constraints:
                parts.append(f"{name}_dtype={constrained!r}")
            elif constrained.dtype is not None:
                parts.append(f"{name}_dtype={constrained.dtype}")
        if self.bias_dtype is not None:
            parts.append(f"bias_dtype={self.bias_dtype}")
        if self.is_dynamic is not None:
            parts.append(f"is_dynamic={self.is_dynamic}")
        return f"DTypeConfig({', '.join(parts)})"

    @classmethod
    def from_dict(cls, dtype_config_dict: dict[str, Any]) -> DTypeConfig:
        """Build from a dict with the optional keys ``input_dtype``,
        ``output_dtype``, ``weight_dtype`` (each a torch.dtype or a
        DTypeWithConstraints), ``bias_dtype`` and ``is_dynamic``."""
        if not isinstance(dtype_config_dict, dict):
            raise invalid("DTypeConfig", dtype_config_dict, "a dict")
        if holds_torch_ao(dtype_config_dict):  # torch.ao's own to_dict() output
            from qcore.config.torch_ao import from_torch_ao_dict

            return from_torch_ao_dict("DTypeConfig", dtype_config_dict)
        unknown = set(dtype_config_dict) - set(_DTYPE_CONFIG_KEYS)
        if unknown:
            raise invalid(
                "DTypeConfig",
                sorted(unknown, key=repr)[0],  # keys of mixed types do not sort by value
                f"one of the keys {list(_DTYPE_CONFIG_KEYS)}",
            )
        return cls(**dtype_config_dict)

    def to_dict(self) -> dict[str, Any]:
        """The inverse of :meth:`from_dict`; unset fields are left out."""
        result: dict[str, Any] = {}
        for name in ("input", "output", "weight"):
            constrained = getattr(self, f"{name}_dtype_with_constraints")
            if constrained.dtype is not None or constrained.has_constraints:
                result[f"{name}_dtype"] = constrained
        if self.bias_dtype is not None:
            result["bias_dtype"] = self.bias_dtype
        if self.is_dynamic is not None:
            result["is_dynamic"] = self.is_dynamic
        return result


_DTYPE_CONFIG_KEYS = ("input_dtype", "output_dtype", "weight_dtype", "bias_dtype", "is_dynamic")


def holds_torch_ao(value: Any, depth: int = 0) -> bool:
    """A dict from torch.ao's ``to_dict()``: it holds torch.ao's own ObservationType,
    DTypeWithConstraints or DTypeConfig objects, within the few levels of dicts and
    lists such a dict has (patterns, tuples, are not searched). Imports nothing:
    without torch.ao's backend_config loaded, no value can be one of its objects."""
    ao = sys.modules.get("torch.ao.quantization.backend_config")
    if ao is None:
        return False
    if isinstance(value, (dict, list)):
        items = value.values() if isinstance(value, dict) else value
        return depth < _TO_DICT_DEPTH and any(holds_torch_ao(item, depth + 1) for item in items)
    return isinstance(value, (ao.ObservationType, ao.DTypeWithConstraints, ao.DTypeConfig))


#: BackendConfig -> configs -> a pattern config -> dtype_configs -> a dtype config -> a value
_TO_DICT_DEPTH = 6
