"""Kernels for activations: relu-like ops on int8 as they are, fixed-qparams
ops (sigmoid, tanh, hardsigmoid), and hardswish, elu and leaky relu, which
requantize to their output's qparams inside torch's kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qcore.kernels.common import (
    OutputKernel,
    bound_arguments,
    one_quantized_input,
    require,
    same_as_input,
)
from qcore.plugin.kernels import ActivationQParams, KernelMatch, SameOp

__all__ = [
    "QuantizedELU",
    "QuantizedHardswish",
    "QuantizedLeakyReLU",
    "lower_clamp_like",
    "lower_fixed_qparams",
]


def lower_clamp_like(match: KernelMatch) -> SameOp:
    """relu, relu6, hardtanh, clamp: torch clamps the int8 values with the
    bounds quantized in the input's qparams, exactly what the reference computes."""
    one_quantized_input(match)
    return same_as_input(match)


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
    """``torch.ops.quantized.hardswish``."""

    def forward(self, x: torch.Tensor, *constants, **named_constants) -> torch.Tensor:
        return torch.ops.quantized.hardswish(x, self.scale, self.zero_point)


def lower_hardswish(match: KernelMatch):
    one_quantized_input(match)
    return QuantizedHardswish(match.output)


class QuantizedELU(OutputKernel):
    """``torch.ops.quantized.elu``."""

    def __init__(self, output: ActivationQParams, alpha: float) -> None:
        super().__init__(output)
        self.alpha = float(alpha)

    def forward(self, x: torch.Tensor, *constants, **named_constants) -> torch.Tensor:
        return torch.ops.quantized.elu(x, self.scale, self.zero_point, self.alpha)

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

    def forward(self, x: torch.Tensor, *constants, **named_constants) -> torch.Tensor:
        return torch.ops.quantized.leaky_relu(
            x, self.negative_slope, False, self.scale, self.zero_point
        )

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}, {super().extra_repr()}"


def lower_leaky_relu(match: KernelMatch):
    one_quantized_input(match)
    if match.module is not None:
        slope = match.module.negative_slope
    else:
        slope = bound_arguments(match, F.leaky_relu)["negative_slope"]
    return QuantizedLeakyReLU(match.output, slope)
