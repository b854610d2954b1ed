"""The qnnpack backend's dtype configs and pattern configs (torch 2.13's native qnnpack).

Besides asymmetric quint8, qnnpack accepts symmetric qint8 (XNNPACK): signed
activations and weights in [-127, 127], with a smallest scale of 2**-12 so
that XNNPACK's requantization scale stays within its lower bound.
"""

from __future__ import annotations

import torch

from qcore.config import BackendPatternConfig, DTypeConfig, DTypeWithConstraints
from qcore.config.standard_ops import standard_pattern_configs

BACKEND = "qnnpack"

SCALE_MIN = 2**-12
"""The smallest scale qnnpack's symmetric qint8 kernels (XNNPACK) accept."""

act_qint8_scale_min_2_neg_12 = DTypeWithConstraints(
    dtype=torch.qint8, scale_min_lower_bound=SCALE_MIN
)
weight_qint8_neg_127_to_127_scale_min_2_neg_12 = DTypeWithConstraints(
    dtype=torch.qint8,
    quant_min_lower_bound=-127,
    quant_max_upper_bound=127,
    scale_min_lower_bound=SCALE_MIN,
)

weighted_op_qint8_symmetric = DTypeConfig(
    input_dtype=act_qint8_scale_min_2_neg_12,
    output_dtype=act_qint8_scale_min_2_neg_12,
    weight_dtype=weight_qint8_neg_127_to_127_scale_min_2_neg_12,
    bias_dtype=torch.float,
)
"""Symmetric qint8 for ops with weights (XNNPACK)."""

default_op_qint8_symmetric = DTypeConfig(
    input_dtype=act_qint8_scale_min_2_neg_12,
    output_dtype=act_qint8_scale_min_2_neg_12,
)
"""Symmetric qint8 for ops without weights (XNNPACK)."""

weighted_op_quint8 = DTypeConfig(
    input_dtype=torch.quint8,
    output_dtype=torch.quint8,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
)
"""Static int8: quint8 activations, qint8 weights, float bias."""

default_op_quint8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8)
"""Static int8 for ops without weights."""

dynamic_int8 = DTypeConfig(
    input_dtype=torch.quint8,
    output_dtype=torch.float,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
    is_dynamic=True,
)
"""Dynamic int8: weights quantized ahead of time, activations on the fly."""

dynamic_float16 = DTypeConfig(
    input_dtype=torch.float16,
    output_dtype=torch.float,
    weight_dtype=torch.float16,
    bias_dtype=torch.float,
    is_dynamic=True,
)
"""Dynamic float16."""

weight_only_quint8 = DTypeConfig(
    input_dtype=torch.float, output_dtype=torch.float, weight_dtype=torch.quint8
)
"""Weight-only quint8 (embeddings)."""

weight_only_quint4x2 = DTypeConfig(
    input_dtype=torch.float, output_dtype=torch.float, weight_dtype=torch.quint4x2
)
"""Weight-only 4-bit (embeddings)."""


def pattern_configs() -> list[BackendPatternConfig]:
    """qnnpack's 190 pattern configs (no tensor-info ops: x.shape, x.size())."""
    default_ops = [default_op_qint8_symmetric, default_op_quint8]
    return standard_pattern_configs(
        conv=[weighted_op_qint8_symmetric, weighted_op_quint8],
        linear=[weighted_op_qint8_symmetric, weighted_op_quint8, dynamic_int8, dynamic_float16],
        binary_op=default_ops,
        cat=default_ops,
        own_qparams_op=default_ops,
        fixed_qparams_op=default_ops,
        shared_qparams_op=default_ops,
        batch_norm=default_ops,
        rnn=[dynamic_int8, dynamic_float16],
        embedding=[weight_only_quint8, weight_only_quint4x2],
    )
