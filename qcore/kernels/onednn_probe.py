"""Whether torch's oneDNN int8 conv computes a conv's geometry right on this CPU.

torch 2.13's oneDNN int8 conv (which its x86 engine runs too) is 40-120 steps off
the reference for some geometries on some CPUs, as in torch.ao's own models. On an
Intel Xeon with AMX and AVX512-VNNI: conv1d/conv2d whose groups have 4-28 input
channels (a multiple of 4) where channels x kernel width is a multiple of 64 from
128 up, and grouped convs with 24 output channels a group at kernel widths 16 and
32 (wav2vec2's positional conv: 32 channels, 2 groups, kernel 16, 1.4 dB against
22.4 on fbgemm); none of these on an AMD EPYC without VNNI. A rule written on one
CPU misses the next, so lowering asks the CPU: it runs one int8 conv of the same
geometry (random weights and input at the conv's input qparams and range, batch
1) on oneDNN and on the reference computation. A conv more than two steps off
anywhere is wrong here. Once per geometry and process: the answer belongs to the
CPU, not to the weights.
"""

from __future__ import annotations

import contextlib
import functools
import platform
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qcore.kernels.runtime import packed_for

__all__ = ["ConvGeometry", "conv_wrong_here", "cpu_fingerprint", "onednn_conv_wrong_here"]

_PROBED_SIZE = 64  # each spatial size at most: the faults found depend on the geometry
_STEPS_OFF = 2  # rounding differs by one step between int8 and float paths; the fault by 40+
_QUANTIZED_CONVS = {1: torch.ops.quantized.conv1d, 2: torch.ops.quantized.conv2d}
_PREPACKS = {1: torch.ops.quantized.conv1d_prepack, 2: torch.ops.quantized.conv2d_prepack}
_FLOAT_CONVS = {1: F.conv1d, 2: F.conv2d}


@functools.cache
def cpu_fingerprint() -> str:
    """What tells this CPU's kind from another's, for a kernel to know it was probed
    on this kind already (a model loaded where it was converted skips the probes, a
    few to tens of milliseconds each): the architecture, torch's CPU capability, the
    int8 dot-product extensions and the model name."""
    name = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        name = next(
            (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), ""
        )
    parts = (
        platform.machine(),
        torch.backends.cpu.get_cpu_capability(),
        f"vnni={torch.cpu._is_vnni_supported()}",
        f"amx={torch.cpu._is_amx_tile_supported()}",
        name or platform.processor(),
    )
    return ", ".join(parts)


@dataclass(frozen=True)
class ConvGeometry:
    """What decides whether oneDNN's int8 conv computes a conv right on a CPU (its
    weights' values do not): channels, kernel size, stride, padding, dilation, groups."""

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    @classmethod
    def of_weight(
        cls,
        weight_shape: Sequence[int],
        stride: Sequence[int],
        padding: Sequence[int],
        dilation: Sequence[int],
        groups: int,
    ) -> ConvGeometry:
        """The geometry of a conv with a weight of ``weight_shape`` (out, in / groups, *kernel)."""
        out_channels, in_per_group, *kernel_size = weight_shape
        return cls(
            in_per_group * groups, out_channels, tuple(kernel_size), tuple(stride),
            tuple(padding), tuple(dilation), groups,
        )  # fmt: skip


def conv_wrong_here(
    geometry: ConvGeometry,
    input_shape: Sequence[int] | None,
    input_range: tuple[int, int, int],
    engine: str = "onednn",
) -> str | None:
    """:func:`onednn_conv_wrong_here` at the spatial size of ``input_shape`` (the one
    prepare recorded; each size capped), or one the kernel covers where none is."""
    dims = len(geometry.kernel_size)
    if input_shape is not None and len(input_shape) == dims + 2:
        spatial = tuple(min(size, _PROBED_SIZE) for size in input_shape[2:])
    else:
        pairs = zip(geometry.kernel_size, geometry.dilation, strict=True)
        spatial = tuple((k - 1) * d + 8 for k, d in pairs)
    return onednn_conv_wrong_here(geometry, spatial, input_range, engine)


@functools.cache
def onednn_conv_wrong_here(
    geometry: ConvGeometry,
    spatial: tuple[int, ...],
    input_range: tuple[int, int, int],
    engine: str = "onednn",
) -> str | None:
    """Why oneDNN's int8 conv of this geometry is wrong on this CPU, or None (also
    where the probe cannot run: conv3d, or a size it refuses; the kernel's own
    lowering decides those). ``spatial``: the input's spatial size; ``input_range``:
    (quant_min, quant_max, zero_point) of its quint8 input; ``engine``: the one the
    kernel packs for (torch's x86 engine hands convs with over 100 groups to fbgemm,
    whose sums of 8-bit inputs saturate: that is not this fault, and lowering packs
    those for onednn)."""
    in_channels, out_channels, groups = geometry.in_channels, geometry.out_channels, geometry.groups
    kernel_size = geometry.kernel_size
    stride, padding, dilation = geometry.stride, geometry.padding, geometry.dilation
    dims = len(kernel_size)
    if dims not in _QUANTIZED_CONVS:
        return None
    generator = torch.Generator().manual_seed(0)
    low, high, zero_point = input_range
    spread = torch.randn(1, in_channels, *spatial, generator=generator) * (high - low) / 8
    integers = (spread.round() + zero_point).clamp(low, high).to(torch.uint8)
    x = torch._make_per_tensor_quantized_tensor(integers, 0.02, zero_point)
    weight = torch.randn(out_channels, in_channels // groups, *kernel_size, generator=generator)
    scales = weight.abs().flatten(1).amax(1).clamp(min=1e-6) / 127
    zeros = torch.zeros(out_channels, dtype=torch.long)
    qweight = torch.quantize_per_channel(weight, scales.double(), zeros, 0, torch.qint8)
    bias = torch.randn(out_channels, generator=generator)
    arguments = (list(stride), list(padding), list(dilation), groups)
    try:
        packed = packed_for(engine, lambda: _PREPACKS[dims](qweight, bias, *arguments))
        got = _QUANTIZED_CONVS[dims](x, packed, 0.05, 64).int_repr().int()
    except RuntimeError:
        return None
    exact = _FLOAT_CONVS[dims](x.dequantize(), qweight.dequantize(), bias, *arguments)
    expected = torch.quantize_per_tensor(exact, 0.05, 64, torch.quint8).int_repr().int()
    off = int((got - expected).abs().max()) if got.shape == expected.shape else 255
    if off <= _STEPS_OFF:
        return None
    return (
        f"oneDNN's int8 conv of this geometry is {off} steps off the reference on this CPU "
        f"(probed at convert: {in_channels}->{out_channels} channels, {groups} groups, "
        f"kernel {list(kernel_size)})"
    )
