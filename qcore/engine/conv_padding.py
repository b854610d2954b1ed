"""A convolution's ``padding="same"``/``"valid"`` as the integers int8 kernels take.

torch's quantized convolutions (and their prepack ops) take explicit per-dimension
padding only. ``"valid"`` is zero padding. ``"same"`` (stride 1) pads each spatial
dimension by ``dilation * (kernel - 1)`` in total; when that is even, torch splits it
equally between both sides, which explicit padding gives exactly. When it is odd
(an even kernel with odd dilation) torch pads one more on the far side, which no
symmetric padding gives: such a conv keeps its string and runs in reference form.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["explicit_padding", "per_dim"]


def per_dim(value: int | Sequence[int], dims: int) -> list[int]:
    """A conv argument that torch accepts as one int for every dimension, as a list."""
    return [value] * dims if isinstance(value, int) else list(value)


def explicit_padding(
    padding: str | int | Sequence[int], kernel_size: Sequence[int], dilation: int | Sequence[int]
) -> list[int] | None:
    """Per-dimension padding equal to ``padding``, or None where none is.

    Example::

        >>> explicit_padding("same", (3, 5), 1)
        [1, 2]
        >>> explicit_padding("same", (2, 2), 1) is None    # torch pads 0 before, 1 after
        True
    """
    dims = len(kernel_size)
    if not isinstance(padding, str):
        return per_dim(padding, dims)
    if padding == "valid":
        return [0] * dims
    if padding != "same":
        return None
    totals = [d * (k - 1) for d, k in zip(per_dim(dilation, dims), kernel_size, strict=True)]
    if any(total % 2 for total in totals):
        return None
    return [total // 2 for total in totals]
