"""Kernels for linear, convolution and transposed convolution on torch's int8 ops.

Each lowered module holds its weights packed for one engine (fbgemm, qnnpack,
x86/onednn) and takes and returns torch quantized tensors, so consecutive
kernels pass int8 data without a dequantize/quantize round trip. Batch norm is
folded into the weights at fusion time, so ConvBn* patterns arrive here as
plain convolutions.

Forwards call torch's ops (bound once at import) in plain branches (no table of ops, no
op chosen in an expression) so that ``torch.jit.script`` compiles them. TorchScript
types packed weights by their dimensionality (``Conv2dPackedParamsBase``) and
compiles every branch, so a conv kernel hands it a module of its dimensionality
(``__prepare_scriptable__``): :class:`ScriptedConv2d` and the like, holding the
same packed object.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qcore.engine.conv_padding import explicit_padding
from qcore.engine.kernel_check import recorded
from qcore.engine.reference import ReferenceModule, weighted_child
from qcore.kernels import onednn_probe
from qcore.kernels.onednn_probe import ConvGeometry, conv_wrong_here
from qcore.kernels.packed import PackedWeights
from qcore.kernels.runtime import EXACT_ENGINE
from qcore.kernels.scripted import (
    SCRIPTED_CONV,
    SCRIPTED_CONV_TRANSPOSE,
    ScriptedLinearReference,
    conv_reference,
    may_read_padding_only,
    reads_padding_only,
)
from qcore.plugin.kernels import ActivationQParams, KernelMatch

__all__ = [
    "QuantizedConv",
    "QuantizedConvTranspose",
    "QuantizedLinear",
    "conv_geometry",
    "onednn_conv_trouble",
    "mark_probed",
    "onednn_kernel_wrong_here",
    "probed_input",
]

_ROUNDING_STEPS = 2  # a kernel's requantization may round differently from the reference

# torch's ops, bound once: a lookup through torch.ops costs about as much as the
# Python around a kernel call. TorchScript compiles them as the ops themselves.
_linear_relu = torch.ops.quantized.linear_relu
_linear = torch.ops.quantized.linear
_conv2d_relu = torch.ops.quantized.conv2d_relu
_conv2d = torch.ops.quantized.conv2d
_conv1d_relu = torch.ops.quantized.conv1d_relu
_conv1d = torch.ops.quantized.conv1d
_conv3d_relu = torch.ops.quantized.conv3d_relu
_conv3d = torch.ops.quantized.conv3d
_conv_transpose2d = torch.ops.quantized.conv_transpose2d
_conv_transpose1d = torch.ops.quantized.conv_transpose1d
_conv_transpose3d = torch.ops.quantized.conv_transpose3d


def _reference(match: KernelMatch) -> ReferenceModule:
    if not isinstance(match.module, ReferenceModule):
        raise TypeError(
            f"expected a module with quantized weights, got {type(match.module).__name__} "
            "(its QConfig has no weight observer)"
        )
    if len(match.inputs) != 1 or match.output is None:
        raise ValueError("needs one quantized input and a quantized output")
    return match.module


class QuantizedLinear(PackedWeights):
    """int8 linear (optionally fused with relu) on ``engine``'s packed weights."""

    sums_uint8_products = True

    def __init__(
        self, reference: ReferenceModule, output: ActivationQParams, relu: bool, engine: str
    ) -> None:
        super().__init__(engine)
        child = weighted_child(reference.module)
        self.in_features, self.out_features = child.in_features, child.out_features
        self.relu = relu
        self.scale, self.zero_point = output.scale, output.zero_point
        self.set_weight_from(reference)
        self.repack()

    def pack(self):
        return torch.ops.quantized.linear_prepack(self.qweight(), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.relu:
            return _linear_relu(x, self._packed, self.scale, self.zero_point)
        return _linear(x, self._packed, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"relu={self.relu}, engine={self.engine}, scale={self.scale}, "
            f"zero_point={self.zero_point}"
        )

    def __prepare_scriptable__(self) -> torch.nn.Module:
        return ScriptedLinearReference(self) if self.left_backend_engine else self

    @classmethod
    def lower(cls, match: KernelMatch, relu: bool = False):
        return cls(_reference(match), match.output, relu, match.engine)


def conv_geometry(conv: torch.nn.Module) -> tuple[list[int], list[int], list[int], int]:
    """(stride, padding, dilation, groups) of a float conv as torch's int8 conv kernels
    take them: explicit zero padding (``"same"``/``"valid"`` resolved); a ValueError
    saying why where they can't run it (a kernel then leaves the conv in reference form)."""
    if conv.padding_mode != "zeros":
        raise ValueError(f"padding_mode {conv.padding_mode!r}: the int8 kernel pads with zeros")
    padding = explicit_padding(conv.padding, conv.kernel_size, conv.dilation)
    if padding is None:
        raise ValueError(
            f"padding={conv.padding!r} with kernel_size={conv.kernel_size} and dilation="
            f"{conv.dilation}: torch pads one more after than before, and the int8 kernel "
            "takes the same padding on both sides"
        )
    return list(conv.stride), padding, list(conv.dilation), conv.groups


class QuantizedConv(PackedWeights):
    """int8 conv1d/2d/3d (optionally fused with relu) on ``engine``'s packed weights."""

    sums_uint8_products = True

    def __init__(
        self, reference: ReferenceModule, output: ActivationQParams, relu: bool, engine: str
    ) -> None:
        super().__init__(engine)
        conv = weighted_child(reference.module)
        self.dims = len(conv.kernel_size)
        self.stride, self.padding, self.dilation, self.groups = conv_geometry(conv)
        self.checks_padding = may_read_padding_only(
            list(conv.kernel_size), list(self.padding), list(self.dilation)
        )
        self.relu = relu
        self.scale, self.zero_point = output.scale, output.zero_point
        self.description = (
            f"{conv.in_channels}, {conv.out_channels}, kernel_size={conv.kernel_size}"
        )
        self.set_weight_from(reference)
        self.repack()

    def pack(self):
        prepack = getattr(torch.ops.quantized, f"conv{self.dims}d_prepack")
        return prepack(
            self.qweight(), self.bias, self.stride, self.padding, self.dilation, self.groups
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, scale, zero_point = self._packed, self.scale, self.zero_point
        # a conv pickled before the check: checked on every call
        if getattr(self, "checks_padding", True) and reads_padding_only(
            list(x.shape), list(self.weight_int.shape[2:]), self.stride, self.padding, self.dilation
        ):
            # oneDNN leaves such outputs as garbage (engine x86 or onednn)
            return conv_reference(
                x, self.qweight(), self.bias, self.stride, self.padding, self.dilation,
                self.groups, self.relu, scale, zero_point,
            )  # fmt: skip
        if self.dims == 2:
            if self.relu:
                return _conv2d_relu(x, packed, scale, zero_point)
            return _conv2d(x, packed, scale, zero_point)
        if self.dims == 1:
            if self.relu:
                return _conv1d_relu(x, packed, scale, zero_point)
            return _conv1d(x, packed, scale, zero_point)
        if self.relu:
            return _conv3d_relu(x, packed, scale, zero_point)
        return _conv3d(x, packed, scale, zero_point)

    def extra_repr(self) -> str:
        return (
            f"{self.description}, relu={self.relu}, engine={self.engine}, "
            f"scale={self.scale}, zero_point={self.zero_point}"
        )

    def __prepare_scriptable__(self) -> torch.nn.Module:
        return SCRIPTED_CONV[self.dims](self)

    @classmethod
    def lower(cls, match: KernelMatch, relu: bool = False):
        reference = _reference(match)
        engine = _conv_engine(reference, match)
        conv = weighted_child(reference.module)
        if engine not in ("x86", "onednn"):
            return cls(reference, match.output, relu, engine)
        found = recorded(match.root.args[0]) if match.root.args else None
        trouble = padding_only_trouble(conv, found[0] if found else None)
        if trouble is not None:  # forward checks every call's size
            kernel = cls(reference, match.output, relu, engine)
            kernel.lowering_note = f"computes as the reference does where {trouble}"
            return kernel
        input_shape = found[0] if found else None
        trouble = _multiplier_trouble(conv) or _wrong_on_this_cpu(
            conv, input_shape, match.inputs[0], engine
        )
        kernel = cls(reference, match.output, relu, engine)
        mark_probed(kernel, input_shape, match.inputs[0])
        if trouble is not None:
            kernel.move_to(EXACT_ENGINE)
            kernel.lowering_note = f"runs on {EXACT_ENGINE}'s kernel: {trouble}"
        return kernel

    #: What :mod:`qcore.kernels.onednn_probe` asks this CPU about a conv on oneDNN: the
    #: input shape prepare recorded (or None) and the input's (quant_min, quant_max,
    #: zero_point); None where the input is not quint8. Set at lowering.
    probed_input = None  # not annotated: TorchScript reads class annotations

    def onednn_wrong_here(self) -> str | None:
        """Why oneDNN's int8 conv (engines x86 and onednn) computes this conv's geometry
        wrong on this CPU, or None (:func:`onednn_kernel_wrong_here`)."""
        if self.engine not in ("x86", "onednn"):
            return None
        return onednn_kernel_wrong_here(self, self.engine)

    def wrong_on_this_cpu(self) -> str | None:
        return super().wrong_on_this_cpu() or self.onednn_wrong_here()


def padding_only_trouble(
    conv: torch.nn.Module, input_shape: Sequence[int] | None = None
) -> str | None:
    """Why some outputs of ``conv`` read zero padding only (on any input, or on one
    of ``input_shape``), which torch 2.13's oneDNN int8 conv leaves as garbage or
    crashes on; or None."""
    stride, padding, dilation, _ = conv_geometry(conv)
    kernel = list(conv.kernel_size)
    if any(p > d * (k - 1) for k, p, d in zip(kernel, padding, dilation, strict=True)):
        return (
            "some outputs read zero padding only (padding > dilation * (kernel - 1)), "
            "which oneDNN's int8 conv leaves as garbage or crashes on"
        )
    sizes = list(input_shape or [])
    if len(sizes) >= len(kernel) and reads_padding_only(
        sizes, kernel, list(stride), list(padding), list(dilation)
    ):
        return (
            f"on the recorded input size {sizes[-len(kernel) :]}, the dilation steps over "
            "the whole input: some outputs read zero padding only, which oneDNN's int8 conv "
            "leaves as garbage"
        )
    return None


def onednn_conv_trouble(
    conv: torch.nn.Module,
    input_shape: Sequence[int] | None = None,
    input_qparams: ActivationQParams | None = None,
    engine: str = "onednn",
) -> str | None:
    """Why torch 2.13's oneDNN int8 conv (which its x86 engine also runs on CPUs with
    VNNI) cannot be trusted with ``conv``'s geometry on an input of ``input_shape``
    (the one prepare recorded, if any), or None. The first two rules are 120-255
    steps off the reference (or uninitialised memory) on an AVX512-VNNI CPU, as in
    torch.ao's models, and hold wherever qcore runs; the last asks this CPU
    (:mod:`qcore.kernels.onednn_probe`) on inputs at ``input_qparams``."""
    return (
        padding_only_trouble(conv, input_shape)
        or _multiplier_trouble(conv)
        or _wrong_on_this_cpu(conv, input_shape, input_qparams, engine)
    )


def _wrong_on_this_cpu(
    conv: torch.nn.Module,
    input_shape: Sequence[int] | None,
    input_qparams: ActivationQParams | None,
    engine: str,
) -> str | None:
    probed = probed_input(input_shape, input_qparams)
    if probed is None:
        return None
    weight_shape = (conv.out_channels, conv.in_channels // conv.groups, *conv.kernel_size)
    geometry = ConvGeometry.of_weight(weight_shape, *conv_geometry(conv))
    return conv_wrong_here(geometry, *probed, engine)


def onednn_kernel_wrong_here(kernel: PackedWeights, engine: str = "onednn") -> str | None:
    """Why oneDNN's int8 conv computes a conv kernel's geometry wrong on this CPU, or
    None: :func:`qcore.kernels.onednn_probe.conv_wrong_here` on its integer weight,
    ``stride``/``padding``/``dilation``/``groups`` and ``probed_input`` (set at
    lowering from :func:`probed_input`; None: nothing to ask). A kernel lowered on
    this kind of CPU (``probed_on``, :func:`mark_probed`) was asked then."""
    probed = getattr(kernel, "probed_input", None)
    if probed is None or getattr(kernel, "probed_on", None) == onednn_probe.cpu_fingerprint():
        return None  # nothing to ask, or asked at lowering on this kind of CPU
    geometry = ConvGeometry.of_weight(
        kernel.weight_int.shape, kernel.stride, kernel.padding, kernel.dilation, kernel.groups
    )
    return conv_wrong_here(geometry, *probed, engine)


def mark_probed(kernel: PackedWeights, input_shape: Sequence[int] | None, input_qparams) -> None:
    """Record, at lowering, what the CPU loading ``kernel`` asks oneDNN again
    (``probed_input``) and the kind of CPU that answered already (``probed_on``)."""
    kernel.probed_input = probed_input(input_shape, input_qparams)
    kernel.probed_on = onednn_probe.cpu_fingerprint()


def probed_input(
    input_shape: Sequence[int] | None, input_qparams: ActivationQParams | None
) -> tuple | None:
    """(input shape or None, (quant_min, quant_max, zero_point)) for the probe; None
    where the input is not quint8 (oneDNN's int8 conv takes quint8 inputs only)."""
    if input_qparams is not None and input_qparams.dtype != torch.quint8:
        return None
    low, high, zero_point = 0, 255, 0
    if input_qparams is not None:
        low, high = input_qparams.quant_range or (0, 255)
        zero_point = input_qparams.zero_point
    shape = tuple(input_shape) if input_shape is not None else None
    return shape, (low, high, zero_point)


def _multiplier_trouble(conv: torch.nn.Module) -> str | None:
    multiplied = conv.out_channels > conv.in_channels
    if len(conv.kernel_size) == 3 and conv.groups == conv.in_channels > 1 and multiplied:
        return "oneDNN's int8 depthwise conv3d with a channel multiplier is wrong on depth-1 inputs"
    return None


# torch 2.13's x86 engine hands convs with more than this many groups to fbgemm,
# whose depthwise kernel sums u8*s8 products in 16 bits even on CPUs with VNNI.
_X86_GROUPS_ON_FBGEMM = 100


def _conv_engine(reference: ReferenceModule, match: KernelMatch) -> str:
    """The engine to pack a conv for: oneDNN's for x86 depthwise convs with 8-bit
    activations (fbgemm's saturate: tens of steps off), else the match's."""
    if match.engine != "x86" or match.inputs[0].quant_range is not None:
        return match.engine
    wide = weighted_child(reference.module).groups > _X86_GROUPS_ON_FBGEMM
    return "onednn" if wide else match.engine


class QuantizedConvTranspose(PackedWeights):
    """int8 conv_transpose1d/2d/3d on ``engine``'s packed weights."""

    sums_uint8_products = True
    output_channel_axis = 1  # weights are (in, out / groups, *kernel)

    def __init__(self, reference: ReferenceModule, output: ActivationQParams, engine: str) -> None:
        super().__init__(engine)
        conv = weighted_child(reference.module)
        if conv.padding_mode != "zeros":
            raise ValueError(f"padding_mode {conv.padding_mode!r}: the int8 kernel pads with zeros")
        self.dims = len(conv.kernel_size)
        self.stride, self.padding = list(conv.stride), list(conv.padding)
        self.output_padding, self.dilation = list(conv.output_padding), list(conv.dilation)
        self.groups = conv.groups
        self.scale, self.zero_point = output.scale, output.zero_point
        self.description = (
            f"{conv.in_channels}, {conv.out_channels}, kernel_size={conv.kernel_size}"
        )
        self.set_weight_from(reference)
        if self.weight_axis is not None:
            raise ValueError(
                "per-channel weights: torch's int8 conv_transpose takes per-tensor weights "
                "(torch.ao's default mappings give ConvTranspose per-tensor weights)"
            )
        self.repack()

    def pack(self):
        prepack = getattr(torch.ops.quantized, f"conv_transpose{self.dims}d_prepack")
        return prepack(
            self.qweight(),
            self.bias,
            self.stride,
            self.padding,
            self.output_padding,
            self.dilation,
            self.groups,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, scale, zero_point = self._packed, self.scale, self.zero_point
        if self.dims == 2:
            return _conv_transpose2d(x, packed, scale, zero_point)
        if self.dims == 1:
            return _conv_transpose1d(x, packed, scale, zero_point)
        return _conv_transpose3d(x, packed, scale, zero_point)

    def extra_repr(self) -> str:
        return (
            f"{self.description}, engine={self.engine}, "
            f"scale={self.scale}, zero_point={self.zero_point}"
        )

    def __prepare_scriptable__(self) -> torch.nn.Module:
        return SCRIPTED_CONV_TRANSPOSE[self.dims](self)

    @classmethod
    def lower(cls, match: KernelMatch):
        reference = _reference(match)
        kernel = cls(reference, match.output, match.engine)
        kernel.avoid_wrong_engine(reference, match.inputs[0])
        return kernel

    def avoid_wrong_engine(self, reference: ReferenceModule, input: ActivationQParams) -> None:
        """Run once against the reference on a random input; where the kernel is off,
        pack for :data:`EXACT_ENGINE` instead, or raise (the layer then stays in
        reference form). torch 2.13's fbgemm int8 conv_transpose2d is 200-255 steps
        off for 2-row kernels with 8k input and output channels (UNet's
        ``ConvTranspose2d(C, C, 2, stride=2)``) on AVX512 CPUs; no shape rule is
        certain across CPUs, so each layer is checked."""
        off = self._steps_off(reference, input)
        if off <= _ROUNDING_STEPS:
            return
        wrong = self.engine
        if wrong != EXACT_ENGINE and self.can_move_to(EXACT_ENGINE):
            self.move_to(EXACT_ENGINE)
            if self._steps_off(reference, input) <= _ROUNDING_STEPS:
                self.lowering_note = (
                    f"runs on {EXACT_ENGINE}'s kernel: torch's {wrong} int8 conv_transpose "
                    f"is {off} steps off the reference for this layer's shape"
                )
                return
        raise ValueError(
            f"torch's int8 conv_transpose ({wrong} and {EXACT_ENGINE}) is up to {off} "
            "steps off the reference for this layer's shape"
        )

    def _steps_off(self, reference: ReferenceModule, input: ActivationQParams) -> int:
        low, high = input.quant_range or (0, 255)
        generator = torch.Generator().manual_seed(0)
        size = (1, weighted_child(reference.module).in_channels) + (6,) * self.dims
        integers = torch.randint(low, high + 1, size, generator=generator, dtype=torch.uint8)
        x = torch._make_per_tensor_quantized_tensor(integers, input.scale, input.zero_point)
        with torch.no_grad():
            expected = torch.quantize_per_tensor(
                reference(x.dequantize()), self.scale, self.zero_point, torch.quint8
            )
            found = self(x)
        return int((found.int_repr().int() - expected.int_repr().int()).abs().max())
