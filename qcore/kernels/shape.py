"""Pooling and shape ops.

Ops that select or move values (max pooling, flatten, reshape, transpose, ...)
run on torch's int8 tensors as they are: exact on int8, so any output qparams
the reference asks for are reached by an exact requantization.

Ops that average: torch's int8 avg pooling (1d, 2d), adaptive avg pooling (1d, 2d)
and mean pick their implementation by the global quantized engine, and under
qnnpack they round some values one step apart from the other engines' kernels.
:class:`QuantizedAverage` computes those as the reference does instead (the float
op on the dequantized input, quantized once to the output's qparams), so a
model's output does not depend on that global. The others (3d pooling,
interpolate) have one int8 implementation: they run on int8 and round once in
the input's qparams, so they are taken only where the reference's output shares
the input's qparams, as the backends' configs declare for them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from qcore.engine.kernel_check import recorded
from qcore.kernels.common import (
    OutputKernel,
    bound_arguments,
    one_quantized_input,
    require,
    same_as_input,
    same_averaging,
)
from qcore.plugin.kernels import ActivationQParams, KernelMatch, SameOp

__all__ = [
    "AVERAGING_PATTERNS",
    "SELECTING_PATTERNS",
    "QuantizedAverage",
    "lower_averaging",
    "lower_selecting",
]

aten = torch.ops.aten

SELECTING_PATTERNS = (
    torch.nn.MaxPool1d,
    torch.nn.MaxPool2d,
    torch.nn.MaxPool3d,
    F.max_pool1d,
    F.max_pool2d,
    F.max_pool3d,
    torch.nn.PixelShuffle,
    torch.nn.PixelUnshuffle,
    F.pixel_shuffle,
    F.pixel_unshuffle,
    torch.nn.ChannelShuffle,
    torch.channel_shuffle,
    torch.nn.Identity,
    torch.nn.Dropout,
    F.dropout,
    torch.flatten,
    torch.transpose,
    torch.squeeze,
    torch.unsqueeze,
    torch.narrow,
    torch.repeat_interleave,
    torch.stack,
    "flatten",
    "reshape",
    "view",
    "transpose",
    "permute",
    "contiguous",
    "squeeze",
    "unsqueeze",
    "narrow",
    "repeat",
    "repeat_interleave",
    "detach",
    # torch.export's aten ops (PT2E graphs)
    aten.max_pool1d.default,
    aten.max_pool2d.default,
    aten.max_pool3d.default,
    aten.flatten.using_ints,
    aten.reshape.default,
    aten.view.default,
    aten.permute.default,
    aten.transpose.int,
    aten.channel_shuffle.default,
    aten.contiguous.default,
    aten.squeeze.dim,
    aten.unsqueeze.default,
    aten.dropout.default,  # an eval model's: train=False (lower_selecting checks)
)

AVERAGING_PATTERNS = (
    torch.nn.AvgPool1d,
    torch.nn.AvgPool2d,
    torch.nn.AvgPool3d,
    torch.nn.AdaptiveAvgPool1d,
    torch.nn.AdaptiveAvgPool2d,
    torch.nn.AdaptiveAvgPool3d,
    F.avg_pool1d,
    F.avg_pool2d,
    F.avg_pool3d,
    F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d,
    F.interpolate,
    torch.mean,
    "mean",
    aten.avg_pool2d.default,
    aten.adaptive_avg_pool2d.default,
    aten.mean.dim,
)


_MAX_POOL1D = (torch.nn.MaxPool1d, F.max_pool1d, aten.max_pool1d.default)
_MAX_POOLS = (
    *_MAX_POOL1D,
    torch.nn.MaxPool2d,
    torch.nn.MaxPool3d,
    F.max_pool2d,
    F.max_pool3d,
    aten.max_pool2d.default,
    aten.max_pool3d.default,
)
_MAX_POOL1D_ARGUMENTS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")


class QuantizedMaxPool1d(torch.nn.Module):
    """max_pool1d on int8, its input first made contiguous where its layout is one
    torch's int8 max_pool1d reads wrong.

    A 3-d view whose batch stride is not channels * length (``flatten(2)`` of a
    channels-last batch of one: strides ``(C, 1, C)``) comes out scrambled from torch
    2.13's int8 max_pool1d on every engine but qnnpack, so the output depended on the
    global engine. Contiguous inputs and conv1d's outputs (strides ``(L*C, 1, C)``)
    are read right and are not copied. The op's arguments are the kernel's own, read
    when it was lowered; the call's are accepted and not read.
    """

    returns_quantized = True
    honors_quant_range = True  # max pooling selects values

    def __init__(self, arguments: dict[str, Any]) -> None:
        super().__init__()
        self.kernel_size = _pair(arguments.get("kernel_size", 1), 1)
        stride = arguments.get("stride")
        self.stride = self.kernel_size if stride in (None, [], ()) else _pair(stride, 1)
        self.padding = _pair(arguments.get("padding", 0), 1)
        self.dilation = _pair(arguments.get("dilation", 1), 1)
        self.ceil_mode = bool(arguments.get("ceil_mode", False))

    def forward(
        self,
        x: torch.Tensor,
        arg1: Any = None,
        arg2: Any = None,
        arg3: Any = None,
        arg4: Any = None,
        arg5: Any = None,
        arg6: Any = None,
        kernel_size: Any = None,
        stride: Any = None,
        padding: Any = None,
        dilation: Any = None,
        ceil_mode: Any = None,
        return_indices: Any = None,
    ) -> torch.Tensor:
        if x.dim() == 3 and not x.is_contiguous():
            channels, length = x.size(1), x.size(2)
            if x.stride(0) != channels * length or x.stride(1) != 1 or x.stride(2) != channels:
                x = x.contiguous()
        return F.max_pool1d(
            x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode
        )

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}"


class QuantizedDropout(torch.nn.Module):
    """An ``nn.Dropout`` in a converted model: its int8 input as is, in either mode
    (torch.ao's ``nnq.Dropout`` too), requantized where the reference's output
    qparams differ (a QAT model's, observed in training mode). Kept as the float
    module, it crashed on int8 once the model was set to training mode
    (``aten::bernoulli_`` on QuantizedCPU)."""

    returns_quantized = True

    def __init__(self, input_qparams: ActivationQParams, output: ActivationQParams) -> None:
        super().__init__()
        self.requantize = output != input_qparams
        self.scale, self.zero_point = float(output.scale), int(output.zero_point)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.requantize:
            return x
        return torch.quantize_per_tensor(x.dequantize(), self.scale, self.zero_point, x.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, zero_point={self.zero_point}" if self.requantize else ""


def lower_selecting(match: KernelMatch) -> SameOp | QuantizedMaxPool1d | QuantizedDropout:
    module = match.module
    if isinstance(module, torch.nn.Dropout):
        same = same_as_input(match)
        return QuantizedDropout(same.produces, match.output)
    if module is None and match.root.target is aten.dropout.default:
        root = match.root
        arguments = normalize_function(
            root.target, root.args, root.kwargs, normalize_to_only_use_kwargs=True
        ).kwargs
        require(arguments["train"] is False, "dropout in training mode")
    same = same_as_input(match)
    key = type(module) if module is not None else match.root.target
    if key in _MAX_POOLS:
        kernel_size = _max_pool_arguments(match, module).get("kernel_size", 2)
        sizes = list(kernel_size) if isinstance(kernel_size, (tuple, list)) else [kernel_size]
        require(
            any(size != 1 for size in sizes),
            "max pooling of size 1, which torch 2.13's qnnpack int8 max pool refuses at "
            "every call (under that engine); the reference form selects the same values",
        )
    if key not in _MAX_POOL1D or match.output != same.produces:
        return same  # (an output requantized after it: the lowering inserts that)
    arguments = _max_pool_arguments(match, module)
    require(not arguments.get("return_indices"), "max_pool1d returning indices")
    return QuantizedMaxPool1d(arguments)


def _max_pool_arguments(match: KernelMatch, module: Any) -> dict[str, Any]:
    names = (*_MAX_POOL1D_ARGUMENTS, "return_indices")
    if module is not None:
        return {name: getattr(module, name) for name in names}
    return _averaging_arguments(match, names)


# The averaging ops whose int8 kernel torch picks by the global quantized engine:
# (kind, the call's arguments after the input, in order).
_AVG_POOL = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")
_ENGINE_DEPENDENT = {
    torch.nn.AvgPool1d: ("avg_pool1d", ()),
    torch.nn.AvgPool2d: ("avg_pool2d", ()),
    torch.nn.AdaptiveAvgPool1d: ("adaptive_avg_pool1d", ()),
    torch.nn.AdaptiveAvgPool2d: ("adaptive_avg_pool2d", ()),
    F.avg_pool1d: ("avg_pool1d", _AVG_POOL),
    F.avg_pool2d: ("avg_pool2d", (*_AVG_POOL, "divisor_override")),
    aten.avg_pool2d.default: ("avg_pool2d", (*_AVG_POOL, "divisor_override")),
    F.adaptive_avg_pool1d: ("adaptive_avg_pool1d", ("output_size",)),
    F.adaptive_avg_pool2d: ("adaptive_avg_pool2d", ("output_size",)),
    aten.adaptive_avg_pool2d.default: ("adaptive_avg_pool2d", ("output_size",)),
    torch.mean: ("mean", ("dim", "keepdim")),
    "mean": ("mean", ("dim", "keepdim")),
    aten.mean.dim: ("mean", ("dim", "keepdim")),
}


def _pair(value: Any, dims: int) -> list[int]:
    values = list(value) if isinstance(value, (tuple, list)) else [value] * dims
    require(all(isinstance(v, int) for v in values), f"sizes {value!r} are not constants")
    return [int(v) for v in values]


class QuantizedAverage(OutputKernel):
    """avg pooling (1d, 2d), adaptive avg pooling (1d, 2d) and mean as the reference
    computes them: the float op on the dequantized input, quantized once to the
    output's qparams.

    Not torch's int8 ops: under the qnnpack engine torch 2.13 runs qnnpack's
    kernels for them, which round some values one step apart from the other
    engines' (and its avg_pool1d scrambles some strided inputs), so a model's output
    would depend on ``torch.backends.quantized.engine``. The float pass costs more
    than the int8 op on large inputs; these ops are rarely a model's large part
    (docs/architecture.md). The op's arguments are the kernel's own, read when it
    was lowered; the call's are accepted and not read.
    """

    def __init__(self, kind: str, output: ActivationQParams, arguments: dict[str, Any]) -> None:
        super().__init__(output)
        self.kind = kind
        self.dtype = output.dtype
        dims = 2 if kind.endswith("2d") else 1
        self.kernel_size = _pair(arguments.get("kernel_size", 1), dims)
        stride = arguments.get("stride")
        self.stride = self.kernel_size if stride in (None, [], ()) else _pair(stride, dims)
        self.padding = _pair(arguments.get("padding", 0), dims)
        self.ceil_mode = bool(arguments.get("ceil_mode", False))
        self.count_include_pad = bool(arguments.get("count_include_pad", True))
        divisor = arguments.get("divisor_override")
        require(divisor is None or isinstance(divisor, int), "divisor_override is not a constant")
        self.divisor_override = divisor
        output_size = arguments.get("output_size", 1)
        require(
            not isinstance(output_size, (tuple, list)) or None not in output_size,
            "an adaptive output size of None (the input's size)",
        )
        self.output_size = _pair(output_size, dims)
        dim = arguments.get("dim")
        self.all_dims = dim is None
        # never empty: TorchScript types an attribute by its value
        self.dim = [-1] if dim is None else _pair(dim, 1)
        self.keepdim = bool(arguments.get("keepdim", False))

    def forward(
        self,
        x: torch.Tensor,
        arg1: Any = None,
        arg2: Any = None,
        arg3: Any = None,
        arg4: Any = None,
        arg5: Any = None,
        arg6: Any = None,
        kernel_size: Any = None,
        stride: Any = None,
        padding: Any = None,
        ceil_mode: Any = None,
        count_include_pad: Any = None,
        divisor_override: Any = None,
        output_size: Any = None,
        dim: Any = None,
        keepdim: Any = None,
        dtype: Any = None,
    ) -> torch.Tensor:
        y = x.dequantize()
        if self.kind == "avg_pool2d":
            y = F.avg_pool2d(
                y, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                self.count_include_pad, self.divisor_override,
            )  # fmt: skip
        elif self.kind == "avg_pool1d":
            y = F.avg_pool1d(
                y, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                self.count_include_pad,
            )  # fmt: skip
        elif self.kind == "adaptive_avg_pool2d":
            y = F.adaptive_avg_pool2d(y, self.output_size)
        elif self.kind == "adaptive_avg_pool1d":
            y = F.adaptive_avg_pool1d(y, self.output_size)
        elif self.all_dims:
            y = torch.mean(y)
        else:
            y = torch.mean(y, self.dim, self.keepdim)
        return torch.quantize_per_tensor(y, self.scale, self.zero_point, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.kind}, {super().extra_repr()}"


def _averaging_arguments(match: KernelMatch, names: tuple[str, ...]) -> dict[str, Any]:
    """The op's arguments by name: a module's attributes, else the call's constants."""
    module = match.module
    if module is not None:
        return {
            name: getattr(module, name)
            for name in (*_AVG_POOL, "divisor_override", "output_size")
            if hasattr(module, name)
        }
    node = match.root
    require(len(node.args) <= len(names) + 1, f"unexpected arguments {node.args[1:]}")
    arguments = dict(zip(names, node.args[1:], strict=False))
    for name, value in node.kwargs.items():
        require(name in names or (name == "dtype" and value is None), f"argument {name!r}")
        arguments[name] = value
    for name, value in arguments.items():
        require(not hasattr(value, "op"), f"argument {name!r} is computed in the graph")
    return arguments


#: (rank, mode) -> torch has an int8 kernel for F.interpolate (without antialias)
_INT8_INTERPOLATION = {
    (3, "area"),
    *((rank, mode) for rank in (4, 5) for mode in ("nearest", "nearest-exact", "area")),
    (4, "bilinear"),
}


def _require_int8_interpolation(match: KernelMatch) -> None:
    """Refuse an interpolation torch has no int8 kernel for (1-d nearest, linear,
    bicubic, trilinear, antialiased): torch raises NotImplementedError at run time."""
    arguments = bound_arguments(match, F.interpolate)
    found = recorded(match.root.args[0], example_sizes=True) if match.root.args else None
    require(found is not None, "its input's rank was not recorded")
    rank, mode = len(found[0]), arguments["mode"]
    require(not arguments["antialias"], "torch has no int8 kernel for antialiased interpolation")
    require(
        (rank, mode) in _INT8_INTERPOLATION,
        f"torch has no int8 kernel for mode={mode!r} on a {rank}-d input",
    )


def lower_averaging(match: KernelMatch) -> SameOp | QuantizedAverage:
    """:class:`QuantizedAverage` for the ops whose int8 kernel depends on the global
    engine (any output qparams: it rounds once, to them); torch's int8 op for the
    others, where the output keeps the input's qparams."""
    root = match.root
    key = type(match.module) if match.module is not None else root.target
    if key is F.interpolate:
        _require_int8_interpolation(match)
    if key not in _ENGINE_DEPENDENT:
        return same_averaging(match)
    one_quantized_input(match)
    kind, names = _ENGINE_DEPENDENT[key]
    kernel = QuantizedAverage(kind, match.output, _averaging_arguments(match, names))
    # An average of values within the input's range stays within it: with the
    # output's qparams the input's (7-bit ranges included), nothing needs clamping.
    kernel.honors_quant_range = all(q == match.output for q in match.inputs)
    return kernel
