"""Running an elementwise int8 op on a tensor's memory in the order it is laid out.

Every int8 conv returns channels-last tensors. Some of torch's int8 elementwise
kernels mishandle them (qnnpack's clamp scrambles them) or return contiguous
ones (elu), which makes the next conv copy its input back to channels-last; on
quantized tensors that copy is not vectorized and costs more than the op. Viewed
as NHWC, a channels-last tensor is contiguous: the op runs there, and the
result, viewed back as NCHW, is channels-last again. No copy either way.

The two halves, :func:`in_memory_order` and :func:`back_from_memory_order`, are
TorchScript functions' building blocks (a scripted kernel cannot pass its op
as a value); :func:`elementwise_in_memory_order` joins them for Python callers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["back_from_memory_order", "elementwise_in_memory_order", "in_memory_order"]


def in_memory_order(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``x`` as a contiguous tensor over its own memory (a permuted view where it is
    channels-last, else ``x.contiguous()``) and the permutation back (``[]``: none)."""
    if x.is_contiguous():
        return x, []
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return x.permute(0, 2, 3, 1), [0, 3, 1, 2]
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return x.permute(0, 2, 3, 4, 1), [0, 4, 1, 2, 3]
    return x.contiguous(), []


def back_from_memory_order(y: torch.Tensor, back: list[int]) -> torch.Tensor:
    """The result of an elementwise op on :func:`in_memory_order`'s view, in the
    input's dimension order (and so its memory layout)."""
    if len(back) == 0:
        return y
    return y.permute(back)


def elementwise_in_memory_order(
    op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """``op(x)`` for an elementwise ``op``, computed on a contiguous view of
    ``x``'s memory; the result has ``x``'s memory layout.

    Example::

        >>> y = elementwise_in_memory_order(lambda t: torch.clamp(t, 0.0, 6.0), qx)
        >>> y.is_contiguous(memory_format=torch.channels_last)   # if qx was
        True
    """
    view, back = in_memory_order(x)
    return back_from_memory_order(op(view), back)
