"""Standard pattern families of ops without weights.

Binary ops, cat, ops that observe their output on their own, ops with fixed
qparams (sigmoid, tanh, ...), ops whose output shares the input's qparams
(pooling, reshaping), ops that only read tensor metadata, and layer norm.
Each family takes the dtype configs it should accept and returns a list of
BackendPatternConfig with every pattern at most once. Re-exported by
:mod:`qcore.config.standard_ops`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qcore.config._standard_ops_base import (
    DIFFERENT,
    NOT_OBSERVED,
    SHARED,
    checked_dtype_configs,
    op_configs,
    pattern_config,
)
from qcore.config.dtypes import DTypeConfig, DTypeWithConstraints
from qcore.config.errors import ConfigError
from qcore.config.pattern import BackendPatternConfig

__all__ = [
    "FIXED_QPARAMS_0_TO_1",
    "FIXED_QPARAMS_NEG1_TO_1",
    "FIXED_QPARAMS_OP_CONSTRAINTS",
    "binary_op_pattern_configs",
    "cat_pattern_configs",
    "fixed_qparams_dtype_configs",
    "fixed_qparams_op_pattern_configs",
    "layer_norm_pattern_configs",
    "own_qparams_op_pattern_configs",
    "shared_qparams_op_pattern_configs",
    "tensor_info_op_pattern_configs",
]

FIXED_QPARAMS_0_TO_1 = DTypeWithConstraints(
    dtype=torch.quint8,
    quant_min_lower_bound=0,
    quant_max_upper_bound=255,
    scale_exact_match=1.0 / 256.0,
    zero_point_exact_match=0,
)
"""quint8 qparams for an output in [0, 1] (sigmoid, hardsigmoid, softmax)."""

FIXED_QPARAMS_NEG1_TO_1 = DTypeWithConstraints(
    dtype=torch.quint8,
    quant_min_lower_bound=0,
    quant_max_upper_bound=255,
    scale_exact_match=2.0 / 256.0,
    zero_point_exact_match=128,
)
"""quint8 qparams for an output in [-1, 1] (tanh)."""


FIXED_QPARAMS_OP_CONSTRAINTS: dict[Any, DTypeWithConstraints] = {
    nn.Hardsigmoid: FIXED_QPARAMS_0_TO_1,
    F.hardsigmoid: FIXED_QPARAMS_0_TO_1,
    "hardsigmoid": FIXED_QPARAMS_0_TO_1,
    "hardsigmoid_": FIXED_QPARAMS_0_TO_1,
    nn.Sigmoid: FIXED_QPARAMS_0_TO_1,
    torch.sigmoid: FIXED_QPARAMS_0_TO_1,
    "sigmoid": FIXED_QPARAMS_0_TO_1,
    "sigmoid_": FIXED_QPARAMS_0_TO_1,
    nn.Softmax: FIXED_QPARAMS_0_TO_1,
    nn.Tanh: FIXED_QPARAMS_NEG1_TO_1,
    torch.tanh: FIXED_QPARAMS_NEG1_TO_1,
    "tanh": FIXED_QPARAMS_NEG1_TO_1,
    "tanh_": FIXED_QPARAMS_NEG1_TO_1,
}
"""Each fixed-qparams op (module class, function or method name) and the
activation constraints its output must be quantized with."""

_BINARY_OPS = (operator.add, torch.add, operator.mul, torch.mul)

_BINARY_OP_OBSERVATION = {
    0: DIFFERENT,  # no tensor argument
    1: SHARED,  # tensor op scalar: the output keeps the tensor's qparams
    2: DIFFERENT,  # tensor op tensor
}

_OWN_QPARAMS_OPS = (
    nn.ELU,
    nn.LeakyReLU,
    nn.Hardswish,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.Dropout,
    nn.PReLU,
    F.elu,
    F.hardswish,
    F.leaky_relu,
    F.dropout,
)

_SHARED_QPARAMS_OPS = (
    # modules
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.ChannelShuffle,
    nn.Hardtanh,
    nn.Identity,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    nn.ReLU,
    nn.ReLU6,
    # functions
    torch.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d,
    F.hardtanh,
    F.hardtanh_,
    F.interpolate,
    F.max_pool1d,
    F.max_pool2d,
    F.max_pool3d,
    F.pixel_shuffle,
    F.pixel_unshuffle,
    F.relu,
    F.relu6,
    torch.avg_pool1d,
    torch._C._nn.avg_pool2d,
    torch._C._nn.avg_pool3d,
    torch.channel_shuffle,  # also F.channel_shuffle
    torch.clamp,
    torch.flatten,
    torch.mean,
    torch.narrow,
    torch.repeat_interleave,
    torch.transpose,
    torch.squeeze,
    torch.stack,
    torch.unsqueeze,
    operator.floordiv,
    # tensor methods
    "contiguous",
    "clamp",
    "detach",
    "detach_",
    "mean",
    "permute",
    "repeat",
    "repeat_interleave",
    "reshape",
    "resize_",
    "relu",
    "relu_",
    "squeeze",
    "squeeze_",
    "transpose",
    "unsqueeze",
    "unsqueeze_",
    "view",
)


def binary_op_pattern_configs(
    dtype_configs: Sequence[DTypeConfig],
) -> list[BackendPatternConfig]:
    """add and mul (``operator`` and ``torch`` forms), alone or followed by a
    relu (module, ``F.relu`` or ``torch.relu``), and ``torch.matmul``: 17 patterns.

    add/mul observe their output on its own when given two tensors and share
    the tensor's observer when given a tensor and a scalar
    (``num_tensor_args_to_observation_type``).
    """
    dtypes = checked_dtype_configs("binary_op_pattern_configs", dtype_configs)
    configs = []
    for op in _BINARY_OPS:
        for pattern in ((op, nn.ReLU), (op, F.relu), (op, torch.relu), op):
            configs.append(
                pattern_config(
                    pattern,
                    dtypes,
                    num_tensor_args_to_observation_type=_BINARY_OP_OBSERVATION,
                )
            )
    configs.append(pattern_config(torch.matmul, dtypes))
    return configs


def cat_pattern_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """``torch.cat``, whose output shares its inputs' observer."""
    dtypes = checked_dtype_configs("cat_pattern_configs", dtype_configs)
    return op_configs([torch.cat], dtypes, SHARED)


def own_qparams_op_pattern_configs(
    dtype_configs: Sequence[DTypeConfig],
) -> list[BackendPatternConfig]:
    """Ops whose output is observed on its own (torch.ao's "default ops"):
    ELU, LeakyReLU, Hardswish, InstanceNorm1d/2d/3d, Dropout, PReLU, their
    functional forms, and ``F.group_norm`` / ``F.instance_norm`` with the
    positions of their weight and bias arguments."""
    dtypes = checked_dtype_configs("own_qparams_op_pattern_configs", dtype_configs)
    return [
        *op_configs(_OWN_QPARAMS_OPS, dtypes),
        pattern_config(F.group_norm, dtypes, input_type_to_index={"weight": 2, "bias": 3}),
        pattern_config(F.instance_norm, dtypes, input_type_to_index={"weight": 3, "bias": 4}),
    ]


def fixed_qparams_dtype_configs(
    dtype_configs: Sequence[DTypeConfig], constraints: DTypeWithConstraints
) -> list[DTypeConfig]:
    """``dtype_configs`` with the fixed-qparams ``constraints`` applied.

    Where an input or output dtype equals ``constraints.dtype``, its quant
    range, ``scale_exact_match`` and ``zero_point_exact_match`` are taken from
    ``constraints``; other dtypes (e.g. qnnpack's qint8) are left unchanged.
    A scale bound on a matching dtype contradicts fixed qparams and raises
    a ConfigError.
    """
    dtypes = checked_dtype_configs("fixed_qparams_dtype_configs", dtype_configs)
    result = []
    for dtype_config in dtypes:
        activations = {}
        for kind in ("input", "output"):
            current = getattr(dtype_config, f"{kind}_dtype_with_constraints")
            if current.dtype == constraints.dtype:
                for bound in ("scale_min_lower_bound", "scale_max_upper_bound"):
                    if getattr(current, bound) is not None:
                        raise ConfigError(
                            f"fixed_qparams_dtype_configs: got {dtype_config!r} with {kind} "
                            f"{bound}={getattr(current, bound)}; expected no scale bound on a "
                            "dtype config for fixed-qparams ops (their scale is fixed)"
                        )
                current = dataclasses.replace(
                    current,
                    quant_min_lower_bound=constraints.quant_min_lower_bound,
                    quant_max_upper_bound=constraints.quant_max_upper_bound,
                    scale_exact_match=constraints.scale_exact_match,
                    zero_point_exact_match=constraints.zero_point_exact_match,
                )
            activations[f"{kind}_dtype"] = current
        result.append(
            DTypeConfig(
                **activations,
                weight_dtype=dtype_config.weight_dtype_with_constraints,
                bias_dtype=dtype_config.bias_dtype,
                is_dynamic=dtype_config.is_dynamic,
            )
        )
    return result


def fixed_qparams_op_pattern_configs(
    dtype_configs: Sequence[DTypeConfig],
) -> list[BackendPatternConfig]:
    """Ops with fixed output qparams (sigmoid, hardsigmoid, softmax, tanh in
    module, function and method forms): ``dtype_configs`` constrained with
    :data:`FIXED_QPARAMS_OP_CONSTRAINTS` (see :func:`fixed_qparams_dtype_configs`)."""
    dtypes = checked_dtype_configs("fixed_qparams_op_pattern_configs", dtype_configs)
    constrained = {
        id(constraints): fixed_qparams_dtype_configs(dtypes, constraints)
        for constraints in FIXED_QPARAMS_OP_CONSTRAINTS.values()
    }
    return [
        pattern_config(op, constrained[id(constraints)])
        for op, constraints in FIXED_QPARAMS_OP_CONSTRAINTS.items()
    ]


def shared_qparams_op_pattern_configs(
    dtype_configs: Sequence[DTypeConfig],
) -> list[BackendPatternConfig]:
    """Ops that work on float and quantized input alike and whose output
    shares the input's observer: pooling, hardtanh, relu, relu6, clamp,
    pixel shuffle, interpolate, mean, and reshaping ops (flatten, view,
    transpose, squeeze, ...), in module, function and method forms."""
    dtypes = checked_dtype_configs("shared_qparams_op_pattern_configs", dtype_configs)
    return op_configs(_SHARED_QPARAMS_OPS, dtypes, SHARED)


def tensor_info_op_pattern_configs(
    dtype_configs: Sequence[DTypeConfig],
) -> list[BackendPatternConfig]:
    """``x.shape`` and ``x.size()``: they return tensor metadata, so neither
    input nor output is observed."""
    dtypes = checked_dtype_configs("tensor_info_op_pattern_configs", dtype_configs)
    return op_configs(("shape", "size"), dtypes, NOT_OBSERVED)


def layer_norm_pattern_configs(
    dtype_configs: Sequence[DTypeConfig],
) -> list[BackendPatternConfig]:
    """``nn.LayerNorm`` and ``F.layer_norm`` (weight and bias at arguments 2
    and 3). Not part of the fbgemm, qnnpack or x86 configs in torch 2.13; used
    by torch.ao's legacy native config with input/output-only dtype configs."""
    dtypes = checked_dtype_configs("layer_norm_pattern_configs", dtype_configs)
    return [
        pattern_config(nn.LayerNorm, dtypes),
        pattern_config(F.layer_norm, dtypes, input_type_to_index={"weight": 2, "bias": 3}),
    ]
