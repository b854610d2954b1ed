"""Re-binning and merging histograms, many at once.

A histogram row is ``bins`` counts over ``[lo, hi]``. Re-binning it over a wider
range splits each bin in ``rate`` equal parts and puts each part's mass in the
new bin its middle falls in (``bucketize(middle, new_edges, right=True) - 1``,
clamped to the bins), as torch.ao's HistogramObserver does. The parts are in
order, so a new bin holds a run of them: a search per new edge and differences of
the cumulative mass replace a lookup per part, and rows are searched together.
:class:`~qcore.observers.histogram.HistogramObserver` re-bins one row with it as a
batch grows its range; ``qcore.sync_observers``
merges hundreds of observers' histograms in one call of :func:`merge_rows`.
"""

from __future__ import annotations

import torch

__all__ = ["UPSAMPLE_RATE", "histc", "merge_rows", "rebin_rows"]

#: Parts per bin when re-binning (torch.ao's HistogramObserver.upsample_rate).
UPSAMPLE_RATE = 16
_F64 = torch.float64
_F32_MAX = torch.finfo(torch.float32).max


def histc(x: torch.Tensor, bins: int, lo: float | torch.Tensor, hi: float | torch.Tensor):
    """``torch.histc(x, bins, lo, hi)`` in ``x``'s dtype, correct for huge ranges too.

    histc computes ``(x - lo) * bins`` in ``x``'s dtype: when that passes float32's
    largest value (ranges wider than 1.7e35 for 2048 bins) it puts every value in the
    first bin, so such ranges are counted in float64. NaN and values outside
    [lo, hi] (±inf among them) are not counted.
    """
    low, high = float(lo), float(hi)
    if (high - low) * bins < _F32_MAX / 2:
        return torch.histc(x, bins, min=lo, max=hi)
    return torch.histc(x.double(), bins, min=low, max=high).to(x.dtype)


def _count_below(middles: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Per row, how many of the (sorted, evenly spaced) ``middles`` lie below each
    edge: ``searchsorted(middles, edges)``. An arithmetic guess corrected against the
    middles themselves; rows the corrections do not settle are searched."""
    count = middles.shape[1]
    first = middles[:, :1].double()
    step = (middles[:, -1:].double() - first) / max(count - 1, 1)
    guess = ((edges.double() - first) / step).ceil_().nan_to_num_(0.0, count, 0.0)
    guess = guess.clamp_(0, count).long()

    def misplaced(guess: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        too_high = (guess > 0) & (middles.gather(1, (guess - 1).clamp(min=0)) >= edges)
        too_low = (guess < count) & (middles.gather(1, guess.clamp(max=count - 1)) < edges)
        return too_high, too_low

    for _ in range(2):
        too_high, too_low = misplaced(guess)
        if not bool((too_high | too_low).any()):
            return guess
        guess = guess - too_high.long() + too_low.long()
    too_high, too_low = misplaced(guess)
    rows = (too_high | too_low).any(dim=1)
    guess[rows] = torch.searchsorted(middles[rows], edges[rows], right=False)
    return guess


def rebin_rows(
    hist: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    new_lo: torch.Tensor,
    new_hi: torch.Tensor,
    rate: int,
) -> torch.Tensor:
    """Rows of ``hist`` (K, bins) over [lo, hi] re-binned over [new_lo, new_hi] ⊇ [lo, hi].

    ``lo``, ``hi``, ``new_lo``, ``new_hi`` are (K,) tensors of the histogram's dtype.
    The part middles and new edges are torch.linspace's, in that dtype, as torch.ao's
    HistogramObserver computes them, so calibrating gives its histograms bit for bit.
    A row with ``lo == hi`` (one value seen) puts all its mass in the value's bin.
    """
    rows, bins = hist.shape
    parts = bins * rate
    single = (lo == hi).tolist()
    middles, inner_edges = [], []
    for row in range(rows):
        # torch.linspace per row (cheap next to the search below), to match its rounding
        low, high = (lo[row], hi[row]) if not single[row] else (lo[row], lo[row] + 1)
        width = (high - low) / parts
        middles.append(torch.linspace(low, high, parts + 1)[:-1] + 0.5 * width)
        inner_edges.append(torch.linspace(new_lo[row], new_hi[row], bins + 1)[1:-1])
    # Parts before each inner edge (bucketize's right=True bins); clamping puts the
    # rest in the first and last bins.
    before = _count_below(torch.stack(middles), torch.stack(inner_edges))
    before = torch.cat([before.new_zeros(rows, 1), before, before.new_full((rows, 1), parts)], 1)
    mass = hist.to(_F64)
    cumulative = torch.cat([mass.new_zeros(rows, 1), mass.cumsum(1)], dim=1)
    whole, part = before // rate, before % rate
    through = cumulative.gather(1, whole) + mass.gather(1, whole.clamp(max=bins - 1)) * part / rate
    result = (through[:, 1:] - through[:, :-1]).clamp_(min=0).to(hist.dtype)
    for row in (r for r in range(rows) if single[r]):
        value = lo[row].reshape(1)
        lump = histc(value, bins, new_lo[row], new_hi[row])
        result[row] = lump * hist[row].sum()
    return result


def merge_rows(
    hist: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    other: torch.Tensor,
    other_lo: torch.Tensor,
    other_hi: torch.Tensor,
    rate: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add the ``other`` histograms to ``hist`` row by row, both re-binned to the union
    of their ranges, as :meth:`HistogramObserver.merge` does one at a time. A row never
    observed has ``lo = inf`` and ``hi = -inf``. Returns the new (hist, lo, hi)."""
    seen, other_seen = torch.isfinite(lo), torch.isfinite(other_lo)
    # An unobserved side's (inf, -inf) drops out of the union by itself.
    new_lo, new_hi = torch.minimum(lo, other_lo), torch.maximum(hi, other_hi)
    merged = hist.clone()

    def rebinned(rows, values, low, high):
        moves = rows & ((low != new_lo) | (high != new_hi))
        values = values.clone()
        if bool(moves.any()):
            values[moves] = rebin_rows(
                values[moves], low[moves], high[moves], new_lo[moves], new_hi[moves], rate
            )
        return values

    both = seen & other_seen
    if bool(both.any()):
        summed = rebinned(both, hist, lo, hi) + rebinned(both, other, other_lo, other_hi)
        merged[both] = summed[both]
    only_other = ~seen & other_seen
    merged[only_other] = other[only_other]
    return merged, new_lo, new_hi
