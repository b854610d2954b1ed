"""Pooling and shape ops: they run on torch's int8 tensors as they are.

Ops that select or move values (max pooling, flatten, reshape, transpose, ...)
are exact on int8, so any output qparams the reference asks for are reached by
an exact requantization. Ops that average (avg pooling, adaptive avg pooling,
mean, interpolate) round once in the input's qparams: they are taken only where
the reference's output shares the input's qparams, as the backends' configs
declare for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qcore.kernels.common import same_as_input, same_averaging
from qcore.plugin.kernels import KernelMatch, SameOp

__all__ = ["AVERAGING_PATTERNS", "SELECTING_PATTERNS", "lower_averaging", "lower_selecting"]

aten = torch.ops.aten

SELECTING_PATTERNS = (
    torch.nn.MaxPool1d,
    torch.nn.MaxPool2d,
    torch.nn.MaxPool3d,
    F.max_pool1d,
    F.max_pool2d,
    F.max_pool3d,
    torch.nn.PixelShuffle,
    torch.nn.PixelUnshuffle,
    F.pixel_shuffle,
    F.pixel_unshuffle,
    torch.nn.ChannelShuffle,
    torch.channel_shuffle,
    torch.nn.Identity,
    torch.nn.Dropout,
    F.dropout,
    torch.flatten,
    torch.transpose,
    torch.squeeze,
    torch.unsqueeze,
    torch.narrow,
    torch.repeat_interleave,
    torch.stack,
    "flatten",
    "reshape",
    "view",
    "transpose",
    "permute",
    "contiguous",
    "squeeze",
    "unsqueeze",
    "narrow",
    "repeat",
    "repeat_interleave",
    "detach",
    # torch.export's aten ops (PT2E graphs)
    aten.max_pool1d.default,
    aten.max_pool2d.default,
    aten.max_pool3d.default,
    aten.flatten.using_ints,
    aten.reshape.default,
    aten.view.default,
    aten.permute.default,
    aten.transpose.int,
    aten.channel_shuffle.default,
)

AVERAGING_PATTERNS = (
    torch.nn.AvgPool1d,
    torch.nn.AvgPool2d,
    torch.nn.AvgPool3d,
    torch.nn.AdaptiveAvgPool1d,
    torch.nn.AdaptiveAvgPool2d,
    torch.nn.AdaptiveAvgPool3d,
    F.avg_pool1d,
    F.avg_pool2d,
    F.avg_pool3d,
    F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d,
    F.interpolate,
    torch.mean,
    "mean",
    aten.avg_pool2d.default,
    aten.adaptive_avg_pool2d.default,
    aten.mean.dim,
)


def lower_selecting(match: KernelMatch) -> SameOp:
    module = match.module
    if isinstance(module, torch.nn.Dropout) and module.training:
        raise ValueError("dropout in training mode")
    return same_as_input(match)


def lower_averaging(match: KernelMatch) -> SameOp:
    return same_averaging(match)
