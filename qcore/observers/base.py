"""What every observer shares: the constructor wrapper and the qparams formula.

An observer is an ``nn.Module`` whose ``forward`` records statistics of the
tensors passing through (and returns them unchanged) and whose
``calculate_qparams()`` turns them into ``(scale, zero_point)``. The interface
is torch.ao's, attribute for attribute, so that torch.ao observers and qcore's
are interchangeable for the engine.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
from torch import nn

__all__ = [
    "EPS",
    "RANGE_LIMIT",
    "ObserverBase",
    "PartialConstructor",
    "UniformQuantizationObserverBase",
    "qrange",
]

EPS = torch.finfo(torch.float32).eps
#: The largest magnitude observers record and compute qparams from: half float32's
#: largest value, so that a range is at most float32's largest value wide and its
#: scale, and every value dequantized with it, stays finite. Larger values saturate.
RANGE_LIMIT = torch.finfo(torch.float32).max / 2

_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)
_PER_CHANNEL = (
    torch.per_channel_affine,
    torch.per_channel_symmetric,
    torch.per_channel_affine_float_qparams,
)
_SYMMETRIC = (torch.per_tensor_symmetric, torch.per_channel_symmetric)
_INT8 = (torch.qint8, torch.int8)
_UINT8 = (torch.quint8, torch.uint8)
_INT32 = (torch.qint32, torch.int32)


def float32_factory_kwargs(factory_kwargs: dict | None) -> dict:
    """``torch.nn.factory_kwargs`` with float32 unless the caller names a dtype: a
    process's default dtype (``torch.set_default_dtype(torch.float64)``) must not
    change statistics and qparams, which torch's quantize ops take as float32."""
    return {"dtype": torch.float32, **torch.nn.factory_kwargs(factory_kwargs)}


class PartialConstructor:
    """A constructor with some arguments bound: ``MinMaxObserver.with_args(...)``.

    Calling it builds a new instance each time. Arguments given through
    :meth:`with_callable_args` are called at construction time. It has
    torch.ao's ``_PartialWrapper`` shape (``p`` is the ``functools.partial``,
    ``callable_args`` the dict) and repr, so code inspecting either works.
    """

    def __init__(self, p: functools.partial) -> None:
        self.p = p
        self.callable_args: dict[str, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for name, make in self.callable_args.items():
            kwargs.setdefault(name, make())
        return self.p(*args, **kwargs)

    def __repr__(self) -> str:
        return repr(self.p) + repr(self.callable_args)

    def with_args(self, **kwargs: Any) -> PartialConstructor:
        """More bound arguments (later ones override); one flat ``functools.partial``,
        so ``p.keywords`` shows them all."""
        result = PartialConstructor(functools.partial(self.p, **kwargs))
        result.callable_args = dict(self.callable_args)
        return result

    def with_callable_args(self, **kwargs: Any) -> PartialConstructor:
        result = PartialConstructor(self.p)
        result.callable_args = {**self.callable_args, **kwargs}
        return result


def _with_args(cls_or_self: Any, **kwargs: Any) -> PartialConstructor:
    return PartialConstructor(functools.partial(cls_or_self, **kwargs))


def _with_callable_args(cls_or_self: Any, **kwargs: Any) -> PartialConstructor:
    return PartialConstructor(functools.partial(cls_or_self)).with_callable_args(**kwargs)


def qrange(
    dtype: torch.dtype, quant_min: int | None, quant_max: int | None, reduce_range: bool
) -> tuple[int, int]:
    """The (quant_min, quant_max) an observer uses, as torch.ao computes it.

    Custom bounds are halved by ``reduce_range`` too (torch.ao's behaviour,
    which ``FakeQuantize.with_args(quant_min=0, quant_max=255, reduce_range=True)``
    relies on to get 0..127).
    """
    if quant_min is not None and quant_max is not None:
        if not quant_min <= 0 <= quant_max:
            raise ValueError(
                f"quant_min={quant_min}, quant_max={quant_max}: the range must include 0"
            )
        if quant_min >= quant_max:
            raise ValueError(f"quant_min={quant_min} must be less than quant_max={quant_max}")
        width = quant_max - quant_min + 1
        if dtype in _INT8 and width > 256:
            raise ValueError(f"quant_min..quant_max spans {width} values; {dtype} holds 256")
        if dtype in _INT32 and width > 2**32:
            raise ValueError(f"quant_min..quant_max spans {width} values; {dtype} holds 2**32")
        if reduce_range:
            return quant_min // 2, quant_max // 2
        return quant_min, quant_max
    if dtype in _INT8:
        return (-64, 63) if reduce_range else (-128, 127)
    if dtype in _UINT8:
        return (0, 127) if reduce_range else (0, 255)
    if dtype in _INT32:
        return -(2**31), 2**31 - 1
    if dtype == torch.int16:
        return -(2**15), 2**15 - 1
    if dtype == getattr(torch, "uint16", None):
        return 0, 2**16 - 1
    return 0, 15  # quint4x2


class ObserverBase(nn.Module):
    """Base of every observer: ``dtype``, ``is_dynamic``, ``with_args``."""

    def __init__(self, dtype: torch.dtype, is_dynamic: bool = False) -> None:
        super().__init__()
        self.dtype = dtype
        self.is_dynamic = is_dynamic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    with_args = classmethod(_with_args)
    with_callable_args = classmethod(_with_callable_args)


_ALLOWED_DTYPES = tuple(
    d
    for d in (
        torch.qint8,
        torch.quint8,
        torch.quint4x2,
        torch.qint32,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        getattr(torch, "uint16", None),
    )
    if d is not None
)


def _next_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Each scale rounded up to 2**k: the quantized range only widens, so it still
    covers what was observed (an affine zero point is computed from the new scale)."""
    return torch.exp2(torch.ceil(torch.log2(scale)))


class UniformQuantizationObserverBase(ObserverBase):
    """Observers computing an affine or symmetric (scale, zero_point) from a min and a max."""

    eps: torch.Tensor
    _version = 3  # torch.ao's state_dict version: same buffer names and shapes

    def __init__(
        self,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict | None = None,
        eps: float = EPS,
        is_dynamic: bool = False,
        power_of_two_scale: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(dtype=dtype, is_dynamic=is_dynamic, **kwargs)
        factory_kwargs = float32_factory_kwargs(factory_kwargs)
        if not isinstance(power_of_two_scale, bool):
            raise ValueError(
                f"{type(self).__name__}: power_of_two_scale={power_of_two_scale!r}; "
                "expected True or False"
            )
        if power_of_two_scale and qscheme == torch.per_channel_affine_float_qparams:
            raise ValueError(
                f"{type(self).__name__}: power_of_two_scale=True with qscheme "
                f"{qscheme}; expected an affine or symmetric qscheme (float qparams keep "
                "their scale as computed)"
            )
        #: Round every scale up to the next power of two (the zero point follows):
        #: what a DTypeWithConstraints with ``scale_power_of_two=True`` asks for.
        self.power_of_two_scale = power_of_two_scale
        if qscheme not in _PER_TENSOR + _PER_CHANNEL:
            raise ValueError(f"{type(self).__name__}: unsupported qscheme {qscheme}")
        if dtype not in _ALLOWED_DTYPES:
            raise ValueError(
                f"{type(self).__name__}: unsupported dtype {dtype}; "
                f"expected one of {', '.join(map(str, _ALLOWED_DTYPES))}"
            )
        eps_value = float(eps)
        if not (math.isfinite(eps_value) and eps_value > 0):
            # eps is the smallest scale: 0 divides by zero on a constant tensor, NaN
            # makes every scale NaN (torch.max propagates it)
            raise ValueError(
                f"{type(self).__name__}: eps={eps_value}; expected a finite positive number "
                "(the smallest scale it computes)"
            )
        self.qscheme = qscheme
        self.reduce_range = reduce_range
        self.register_buffer("eps", torch.tensor([eps], **factory_kwargs))
        self.has_customized_qrange = quant_min is not None and quant_max is not None
        self.quant_min, self.quant_max = qrange(dtype, quant_min, quant_max, reduce_range)

    def _reject_symmetric_reduced_quint8(self) -> None:
        if self.qscheme in _SYMMETRIC and self.reduce_range and self.dtype == torch.quint8:
            raise NotImplementedError(
                f"{type(self).__name__}: reduce_range is not supported with symmetric "
                "quantization to quint8"
            )

    def _calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero_point) for the range [min_val, max_val] (per tensor or per channel)."""
        device = min_val.device
        unobserved = min_val.numel() == 0 or max_val.numel() == 0
        if not unobserved and min_val.dim() == 0:
            unobserved = bool(min_val == float("inf") and max_val == float("-inf"))
        if unobserved:
            warnings.warn(
                f"{type(self).__name__}.calculate_qparams() called before it observed any "
                "tensor; returning scale 1.0 and zero point 0",
                stacklevel=3,
            )
            unit = torch.tensor([1.0], dtype=torch.float32, device=device)
            return unit, torch.tensor([0], device=device)
        if min_val.numel() == 1 and max_val.numel() == 1:
            # per tensor (every QAT step): compare on the host, no tensor ops
            lo, hi = min_val.item(), max_val.item()
            nan = math.isnan(lo) or math.isnan(hi)
            beyond = not (-RANGE_LIMIT <= lo and hi <= RANGE_LIMIT)
        else:
            nan = bool(torch.isnan(min_val).any() | torch.isnan(max_val).any())
            beyond = True
        if nan:
            # qcore's observers skip NaN; this comes from a state_dict or a subclass
            raise ValueError(
                f"{type(self).__name__}: min_val={min_val.tolist()}, max_val="
                f"{max_val.tolist()} hold NaN; expected the finite range of the observed "
                "values, from which a scale can be computed"
            )
        if min_val.dim() > 0:
            # channels never observed (or only non-finite values): the qparams of zeros
            empty = (min_val == math.inf) & (max_val == -math.inf)
            if bool(empty.any()):
                min_val = torch.where(empty, torch.zeros_like(min_val), min_val)
                max_val = torch.where(empty, torch.zeros_like(max_val), max_val)
        if torch.any(min_val > max_val):
            raise ValueError(f"min {min_val} should be less than max {max_val}")
        if beyond:
            # a range wider than float32 can span would give an infinite scale
            min_val = min_val.clamp(-RANGE_LIMIT, RANGE_LIMIT)
            max_val = max_val.clamp(-RANGE_LIMIT, RANGE_LIMIT)

        quant_min, quant_max = self.quant_min, self.quant_max
        min_neg = torch.min(min_val, torch.zeros_like(min_val))
        max_pos = torch.max(max_val, torch.zeros_like(max_val))
        zero_point = torch.zeros(min_neg.size(), dtype=torch.int64, device=device)
        if self.qscheme in _SYMMETRIC:
            max_pos = torch.max(-min_neg, max_pos)
            scale = torch.max(max_pos / (float(quant_max - quant_min) / 2), self.eps)
            if self.dtype in _UINT8:
                middle = (quant_min + quant_max) // 2 if self.has_customized_qrange else 128
                zero_point = zero_point.new_full(zero_point.size(), middle)
            elif self.dtype == getattr(torch, "uint16", None):
                zero_point = zero_point.new_full(zero_point.size(), 2**15)
        elif self.qscheme == torch.per_channel_affine_float_qparams:
            scale = (max_val - min_val) / float(quant_max - quant_min)
            scale = torch.where(scale > self.eps, scale, torch.ones_like(scale))
            # q = round((x - min) / scale): the zero point is -min / scale, a float
            zero_point = -1 * min_val / scale
        else:
            scale = torch.max((max_pos - min_neg) / float(quant_max - quant_min), self.eps)
            if self.power_of_two_scale:
                scale = _next_power_of_two(scale)
            zero_point = quant_min - torch.round(min_neg / scale).to(torch.int)
            zero_point = torch.clamp(zero_point, quant_min, quant_max)
        if self.power_of_two_scale and self.qscheme in _SYMMETRIC:
            scale = _next_power_of_two(scale)

        # 0-d results become 1-element tensors, as FakeQuantize's buffers expect.
        if scale.dim() == 0:
            scale = scale.reshape(1)
        if zero_point.dim() == 0:
            zero_point = zero_point.reshape(1)
        return scale, zero_point

    def reset_min_max_vals(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot reset its min/max values")
