"""What ``torch.jit.script`` compiles for the conv kernels (``qcore.kernels.weighted``).

TorchScript types packed weights by their dimensionality (``Conv2dPackedParamsBase``)
and compiles every branch of a forward, so a conv kernel's ``__prepare_scriptable__``
hands it a module of its own dimensionality, holding the same packed object.

No ``from __future__ import annotations`` here: TorchScript reads the class-level
attribute annotations as types, not strings.
"""

import torch
import torch.nn.functional as F

__all__ = [
    "SCRIPTED_CONV",
    "SCRIPTED_CONV_TRANSPOSE",
    "ScriptedConv1d",
    "ScriptedConv2d",
    "ScriptedConv3d",
    "ScriptedConvTranspose1d",
    "ScriptedConvTranspose2d",
    "ScriptedConvTranspose3d",
    "ScriptedLinearReference",
    "conv_reference",
    "conv_transpose_reference",
    "may_read_padding_only",
    "reads_padding_only",
]


def reads_padding_only(
    sizes: list[int], kernel: list[int], stride: list[int], padding: list[int], dilation: list[int]
) -> bool:
    """Whether some output of a conv over an input of ``sizes`` (its last dims are
    the spatial ones) has every tap (``o * stride - padding + j * dilation``) in the
    zero padding. Where padding <= dilation * (kernel - 1) that takes a dilation
    stepping over the whole input (size < dilation), so most calls check one
    comparison per dimension."""
    spatial = len(kernel)
    for i in range(spatial):
        size, d = sizes[len(sizes) - spatial + i], dilation[i]
        if size <= 0 or (size >= d and padding[i] <= d * (kernel[i] - 1)):
            continue
        outputs = (size + 2 * padding[i] - d * (kernel[i] - 1) - 1) // stride[i] + 1
        for o in range(max(outputs, 0)):
            reached = False
            for j in range(kernel[i]):
                tap = o * stride[i] - padding[i] + j * d
                if 0 <= tap < size:
                    reached = True
                    break
            if not reached:
                return True
    return False


def may_read_padding_only(kernel: list[int], padding: list[int], dilation: list[int]) -> bool:
    """Whether :func:`reads_padding_only` can hold on some input: spares the check
    per call of every undilated conv."""
    for i in range(len(kernel)):  # TorchScript: no zip(strict=)
        if dilation[i] > 1 or padding[i] > dilation[i] * (kernel[i] - 1):
            return True
    return False


def conv_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    relu: bool,
    scale: float,
    zero_point: int,
) -> torch.Tensor:
    """The int8 conv's values computed as its reference form does (float math on the
    dequantized input and weight, quantized at the output's qparams): for the
    geometries torch's oneDNN conv gets wrong."""
    inputs, weight = x.dequantize(), qweight.dequantize()
    if len(stride) == 1:
        y = F.conv1d(inputs, weight, bias, stride, padding, dilation, groups)
    elif len(stride) == 2:
        y = F.conv2d(inputs, weight, bias, stride, padding, dilation, groups)
    else:
        y = F.conv3d(inputs, weight, bias, stride, padding, dilation, groups)
    if relu:
        y = torch.relu(y)
    # .float(): under torch.autocast the conv gives bfloat16, which quantize refuses
    return torch.quantize_per_tensor(y.float(), scale, zero_point, x.dtype)


def conv_transpose_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    output_padding: list[int],
    dilation: list[int],
    groups: int,
    scale: float,
    zero_point: int,
) -> torch.Tensor:
    """:func:`conv_reference` for a transposed conv."""
    inputs, weight = x.dequantize(), qweight.dequantize()
    arguments = (stride, padding, output_padding, groups, dilation)
    if len(stride) == 1:
        y = F.conv_transpose1d(inputs, weight, bias, *arguments)
    elif len(stride) == 2:
        y = F.conv_transpose2d(inputs, weight, bias, *arguments)
    else:
        y = F.conv_transpose3d(inputs, weight, bias, *arguments)
    return torch.quantize_per_tensor(y.float(), scale, zero_point, x.dtype)


class ScriptedLinearReference(torch.nn.Module):
    """What ``torch.jit.script`` compiles for a linear kernel that left its backend's
    engine (``PackedWeights.left_backend_engine``): torch.jit.load would pack its
    weight for the global engine, whose kernel is wrong for this layer, so it computes
    the reference's numbers (float math on the dequantized input and weight)."""

    bias: torch.Tensor | None

    def __init__(self, kernel: torch.nn.Module) -> None:
        super().__init__()
        self.qweight, self.bias = kernel.qweight(), kernel.bias
        self.scale, self.zero_point = float(kernel.scale), int(kernel.zero_point)
        self.relu = bool(kernel.relu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.dequantize(), self.qweight.dequantize(), self.bias)
        if self.relu:
            y = torch.relu(y)
        return torch.quantize_per_tensor(y.float(), self.scale, self.zero_point, x.dtype)


# int8 weight, bias, stride, padding, output padding, dilation, groups, output scale
# and zero point, relu, training, reference only
_ConvState = tuple[
    torch.Tensor, torch.Tensor | None, list[int], list[int], list[int], list[int], int,
    float, int, bool, bool, bool,
]  # fmt: skip


class _Scripted(torch.nn.Module):
    bias: torch.Tensor | None

    """What ``torch.jit.script`` compiles for a conv kernel: its packed weights (the
    same object, packed for the kernel's engine) and output qparams.

    torch.jit.save writes the int8 weight, bias and geometry (``__getstate__``) and
    torch.jit.load packs them again (``__setstate__``; torch's own serialization of
    packed convs needs an unpack that qnnpack's conv3d lacks). torch's prepack ops
    pack for ``torch.backends.quantized.engine``: load under the kernel's engine. A
    kernel that left its backend's engine (``PackedWeights.left_backend_engine``: the
    backend's kernel is wrong for this layer) would load packed for the backend's:
    its scripted form computes the reference's numbers (``reference_only``).
    """

    def __init__(self, kernel: torch.nn.Module) -> None:
        super().__init__()
        self._packed = kernel._packed
        self.qweight = kernel.qweight()
        self.bias = kernel.bias
        self.stride, self.padding = list(kernel.stride), list(kernel.padding)
        self.output_padding = list(getattr(kernel, "output_padding", [0] * kernel.dims))
        self.dilation, self.groups = list(kernel.dilation), int(kernel.groups)
        self.scale, self.zero_point = float(kernel.scale), int(kernel.zero_point)
        self.relu = bool(getattr(kernel, "relu", False))
        self.reference_only = bool(getattr(kernel, "left_backend_engine", False))
        self.checks_padding = may_read_padding_only(
            list(self.qweight.shape[2:]), self.padding, self.dilation
        )

    @torch.jit.export
    def __getstate__(self) -> _ConvState:
        return (
            self.qweight, self.bias, self.stride, self.padding, self.output_padding,
            self.dilation, self.groups, self.scale, self.zero_point, self.relu, self.training,
            self.reference_only,
        )  # fmt: skip

    @torch.jit.export
    def __setstate__(self, state: _ConvState) -> None:
        self.qweight, self.bias = state[0], state[1]
        self.stride, self.padding, self.output_padding = state[2], state[3], state[4]
        self.dilation, self.groups = state[5], state[6]
        self.scale, self.zero_point, self.relu, self.training = (
            state[7], state[8], state[9], state[10],
        )  # fmt: skip
        self.reference_only = state[11]
        self.checks_padding = may_read_padding_only(
            list(self.qweight.shape[2:]), self.padding, self.dilation
        )
        self._packed = self._pack()

    def _computes_reference(self, x: torch.Tensor) -> bool:
        """Whether to compute the reference's numbers: the kernel left its backend's
        engine, or some output of ``x`` reads padding only."""
        if self.reference_only:
            return True
        if not self.checks_padding:
            return False
        kernel = list(self.qweight.shape[2:])
        return reads_padding_only(list(x.shape), kernel, self.stride, self.padding, self.dilation)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return conv_reference(
            x, self.qweight, self.bias, self.stride, self.padding, self.dilation, self.groups,
            self.relu, self.scale, self.zero_point,
        )  # fmt: skip

    def _transposed_reference(self, x: torch.Tensor) -> torch.Tensor:
        return conv_transpose_reference(
            x, self.qweight, self.bias, self.stride, self.padding, self.output_padding,
            self.dilation, self.groups, self.scale, self.zero_point,
        )  # fmt: skip


class ScriptedConv1d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv2dPackedParamsBase:
        return torch.ops.quantized.conv1d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._computes_reference(x):
            return self._reference(x)
        if self.relu:
            return torch.ops.quantized.conv1d_relu(x, self._packed, self.scale, self.zero_point)
        return torch.ops.quantized.conv1d(x, self._packed, self.scale, self.zero_point)


class ScriptedConv2d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv2dPackedParamsBase:
        return torch.ops.quantized.conv2d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._computes_reference(x):
            return self._reference(x)
        if self.relu:
            return torch.ops.quantized.conv2d_relu(x, self._packed, self.scale, self.zero_point)
        return torch.ops.quantized.conv2d(x, self._packed, self.scale, self.zero_point)


class ScriptedConv3d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv3dPackedParamsBase:
        return torch.ops.quantized.conv3d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._computes_reference(x):
            return self._reference(x)
        if self.relu:
            return torch.ops.quantized.conv3d_relu(x, self._packed, self.scale, self.zero_point)
        return torch.ops.quantized.conv3d(x, self._packed, self.scale, self.zero_point)


class ScriptedConvTranspose1d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv2dPackedParamsBase:
        return torch.ops.quantized.conv_transpose1d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.output_padding,
            self.dilation, self.groups,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reference_only:
            return self._transposed_reference(x)
        return torch.ops.quantized.conv_transpose1d(x, self._packed, self.scale, self.zero_point)


class ScriptedConvTranspose2d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv2dPackedParamsBase:
        return torch.ops.quantized.conv_transpose2d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.output_padding,
            self.dilation, self.groups,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reference_only:
            return self._transposed_reference(x)
        return torch.ops.quantized.conv_transpose2d(x, self._packed, self.scale, self.zero_point)


class ScriptedConvTranspose3d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv3dPackedParamsBase:
        return torch.ops.quantized.conv_transpose3d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.output_padding,
            self.dilation, self.groups,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reference_only:
            return self._transposed_reference(x)
        return torch.ops.quantized.conv_transpose3d(x, self._packed, self.scale, self.zero_point)


SCRIPTED_CONV = {1: ScriptedConv1d, 2: ScriptedConv2d, 3: ScriptedConv3d}
SCRIPTED_CONV_TRANSPOSE = {
    1: ScriptedConvTranspose1d,
    2: ScriptedConvTranspose2d,
    3: ScriptedConvTranspose3d,
}
