"""The float form of a weighted op with its post-ops, as oneDNN fuses them.

PT2E quantizers such as x86's annotate ``conv -> add(other) -> relu`` or
``linear -> gelu`` as one pattern: the intermediate values are never
quantized. :class:`WeightedWithPostOps` is that pattern as one module (the
reference semantics, run on dequantized weights inside a ReferenceModule), so
a backend's kernel can take it whole. A weighted op with relu alone, or with
nothing, keeps torch.ao's classes (``ConvReLU2d``, ``LinearReLU``, ``Conv2d``),
which every backend's kernels know.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["WeightedWithPostOps"]


class WeightedWithPostOps(nn.Sequential):
    """``weighted(x)``, plus ``other`` if ``residual_add``, then ``activation``.

    ``self[0]`` is the conv or linear (where the weights live, as in torch.ao's
    fused containers), ``self[1]`` the activation module if there is one.

    Example::

        >>> fused = WeightedWithPostOps(nn.Conv2d(8, 8, 3), residual_add=True,
        ...                             activation=nn.ReLU())
        >>> y = fused(x, shortcut)          # relu(conv(x) + shortcut)
    """

    def __init__(
        self, weighted: nn.Module, *, residual_add: bool, activation: nn.Module | None
    ) -> None:
        super().__init__(weighted, *([activation] if activation is not None else []))
        self.residual_add = residual_add

    @property
    def activation(self) -> nn.Module | None:
        return self[1] if len(self) > 1 else None

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        if self.residual_add != (other is not None):
            expected = "a residual input" if self.residual_add else "no residual input"
            raise TypeError(f"WeightedWithPostOps: expected {expected}")
        y = self[0](x)
        if other is not None:
            y = y + other
        activation = self.activation
        return y if activation is None else activation(y)

    def extra_repr(self) -> str:
        return f"residual_add={self.residual_add}"
