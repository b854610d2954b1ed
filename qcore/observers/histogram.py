"""HistogramObserver: a running histogram, and the L2-optimal range within it.

The search is torch.ao's (caffe2's NormMinimization): starting from the full
range, greedily drop the sparser tail, a 1e-5 quantile step at a time, while
the L2 error of quantizing the histogram to ``2**bits`` bins to the candidate
range keeps falling. torch.ao walks that loop in Python and computes each
candidate's error separately (~60 ms per observer). Here the walk jumps from
one bin change to the next (the candidates do not depend on the errors, only
where the walk stops does), and the errors of a batch of candidates are
computed as one tensor expression, with the same float32 operations, so the
chosen range is the same.

The state is three buffers, ``histogram``, ``min_val`` and ``max_val``, so it
survives ``state_dict`` and two observers' histograms can be merged
(:meth:`HistogramObserver.merge`) the way successive batches are.

NaN and ±inf are not counted (``nonfinite_skipped`` counts them; convert warns
once), magnitudes beyond ``RANGE_LIMIT`` (1.7e38) are counted as ±RANGE_LIMIT, and
ranges too wide for float32's arithmetic are counted and searched in units that
are not (:mod:`qcore.observers.nonfinite`). torch.ao's observer fails on a NaN
("torch.histc: range of [nan, nan] is not finite") and puts every value of a range
wider than 1.7e35 in its first bin.
"""

from __future__ import annotations

import bisect
import itertools
import math
import struct
import warnings
from typing import Any

import torch

from qcore.observers.base import (
    _PER_TENSOR,
    EPS,
    RANGE_LIMIT,
    UniformQuantizationObserverBase,
    float32_factory_kwargs,
)
from qcore.observers.histogram_merge import UPSAMPLE_RATE, histc, merge_rows, rebin_rows
from qcore.observers.nonfinite import finite_aminmax

__all__ = ["HistogramObserver"]

_STEP = 1e-5  # torch.ao's quantile granularity
_ALPHAS: list[float] = []  # alpha after k moves, accumulated exactly as torch.ao's loop does
_BETAS: list[float] = []
_FIRST_BATCH = 8  # candidates whose errors are computed together, doubling up to _MAX_BATCH
_MAX_BATCH = 512
# Bins wider than this are searched in units of one bin: the L2 errors grow as the
# bin width squared and would overflow float32 (a range of 2e9 over 2048 bins is
# still searched in its own units, as torch.ao does).
_WIDEST_BIN = 1e6


def _quantile_steps() -> tuple[list[float], list[float]]:
    if not _ALPHAS:
        n = int(1 / _STEP) + 2
        _ALPHAS.extend(itertools.accumulate(itertools.repeat(_STEP, n), initial=0.0))
        _BETAS.extend(itertools.accumulate(itertools.repeat(-_STEP, n), initial=1.0))
    return _ALPHAS, _BETAS


def _f32(value: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _candidates(csum: list[float], total: float, bins: int):
    """The (start_bin, end_bin) pairs torch.ao's greedy walk evaluates, in order,
    assuming each is accepted (the walk stops at the first rejected one)."""
    alphas, betas = _quantile_steps()
    a = b = 0
    start, end = 0, bins - 1

    def ends_below(k: int) -> bool:  # the end bin moves down at beta step k
        return _f32(betas[k] * total) < csum[end]

    while alphas[a] < betas[b]:
        # the first bin reaching the alpha quantile, the last within the beta one
        left = min(max(bisect.bisect_left(csum, _f32(alphas[a + 1] * total)), start), end)
        right = bisect.bisect_right(csum, _f32(betas[b + 1] * total)) - 1
        right = max(min(right, end), start)
        if left - start > end - right:
            a += 1
            start = left
            yield start, end
        elif right < end:
            b += 1
            end = right
            yield start, end
        else:
            # nothing moves; torch.ao steps beta until the end bin moves or the
            # quantiles meet: jump there
            lo, hi = b + 1, len(betas) - 2
            while lo < hi:
                mid = (lo + hi) // 2
                if not alphas[a] < betas[mid] or (start < end and ends_below(mid + 1)):
                    hi = mid
                else:
                    lo = mid + 1
            b = lo


class HistogramObserver(UniformQuantizationObserverBase):
    """Records a ``bins``-bin histogram of the observed values; ``calculate_qparams``
    picks the range minimizing the L2 quantization error, then qparams as
    :class:`MinMaxObserver` computes them for that range.

    NaN and ±inf values are skipped and counted in ``nonfinite_skipped`` (convert
    warns once, naming the observers); magnitudes beyond ``RANGE_LIMIT`` (1.7e38)
    count as ``±RANGE_LIMIT``, so the scale is always finite and positive.
    """

    histogram: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        bins: int = 2048,
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
                f"HistogramObserver supports per-tensor qschemes only, not {qscheme}"
            )
        if is_dynamic:
            raise NotImplementedError("HistogramObserver does not support is_dynamic=True")
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
        self.bins = bins
        self.register_buffer("histogram", torch.zeros(bins, **factory_kwargs))
        self.register_buffer("min_val", torch.tensor(float("inf"), **factory_kwargs))
        self.register_buffer("max_val", torch.tensor(float("-inf"), **factory_kwargs))
        self.dst_nbins = 2 ** torch.iinfo(dtype).bits
        self.upsample_rate = UPSAMPLE_RATE  # finer bins when re-binning an old histogram

    # -- recording ---------------------------------------------------------------

    def _rebin(
        self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, new_lo, new_hi
    ) -> torch.Tensor:
        """``hist`` over [lo, hi] re-binned over [new_lo, new_hi] ⊇ [lo, hi]
        (``qcore.observers.histogram_merge``: each bin split in ``upsample_rate``
        parts, each part's mass put where its middle falls)."""
        row = [torch.as_tensor(v).reshape(1) for v in (lo, hi, new_lo, new_hi)]
        return rebin_rows(hist[None], *row, self.upsample_rate)[0]

    def _store(self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        self.histogram.detach_().resize_(hist.shape).copy_(hist)
        self.min_val.detach_().resize_(lo.shape).copy_(lo)
        self.max_val.detach_().resize_(hi.shape).copy_(hi)

    def _record(self, x: torch.Tensor, x_min: torch.Tensor, x_max: torch.Tensor) -> None:
        """Add the values ``x`` (within [x_min, x_max]), growing the range as needed;
        merging another histogram is :meth:`merge`."""
        if self.min_val == float("inf") or self.max_val == float("-inf"):
            self._store(histc(x, self.bins, x_min, x_max), x_min, x_max)
            return
        new_lo = torch.min(self.min_val, x_min).detach()
        new_hi = torch.max(self.max_val, x_max).detach()
        update = histc(x, self.bins, new_lo, new_hi).to(self.histogram.device)
        if new_lo == self.min_val and new_hi == self.max_val:
            self._store(self.histogram + update, new_lo, new_hi)
        else:
            old = self._rebin(self.histogram, self.min_val, self.max_val, new_lo, new_hi)
            self._store(update + old, new_lo, new_hi)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach()
        extremes = finite_aminmax(self, x)
        if extremes is None:  # every value was NaN or infinite
            return x_orig
        x_min, x_max = extremes
        # histc leaves out NaN and values outside [x_min, x_max], ±inf among them;
        # finite values beyond the limit are counted at its ends
        if x_min.item() == -RANGE_LIMIT or x_max.item() == RANGE_LIMIT:
            x = torch.where(torch.isfinite(x), x.clamp(-RANGE_LIMIT, RANGE_LIMIT), math.nan)
        self._record(x, x_min, x_max)
        return x_orig

    def merge(self, other: HistogramObserver) -> None:
        """Add ``other``'s histogram (e.g. from another process) to this one, re-binned
        to the union of both ranges as a new batch would be."""
        if other.bins != self.bins:
            raise ValueError(
                f"cannot merge a {other.bins}-bin histogram into a {self.bins}-bin one"
            )
        mine = (self.histogram[None], self.min_val.reshape(1), self.max_val.reshape(1))
        theirs = (other.histogram[None], other.min_val.reshape(1), other.max_val.reshape(1))
        hist, lo, hi = merge_rows(*mine, *(t.detach() for t in theirs), self.upsample_rate)
        self._store(hist[0], lo.reshape(self.min_val.shape), hi.reshape(self.max_val.shape))

    # -- the range search ----------------------------------------------------------

    def _errors(self, starts: list[int], ends: list[int], bin_width: float) -> torch.Tensor:
        """L2 error of quantizing the histogram to each candidate range (torch.ao's
        ``_compute_quantization_error``, one row per candidate)."""
        device = self.histogram.device
        start = torch.tensor(starts, device=device)[:, None]
        count = torch.tensor(ends, device=device)[:, None] - start + 1
        dst64 = bin_width * count.double() / self.dst_nbins
        dst = dst64.float()
        half = (dst64 / 2).float()
        width = torch.tensor(bin_width, dtype=torch.float32, device=device)
        src = torch.arange(self.bins, device=device)
        begin = (src - start).float() * width
        end = begin + width
        last = self.dst_nbins - 1
        dst_of_begin = torch.clamp(torch.div(begin, dst, rounding_mode="floor"), 0, last)
        dst_of_end = torch.clamp(torch.div(end, dst, rounding_mode="floor"), 0, last)
        density = self.histogram / width

        def norm(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
            return density * ((hi * hi * hi - lo * lo * lo) / 3)

        errors = norm(begin - (dst_of_begin + 0.5) * dst, torch.ones_like(begin) * half)
        errors = errors + (dst_of_end - dst_of_begin - 1) * norm(-half, half)
        errors = errors + norm(-half, end - (dst_of_end * dst + half))
        errors = errors.sum(dim=1)
        return torch.where(dst64[:, 0] == 0.0, torch.zeros_like(errors), errors)

    def _non_linear_param_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(new_min, new_max): the range torch.ao's greedy L2 search settles on."""
        if self.histogram.numel() != self.bins:
            raise ValueError(
                f"histogram has {self.histogram.numel()} bins, the observer {self.bins}"
            )
        bin_width = (self.max_val.item() - self.min_val.item()) / self.bins
        if bin_width > _WIDEST_BIN:
            bin_width = 1.0  # the errors scale with the width squared: the same choice
        csum = torch.cumsum(self.histogram, dim=0).tolist()
        total = torch.sum(self.histogram).item()
        walk = _candidates(csum, total, self.bins)
        best = (0, self.bins - 1)
        best_error = math.inf
        batch = _FIRST_BATCH
        while True:
            chunk = list(itertools.islice(walk, batch))
            if not chunk:
                break
            starts, ends = zip(*chunk, strict=True)
            errors = self._errors(list(starts), list(ends), bin_width).tolist()
            stop = False
            for candidate, error in zip(chunk, errors, strict=True):
                if error > best_error:
                    stop = True
                    break
                best, best_error = candidate, error
            if stop:
                break
            batch = min(2 * batch, _MAX_BATCH)
        step = (self.max_val - self.min_val) / self.bins
        return self.min_val + step * best[0], self.min_val + step * (best[1] + 1)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.min_val == float("inf") and self.max_val == float("-inf"):
            warnings.warn(
                "HistogramObserver.calculate_qparams() called before it observed any tensor; "
                "returning scale 1.0 and zero point 0",
                stacklevel=2,
            )
            device = self.min_val.device
            unit = torch.tensor([1.0], dtype=torch.float32, device=device)
            return unit, torch.tensor([0], device=device)
        new_min, new_max = self._non_linear_param_search()
        return self._calculate_qparams(new_min, new_max)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args) -> None:
        version = local_metadata.get("version")
        for name, empty in (("min_val", float("inf")), ("max_val", float("-inf"))):
            key = prefix + name
            if key in state_dict and (version is None or version < 3):
                if state_dict[key].shape == torch.Size([0]):  # torch.ao before version 3
                    state_dict[key] = torch.tensor(empty)
        for name in ("histogram", "min_val", "max_val"):
            if prefix + name in state_dict:
                getattr(self, name).resize_(state_dict[prefix + name].shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"
