"""The kernel interface plugins implement.

A :class:`Kernel` names the reference pattern it replaces at convert time. The
engine (``qcore.engine.lower``) walks the reference graph; where a kernel's
pattern matches, it describes the match (:class:`KernelMatch`: the nodes, their
modules, the qparams of the quantized inputs and of the output) and calls
:meth:`Kernel.lower`, which returns either

* a ``torch.nn.Module`` called like the matched root op, with each quantized
  input given as a torch quantized tensor (dynamic kernels get the float input);
  it returns a torch quantized tensor, or a float one when its class sets
  ``returns_quantized = False`` (dynamic and weight-only kernels). Where the
  output's ``quant_range`` is narrowed, only a kernel that sets
  ``honors_quant_range = True`` (its output never leaves that range) is taken:
  torch's int8 ops clamp to the dtype's whole range; or
* :class:`SameOp`: the matched op itself runs on torch quantized tensors
  (pooling, relu, shape ops), producing ``SameOp.produces`` qparams.

A kernel that cannot take an instance raises; the engine leaves the pattern in
reference form and explain shows the error as the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ActivationQParams",
    "DynamicInput",
    "Kernel",
    "KernelMatch",
    "KernelUnavailable",
    "SameOp",
]


@dataclass(frozen=True)
class ActivationQParams:
    """Per-tensor qparams of an activation at a kernel's boundary.

    ``quant_range`` is (quant_min, quant_max) when the reference clamps to less
    than the dtype's range (7-bit activations on CPUs without VNNI), else None.
    """

    scale: float
    zero_point: int
    dtype: torch.dtype
    quant_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class DynamicInput:
    """An input quantized on the fly (dynamic quantization) to [quant_min, quant_max]."""

    quant_min: int
    quant_max: int
    dtype: torch.dtype

    @property
    def reduce_range(self) -> bool:
        """Whether the range is one bit short of the dtype's (fbgemm's overflow guard)."""
        return self.quant_max - self.quant_min < 255


@dataclass(frozen=True)
class KernelMatch:
    """One place in a reference graph where a kernel's pattern matched.

    ``nodes`` are the matched op nodes in forward order (``nodes[0]`` is the
    root, called with the replacement's arguments) and ``modules`` the module
    each runs (a ``ReferenceModule`` for quantized weighted modules, None for
    functions and methods). ``inputs`` holds the qparams of the root's quantized
    tensor inputs in argument order, ``dynamic`` its dynamically quantized ones,
    ``float_inputs`` how many tensor inputs are neither. ``output`` is what the
    reference quantizes the result to, None when the result stays float.
    """

    nodes: tuple
    modules: tuple
    inputs: tuple[ActivationQParams, ...]
    output: ActivationQParams | None
    dynamic: tuple[DynamicInput, ...] = ()
    float_inputs: int = 0
    engine: str = ""

    @property
    def root(self) -> Any:
        return self.nodes[0]

    @property
    def module(self) -> Any:
        """The root's module (None for a function or method)."""
        return self.modules[0]


@dataclass(frozen=True)
class SameOp:
    """The matched op runs unchanged on torch quantized tensors.

    ``produces`` is the qparams torch's op gives its output; where the
    reference quantizes to other qparams, the engine requantizes (a kernel only
    says SameOp where that is exact, e.g. max pooling or relu).
    """

    produces: ActivationQParams


class KernelUnavailable(RuntimeError):
    """The kernel does not exist for this engine (e.g. a qnnpack limitation)."""


@dataclass(frozen=True)
class Kernel:
    """A backend's int8 implementation of one reference pattern.

    ``pattern`` is a module class, a function (``torch.add``), a method name
    (``"reshape"``), or a tuple of those in forward order for a fused chain
    (``(torch.add, torch.nn.ReLU)``). ``engine`` names the packed weight format
    (e.g. ``"fbgemm"``) the kernel runs on, whatever
    ``torch.backends.quantized.engine`` says.

    Example::

        >>> Kernel(name="linear", pattern=torch.nn.Linear, engine="fbgemm",
        ...        lower=lower_linear,   # lower_linear(match: KernelMatch) -> Module
        ...        activation_dtypes=(torch.quint8,))
    """

    name: str
    pattern: Any
    engine: str
    lower: Any = field(default=None, compare=False)
    """Callable ``lower(match: KernelMatch) -> torch.nn.Module | SameOp``."""
    activation_dtypes: tuple[torch.dtype, ...] = ()
    """The quantized activation dtypes the kernel takes and returns (``(torch.quint8,)``
    for torch's int8 conv and linear); empty takes any. Lowering checks it, so a
    config that accepts other dtypes leaves the pattern in reference form, explained."""
    no_model_reason: str = field(default="", compare=False)
    """Why the conformance suite (``qcore check``) cannot check this kernel, e.g.
    ``"a QAT module: convert gives its float form, which the float pattern's kernel
    takes"``. The suite builds a small model of the kernel's pattern
    (:func:`qcore.conformance_models.model_for`), quantizes it with the backend and
    compares the kernel alone with the reference form. A kernel fails the check when
    no model can be built for its pattern, or when the kernel takes nothing of that
    model, unless this reason is set; the reason never excuses a kernel whose output
    disagrees with the reference form."""

    def __post_init__(self) -> None:
        from qcore.config.errors import invalid

        if not isinstance(self.name, str) or not self.name:
            raise invalid("Kernel.name", self.name, "a non-empty str")
        chain = self.pattern if isinstance(self.pattern, tuple) else (self.pattern,)
        if not chain or not all(_is_pattern_op(op) for op in chain):
            raise invalid(
                f"Kernel.pattern (kernel {self.name!r})",
                self.pattern,
                "a module class, a function such as torch.add, a method name such as "
                "'reshape', or a non-empty tuple of those in forward order",
            )
        if not isinstance(self.engine, str) or not self.engine:
            raise invalid("Kernel.engine", self.engine, "a non-empty str such as 'fbgemm'")
        if self.lower is not None and not callable(self.lower):
            raise invalid("Kernel.lower", self.lower, "a callable or None")
        if not isinstance(self.no_model_reason, str):
            raise invalid(
                f"Kernel.no_model_reason (kernel {self.name!r})",
                self.no_model_reason,
                "a str saying why no conformance model can be built ('' for none)",
            )
        if not isinstance(self.activation_dtypes, tuple) or not all(
            isinstance(dtype, torch.dtype) for dtype in self.activation_dtypes
        ):
            raise invalid(
                "Kernel.activation_dtypes", self.activation_dtypes, "a tuple of torch.dtype"
            )

    @property
    def chain(self) -> tuple:
        """The pattern as a tuple in forward order."""
        return self.pattern if isinstance(self.pattern, tuple) else (self.pattern,)


def _is_pattern_op(op: Any) -> bool:
    """One op of a kernel's pattern: a class, a callable or a method name."""
    if isinstance(op, str):
        return bool(op)
    return isinstance(op, type) or (callable(op) and not isinstance(op, tuple))
