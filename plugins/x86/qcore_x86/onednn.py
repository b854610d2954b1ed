"""x86's fused kernels on oneDNN (``torch.ops.onednn.*``).

oneDNN runs an int8 conv or linear together with what follows it: an
activation (relu, hardtanh, hardswish, silu; for linear also leaky_relu, tanh,
gelu), a residual add with an optional relu, and an int8 or a float output.
PT2E's x86 recipe (``qcore_x86.quantizer``) leaves exactly those intermediate
values unquantized, so ``conv -> add -> relu`` is one oneDNN call here where
torch's ``quantized`` ops need three, or leave it in float.

These kernels take the shapes torch's ``quantized`` ops cannot: post-ops other
than relu, a residual add, a float output, a 7-bit output range. They come after
the kernel library (``qcore.kernels``) in the backend's list: a plain or relu
conv/linear with a full-range int8 output runs there as fast, without converting
its tensors.

The ``onednn`` backend (FX, torch.ao's onednn config) fuses ``conv -> add [-> relu]``
at prepare into ``ConvAdd2d``/``ConvAddReLU2d``; :class:`OnednnPackedConvAdd` runs
those as one oneDNN conv with a sum (``qconv2d_pointwise.binary``). torch.ao's onednn
backend calls ``quantized::conv2d_add[_relu]`` instead, which refuses to run unless
the global quantized engine is onednn; these ops read no global.

Why 7 bits: without VNNI, oneDNN (like fbgemm, and torch's ``quantized`` ops on
either) sums pairs of u8*s8 products in 16 bits, which saturate once activations
use the 8th bit. ``X86Quantizer`` quantizes activations to 7 bits on such CPUs
(as torch.ao's x86 qconfig does with ``reduce_range``) and warns when told not to.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
from torch import nn

from qcore.engine.kernel_check import dynamic_dims, recorded
from qcore.engine.reference import ReferenceModule, weighted_child
from qcore.kernels.packed import PackedWeights
from qcore.kernels.runtime import int8_products_saturate
from qcore.kernels.scripted import may_read_padding_only
from qcore.kernels.weighted import (
    QuantizedConv,
    conv_geometry,
    mark_probed,
    onednn_conv_trouble,
    onednn_kernel_wrong_here,
)
from qcore.plugin.kernels import ActivationQParams, Kernel, KernelMatch
from qcore.pt2e.fused import WeightedWithPostOps

__all__ = [
    "OnednnConv",
    "OnednnLinear",
    "OnednnPackedConvAdd",
    "cpu_has_vnni",
    "onednn_engine_conv_add_kernels",
    "onednn_kernels",
]

ENGINE = "x86"


def cpu_has_vnni() -> bool:
    """Whether this CPU multiplies u8*s8 without 16-bit saturation (VNNI or AMX)."""
    return not int8_products_saturate()


def _unary(activation: nn.Module | None, linear: bool) -> tuple[str, list, str]:
    """(oneDNN's post-op name, its scalars, its algorithm) for ``activation``."""
    if activation is None:
        return "none", [], ""
    if isinstance(activation, nn.ReLU):
        return "relu", [], ""
    if isinstance(activation, nn.Hardtanh):
        return "hardtanh", [float(activation.min_val), float(activation.max_val)], ""
    if isinstance(activation, nn.Hardswish):
        return "hardswish", [], ""
    if isinstance(activation, nn.SiLU):
        return "swish", [], ""
    if linear and isinstance(activation, nn.LeakyReLU):
        return "leaky_relu", [float(activation.negative_slope)], ""
    if linear and isinstance(activation, nn.Tanh):
        return "tanh", [], ""
    if linear and isinstance(activation, nn.GELU):
        return "gelu", [], activation.approximate
    kind = "linear" if linear else "conv"
    raise ValueError(f"oneDNN fuses no {type(activation).__name__} after a {kind}")


_RELU_FUSED = (nni.ConvReLU1d, nni.ConvReLU2d, nni.ConvReLU3d, nni.LinearReLU, nni.ConvAddReLU2d)


def _post_ops(fused: nn.Module) -> tuple[bool, nn.Module | None]:
    """(residual add?, the activation) of a fused module: PT2E's WeightedWithPostOps
    or torch.ao's intrinsic classes (FX, e.g. the onednn config's ConvAddReLU2d)."""
    if isinstance(fused, WeightedWithPostOps):
        return fused.residual_add, fused.activation
    residual = isinstance(fused, (nni.ConvAdd2d, nni.ConvAddReLU2d))
    if isinstance(fused, _RELU_FUSED):
        return residual, nn.ReLU()
    if isinstance(fused, (nni.LinearLeakyReLU, nni.LinearTanh)):
        return False, fused[1]
    return residual, None


def _as_uint8(x: torch.Tensor) -> torch.Tensor:
    """The uint8 data of a torch quint8 tensor, without a copy."""
    return torch.empty(0, dtype=torch.uint8).set_(
        x.untyped_storage(), x.storage_offset(), x.size(), x.stride()
    )


def _prepared_input_shape(match: KernelMatch, conv: nn.Module) -> list[int] | None:
    """The shape the conv's input had when the model was prepared, or None.

    Packed without an input shape, oneDNN lays some weights out for a made-up one and
    reorders them at every call (a third of a small conv-add's time); packed for the
    shape the model runs at, it doesn't. Another shape at run time gives the same
    values (the weight is reordered then). The shape is the one recorded for the
    conv's input (``qcore.engine.kernel_check.recorded``)."""
    found = recorded(match.root.args[0]) if match.root.args else None
    if found is None:
        return None
    shape = found[0]
    fits = len(shape) == len(conv.kernel_size) + 2 and shape[1] == conv.in_channels
    return list(shape) if fits else None


def _recorded_input_shape(match: KernelMatch) -> list[int] | None:
    found = recorded(match.root.args[0] if match.root.args else None, example_sizes=True)
    return found[0] if found else None


def _conv_trouble(match: KernelMatch, conv: nn.Module, sizes_vary: bool) -> str | None:
    """:func:`onednn_conv_trouble` on the conv's input as prepare recorded it. Where
    the input's spatial size may vary (``sizes_vary``: FX, or a dynamic size in an
    exported graph), a dilated or over-padded conv may read padding only at some
    size, and these kernels cannot check each call as QuantizedConv does."""
    trouble = onednn_conv_trouble(conv, _recorded_input_shape(match), match.inputs[0])
    _, padding, dilation, _ = conv_geometry(conv)
    if (
        trouble is None
        and sizes_vary
        and may_read_padding_only(list(conv.kernel_size), list(padding), list(dilation))
    ):
        trouble = (
            "a dilated conv on an input of dynamic spatial size (any, in an FX model): at "
            "some sizes its outputs read zero padding only, which oneDNN's int8 conv leaves "
            "as garbage"
        )
    return trouble


def _dynamic_spatial_size(match: KernelMatch, conv: nn.Module) -> bool:
    x = match.root.args[0] if match.root.args else None
    return bool(dynamic_dims(x) & set(range(2, 2 + len(conv.kernel_size))))


def _set_weight_qparams(kernel: PackedWeights) -> None:
    """The per-output-channel weight scales and zero points oneDNN's calls take."""
    channels = kernel.weight_int.shape[0]
    kernel._w_scale = kernel.weight_scale.float().expand(channels).contiguous()
    kernel._w_zero_point = torch.zeros(channels, dtype=torch.int32)


def _prepack_conv(kernel: PackedWeights) -> torch.Tensor:
    """A conv kernel's weight packed by oneDNN, for the input shape it was prepared with."""
    return torch.ops.onednn.qconv_prepack(
        kernel.weight_int, kernel._w_scale, *kernel._x, kernel.stride, kernel.padding,
        kernel.dilation, kernel.groups, getattr(kernel, "packed_for_shape", None),
    )  # fmt: skip


class _OnednnWeighted(PackedWeights):
    """What the conv and linear kernels share: qparams at both ends, the post-ops."""

    honors_quant_range = True
    packs_for_global_engine = False  # torch.ops.onednn's prepack takes no engine
    sums_uint8_products = True

    def __init__(self, match: KernelMatch, linear: bool) -> None:
        super().__init__(ENGINE)
        reference = match.module
        fused = reference.module
        self.residual_add, activation = _post_ops(fused)
        self.unary, self.unary_scalars, self.unary_algorithm = _unary(activation, linear)
        x = match.inputs[0]
        self.register_buffer("input_scale", torch.tensor(x.scale, dtype=torch.float64))
        self.register_buffer("input_zero_point", torch.tensor(x.zero_point))
        self.returns_quantized = match.output is not None
        if match.output is not None:
            self.scale, self.zero_point = match.output.scale, match.output.zero_point
            self.quant_range = match.output.quant_range or (0, 255)
        self.set_weight_from(reference)
        if not self.weight_zero_point.eq(0).all():
            raise ValueError("oneDNN takes symmetric weights (zero point 0)")
        self.description = ""

    def repack(self) -> None:
        self._x = (float(self.input_scale), int(self.input_zero_point))
        _set_weight_qparams(self)
        super().repack()

    def _output_args(self) -> tuple:
        if self.returns_quantized:
            return self.scale, self.zero_point, None
        return 1.0, 0, torch.float32

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        if not self.returns_quantized:
            return y
        if self.quant_range != (0, 255):
            y = y.clamp_(*self.quant_range)
        return torch._make_per_tensor_quantized_tensor(y, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        output = (
            f"scale={self.scale}, zero_point={self.zero_point}"
            if self.returns_quantized
            else "float output"  # no output qparams: there is no scale to print
        )
        residual = "residual add, " if self.residual_add else ""
        return f"{self.description}, {residual}post-op={self.unary}, {output}"

    def __prepare_scriptable__(self) -> torch.nn.Module:
        """The same oneDNN calls on the same packed weight, saved and loaded by TorchScript
        (``qcore_x86.onednn_scripted``)."""
        from qcore_x86 import onednn_scripted

        kind = "Linear" if isinstance(self, OnednnLinear) else "Conv"
        return getattr(onednn_scripted, f"ScriptedOnednn{kind}")(self, self._packed)


# What torch 2.13's qconv_pointwise accepts after a conv of each dimensionality.
_CONV_POST_OPS = {
    1: ("none", "relu"),
    2: ("none", "relu", "hardtanh", "hardswish", "swish"),
    3: ("none",),
}


class OnednnConv(_OnednnWeighted):
    """int8 conv1d/2d/3d with oneDNN post-ops (``_CONV_POST_OPS``); conv2d also with
    a residual add (sum)."""

    def __init__(self, match: KernelMatch) -> None:
        super().__init__(match, linear=False)
        conv = weighted_child(match.module.module)
        self.dims = len(conv.kernel_size)
        self.stride, self.padding, self.dilation, self.groups = conv_geometry(conv)
        self.packed_for_shape = _prepared_input_shape(match, conv)
        self.description = (
            f"{conv.in_channels}, {conv.out_channels}, kernel_size={conv.kernel_size}"
        )
        trouble = _conv_trouble(match, conv, sizes_vary=_dynamic_spatial_size(match, conv))
        if trouble is not None:
            raise ValueError(trouble)
        if self.residual_add and self.dims != 2:
            raise ValueError("oneDNN fuses a residual add into conv2d only")
        if self.unary not in _CONV_POST_OPS[self.dims]:
            raise ValueError(f"oneDNN fuses no {self.unary} into a conv{self.dims}d")
        if self.residual_add and self.returns_quantized and len(match.inputs) != 2:
            raise ValueError(
                "an int8 output needs an int8 residual (oneDNN sums in the output's dtype)"
            )
        # What the CPU loading the model asks again (PackedWeights.check_on_load).
        mark_probed(self, _recorded_input_shape(match), match.inputs[0])
        self.repack()

    pack = _prepack_conv

    def wrong_on_this_cpu(self) -> str | None:
        return super().wrong_on_this_cpu() or onednn_kernel_wrong_here(self)

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        weight = (self._packed, self._w_scale, self._w_zero_point, self.bias)
        geometry = (self.stride, self.padding, self.dilation, self.groups)
        if other is None:
            y = torch.ops.onednn.qconv_pointwise(
                _as_uint8(x), *self._x, *weight, *geometry, *self._output_args(),
                self.unary, self.unary_scalars, self.unary_algorithm,
            )  # fmt: skip
            return self._finish(y)
        # oneDNN sums into its accumulator in place: always a tensor of our own.
        if self.returns_quantized:
            accumulator = other.int_repr().contiguous(memory_format=torch.channels_last)
            accumulated = (other.q_scale(), other.q_zero_point())
        else:
            accumulator = other.dequantize() if other.is_quantized else other.clone()
            accumulator = accumulator.contiguous(memory_format=torch.channels_last)
            accumulated = (1.0, 0)
        y = torch.ops.onednn.qconv2d_pointwise.binary(
            _as_uint8(x), *self._x, self._packed, self._w_scale, self._w_zero_point,
            accumulator, self.bias, *geometry, *self._output_args(), *accumulated,
            "sum", 1.0, self.unary, self.unary_scalars, self.unary_algorithm,
        )  # fmt: skip
        return self._finish(y)


class OnednnLinear(_OnednnWeighted):
    """int8 linear with oneDNN post-ops, or with a residual add (in float)."""

    def __init__(self, match: KernelMatch) -> None:
        super().__init__(match, linear=True)
        linear = weighted_child(match.module.module)
        self.description = f"in_features={linear.in_features}, out_features={linear.out_features}"
        self.repack()

    def pack(self):
        return torch.ops.onednn.qlinear_prepack(self.weight_int, None)

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        weight = (self._packed, self._w_scale, self._w_zero_point, self.bias)
        # oneDNN's linear reads its input and addend as row-major matrices, whatever
        # their strides (a transposed or sliced view gave another tensor's values), and
        # flattens an empty input's leading dimensions into one
        x = x.contiguous()
        leading = list(x.shape[:-1])
        if other is None:
            y = torch.ops.onednn.qlinear_pointwise(
                _as_uint8(x), *self._x, *weight, *self._output_args(),
                self.unary, self.unary_scalars, self.unary_algorithm,
            )  # fmt: skip
        else:
            addend = (other.dequantize() if other.is_quantized else other).contiguous()
            y = torch.ops.onednn.qlinear_pointwise.binary(
                _as_uint8(x), *self._x, *weight[:3], addend, self.bias, *self._output_args(),
                1.0, 0, "add", 1.0, self.unary, self.unary_scalars, self.unary_algorithm,
            )  # fmt: skip
        if list(y.shape[:-1]) != leading:
            y = y.reshape(leading + [y.shape[-1]])
        return self._finish(y)


class OnednnPackedConvAdd(QuantizedConv):
    """torch.ao's onednn ``ConvAdd2d``/``ConvAddReLU2d``, both inputs and the output
    int8: oneDNN's conv with a sum into the residual and an optional relu,
    ``qconv2d_pointwise.binary``, on weights packed by ``torch.ops.onednn.qconv_prepack``.

    torch.ao runs these with ``quantized::conv2d_add[_relu]``, which checks torch's
    global quantized engine (not its packed weights' engine) and fails unless it is
    onednn: a kernel would have to set that process-wide global at every call, which
    changes other threads' ops. The pointwise call reads no global and gives the same
    values (tests/test_engine_independence.py).
    """

    packs_for_global_engine = False  # torch.ops.onednn's prepack takes no engine

    def __init__(self, match: KernelMatch, relu: bool) -> None:
        if len(match.inputs) != 2 or match.output is None or match.output.quant_range:
            raise ValueError("needs two int8 inputs and a full-range int8 output")
        reference = match.module
        if not reference.weight_qparams or any(
            q.zero_point.ne(0).any() for q in reference.weight_qparams.values()
        ):
            raise ValueError("oneDNN takes symmetric weights (zero point 0)")
        # What packing needs (the input's qparams, which do not change the packed
        # weight), and the post-ops; the scripted form reads them too.
        self._x = (match.inputs[0].scale, match.inputs[0].zero_point)
        self.residual_add, self.unary = True, "relu" if relu else "none"
        self.unary_scalars, self.unary_algorithm = [], ""
        conv = weighted_child(reference.module)
        self.packed_for_shape = _prepared_input_shape(match, conv)
        trouble = _conv_trouble(match, conv, sizes_vary=True)  # an FX model's may
        if trouble is not None:
            raise ValueError(trouble)
        super().__init__(reference, match.output, relu, "onednn")
        mark_probed(self, _recorded_input_shape(match), match.inputs[0])
        self.residual_used_elsewhere = _residual_used_elsewhere(match.root)

    def repack(self) -> None:
        _set_weight_qparams(self)
        super().repack()

    pack = _prepack_conv

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        # oneDNN sums into its accumulator in place, as conv2d_add into its residual: the
        # residual's own memory, copied first where something else reads it too (also
        # the conv itself: conv(x) + x).
        accumulator = _as_uint8(other)
        shared = other.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        in_place = not (self.residual_used_elsewhere or shared)
        if not (in_place and accumulator.is_contiguous(memory_format=torch.channels_last)):
            # oneDNN takes a channels-last accumulator (what every int8 conv returns)
            accumulator = accumulator.clone(memory_format=torch.channels_last)
        # The input's own qparams (a loaded state_dict may bring other ones than those
        # it was lowered with; packing does not depend on them).
        y = torch.ops.onednn.qconv2d_pointwise.binary(
            _as_uint8(x), x.q_scale(), x.q_zero_point(), self._packed, self._w_scale,
            self._w_zero_point, accumulator, self.bias, self.stride, self.padding,
            self.dilation, self.groups, self.scale, self.zero_point, None, other.q_scale(),
            other.q_zero_point(), "sum", 1.0, self.unary, self.unary_scalars, self.unary_algorithm,
        )  # fmt: skip
        return torch._make_per_tensor_quantized_tensor(y, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return "residual add, " + super().extra_repr()

    def __prepare_scriptable__(self) -> torch.nn.Module:
        """The same oneDNN call on the same packed weight (``qcore_x86.onednn_scripted``)."""
        from qcore_x86.onednn_scripted import ScriptedOnednnConv

        return ScriptedOnednnConv(self, self._packed)


def _residual_used_elsewhere(root: Any) -> bool:
    """Whether anything that runs after the fused conv-add reads its residual too.

    In the reference graph the residual is ``dequantize(quantize(y))``; ``y`` reused
    (``z = conv(x) + y; z + y``) gives the quantize more than one reader. Readers that
    run before the conv-add (a residual block's first conv reads the block's input)
    are done with it when the conv-add sums into it.
    """
    residual = root.args[1]
    readers = set(residual.users)
    source = residual.args[0] if residual.args else None
    if hasattr(source, "users"):
        readers |= {reader for dequantize in source.users for reader in dequantize.users}
        readers |= set(source.users) - {residual}
    readers.discard(root)
    later = False
    for node in root.graph.nodes:  # execution order
        if node in readers and later:
            return True
        later = later or node is root
    return False


def _conv_add(match: KernelMatch) -> OnednnPackedConvAdd:
    return OnednnPackedConvAdd(match, relu=isinstance(match.module.module, nni.ConvAddReLU2d))


def onednn_engine_conv_add_kernels() -> list[Kernel]:
    """``ConvAdd2d``/``ConvAddReLU2d`` as one oneDNN conv with a sum, both inputs and
    the output int8 (:class:`OnednnPackedConvAdd`)."""
    return [
        Kernel("onednn.conv2d_add", pattern, "onednn", _conv_add)
        for pattern in (nni.ConvAdd2d, nni.ConvAddReLU2d)
    ]


def _check(match: KernelMatch, kind: tuple[type, ...]) -> None:
    if not isinstance(match.module, ReferenceModule):
        raise TypeError("expected a module with quantized weights")
    weighted = weighted_child(match.module.module)
    if not isinstance(weighted, kind):
        raise ValueError(f"{type(weighted).__name__} is not a {kind[0].__name__[:-2]}")
    if match.dynamic or not match.inputs:
        raise ValueError("needs a statically quantized input")
    x: ActivationQParams = match.inputs[0]
    if x.dtype != torch.quint8:
        raise ValueError(f"oneDNN's int8 kernels take quint8 activations, not {x.dtype}")


def _lower(match: KernelMatch, kind: tuple[type, ...], kernel: type):
    _check(match, kind)
    return kernel(match)


def onednn_kernels() -> list[Kernel]:
    """x86's oneDNN kernels, tried after the kernel library's (see the module docstring)."""
    convs = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    # oneDNN: no relu after conv3d
    conv_patterns = [*convs, nni.ConvReLU1d, nni.ConvReLU2d, nni.ConvAdd2d, nni.ConvAddReLU2d]
    linear_patterns = [nn.Linear, nni.LinearReLU, nni.LinearLeakyReLU, nni.LinearTanh]
    conv = functools.partial(_lower, kind=convs, kernel=OnednnConv)
    linear = functools.partial(_lower, kind=(nn.Linear,), kernel=OnednnLinear)
    return [
        *(
            Kernel("x86.onednn_conv", p, ENGINE, conv)
            for p in [*conv_patterns, WeightedWithPostOps]
        ),
        *(Kernel("x86.onednn_linear", p, ENGINE, linear) for p in linear_patterns),
        Kernel(
            "x86.onednn_linear",
            WeightedWithPostOps,
            ENGINE,
            linear,
            no_model_reason=(
                "WeightedWithPostOps is the pattern of both oneDNN kernels; the conformance "
                "suite's model of it is a conv (x86.onednn_conv), which this kernel refuses"
            ),
        ),
    ]
