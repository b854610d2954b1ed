"""The chip's kernels: integer arithmetic end to end, as the silicon does it.

Each kernel takes a quint8 activation, accumulates ``(x - x_zero_point) * w`` in
the chip's 32-bit integer accumulator (emulated exactly in float64: every partial
sum of int8 products in these layers is an integer far below 2**53), adds an
int32 bias, and requantizes with one multiplier per output channel,
``x_scale * w_scale / out_scale``, fixed when the model is lowered.

qcore hands a kernel a :class:`qcore.plugin.kernels.KernelMatch`: ``match.module``
holds the layer's integer weight and its qparams, ``match.inputs`` and
``match.output`` the activation qparams at the kernel's boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IntegerConv2d", "IntegerLinear"]


class _IntegerKernel(torch.nn.Module):
    """What every kernel of the chip shares: its weight, int32 bias and requantizer."""

    returns_quantized = True  # qcore passes its output to the next kernel as it is

    def __init__(self, match, relu: bool) -> None:
        super().__init__()
        reference = match.module
        if match.output is None or len(match.inputs) != 1:
            raise ValueError("the chip's kernels take one quint8 input to a quint8 output")
        ((weight_name, weight_qparams),) = reference.weight_qparams.items()
        if weight_qparams.dtype != torch.qint8 or bool((weight_qparams.zero_point != 0).any()):
            raise ValueError(
                f"weight: the chip takes symmetric qint8 weights, got {weight_qparams.dtype} "
                f"with zero point {weight_qparams.zero_point.tolist()}"
            )
        layer = self.layer_of(reference.module)
        out_channels = layer.weight.shape[0]
        (activation,), output = match.inputs, match.output
        weight_scale = weight_qparams.scale.double().flatten().expand(out_channels)
        accumulator_scale = activation.scale * weight_scale
        multiplier = accumulator_scale / output.scale
        bias = layer.bias if layer.bias is not None else torch.zeros(out_channels)
        # What the chip stores: int8 weights, an int32 bias, one multiplier per channel.
        self.register_buffer("weight_int8", reference.integer_weight(weight_name).to(torch.int8))
        bias_int32 = torch.round(bias.detach().double() / accumulator_scale).to(torch.int32)
        self.register_buffer("bias_int32", bias_int32)
        self.register_buffer("multiplier", multiplier.float())
        self.input_zero_point = activation.zero_point
        self.scale, self.zero_point = output.scale, output.zero_point
        # relu is free in the requantizer: clamp at the output's zero point.
        self.quant_min = output.zero_point if relu else 0

    @staticmethod
    def layer_of(module: torch.nn.Module) -> torch.nn.Module:
        return module[0] if isinstance(module, torch.nn.Sequential) else module

    def accumulate(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x.int_repr().double() - self.input_zero_point
        accumulator = self.accumulate(centred, self.weight_int8.double())
        per_channel = (1, -1) + (1,) * (accumulator.dim() - 2)
        biased = accumulator + self.bias_int32.view(per_channel)
        requantized = torch.round(biased * self.multiplier.double().view(per_channel))
        q = (requantized + self.zero_point).clamp(self.quant_min, 255).to(torch.uint8)
        return torch._make_per_tensor_quantized_tensor(q, self.scale, self.zero_point)


class IntegerLinear(_IntegerKernel):
    """``nn.Linear`` on the chip."""

    def accumulate(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        accumulator = F.linear(x, weight)
        # Keep the channel axis second, as the requantizer expects.
        return accumulator.reshape(-1, accumulator.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @classmethod
    def lower(cls, match) -> IntegerLinear:
        return cls(match, relu=False)


class IntegerConv2d(_IntegerKernel):
    """Fused conv2d-relu (``ConvReLU2d``) on the chip."""

    def __init__(self, match, relu: bool) -> None:
        super().__init__(match, relu)
        conv = self.layer_of(match.module.module)
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(
                f"padding: the chip pads with explicit zeros, got padding={conv.padding!r}, "
                f"padding_mode={conv.padding_mode!r}"
            )
        # Zero padding of the centred input is padding with the input's zero point.
        self.stride, self.padding = conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups

    def accumulate(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, weight, None, self.stride, self.padding, self.dilation, self.groups)

    @classmethod
    def lower(cls, match) -> IntegerConv2d:
        return cls(match, relu=True)
