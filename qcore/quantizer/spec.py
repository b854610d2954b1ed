"""The annotation API (seed 004): how a tensor is quantized, as frozen data.

An *edge* is ``(producer_node, consumer_node)``: one input of one op. A *node*
stands for its output tensor. Annotations map edges and nodes to specs:

* :class:`QuantizationSpec`: observe the tensor with this observer, quantize to
  this dtype and range;
* :class:`SharedQuantizationSpec`: use the same observer (hence qparams) as
  another edge or node; sharing is transitive;
* :class:`FixedQParamsQuantizationSpec`: known scale and zero point (sigmoid);
* :class:`DerivedQuantizationSpec`: qparams computed from other observers
  (a conv bias: activation scale times weight scale).

Example::

    >>> act = QuantizationSpec(dtype=torch.uint8, quant_min=0, quant_max=255,
    ...                        qscheme=torch.per_tensor_affine,
    ...                        observer_or_fake_quant_ctr=HistogramObserver)
    >>> add_node.meta["quantization_annotation"] = QuantizationAnnotation(
    ...     input_qspec_map={a: act, b: SharedQuantizationSpec((a, add_node))},
    ...     output_qspec=act, _annotated=True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from qcore.config.dtypes import value_range
from qcore.config.errors import invalid

__all__ = [
    "DerivedQuantizationSpec",
    "EdgeOrNode",
    "FixedQParamsQuantizationSpec",
    "QuantizationAnnotation",
    "QuantizationSpec",
    "QuantizationSpecBase",
    "SharedQuantizationSpec",
]

EdgeOrNode = tuple[Node, Node] | Node

_PER_CHANNEL = (
    torch.per_channel_affine,
    torch.per_channel_symmetric,
    torch.per_channel_affine_float_qparams,
)
_QSCHEMES = (torch.per_tensor_affine, torch.per_tensor_symmetric, *_PER_CHANNEL)


class QuantizationSpecBase:
    """Base of the four spec kinds."""

    __slots__ = ()


def _integer_range(dtype: Any, otherwise: Any) -> tuple[Any, Any]:
    """The values an integer ``dtype`` holds; ``(otherwise, otherwise)`` for others."""
    found = value_range(dtype) if isinstance(dtype, torch.dtype) else None
    return found[:2] if found is not None and found[2] else (otherwise, otherwise)


def _check_range(owner: str, quant_min: Any, quant_max: Any, dtype: Any = None) -> None:
    for name, value in (("quant_min", quant_min), ("quant_max", quant_max)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise invalid(f"{owner}.{name}", value, "an int or None")
        low, high = _integer_range(dtype, value)
        if value is not None and not low <= value <= high:
            # torchao's fake tensors would hold other values than the dtype holds
            raise invalid(f"{owner}.{name}", value, f"a value in {dtype}'s range [{low}, {high}]")
    if quant_min is not None and quant_max is not None and quant_min > quant_max:
        raise invalid(
            f"{owner}.quant_min", quant_min, f"a value no greater than quant_max={quant_max}"
        )


def _check_common(owner: str, dtype: Any, qscheme: Any) -> None:
    if not isinstance(dtype, torch.dtype):
        raise invalid(f"{owner}.dtype", dtype, "a torch.dtype such as torch.uint8 or torch.int8")
    if qscheme is not None and qscheme not in _QSCHEMES:
        raise invalid(f"{owner}.qscheme", qscheme, f"None or one of {list(_QSCHEMES)}")


@dataclass(eq=True, frozen=True)
class QuantizationSpec(QuantizationSpecBase):
    """Observe a tensor with ``observer_or_fake_quant_ctr`` and quantize it to
    ``dtype`` within [quant_min, quant_max]."""

    dtype: torch.dtype
    observer_or_fake_quant_ctr: Callable[..., Any]
    quant_min: int | None = None
    quant_max: int | None = None
    qscheme: torch.qscheme | None = None
    ch_axis: int | None = None
    is_dynamic: bool = False

    def __post_init__(self) -> None:
        owner = "QuantizationSpec"
        _check_common(owner, self.dtype, self.qscheme)
        _check_range(owner, self.quant_min, self.quant_max, self.dtype)
        if isinstance(self.observer_or_fake_quant_ctr, torch.nn.Module) or not callable(
            self.observer_or_fake_quant_ctr
        ):
            raise invalid(
                f"{owner}.observer_or_fake_quant_ctr",
                self.observer_or_fake_quant_ctr,
                "an observer or fake-quant class or constructor (MinMaxObserver.with_args(...))",
            )
        if self.ch_axis is not None and (
            isinstance(self.ch_axis, bool) or not isinstance(self.ch_axis, int)
        ):
            raise invalid(f"{owner}.ch_axis", self.ch_axis, "an int or None")
        if self.qscheme in _PER_CHANNEL and self.ch_axis is None:
            raise invalid(f"{owner}.ch_axis", None, f"an int, since qscheme is {self.qscheme}")


@dataclass(eq=True, frozen=True)
class FixedQParamsQuantizationSpec(QuantizationSpecBase):
    """Quantize with a known ``scale`` and ``zero_point`` (no statistics needed)."""

    dtype: torch.dtype
    scale: float
    zero_point: int
    quant_min: int | None = None
    quant_max: int | None = None
    qscheme: torch.qscheme | None = None
    is_dynamic: bool = False

    def __post_init__(self) -> None:
        owner = "FixedQParamsQuantizationSpec"
        _check_common(owner, self.dtype, self.qscheme)
        _check_range(owner, self.quant_min, self.quant_max, self.dtype)
        if (
            isinstance(self.scale, bool)
            or not isinstance(self.scale, (int, float))
            or not 0 < self.scale < math.inf
        ):
            raise invalid(f"{owner}.scale", self.scale, "a finite float greater than 0")
        if isinstance(self.zero_point, bool) or not isinstance(self.zero_point, int):
            raise invalid(f"{owner}.zero_point", self.zero_point, "an int")
        low, high = _integer_range(self.dtype, self.zero_point)
        low = low if self.quant_min is None else self.quant_min
        high = high if self.quant_max is None else self.quant_max
        if not low <= self.zero_point <= high:
            raise invalid(f"{owner}.zero_point", self.zero_point, f"an int in [{low}, {high}]")


def _check_edge_or_node(field_name: str, value: Any) -> None:
    if isinstance(value, Node):
        return
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, Node) for v in value):
        return
    raise invalid(field_name, value, "a torch.fx.Node or a (producer, consumer) pair of Nodes")


@dataclass(eq=True, frozen=True)
class SharedQuantizationSpec(QuantizationSpecBase):
    """Use the observer of ``edge_or_node`` (an input edge or a node's output)."""

    edge_or_node: EdgeOrNode

    def __post_init__(self) -> None:
        _check_edge_or_node("SharedQuantizationSpec.edge_or_node", self.edge_or_node)


@dataclass(eq=True, frozen=True)
class DerivedQuantizationSpec(QuantizationSpecBase):
    """Qparams computed by ``derive_qparams_fn(observers)`` from the observers of
    ``derived_from`` (edges or nodes)."""

    derived_from: list[EdgeOrNode]
    derive_qparams_fn: Callable[[list[Any]], tuple[torch.Tensor, torch.Tensor]]
    dtype: torch.dtype
    quant_min: int | None = None
    quant_max: int | None = None
    qscheme: torch.qscheme | None = None
    ch_axis: int | None = None
    is_dynamic: bool = False

    def __post_init__(self) -> None:
        owner = "DerivedQuantizationSpec"
        _check_common(owner, self.dtype, self.qscheme)
        _check_range(owner, self.quant_min, self.quant_max, self.dtype)
        if not self.derived_from:
            raise invalid(f"{owner}.derived_from", self.derived_from, "at least one edge or node")
        for index, item in enumerate(self.derived_from):
            _check_edge_or_node(f"{owner}.derived_from[{index}]", item)
        if not callable(self.derive_qparams_fn):
            raise invalid(f"{owner}.derive_qparams_fn", self.derive_qparams_fn, "a callable")

    # Lists are not hashable; the spec is identified by what it derives from.
    def __hash__(self) -> int:
        return hash((tuple(self.derived_from), self.derive_qparams_fn, self.dtype))


@dataclass
class QuantizationAnnotation:
    """How one node's inputs (edges) and output are quantized.

    Stored in ``node.meta["quantization_annotation"]``.
    """

    input_qspec_map: dict[Node, QuantizationSpecBase | None] = field(default_factory=dict)
    output_qspec: QuantizationSpecBase | None = None
    allow_implicit_sharing: bool = True
    _annotated: bool = False

    def __post_init__(self) -> None:
        owner = "QuantizationAnnotation"
        if not isinstance(self.input_qspec_map, dict):
            raise invalid(f"{owner}.input_qspec_map", self.input_qspec_map, "a dict")
        for node, spec in self.input_qspec_map.items():
            if not isinstance(node, Node):
                raise invalid(f"{owner}.input_qspec_map key", node, "a torch.fx.Node")
            _check_spec(f"{owner}.input_qspec_map[{node.name!r}]", spec)
        _check_spec(f"{owner}.output_qspec", self.output_qspec)

    def quantized_values(self, node: Node) -> list[Node]:
        """The values this annotation of ``node`` quantizes: each input with a spec,
        and ``node`` itself where its output has one."""
        values = [arg for arg, spec in self.input_qspec_map.items() if spec is not None]
        return values + [node] if self.output_qspec is not None else values


# torchao's and torch.ao's spec classes, which their Quantizers' annotations hold
_SPEC_CLASS_NAMES = {
    "QuantizationSpec",
    "SharedQuantizationSpec",
    "FixedQParamsQuantizationSpec",
    "DerivedQuantizationSpec",
}


def _check_spec(field_name: str, spec: Any) -> None:
    if spec is None or isinstance(spec, QuantizationSpecBase):
        return
    if type(spec).__name__ in _SPEC_CLASS_NAMES:
        return
    raise invalid(
        field_name,
        spec,
        "None or a QuantizationSpec, SharedQuantizationSpec, "
        "FixedQParamsQuantizationSpec or DerivedQuantizationSpec",
    )
