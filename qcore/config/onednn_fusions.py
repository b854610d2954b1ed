"""The fusions torch.ao's ``onednn`` BackendConfig adds to the standard families.

oneDNN runs a conv2d together with a residual add (and a relu after it), and a
linear together with leaky_relu or tanh. These families configure those
patterns as torch 2.13's onednn config does, with qcore's fuser methods:

* :func:`conv_add_pattern_configs` -- ``conv2d [-> bn] -> add(other) [-> relu]``,
  the conv on either side of ``torch.add``/``operator.add``, fused into
  ``ConvAdd2d``/``ConvAddReLU2d``; the other operand becomes the fused
  module's second input (``extra_inputs_getter``). 18 patterns.
* :func:`linear_eltwise_pattern_configs` -- ``linear [-> bn] -> leaky_relu``
  and ``linear -> tanh`` (``LinearLeakyReLU``, ``LinearTanh``). 11 patterns.

Folding a BatchNorm into a conv or linear that is then fused further needs
eval mode: for QAT these fusers raise a :class:`~qcore.config.fusers.FusionError`
(torch.ao raises NotImplementedError).

Example (a backend that runs conv + add in one kernel)::

    >>> from qcore.config.onednn_fusions import conv_add_pattern_configs
    >>> BackendConfig("mychip").set_backend_pattern_configs(
    ...     conv_add_pattern_configs([weighted_int8]))
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
from torch import nn
from torch.fx import Node
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

from qcore.config._standard_ops_base import checked_dtype_configs
from qcore.config.dtypes import DTypeConfig
from qcore.config.fusers import (
    FusionError,
    _check_eval,
    _check_same_mode,
    _name,
    fuse_linear_leaky_relu,
    fuse_linear_tanh,
)
from qcore.config.pattern import BackendPatternConfig, MatchAllNode

__all__ = [
    "conv_add_pattern_configs",
    "fuse_conv_add",
    "fuse_conv_add_relu",
    "fuse_linear_bn_leaky_relu",
    "linear_eltwise_pattern_configs",
]

_ADD_OPS = (torch.add, operator.add)


def _folded_conv(fuser: str, is_qat: bool, part: Any) -> nn.Module:
    """The conv of a matched ``conv`` or ``(bn, conv)``, the BatchNorm folded in."""
    if not isinstance(part, tuple):
        return part
    bn, conv = part
    if is_qat:
        raise FusionError(
            f"{fuser}: got {_name(conv)} and {_name(bn)} with is_qat=True; expected "
            "is_qat=False (a conv + BatchNorm fused further into an add is folded, which "
            "quantization-aware training cannot train; prepare QAT with backend 'x86')"
        )
    _check_eval(fuser, conv, bn)
    return fuse_conv_bn_eval(conv, bn)


def _conv_side(left: Any, right: Any) -> Any:
    """The conv operand of a matched add: the side that is not ``MatchAllNode``."""
    return right if left is MatchAllNode else left


def fuse_conv_add(is_qat: bool, add: Any, left: Any, right: Any) -> nn.Module:
    """``(add, conv, other)`` or ``(add, other, conv)``, conv possibly ``(bn, conv)``,
    into ``ConvAdd2d(conv, add)``; called by the engine with the matched modules."""
    conv = _folded_conv("fuse_conv_add", is_qat, _conv_side(left, right))
    return nni.ConvAdd2d(conv, add)


def fuse_conv_add_relu(is_qat: bool, relu: nn.Module, add_match: tuple) -> nn.Module:
    """``(relu, (add, conv, other))`` (either side, conv possibly ``(bn, conv)``) into
    ``ConvAddReLU2d(conv, add, relu)``."""
    add, left, right = add_match
    conv = _folded_conv("fuse_conv_add_relu", is_qat, _conv_side(left, right))
    return nni.ConvAddReLU2d(conv, add, relu)


def _add_match(nested: tuple) -> tuple:
    """The ``(add, left, right)`` node match, under a relu or not."""
    return nested[1] if len(nested) == 2 else nested


def _conv_node(part: Any) -> Node:
    return part[1] if isinstance(part, tuple) else part  # (bn, conv) -> conv


def conv_add_left_root(nested: tuple) -> Node:
    """The conv node of ``add(conv, other)``: the fused module's node."""
    return _conv_node(_add_match(nested)[1])


def conv_add_right_root(nested: tuple) -> Node:
    """The conv node of ``add(other, conv)``."""
    return _conv_node(_add_match(nested)[2])


def conv_add_left_extra_inputs(nested: tuple) -> list[Node]:
    """``[other]`` of ``add(conv, other)``: the fused module's second input."""
    return [_add_match(nested)[2]]


def conv_add_right_extra_inputs(nested: tuple) -> list[Node]:
    """``[other]`` of ``add(other, conv)``."""
    return [_add_match(nested)[1]]


def _conv_add_configs(
    dtypes: list[DTypeConfig], relu: bool, fused: type[nn.Module]
) -> list[BackendPatternConfig]:
    configs = []
    for conv_left in (True, False):
        for with_bn in (True, False):
            for add_op in _ADD_OPS:
                conv: Any = (nn.BatchNorm2d, nn.Conv2d) if with_bn else nn.Conv2d
                add = (add_op, conv, MatchAllNode) if conv_left else (add_op, MatchAllNode, conv)
                configs.append(
                    BackendPatternConfig()
                    ._set_pattern_complex_format((nn.ReLU, add) if relu else add)
                    .set_dtype_configs(dtypes)
                    .set_fuser_method(fuse_conv_add_relu if relu else fuse_conv_add)
                    ._set_root_node_getter(conv_add_left_root if conv_left else conv_add_right_root)
                    ._set_extra_inputs_getter(
                        conv_add_left_extra_inputs if conv_left else conv_add_right_extra_inputs
                    )
                    .set_fused_module(fused)
                )
    configs.append(
        BackendPatternConfig(fused)
        .set_dtype_configs(dtypes)
        .set_root_module(nn.Conv2d)
        .set_reference_quantized_module(torch.ao.nn.quantized.reference.Conv2d)
    )
    return configs


def conv_add_pattern_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """Conv2d (+ BatchNorm2d) + add (+ ReLU) fusions and their fused modules."""
    dtypes = checked_dtype_configs("conv_add", dtype_configs)
    return [
        *_conv_add_configs(dtypes, relu=False, fused=nni.ConvAdd2d),
        *_conv_add_configs(dtypes, relu=True, fused=nni.ConvAddReLU2d),
    ]


def fuse_linear_bn_leaky_relu(
    is_qat: bool, linear: nn.Module, bn: nn.Module, leaky_relu: nn.Module
) -> nn.Module:
    """``Linear, BatchNorm1d, LeakyReLU`` into ``LinearLeakyReLU`` with the
    BatchNorm folded (eval mode only, as in torch.ao)."""
    fuser = "fuse_linear_bn_leaky_relu"
    _check_same_mode(fuser, linear, bn, leaky_relu)
    if is_qat:
        raise FusionError(
            f"{fuser}: got {_name(linear)}, {_name(bn)} and {_name(leaky_relu)} with "
            "is_qat=True; expected is_qat=False (the BatchNorm is folded, which "
            "quantization-aware training cannot train)"
        )
    _check_eval(fuser, linear, bn)
    if type(linear) is not nn.Linear:
        raise FusionError(f"{fuser}: got {_name(linear)}; expected a torch.nn.Linear")
    return nni.LinearLeakyReLU(fuse_linear_bn_eval(linear, bn), leaky_relu)


def _eltwise_configs(
    dtypes: list[DTypeConfig], module: type, function: Any, fused: type[nn.Module], fuser: Any
) -> list[BackendPatternConfig]:
    return [
        BackendPatternConfig((nn.Linear, module))
        .set_dtype_configs(dtypes)
        .set_fuser_method(fuser)
        .set_fused_module(fused),
        BackendPatternConfig((nn.Linear, function))
        .set_dtype_configs(dtypes)
        .set_fuser_method(fuser)
        .set_fused_module(fused),
        BackendPatternConfig(fused)
        .set_dtype_configs(dtypes)
        .set_root_module(nn.Linear)
        .set_reference_quantized_module(torch.ao.nn.quantized.reference.Linear),
        BackendPatternConfig((torch.nn.functional.linear, module)).set_dtype_configs(dtypes),
        BackendPatternConfig((torch.nn.functional.linear, function)).set_dtype_configs(dtypes),
    ]


def linear_eltwise_pattern_configs(
    dtype_configs: Sequence[DTypeConfig],
) -> list[BackendPatternConfig]:
    """Linear (+ BatchNorm1d) + LeakyReLU and Linear + Tanh, fused and functional."""
    dtypes = checked_dtype_configs("linear_eltwise", dtype_configs)
    return [
        *_eltwise_configs(
            dtypes,
            nn.LeakyReLU,
            torch.nn.functional.leaky_relu,
            nni.LinearLeakyReLU,
            fuse_linear_leaky_relu,
        ),
        BackendPatternConfig((nn.Linear, nn.BatchNorm1d, nn.LeakyReLU))
        .set_dtype_configs(dtypes)
        .set_fuser_method(fuse_linear_bn_leaky_relu)
        .set_fused_module(nni.LinearLeakyReLU),
        *_eltwise_configs(dtypes, nn.Tanh, torch.tanh, nni.LinearTanh, fuse_linear_tanh),
    ]


# A (BatchNorm, conv) part is folded for good: QAT, which trains the BatchNorm,
# leaves these patterns to conv + BatchNorm and a separate add (qcore.engine.fuse).
fuse_conv_add.trains_batchnorm = False  # type: ignore[attr-defined]
fuse_conv_add_relu.trains_batchnorm = False  # type: ignore[attr-defined]
