"""What ``torch.jit.script`` compiles for x86's oneDNN kernels (``qcore_x86.onednn``).

The kernels' ``__prepare_scriptable__`` hands TorchScript a :class:`ScriptedOnednnConv`
or :class:`ScriptedOnednnLinear`: the same oneDNN calls, on the same packed weight.
oneDNN's packed weights are opaque tensors that ``torch.jit.save`` cannot write, so
these modules save the integer weight and its settings (``__getstate__``) and pack
again on ``torch.jit.load`` (``__setstate__``) with ``torch.ops.onednn.*_prepack``,
which reads no global engine: the loaded model runs on oneDNN whatever
``torch.backends.quantized.engine`` says.

The onednn backend's conv-add (``quantized::conv2d_add[_relu]``) reads torch's global
engine, which TorchScript cannot set; scripted, it becomes the same fused conv + sum
on ``torch.ops.onednn.qconv2d_pointwise.binary`` (bit-identical on the example
models, tests/test_torchscript.py).

Eager forwards view int8 input as uint8 without a copy; TorchScript has no such
view, so scripted forwards copy it (``int_repr``): the same values. The input's
qparams are read from the input (the qparams the kernel was lowered with: the
lowering quantizes to them); packing does not depend on them.

No ``from __future__ import annotations`` here: TorchScript reads the class-level
attribute annotations as types, not strings.
"""

import torch

# torch's ``Scalar?[]`` (the post-op's scalars): TorchScript reads Union[int, float,
# complex] as its number type.
Scalars = list[int | float | complex | None]

__all__ = ["ScriptedOnednnConv", "ScriptedOnednnLinear"]

# weight, weight scales, bias, input (scale, zero point), int8 output?, output
# (scale, zero point, low, high), post-op (name, scalars, algorithm), residual add?,
# conv geometry (stride, padding, dilation, groups), training, the input shape the
# weight is packed for (qcore_x86.onednn._prepared_input_shape)
_State = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor | None, float, int, bool,
    float, int, int, int, str, Scalars, str, bool,
    list[int], list[int], list[int], int, bool, list[int] | None,
]  # fmt: skip


class _ScriptedOnednn(torch.nn.Module):
    bias: torch.Tensor | None
    unary_scalars: Scalars
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    packed_for_shape: list[int] | None

    def __init__(self, kernel: torch.nn.Module, packed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_int = kernel.weight_int
        self.w_scale = kernel.weight_scale.float().expand(kernel.weight_int.shape[0]).contiguous()
        self.bias = kernel.bias
        self.input_scale, self.input_zero_point = kernel._x
        self.returns_quantized: bool = kernel.returns_quantized
        self.scale: float = float(getattr(kernel, "scale", 1.0))
        self.zero_point: int = int(getattr(kernel, "zero_point", 0))
        self.quant_low, self.quant_high = getattr(kernel, "quant_range", (0, 255))
        self.unary, self.unary_algorithm = kernel.unary, kernel.unary_algorithm
        self.unary_scalars = [float(s) for s in kernel.unary_scalars]
        self.residual_add: bool = kernel.residual_add
        self.stride = list(getattr(kernel, "stride", []))
        self.padding = list(getattr(kernel, "padding", []))
        self.dilation = list(getattr(kernel, "dilation", []))
        self.groups: int = getattr(kernel, "groups", 1)
        self.packed_for_shape = getattr(kernel, "packed_for_shape", None)
        self.w_zero_point = torch.zeros(self.w_scale.shape[0], dtype=torch.int32)
        self._packed = packed if packed is not None else self._pack()

    def _pack(self) -> torch.Tensor:
        raise NotImplementedError

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        if not self.returns_quantized:
            return y
        if self.quant_low != 0 or self.quant_high != 255:
            y = y.clamp_(self.quant_low, self.quant_high)
        return torch._make_per_tensor_quantized_tensor(y, self.scale, self.zero_point)

    def _output_dtype(self) -> torch.dtype | None:
        if self.returns_quantized:
            return None
        return torch.float32

    def _output_scale(self) -> float:
        return self.scale if self.returns_quantized else 1.0

    def _output_zero_point(self) -> int:
        return self.zero_point if self.returns_quantized else 0

    @torch.jit.export
    def __getstate__(self) -> _State:
        return (
            self.weight_int, self.w_scale, self.bias, self.input_scale, self.input_zero_point,
            self.returns_quantized, self.scale, self.zero_point, self.quant_low,
            self.quant_high, self.unary, self.unary_scalars, self.unary_algorithm,
            self.residual_add, self.stride, self.padding, self.dilation, self.groups,
            self.training, self.packed_for_shape,
        )  # fmt: skip

    @torch.jit.export
    def __setstate__(self, state: _State) -> None:
        self.weight_int, self.w_scale, self.bias = state[0], state[1], state[2]
        self.input_scale, self.input_zero_point = state[3], state[4]
        self.returns_quantized, self.scale, self.zero_point = state[5], state[6], state[7]
        self.quant_low, self.quant_high = state[8], state[9]
        self.unary, self.unary_scalars, self.unary_algorithm = state[10], state[11], state[12]
        self.residual_add = state[13]
        self.stride, self.padding, self.dilation, self.groups = (
            state[14], state[15], state[16], state[17],
        )  # fmt: skip
        self.training = state[18]
        self.packed_for_shape = state[19]
        self.w_zero_point = torch.zeros(self.w_scale.shape[0], dtype=torch.int32)
        self._packed = self._pack()

    def extra_repr(self) -> str:
        residual = "residual add, " if self.residual_add else ""
        output = f"scale={self.scale}, zero_point={self.zero_point}"
        return f"{residual}post-op={self.unary}, " + (
            output if self.returns_quantized else "float output"
        )


class ScriptedOnednnConv(_ScriptedOnednn):
    """``torch.ops.onednn.qconv_pointwise`` (``qconv2d_pointwise.binary`` with a residual)."""

    def _pack(self) -> torch.Tensor:
        return torch.ops.onednn.qconv_prepack(
            self.weight_int, self.w_scale, self.input_scale, self.input_zero_point,
            self.stride, self.padding, self.dilation, self.groups, self.packed_for_shape,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        if other is None:
            y = torch.ops.onednn.qconv_pointwise(
                x.int_repr(), x.q_scale(), x.q_zero_point(), self._packed,
                self.w_scale, self.w_zero_point, self.bias, self.stride, self.padding,
                self.dilation, self.groups, self._output_scale(), self._output_zero_point(),
                self._output_dtype(), self.unary, self.unary_scalars, self.unary_algorithm,
            )  # fmt: skip
            return self._finish(y)
        # oneDNN sums into its accumulator in place: always a tensor of our own.
        if self.returns_quantized:
            accumulator = other.int_repr().contiguous(memory_format=torch.channels_last)
            accumulated_scale, accumulated_zero_point = other.q_scale(), other.q_zero_point()
        else:
            accumulator = other.dequantize() if other.is_quantized else other.clone()
            accumulator = accumulator.contiguous(memory_format=torch.channels_last)
            accumulated_scale, accumulated_zero_point = 1.0, 0
        y = torch.ops.onednn.qconv2d_pointwise(  # the .binary overload
            x.int_repr(), x.q_scale(), x.q_zero_point(), self._packed, self.w_scale,
            self.w_zero_point, accumulator, self.bias, self.stride, self.padding,
            self.dilation, self.groups, self._output_scale(), self._output_zero_point(),
            self._output_dtype(), accumulated_scale, accumulated_zero_point, "sum", 1.0,
            self.unary, self.unary_scalars, self.unary_algorithm,
        )  # fmt: skip
        return self._finish(y)


class ScriptedOnednnLinear(_ScriptedOnednn):
    """``torch.ops.onednn.qlinear_pointwise`` (``.binary`` with a residual, in float)."""

    def _pack(self) -> torch.Tensor:
        return torch.ops.onednn.qlinear_prepack(self.weight_int, None)

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        data = x.int_repr().contiguous()  # as OnednnLinear: row-major in, leading dims kept
        leading = list(x.shape[:-1])
        if other is None:
            y = torch.ops.onednn.qlinear_pointwise(
                data, x.q_scale(), x.q_zero_point(), self._packed,
                self.w_scale, self.w_zero_point, self.bias, self._output_scale(),
                self._output_zero_point(), self._output_dtype(), self.unary,
                self.unary_scalars, self.unary_algorithm,
            )  # fmt: skip
        else:
            addend = (other.dequantize() if other.is_quantized else other).contiguous()
            y = torch.ops.onednn.qlinear_pointwise(  # the .binary overload
                data, x.q_scale(), x.q_zero_point(), self._packed, self.w_scale,
                self.w_zero_point, addend, self.bias, self._output_scale(),
                self._output_zero_point(), self._output_dtype(), 1.0, 0, "add", 1.0,
                self.unary, self.unary_scalars, self.unary_algorithm,
            )  # fmt: skip
        if list(y.shape[:-1]) != leading:
            y = y.reshape(leading + [y.shape[-1]])
        return self._finish(y)
