"""What ``torch.jit.script`` compiles for the conv kernels (``qcore.kernels.weighted``).

TorchScript types packed weights by their dimensionality (``Conv2dPackedParamsBase``)
and compiles every branch of a forward, so a conv kernel's ``__prepare_scriptable__``
hands it a module of its own dimensionality, holding the same packed object.

No ``from __future__ import annotations`` here: TorchScript reads the class-level
attribute annotations as types, not strings.
"""

import torch

__all__ = [
    "SCRIPTED_CONV",
    "SCRIPTED_CONV_TRANSPOSE",
    "ScriptedConv1d",
    "ScriptedConv2d",
    "ScriptedConv3d",
    "ScriptedConvTranspose1d",
    "ScriptedConvTranspose2d",
    "ScriptedConvTranspose3d",
]

# int8 weight, bias, stride, padding, output padding, dilation, groups, output scale
# and zero point, relu, training
_ConvState = tuple[
    torch.Tensor, torch.Tensor | None, list[int], list[int], list[int], list[int], int,
    float, int, bool, bool,
]  # fmt: skip


class _Scripted(torch.nn.Module):
    bias: torch.Tensor | None

    """What ``torch.jit.script`` compiles for a conv kernel: its packed weights (the
    same object, packed for the kernel's engine) and output qparams.

    torch.jit.save writes the int8 weight, bias and geometry (``__getstate__``) and
    torch.jit.load packs them again (``__setstate__``; torch's own serialization of
    packed convs needs an unpack that qnnpack's conv3d lacks). torch's prepack ops
    pack for ``torch.backends.quantized.engine``: load under the kernel's engine.
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

    @torch.jit.export
    def __getstate__(self) -> _ConvState:
        return (
            self.qweight, self.bias, self.stride, self.padding, self.output_padding,
            self.dilation, self.groups, self.scale, self.zero_point, self.relu, self.training,
        )  # fmt: skip

    @torch.jit.export
    def __setstate__(self, state: _ConvState) -> None:
        self.qweight, self.bias = state[0], state[1]
        self.stride, self.padding, self.output_padding = state[2], state[3], state[4]
        self.dilation, self.groups = state[5], state[6]
        self.scale, self.zero_point, self.relu, self.training = (
            state[7], state[8], state[9], state[10],
        )  # fmt: skip
        self._packed = self._pack()


class ScriptedConv1d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv2dPackedParamsBase:
        return torch.ops.quantized.conv1d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.relu:
            return torch.ops.quantized.conv1d_relu(x, self._packed, self.scale, self.zero_point)
        return torch.ops.quantized.conv1d(x, self._packed, self.scale, self.zero_point)


class ScriptedConv2d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv2dPackedParamsBase:
        return torch.ops.quantized.conv2d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.relu:
            return torch.ops.quantized.conv2d_relu(x, self._packed, self.scale, self.zero_point)
        return torch.ops.quantized.conv2d(x, self._packed, self.scale, self.zero_point)


class ScriptedConv3d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv3dPackedParamsBase:
        return torch.ops.quantized.conv3d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        return torch.ops.quantized.conv_transpose1d(x, self._packed, self.scale, self.zero_point)


class ScriptedConvTranspose2d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv2dPackedParamsBase:
        return torch.ops.quantized.conv_transpose2d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.output_padding,
            self.dilation, self.groups,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.conv_transpose2d(x, self._packed, self.scale, self.zero_point)


class ScriptedConvTranspose3d(_Scripted):
    def _pack(self) -> torch.classes.quantized.Conv3dPackedParamsBase:
        return torch.ops.quantized.conv_transpose3d_prepack(
            self.qweight, self.bias, self.stride, self.padding, self.output_padding,
            self.dilation, self.groups,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.conv_transpose3d(x, self._packed, self.scale, self.zero_point)


SCRIPTED_CONV = {1: ScriptedConv1d, 2: ScriptedConv2d, 3: ScriptedConv3d}
SCRIPTED_CONV_TRANSPOSE = {
    1: ScriptedConvTranspose1d,
    2: ScriptedConvTranspose2d,
    3: ScriptedConvTranspose3d,
}
