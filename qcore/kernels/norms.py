"""Kernels for normalization: batch norm (2d/3d, with relu), layer norm,
group norm and instance norm, on ``torch.ops.quantized``.

The float affine parameters and statistics are kept as buffers, so they are in
the state_dict like any module's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from qcore.kernels.common import OutputKernel, bound_arguments, one_quantized_input, require
from qcore.plugin.kernels import ActivationQParams, KernelMatch

__all__ = [
    "QuantizedBatchNorm",
    "QuantizedGroupNorm",
    "QuantizedInstanceNorm",
    "QuantizedLayerNorm",
]

# torch's ops, bound once: a lookup through torch.ops costs about as much as the
# Python around a kernel call. TorchScript compiles them as the ops themselves.
_batch_norm2d_relu = torch.ops.quantized.batch_norm2d_relu
_batch_norm2d = torch.ops.quantized.batch_norm2d
_batch_norm3d_relu = torch.ops.quantized.batch_norm3d_relu
_batch_norm3d = torch.ops.quantized.batch_norm3d
_layer_norm = torch.ops.quantized.layer_norm
_group_norm = torch.ops.quantized.group_norm
_instance_norm = torch.ops.quantized.instance_norm


def _buffer(value: Any) -> torch.Tensor | None:
    return None if value is None else value.detach().float().clone()


class _NormKernel(OutputKernel):
    def __init__(self, output: ActivationQParams, weight: Any, bias: Any, eps: float) -> None:
        super().__init__(output)
        self.register_buffer("weight", _buffer(weight))
        self.register_buffer("bias", _buffer(bias))
        self.eps = float(eps)


class QuantizedBatchNorm(_NormKernel):
    """``torch.ops.quantized.batch_norm{2,3}d[_relu]`` with the module's running statistics."""

    def __init__(self, bn: torch.nn.Module, output: ActivationQParams, dims: int, relu: bool):
        require(bn.track_running_stats, "batch norm without running statistics")
        super().__init__(output, bn.weight, bn.bias, bn.eps)
        self.register_buffer("running_mean", _buffer(bn.running_mean))
        self.register_buffer("running_var", _buffer(bn.running_var))
        self.dims, self.relu = dims, relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, mean, var = self.weight, self.bias, self.running_mean, self.running_var
        eps, scale, zero_point = self.eps, self.scale, self.zero_point
        if self.dims == 2:
            if self.relu:
                return _batch_norm2d_relu(x, weight, bias, mean, var, eps, scale, zero_point)
            return _batch_norm2d(x, weight, bias, mean, var, eps, scale, zero_point)
        if self.relu:
            return _batch_norm3d_relu(x, weight, bias, mean, var, eps, scale, zero_point)
        return _batch_norm3d(x, weight, bias, mean, var, eps, scale, zero_point)


def lower_batch_norm(match: KernelMatch, dims: int):
    """BatchNorm2d/3d, or torch.ao's fused BNReLU2d/3d (a Sequential of bn, relu),
    or a bn module followed by a relu."""
    one_quantized_input(match)
    module = match.module
    relu = isinstance(module, torch.nn.Sequential) or len(match.nodes) > 1
    bn = module[0] if isinstance(module, torch.nn.Sequential) else module
    return QuantizedBatchNorm(bn, match.output, dims, relu)


class QuantizedLayerNorm(_NormKernel):
    """``torch.ops.quantized.layer_norm``."""

    def __init__(self, output, normalized_shape, weight, bias, eps) -> None:
        super().__init__(output, weight, bias, eps)
        self.normalized_shape = list(normalized_shape)

    # F.layer_norm's other arguments are the kernel's own: accepted, not read.
    def forward(
        self,
        x: torch.Tensor,
        normalized_shape: Any = None,
        weight: Any = None,
        bias: Any = None,
        eps: Any = None,
    ) -> torch.Tensor:
        return _layer_norm(
            x, self.normalized_shape, self.weight, self.bias, self.eps, self.scale, self.zero_point
        )


def lower_layer_norm(match: KernelMatch):
    one_quantized_input(match)
    if match.module is not None:
        m = match.module
        return QuantizedLayerNorm(match.output, m.normalized_shape, m.weight, m.bias, m.eps)
    args = bound_arguments(match, F.layer_norm)
    require(match.float_inputs == 0, "weight/bias are computed in the graph")
    return QuantizedLayerNorm(
        match.output, args["normalized_shape"], args["weight"], args["bias"], args["eps"]
    )


class QuantizedGroupNorm(_NormKernel):
    """``torch.ops.quantized.group_norm``."""

    def __init__(self, output, num_groups, weight, bias, eps) -> None:
        super().__init__(output, weight, bias, eps)
        self.num_groups = int(num_groups)

    # F.group_norm's other arguments are the kernel's own: accepted, not read.
    def forward(
        self,
        x: torch.Tensor,
        num_groups: Any = None,
        weight: Any = None,
        bias: Any = None,
        eps: Any = None,
    ) -> torch.Tensor:
        return _group_norm(
            x, self.num_groups, self.weight, self.bias, self.eps, self.scale, self.zero_point
        )


def lower_group_norm(match: KernelMatch):
    one_quantized_input(match)
    if match.module is not None:
        m = match.module
        return QuantizedGroupNorm(match.output, m.num_groups, m.weight, m.bias, m.eps)
    args = bound_arguments(match, F.group_norm)
    return QuantizedGroupNorm(
        match.output, args["num_groups"], args["weight"], args["bias"], args["eps"]
    )


class QuantizedInstanceNorm(_NormKernel):
    """``torch.ops.quantized.instance_norm`` (unit weight and zero bias when not affine)."""

    # F.instance_norm's other arguments are the kernel's own: accepted, not read.
    def forward(
        self,
        x: torch.Tensor,
        running_mean: Any = None,
        running_var: Any = None,
        weight: Any = None,
        bias: Any = None,
        use_input_stats: Any = None,
        momentum: Any = None,
        eps: Any = None,
    ) -> torch.Tensor:
        channels = x.shape[1]
        gamma = self.weight if self.weight is not None else torch.ones(channels)
        beta = self.bias if self.bias is not None else torch.zeros(channels)
        values_per_instance = 1
        for size in x.shape[2:]:
            values_per_instance *= size
        if values_per_instance <= 2:
            # torch 2.13's int8 instance norm is 90-255 steps off over two values (on
            # every engine, as torch.ao's model): compute as the reference does
            y = F.instance_norm(x.dequantize(), weight=gamma, bias=beta, eps=self.eps)
            return torch.quantize_per_tensor(y, self.scale, self.zero_point, x.dtype)
        return _instance_norm(x, gamma, beta, self.eps, self.scale, self.zero_point)


def lower_instance_norm(match: KernelMatch):
    one_quantized_input(match)
    if match.module is not None:
        m = match.module
        require(
            not m.track_running_stats,
            "instance norm with running statistics (torch's int8 kernel normalizes per instance)",
        )
        return QuantizedInstanceNorm(match.output, m.weight, m.bias, m.eps)
    args = bound_arguments(match, F.instance_norm)
    require(
        args["running_mean"] is None and args["running_var"] is None and args["use_input_stats"],
        "instance norm with running statistics",
    )
    return QuantizedInstanceNorm(match.output, args["weight"], args["bias"], args["eps"])
