"""Running an elementwise int8 op on a tensor's memory in the order it is laid out.

Every int8 conv returns channels-last tensors. Some of torch's int8 elementwise
kernels mishandle them (qnnpack's clamp scrambles them) or return contiguous
ones (elu), which makes the next conv copy its input back to channels-last; on
quantized tensors that copy is not vectorized and costs more than the op. Viewed
as NHWC, a channels-last tensor is contiguous: the op runs there, and the
result, viewed back as NCHW, is channels-last again. No copy either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["elementwise_in_memory_order"]


class _ChannelsLast(NamedTuple):
    memory_format: torch.memory_format
    to_channels_innermost: tuple[int, ...]
    back: tuple[int, ...]


_CHANNELS_LAST = {
    4: _ChannelsLast(torch.channels_last, (0, 2, 3, 1), (0, 3, 1, 2)),
    5: _ChannelsLast(torch.channels_last_3d, (0, 2, 3, 4, 1), (0, 4, 1, 2, 3)),
}


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
    if x.is_contiguous():
        return op(x)
    layout = _CHANNELS_LAST.get(x.dim())
    if layout is not None and x.is_contiguous(memory_format=layout.memory_format):
        return op(x.permute(layout.to_channels_innermost)).permute(layout.back)
    return op(x.contiguous())
