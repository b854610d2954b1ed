"""Kernels for linear and convolution (with fused relu) on torch's int8 ops.

Each lowered module holds its weights packed for one engine (fbgemm, qnnpack,
x86/onednn) and takes and returns torch quantized tensors, so consecutive
kernels pass int8 data without a dequantize/quantize round trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni

from qcore.engine.reference import ReferenceModule, weighted_child
from qcore.kernels.runtime import packing_engine, to_torch_qtensor
from qcore.plugin.kernels import Kernel

__all__ = ["ActivationQParams", "QuantizedConv", "QuantizedLinear", "weighted_kernels"]


@dataclass(frozen=True)
class ActivationQParams:
    """Per-tensor qparams of an activation at a kernel's boundary."""

    scale: float
    zero_point: int
    dtype: torch.dtype


def _packed_weight(reference: ReferenceModule) -> tuple[torch.Tensor, torch.Tensor | None]:
    (name,) = reference.weight_qparams
    weight = to_torch_qtensor(reference.integer_weight(name), reference.weight_qparams[name])
    bias = weighted_child(reference.module).bias
    return weight, None if bias is None else bias.detach().float()


class QuantizedLinear(torch.nn.Module):
    """int8 linear (optionally fused with relu) on ``engine``'s packed weights."""

    def __init__(
        self, reference: ReferenceModule, output: ActivationQParams, relu: bool, engine: str
    ):
        super().__init__()
        weight, bias = _packed_weight(reference)
        with packing_engine(engine):
            self._packed = torch.ops.quantized.linear_prepack(weight, bias)
        self.engine, self.relu = engine, relu
        self.scale, self.zero_point = output.scale, output.zero_point
        child = weighted_child(reference.module)
        self.in_features, self.out_features = child.in_features, child.out_features
        self._op = torch.ops.quantized.linear_relu if relu else torch.ops.quantized.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self._packed, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"relu={self.relu}, engine={self.engine}, scale={self.scale}, "
            f"zero_point={self.zero_point}"
        )


_CONV_OPS = {
    1: (
        torch.ops.quantized.conv1d_prepack,
        torch.ops.quantized.conv1d,
        torch.ops.quantized.conv1d_relu,
    ),
    2: (
        torch.ops.quantized.conv2d_prepack,
        torch.ops.quantized.conv2d,
        torch.ops.quantized.conv2d_relu,
    ),
    3: (
        torch.ops.quantized.conv3d_prepack,
        torch.ops.quantized.conv3d,
        torch.ops.quantized.conv3d_relu,
    ),
}


class QuantizedConv(torch.nn.Module):
    """int8 conv1d/2d/3d (optionally fused with relu) on ``engine``'s packed weights."""

    def __init__(
        self, reference: ReferenceModule, output: ActivationQParams, relu: bool, engine: str
    ):
        super().__init__()
        conv = weighted_child(reference.module)
        if conv.padding_mode != "zeros":
            raise ValueError(f"padding_mode {conv.padding_mode!r}: the int8 kernel pads with zeros")
        dims = len(conv.kernel_size)
        prepack, op, op_relu = _CONV_OPS[dims]
        weight, bias = _packed_weight(reference)
        with packing_engine(engine):
            self._packed = prepack(
                weight,
                bias,
                list(conv.stride),
                list(conv.padding),
                list(conv.dilation),
                conv.groups,
            )
        self.engine, self.relu = engine, relu
        self.scale, self.zero_point = output.scale, output.zero_point
        self.description = (
            f"{conv.in_channels}, {conv.out_channels}, kernel_size={conv.kernel_size}"
        )
        self._op = op_relu if relu else op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self._packed, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return (
            f"{self.description}, relu={self.relu}, engine={self.engine}, "
            f"scale={self.scale}, zero_point={self.zero_point}"
        )


def _lowering(module_class: type, relu: bool, engine: str) -> Any:
    def lower(reference: ReferenceModule, inputs: ActivationQParams, output: ActivationQParams):
        return module_class(reference, output, relu, engine)

    return lower


_FAMILIES = [
    ("linear", torch.nn.Linear, QuantizedLinear, False),
    ("linear_relu", nni.LinearReLU, QuantizedLinear, True),
    ("conv1d", torch.nn.Conv1d, QuantizedConv, False),
    ("conv1d_relu", nni.ConvReLU1d, QuantizedConv, True),
    ("conv2d", torch.nn.Conv2d, QuantizedConv, False),
    ("conv2d_relu", nni.ConvReLU2d, QuantizedConv, True),
    ("conv3d", torch.nn.Conv3d, QuantizedConv, False),
    ("conv3d_relu", nni.ConvReLU3d, QuantizedConv, True),
]


def weighted_kernels(engine: str) -> list[Kernel]:
    """Linear and conv kernels (with relu) packed for ``engine``.

    Example (a plugin's hook)::

        @hookimpl
        def qcore_backend_kernels(backend):
            return weighted_kernels("fbgemm")
    """
    return [
        Kernel(
            name=f"{engine}.{name}",
            pattern=pattern,
            engine=engine,
            lower=_lowering(cls, relu, engine),
        )
        for name, pattern, cls, relu in _FAMILIES
    ]
