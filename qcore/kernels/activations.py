"""Kernels for activations: relu on int8 as it is; relu6, hardtanh and clamp on
int8 in any memory layout; fixed-qparams ops (sigmoid, tanh, hardsigmoid); elu and
leaky relu, which requantize to their output's qparams inside torch's kernel; and
hardswish, computed as the reference does.

Every kernel's output is the same whatever ``torch.backends.quantized.engine``
says: where torch's int8 op picks its implementation by that global and the
implementations disagree (clamp on channels-last input, hardswish's rounding),
the kernel avoids that (tests/test_engine_independence.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from qcore.kernels.common import (
    OutputKernel,
    bound_arguments,
    one_quantized_input,
    require,
    same_as_input,
)
from qcore.kernels.layout import back_from_memory_order, in_memory_order
from qcore.ops import storage_dtype
from qcore.plugin.kernels import ActivationQParams, KernelMatch, SameOp

__all__ = [
    "QuantizedClamp",
    "QuantizedELU",
    "QuantizedHardswish",
    "QuantizedLeakyReLU",
    "lower_clamp",
    "lower_fixed_qparams",
    "lower_relu",
]

# torch's ops, bound once: a lookup through torch.ops costs about as much as the
# Python around a kernel call. TorchScript compiles them as the ops themselves.
_elu = torch.ops.quantized.elu
_leaky_relu = torch.ops.quantized.leaky_relu

aten = torch.ops.aten
_QNNPACK = 2  # torch._C._get_qengine()'s number for qnnpack (c10/core/QEngine.h)


def lower_relu(match: KernelMatch) -> SameOp:
    """relu: torch clamps the int8 values at the input's zero point, exactly what
    the reference computes."""
    one_quantized_input(match)
    return same_as_input(match)


class QuantizedClamp(torch.nn.Module):
    """relu6, hardtanh and clamp on int8: ``torch.clamp`` with the bounds, which
    torch applies to the int8 values in the input's qparams (exact), then a
    requantization where the output's qparams differ from the input's.

    The output does not depend on which clamp the global quantized engine picks.
    torch 2.13's qnnpack clamp (what hardtanh, relu6 and clamp run while the engine
    is qnnpack) reads a channels-last input, as every int8 conv returns, as if it
    were contiguous and returns a contiguous, scrambled tensor; the other engines'
    clamp keeps the layout. So a channels-last input is clamped directly and, where
    the result came back contiguous, clamped again on its NHWC view (contiguous: no
    copy, exact on every engine). The check, not the global, decides: another thread
    may switch the engine between the kernel's read and torch's.
    """

    returns_quantized = True

    def __init__(self, low: float, high: float, output: ActivationQParams | None) -> None:
        super().__init__()
        self.low, self.high = low, high
        # None: the output keeps the input's qparams
        self.requantize = output is not None
        self.scale = output.scale if output is not None else 1.0
        self.zero_point = output.zero_point if output is not None else 0
        self.dtype = output.dtype if output is not None else torch.quint8
        # clamping keeps values inside a narrowed (7-bit) input range; a requantization
        # uses the dtype's full range
        self.honors_quant_range = output is None

    def __setstate__(self, state: dict) -> None:
        if "requantize_to" in state:  # pickled before the kernel was scriptable
            output = state.pop("requantize_to")
            state["requantize"] = output is not None
            state["scale"] = output.scale if output is not None else 1.0
            state["zero_point"] = output.zero_point if output is not None else 0
            state["dtype"] = output.dtype if output is not None else torch.quint8
        super().__setstate__(state)

    # The bounds are the kernel's own: the call's arguments (relu6's inplace,
    # hardtanh's min_val/max_val, clamp's min/max) are accepted and not read.
    def forward(
        self,
        x: torch.Tensor,
        min: Any = None,  # noqa: A002 (torch.clamp's names)
        max: Any = None,  # noqa: A002
        inplace: Any = None,
        min_val: Any = None,
        max_val: Any = None,
    ) -> torch.Tensor:
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            # every int8 conv's output (the common case, without the generic
            # helpers' calls: this runs after most convs)
            clamped_in_place_order = False
            clamped = x
            if torch.jit.is_scripting() or not self._qnnpack_engine_is_set():
                clamped = torch.clamp(x, self.low, self.high)
                clamped_in_place_order = clamped.is_contiguous(memory_format=torch.channels_last)
            if not clamped_in_place_order:
                # qnnpack's clamp ran (the engine is qnnpack, or was switched just
                # now): its output is contiguous, written from the channels-last
                # memory as if that were contiguous. The NHWC view is contiguous:
                # every engine's clamp is exact there.
                nhwc = torch.clamp(x.permute(0, 2, 3, 1), self.low, self.high)
                clamped = nhwc.permute(0, 3, 1, 2)
        else:
            view, back = in_memory_order(x)
            clamped = back_from_memory_order(torch.clamp(view, self.low, self.high), back)
        if not self.requantize:
            return clamped
        return torch.quantize_per_tensor(
            clamped.dequantize(), self.scale, self.zero_point, self.dtype
        )

    @torch.jit.unused
    def _qnnpack_engine_is_set(self) -> bool:
        """A hint only (forward checks torch's result): eager kernels skip a clamp
        they would redo; scripted ones cannot read the global and always check."""
        return torch._C._get_qengine() == _QNNPACK

    # as QuantizedMatmul._under_autocast: TorchScript cannot resolve the string
    # annotation ``from __future__ import annotations`` makes of bool
    _qnnpack_engine_is_set.__annotations__["return"] = bool

    def extra_repr(self) -> str:
        requantize = ""
        if self.requantize:
            output = ActivationQParams(self.scale, self.zero_point, self.dtype)
            requantize = f", requantize_to={output}"
        return f"low={self.low}, high={self.high}{requantize}"


def _constant(value, name: str):
    require(not isinstance(value, Node), f"argument {name!r} is computed in the graph")
    return None if value is None else float(value)


def clamp_bounds(match: KernelMatch) -> tuple[float | None, float | None]:
    """The (low, high) bounds of a relu6, hardtanh or clamp call or module."""
    if isinstance(match.module, torch.nn.Hardtanh):  # ReLU6 is one
        return float(match.module.min_val), float(match.module.max_val)
    target, args, kwargs = match.root.target, match.root.args, match.root.kwargs
    if target is F.relu6:
        return 0.0, 6.0
    if target is F.hardtanh:
        bounds = bound_arguments(match, F.hardtanh)
        return float(bounds["min_val"]), float(bounds["max_val"])
    if target in (aten.hardtanh.default, aten.hardtanh_.default):
        low = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
        high = args[2] if len(args) > 2 else kwargs.get("max_val", 1.0)
        return _constant(low, "min_val"), _constant(high, "max_val")
    # torch.clamp(x, min=None, max=None) and Tensor.clamp
    low = args[1] if len(args) > 1 else kwargs.get("min")
    high = args[2] if len(args) > 2 else kwargs.get("max")
    require(low is not None or high is not None, "clamp without bounds")
    return _constant(low, "min"), _constant(high, "max")


def lower_clamp(match: KernelMatch) -> QuantizedClamp:
    """relu6, hardtanh, clamp: :class:`QuantizedClamp` on every engine (torch's op as
    it is would scramble channels-last inputs whenever the global engine is qnnpack).
    torch's qnnpack int8 clamp needs both bounds: a missing one is the input's most
    extreme value, which clamps nothing."""
    same = same_as_input(match)
    produces = same.produces
    low, high = clamp_bounds(match)
    requantize_to = None if match.output == produces else match.output
    values = torch.iinfo(storage_dtype(produces.dtype))
    if low is None:
        low = (values.min - produces.zero_point) * produces.scale
    if high is None:
        high = (values.max - produces.zero_point) * produces.scale
    return QuantizedClamp(low, high, requantize_to)


# What torch's int8 kernels produce: scale, zero point per output dtype.
_FIXED = {
    "sigmoid": {torch.quint8: (1.0 / 256, 0), torch.qint8: (1.0 / 256, -128)},
    "hardsigmoid": {torch.quint8: (1.0 / 256, 0), torch.qint8: (1.0 / 256, -128)},
    "tanh": {torch.quint8: (2.0 / 256, 128), torch.qint8: (2.0 / 256, 0)},
}


def lower_fixed_qparams(match: KernelMatch, op: str) -> SameOp:
    """sigmoid, tanh, hardsigmoid: torch's int8 op produces fixed qparams; taken
    when the reference quantizes to the same ones (a fixed-qparams observer)."""
    inputs = one_quantized_input(match)
    scale, zero_point = _FIXED[op][inputs.dtype]
    produces = ActivationQParams(scale, zero_point, inputs.dtype)
    require(
        match.output == produces,
        f"output qparams (scale={match.output.scale:.6g}, zero_point="
        f"{match.output.zero_point}) are not torch's fixed {op} ones "
        f"(scale={scale:.6g}, zero_point={zero_point})",
    )
    return SameOp(produces)


class QuantizedHardswish(OutputKernel):
    """hardswish as the reference computes it: on the dequantized input, quantized to
    the output's qparams (in the input's dtype).

    Not ``torch.ops.quantized.hardswish``: it picks its implementation by the
    global quantized engine, and they disagree. fbgemm's, x86's and onednn's round
    some values one step away from the reference (8 of 1536 in
    tests/test_engine_independence.py's case), qnnpack's does not, so no engine's
    can stand in for the reference. This costs a float pass (about 10 us a call
    at 1x32x16x16 against the op's 4.5); the values are the reference's.
    """

    def forward(self, x: torch.Tensor, inplace: Any = None) -> torch.Tensor:
        return torch.quantize_per_tensor(
            F.hardswish(x.dequantize()), self.scale, self.zero_point, x.dtype
        )


def lower_hardswish(match: KernelMatch):
    one_quantized_input(match)
    return QuantizedHardswish(match.output)


class QuantizedELU(OutputKernel):
    """``torch.ops.quantized.elu``."""

    def __init__(self, output: ActivationQParams, alpha: float) -> None:
        super().__init__(output)
        self.alpha = float(alpha)

    def forward(self, x: torch.Tensor, alpha: Any = None, inplace: Any = None) -> torch.Tensor:
        # torch's int8 elu returns a contiguous tensor: the next conv would copy it back
        view, back = in_memory_order(x)
        y = _elu(view, self.scale, self.zero_point, self.alpha)
        return back_from_memory_order(y, back)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, {super().extra_repr()}"


def lower_elu(match: KernelMatch):
    one_quantized_input(match)
    if match.module is not None:
        alpha = match.module.alpha
    else:
        alpha = bound_arguments(match, F.elu)["alpha"]
    return QuantizedELU(match.output, alpha)


class QuantizedLeakyReLU(OutputKernel):
    """``torch.ops.quantized.leaky_relu``."""

    def __init__(self, output: ActivationQParams, negative_slope: float) -> None:
        super().__init__(output)
        self.negative_slope = float(negative_slope)

    def forward(
        self, x: torch.Tensor, negative_slope: Any = None, inplace: Any = None
    ) -> torch.Tensor:
        return _leaky_relu(x, self.negative_slope, False, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}, {super().extra_repr()}"


def lower_leaky_relu(match: KernelMatch):
    one_quantized_input(match)
    if match.module is not None:
        slope = match.module.negative_slope
    else:
        slope = bound_arguments(match, F.leaky_relu)["negative_slope"]
    return QuantizedLeakyReLU(match.output, slope)
