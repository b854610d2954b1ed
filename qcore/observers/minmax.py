"""Min/max observers: running or moving-average, per tensor or per channel.

NaN and ±inf are skipped and counted (``nonfinite_skipped``); magnitudes beyond
``RANGE_LIMIT`` are recorded as ``±RANGE_LIMIT`` (:mod:`qcore.observers.nonfinite`
says why). A tensor without a finite value is not a batch for a moving average.
"""

from __future__ import annotations

from typing import Any

import torch

from qcore.observers.base import (
    _PER_CHANNEL,
    _PER_TENSOR,
    EPS,
    UniformQuantizationObserverBase,
    float32_factory_kwargs,
)
from qcore.observers.nonfinite import finite_aminmax, finite_aminmax_rows

__all__ = [
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "PerChannelMinMaxObserver",
]


def _register_batch_counter(observer: torch.nn.Module) -> None:
    """``batches_observed``: how many tensors with a finite value a moving average has
    seen, the weight of its averages when several processes' observers are merged
    (:func:`qcore.sync_observers`). Not persistent: state_dicts keep torch.ao's keys."""
    observer.register_buffer("batches_observed", torch.tensor(0), persistent=False)


class MinMaxObserver(UniformQuantizationObserverBase):
    """qparams from the running minimum and maximum of everything observed.

    Unlike torch.ao's, which propagates a NaN into every later scale, NaN and ±inf
    values are skipped and counted in ``nonfinite_skipped`` (convert warns once,
    naming the observers), and magnitudes beyond ``RANGE_LIMIT`` (1.7e38) are
    recorded as ``±RANGE_LIMIT``, so the scale is always finite and positive.
    """

    min_val: torch.Tensor
    max_val: torch.Tensor

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
        **kwargs: Any,
    ) -> None:
        if qscheme not in _PER_TENSOR:
            raise NotImplementedError(
                f"{type(self).__name__} supports per_tensor_affine and per_tensor_symmetric, "
                f"not {qscheme}"
            )
        super().__init__(
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            factory_kwargs=factory_kwargs,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        factory_kwargs = float32_factory_kwargs(factory_kwargs)
        self.register_buffer("min_val", torch.tensor(float("inf"), **factory_kwargs))
        self.register_buffer("max_val", torch.tensor(float("-inf"), **factory_kwargs))
        self._reject_symmetric_reduced_quint8()

    def _update(self, x_min: torch.Tensor, x_max: torch.Tensor) -> None:
        self.min_val.copy_(torch.min(x_min, self.min_val))
        self.max_val.copy_(torch.max(x_max, self.max_val))

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach().to(self.min_val.dtype)
        extremes = finite_aminmax(self, x)
        if extremes is not None:  # else every value was NaN or infinite
            self._update(*extremes)
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._calculate_qparams(self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"

    def reset_min_max_vals(self) -> None:
        self.min_val.fill_(float("inf"))
        self.max_val.fill_(float("-inf"))


class MovingAverageMinMaxObserver(MinMaxObserver):
    """qparams from moving averages of the min and max:
    ``min += averaging_constant * (min(x) - min)`` (the first tensor sets them)."""

    def __init__(
        self,
        averaging_constant: float = 0.01,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        eps: float = EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        if is_dynamic and averaging_constant != 1:
            raise NotImplementedError(
                f"{type(self).__name__} supports is_dynamic=True only with averaging_constant=1, "
                f"not {averaging_constant}"
            )
        self.averaging_constant = averaging_constant
        super().__init__(
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        _register_batch_counter(self)

    def _update(self, x_min: torch.Tensor, x_max: torch.Tensor) -> None:
        self.batches_observed += 1  # a tensor with finite values
        if self.min_val == float("inf") and self.max_val == float("-inf"):
            self.min_val.copy_(x_min)
            self.max_val.copy_(x_max)
        else:
            c = self.averaging_constant
            self.min_val.copy_(self.min_val + c * (x_min - self.min_val))
            self.max_val.copy_(self.max_val + c * (x_max - self.max_val))


def _per_channel_aminmax(
    observer: torch.nn.Module, x: torch.Tensor, ch_axis: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = torch.flatten(x.transpose(0, ch_axis), start_dim=1)
    return finite_aminmax_rows(observer, rows)


class PerChannelMinMaxObserver(UniformQuantizationObserverBase):
    """Running min and max of each slice along ``ch_axis``; one (scale, zero_point) each.

    NaN and ±inf values are skipped and counted in ``nonfinite_skipped``, as by
    :class:`MinMaxObserver`; a channel that never held a finite value gets the
    qparams of zeros.
    """

    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        ch_axis: int = 0,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_channel_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict | None = None,
        eps: float = EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        if qscheme not in _PER_CHANNEL:
            raise NotImplementedError(
                f"{type(self).__name__} supports per_channel_affine, per_channel_symmetric and "
                f"per_channel_affine_float_qparams, not {qscheme}"
            )
        if is_dynamic:
            raise NotImplementedError(f"{type(self).__name__} does not support is_dynamic=True")
        super().__init__(
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            factory_kwargs=factory_kwargs,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        factory_kwargs = float32_factory_kwargs(factory_kwargs)
        self.ch_axis = ch_axis
        self.register_buffer("min_val", torch.tensor([], **factory_kwargs))
        self.register_buffer("max_val", torch.tensor([], **factory_kwargs))
        self._reject_symmetric_reduced_quint8()

    def _observed(self) -> None:
        """Called for each tensor with a finite value (moving averages count them)."""

    def _combine(self, cur: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        # a channel without finite values in ``cur`` is (inf, -inf): it keeps its range
        return torch.min(cur[0], self.min_val), torch.max(cur[1], self.max_val)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach().to(self.min_val.dtype)
        current = _per_channel_aminmax(self, x, self.ch_axis)
        if current is None:  # every value was NaN or infinite
            return x_orig
        self._observed()
        if self.min_val.numel() == 0 or self.max_val.numel() == 0:
            min_val, max_val = current
        else:
            min_val, max_val = self._combine(current)
        self.min_val.resize_(min_val.shape).copy_(min_val)
        self.max_val.resize_(max_val.shape).copy_(max_val)
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._calculate_qparams(self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"

    def reset_min_max_vals(self) -> None:
        self.min_val = torch.empty(0, dtype=self.min_val.dtype, device=self.min_val.device)
        self.max_val = torch.empty(0, dtype=self.max_val.dtype, device=self.max_val.device)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args) -> None:
        # buffers start empty; take the saved shape (torch.ao names, version 3)
        for name in ("min_val", "max_val"):
            if prefix + name in state_dict:
                getattr(self, name).resize_(state_dict[prefix + name].shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args)


class MovingAveragePerChannelMinMaxObserver(PerChannelMinMaxObserver):
    """Per-channel moving averages of the min and max."""

    def __init__(
        self,
        averaging_constant: float = 0.01,
        ch_axis: int = 0,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_channel_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        eps: float = EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            ch_axis=ch_axis,
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        self.averaging_constant = averaging_constant
        _register_batch_counter(self)

    def _observed(self) -> None:
        self.batches_observed += 1

    def _combine(self, cur: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.averaging_constant
        lo, hi = self.min_val, self.max_val
        averaged = lo + c * (cur[0] - lo), hi + c * (cur[1] - hi)
        # A channel without finite values in ``cur`` (inf, -inf) keeps its average; one
        # without any before takes ``cur``'s (inf + c * (x - inf) would be NaN).
        now, before = torch.isfinite(cur[0]), torch.isfinite(lo)
        return (
            torch.where(now, torch.where(before, averaged[0], cur[0]), lo),
            torch.where(now, torch.where(before, averaged[1], cur[1]), hi),
        )
