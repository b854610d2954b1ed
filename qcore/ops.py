"""Quantize and dequantize on plain integer tensors.

The reference representation qcore converts to is made of these functions:
``quantize_*`` returns a ``torch.uint8`` / ``int8`` / ``int32`` tensor (never
one of torch's deprecated ``quint8``/``qint8`` quantized tensor types) and
``dequantize_*`` takes it back to float. They are plain Python functions built
from torch ops, so they work as ``call_function`` targets in an FX graph and
under ``torch.compile``.

Numerics follow torch's CPU (x86) kernels bit for bit, including how ties are
rounded (half to even) and in which precision each step is computed; torch is
not consistent across its own kernels, so neither is this module:

* :func:`quantize_per_tensor` to 8 bits: ``round(fma(x, 1/scale, zero_point))``
  in float32, as fbgemm's vectorized kernel behind ``torch.quantize_per_tensor``
  (the fused multiply-add is computed exactly in float64, then rounded to
  float32 once).
* :func:`quantize_per_tensor` to 32 bits and :func:`quantize_per_channel`:
  ``round(x * (1/scale) + zero_point)`` with float32 rounding after each step.
* :func:`dequantize_per_tensor`: ``(q - zero_point) * scale`` in float32;
  :func:`dequantize_per_channel`: the same in float64, rounded to float32.
* :func:`fake_quantize_per_tensor` / :func:`fake_quantize_per_channel`: as
  ``torch.fake_quantize_per_*_affine`` (used by QAT):
  ``(clamp(round(x * (1/scale)) + zero_point) - zero_point) * scale``, with the
  same straight-through gradient (passed where the value was not clamped).
* :func:`choose_qparams_per_tensor`: as ``torch.quantize_per_tensor_dynamic``.

``dtype`` arguments accept the quantized dtypes (``torch.quint8``, ``qint8``,
``qint32``) or the plain ones (``torch.uint8``, ``int8``, ``int32``); scales
and zero points accept Python numbers or 0-d/1-d tensors.

Every public function compiles with ``torch.jit.script`` (a converted model's graph
calls them), with the same numbers: where the eager code uses what TorchScript
lacks (``struct``, ``try``, a dict of dtypes) a ``torch.jit.is_scripting()`` branch
computes the same value another way.
"""

from __future__ import annotations

import math
import struct

import torch

__all__ = [
    "choose_qparams_per_tensor",
    "dequantize_per_channel",
    "dequantize_per_tensor",
    "fake_quantize_dynamic",
    "fake_quantize_per_channel",
    "fake_quantize_per_tensor",
    "quantize_per_channel",
    "quantize_per_tensor",
    "STORAGE_DTYPES",
    "storage_dtype",
]

#: quantized or plain dtype -> the plain dtype its values are stored in.
STORAGE_DTYPES = {
    torch.quint8: torch.uint8,
    torch.qint8: torch.int8,
    torch.qint32: torch.int32,
    torch.quint4x2: torch.uint8,
    torch.uint8: torch.uint8,
    torch.int8: torch.int8,
    torch.int16: torch.int16,
    torch.int32: torch.int32,
}
# torch.uint16 exists from torch 2.3.
if hasattr(torch, "uint16"):
    STORAGE_DTYPES[torch.uint16] = torch.uint16


@torch.jit.unused
def _f32_eager(value: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _f32(value: float) -> float:
    """``value`` rounded to float32 (infinite beyond its range)."""
    if not torch.jit.is_scripting():
        return _f32_eager(value)
    # from 2**128 - 2**103 (halfway between float32's largest, 2**128 - 2**104, and
    # 2**128; the tie goes to even, up) float64 values round to infinity
    if abs(value) >= 3.4028235677973366e38:
        return math.copysign(math.inf, value)
    if abs(value) > 3.4028234663852886e38:  # rounds to the largest (torch.full refuses)
        return math.copysign(3.4028234663852886e38, value)
    return float(torch.full((), value, dtype=torch.float32))


# fbgemm's ChooseQuantizationParams raises smaller scales to this (a float32 constant:
# _f32(6.1e-5), written out because TorchScript reads no global float).
_SMALL_SCALE_THRESHOLD = 6.0999998822808266e-05


@torch.jit.unused
def _storage_dtype_eager(dtype: torch.dtype) -> torch.dtype:
    try:
        return STORAGE_DTYPES[dtype]
    except KeyError:
        known = ", ".join(sorted(str(d) for d in STORAGE_DTYPES))
        raise ValueError(f"cannot quantize to {dtype}; expected one of {known}") from None


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The plain integer dtype holding values of ``dtype`` (``quint8`` -> ``uint8``)."""
    if not torch.jit.is_scripting():
        return _storage_dtype_eager(dtype)
    # STORAGE_DTYPES, spelled out for TorchScript (no dict of dtypes there)
    if dtype == torch.quint8 or dtype == torch.quint4x2:
        return torch.uint8
    if dtype == torch.qint8:
        return torch.int8
    if dtype == torch.qint32:
        return torch.int32
    if dtype == torch.uint8 or dtype == torch.int8 or dtype == torch.int16:
        return dtype
    if dtype == torch.int32 or dtype == torch.uint16:
        return dtype
    raise ValueError("cannot quantize to this dtype; expected one of qcore.ops.STORAGE_DTYPES")


def _as_tensor(value: float | int | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``torch.as_tensor(value, device=like.device)``, in a form TorchScript compiles."""
    if isinstance(value, torch.Tensor):
        return value.to(like.device)
    if isinstance(value, int):
        return torch.tensor(value, device=like.device)
    return torch.tensor(value, device=like.device)


def _as_float32(value: float | int | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return _as_tensor(value, like).to(torch.float32)


def _channel_view(values: torch.Tensor, x: torch.Tensor, axis: int, dtype: torch.dtype):
    """1-d per-channel ``values`` shaped to broadcast along ``axis`` of ``x``."""
    tensor = values.to(x.device).to(dtype)
    axis = axis % x.dim()
    shape = [1] * x.dim()
    shape[axis] = -1
    return tensor.reshape(shape)


def _clamp_to(values: torch.Tensor, quant_min: int, quant_max: int, dtype: torch.dtype):
    return torch.clamp(values, quant_min, quant_max).to(storage_dtype(dtype))


def quantize_per_tensor(
    x: torch.Tensor,
    scale: float | torch.Tensor,
    zero_point: int | torch.Tensor,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``x`` (float) quantized to a plain integer tensor of ``storage_dtype(dtype)``."""
    x = x.to(torch.float32)
    inv_scale = 1.0 / _as_float32(scale, x)
    zp = _as_tensor(zero_point, x)
    plain = storage_dtype(dtype)
    if plain == torch.uint8 or plain == torch.int8:
        # fused multiply-add: the float64 product of two float32 is exact.
        scaled = (x.double() * inv_scale.double() + zp.double()).to(torch.float32)
    else:
        scaled = x * inv_scale + zp.to(torch.float32)
    return _clamp_to(torch.round(scaled), quant_min, quant_max, dtype)


def dequantize_per_tensor(
    q: torch.Tensor,
    scale: float | torch.Tensor,
    zero_point: int | torch.Tensor,
    quant_min: int | None = None,
    quant_max: int | None = None,
    dtype: torch.dtype | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(q - zero_point) * scale`` in float32 (``quant_min``/``quant_max``/``dtype`` unused,
    accepted so the call mirrors :func:`quantize_per_tensor`)."""
    scale32 = _as_float32(scale, q)
    zp = _as_float32(zero_point, q)
    return ((q.to(torch.float32) - zp) * scale32).to(out_dtype)


def quantize_per_channel(
    x: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``x`` quantized with one (scale, zero point) per slice along ``axis``."""
    x = x.to(torch.float32)
    inv_scale = 1.0 / _channel_view(scales, x, axis, torch.float32)
    zp = _channel_view(zero_points, x, axis, torch.float32)
    scaled = x * inv_scale + zp
    return _clamp_to(torch.round(scaled), quant_min, quant_max, dtype)


def dequantize_per_channel(
    q: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor,
    axis: int,
    quant_min: int | None = None,
    quant_max: int | None = None,
    dtype: torch.dtype | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(q - zero_point) * scale`` per slice along ``axis``."""
    scale = _channel_view(scales, q, axis, torch.float64)
    zp = _channel_view(zero_points, q, axis, torch.float64)
    return ((q.to(torch.float64) - zp) * scale).to(out_dtype)


def _straight_through(x: torch.Tensor, out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``out``, with the gradient of ``x`` passed where ``mask`` holds."""
    if not x.requires_grad:
        return out
    return out.detach() + (x - x.detach()) * mask


def fake_quantize_per_tensor(
    x: torch.Tensor,
    scale: float | torch.Tensor,
    zero_point: int | torch.Tensor,
    quant_min: int,
    quant_max: int,
) -> torch.Tensor:
    """Quantize and dequantize in float, like ``torch.fake_quantize_per_tensor_affine``."""
    scale32 = _as_float32(scale, x)
    zp = _as_float32(zero_point, x)
    rounded = torch.round(x.detach().to(torch.float32) * (1.0 / scale32)) + zp
    mask = (rounded >= quant_min) & (rounded <= quant_max)
    out = (torch.clamp(rounded, quant_min, quant_max) - zp) * scale32
    return _straight_through(x, out.to(x.dtype), mask)


def fake_quantize_per_channel(
    x: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
) -> torch.Tensor:
    """Like ``torch.fake_quantize_per_channel_affine``."""
    scale = _channel_view(scales, x, axis, torch.float32)
    zp_raw = zero_points.to(x.device)
    zp = _channel_view(zp_raw, x, axis, torch.float32)
    if zp_raw.is_floating_point():
        # float zero points (per_channel_affine_float_qparams): rounded after adding.
        rounded = torch.round(x.detach().to(torch.float32) * (1.0 / scale) + zp)
        mask = (rounded >= quant_min) & (rounded <= quant_max)
        out = (torch.clamp(rounded, quant_min, quant_max) - zp) * scale
    else:
        rounded = torch.round(x.detach().to(torch.float32) * (1.0 / scale)) + zp
        mask = (rounded >= quant_min) & (rounded <= quant_max)
        out = (torch.clamp(rounded, quant_min, quant_max) - zp) * scale
    return _straight_through(x, out.to(x.dtype), mask)


def choose_qparams_per_tensor(
    x: torch.Tensor, quant_min: int = 0, quant_max: int = 255
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) for dynamic quantization of ``x`` to [quant_min, quant_max].

    The algorithm of ``torch.quantize_per_tensor_dynamic`` (fbgemm's
    ChooseQuantizationParams without sparsity preservation); pass the halved
    range for ``reduce_range``. Returns a float64 and an int64 0-d tensor (torch keeps
    the scale in double precision too).
    """
    if x.numel() == 0:
        lo = hi = 0.0
    else:
        lo_t, hi_t = torch.aminmax(x.detach().to(torch.float32))
        lo, hi = float(lo_t), float(hi_t)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / (quant_max - quant_min)  # float64, as fbgemm
    if _f32(scale) == 0.0 or math.isinf(_f32(1.0 / _f32(scale))):
        scale = 0.1
    if scale < 6.0999998822808266e-05:  # _SMALL_SCALE_THRESHOLD
        original = _f32(scale)
        scale = 6.0999998822808266e-05  # _SMALL_SCALE_THRESHOLD
        if lo == 0.0:
            hi = _f32(scale * (quant_max - quant_min))
        elif hi == 0.0:
            lo = _f32(-scale * (quant_max - quant_min))
        else:
            amplifier = _f32(scale / original)
            lo, hi = _f32(lo * amplifier), _f32(hi * amplifier)
    from_min = quant_min - lo / scale
    from_max = quant_max - hi / scale
    error_min = abs(quant_min) - abs(lo / scale)
    error_max = abs(quant_max) - abs(hi / scale)
    initial = from_min if error_min < error_max else from_max
    if initial < quant_min:
        zero_point = quant_min
    elif initial > quant_max:
        zero_point = quant_max
    else:
        zero_point = int(round(initial))  # half to even, as nearbyint
    # torch.full, not torch.tensor: TorchScript's torch.tensor(float) rounds to float32 first
    return (
        torch.full((), scale, dtype=torch.float64, device=x.device),
        torch.full((), zero_point, dtype=torch.int64, device=x.device),
    )


def fake_quantize_dynamic(
    x: torch.Tensor, quant_min: int, quant_max: int, dtype: torch.dtype
) -> torch.Tensor:
    """Dynamic quantization in reference form: qparams chosen from ``x`` itself,
    then quantize and dequantize."""
    scale, zero_point = choose_qparams_per_tensor(x, quant_min, quant_max)
    q = quantize_per_tensor(x, scale, zero_point, quant_min, quant_max, dtype)
    return dequantize_per_tensor(q, scale, zero_point, out_dtype=x.dtype)
