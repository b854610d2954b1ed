"""Standard pattern families of ops with weights, and their fusions.

Conv (1d/2d/3d, transposed), linear, batch norm, RNNs and embeddings: the
float modules, their QAT and fused forms, the functional forms, and the
fusion rules (with the fuser methods of :mod:`qcore.config.fusers`). Each
family takes the dtype configs it should accept and returns a list of
BackendPatternConfig with every pattern at most once. Re-exported by
:mod:`qcore.config.standard_ops`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch.ao.nn.intrinsic as nni
import torch.ao.nn.intrinsic.qat as nniqat
import torch.ao.nn.qat as nnqat
import torch.ao.nn.quantized.reference as nnqr
import torch.nn.functional as F
from torch import nn

from qcore.config._standard_ops_base import (
    WEIGHT_BIAS_ARGS,
    checked_dtype_configs,
    pattern_config,
)
from qcore.config.dtypes import DTypeConfig
from qcore.config.fusers import (
    fuse_bn2d_relu,
    fuse_bn3d_relu,
    fuse_conv1d_relu,
    fuse_conv2d_relu,
    fuse_conv3d_relu,
    fuse_conv_bn,
    fuse_conv_bn_relu,
    fuse_convtranspose_bn,
    fuse_linear_bn,
    fuse_linear_relu,
)
from qcore.config.pattern import BackendPatternConfig

__all__ = [
    "conv_pattern_configs",
    "linear_pattern_configs",
    "batch_norm_pattern_configs",
    "rnn_pattern_configs",
    "embedding_pattern_configs",
]


class _ConvClasses(NamedTuple):
    """Every class and function of one conv dimension."""

    conv: type[nn.Module]
    bn: type[nn.Module]
    functional: Any
    reference: type[nn.Module]
    qat: type[nn.Module]
    relu_fused: type[nn.Module]
    relu_fuser: Any
    relu_qat: type[nn.Module]
    bn_fused: type[nn.Module]
    bn_qat: type[nn.Module]
    bn_relu_fused: type[nn.Module]
    bn_relu_qat: type[nn.Module]
    transpose: type[nn.Module]
    transpose_functional: Any
    transpose_reference: type[nn.Module]


_CONV_CLASSES = (
    _ConvClasses(
        nn.Conv1d,
        nn.BatchNorm1d,
        F.conv1d,
        nnqr.Conv1d,
        nnqat.Conv1d,
        nni.ConvReLU1d,
        fuse_conv1d_relu,
        nniqat.ConvReLU1d,
        nni.ConvBn1d,
        nniqat.ConvBn1d,
        nni.ConvBnReLU1d,
        nniqat.ConvBnReLU1d,
        nn.ConvTranspose1d,
        F.conv_transpose1d,
        nnqr.ConvTranspose1d,
    ),
    _ConvClasses(
        nn.Conv2d,
        nn.BatchNorm2d,
        F.conv2d,
        nnqr.Conv2d,
        nnqat.Conv2d,
        nni.ConvReLU2d,
        fuse_conv2d_relu,
        nniqat.ConvReLU2d,
        nni.ConvBn2d,
        nniqat.ConvBn2d,
        nni.ConvBnReLU2d,
        nniqat.ConvBnReLU2d,
        nn.ConvTranspose2d,
        F.conv_transpose2d,
        nnqr.ConvTranspose2d,
    ),
    _ConvClasses(
        nn.Conv3d,
        nn.BatchNorm3d,
        F.conv3d,
        nnqr.Conv3d,
        nnqat.Conv3d,
        nni.ConvReLU3d,
        fuse_conv3d_relu,
        nniqat.ConvReLU3d,
        nni.ConvBn3d,
        nniqat.ConvBn3d,
        nni.ConvBnReLU3d,
        nniqat.ConvBnReLU3d,
        nn.ConvTranspose3d,
        F.conv_transpose3d,
        nnqr.ConvTranspose3d,
    ),
)


def _one_conv_dimension(c: _ConvClasses, dtypes: list[DTypeConfig]) -> list[BackendPatternConfig]:
    to_reference = {"root": c.conv, "reference": c.reference}
    return [
        # (1) the conv alone: float module, QAT module, functional
        pattern_config(c.conv, dtypes, qat=c.qat, **to_reference),
        pattern_config(c.qat, dtypes, **to_reference),
        pattern_config(c.functional, dtypes, input_type_to_index=WEIGHT_BIAS_ARGS),
        # (2) conv + relu: fusion rules, the fused module and its QAT form, functional
        pattern_config((c.conv, nn.ReLU), dtypes, fuser=c.relu_fuser, fused=c.relu_fused),
        pattern_config((c.conv, F.relu), dtypes, fuser=c.relu_fuser, fused=c.relu_fused),
        # torch.ao configures the fused ConvReLU twice; its second setting, which
        # wins there, names only the QAT module.
        pattern_config(c.relu_fused, dtypes, qat=c.relu_qat),
        pattern_config(c.relu_qat, dtypes, **to_reference),
        pattern_config((c.functional, nn.ReLU), dtypes),
        pattern_config((c.functional, F.relu), dtypes),
        # (3) conv + bn (+ relu): fusion rules, fused modules and their QAT forms
        pattern_config((c.conv, c.bn), dtypes, fuser=fuse_conv_bn, fused=c.bn_fused),
        pattern_config(
            (c.conv, c.bn, nn.ReLU), dtypes, fuser=fuse_conv_bn_relu, fused=c.bn_relu_fused
        ),
        pattern_config(
            (c.conv, c.bn, F.relu),
            dtypes,
            root=c.conv,
            fuser=fuse_conv_bn_relu,
            fused=c.bn_relu_fused,
        ),
        pattern_config(c.bn_fused, dtypes, qat=c.bn_qat),
        pattern_config(c.bn_relu_fused, dtypes, qat=c.bn_relu_qat),
        pattern_config(c.bn_qat, dtypes, **to_reference),
        pattern_config(c.bn_relu_qat, dtypes, **to_reference),
        # (4) transposed conv, its bn folding (post-training only), functional
        pattern_config(c.transpose, dtypes, root=c.transpose, reference=c.transpose_reference),
        pattern_config(
            (c.transpose, c.bn),
            dtypes,
            root=c.transpose,
            reference=c.transpose_reference,
            fuser=fuse_convtranspose_bn,
        ),
        pattern_config(c.transpose_functional, dtypes, input_type_to_index=WEIGHT_BIAS_ARGS),
    ]


def conv_pattern_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """Conv1d/2d/3d and ConvTranspose1d/2d/3d, 19 patterns per dimension.

    For each dimension: the conv module, its QAT module and ``F.convNd``;
    conv + ReLU (module or ``F.relu``) fusion, the fused ``ConvReLUNd`` and
    its QAT form, ``F.convNd`` + relu; conv + BatchNorm (+ ReLU) fusion, the
    fused ``ConvBnNd``/``ConvBnReLUNd`` and their QAT forms; the transposed
    conv, its BatchNorm folding and ``F.conv_transposeNd``.
    """
    dtypes = checked_dtype_configs("conv_pattern_configs", dtype_configs)
    return [config for c in _CONV_CLASSES for config in _one_conv_dimension(c, dtypes)]


def linear_pattern_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """Linear, 12 patterns: the module, its QAT module, ``F.linear``; linear +
    ReLU fusion, ``LinearReLU`` and its QAT form, ``F.linear`` + relu; linear +
    BatchNorm1d fusion, ``LinearBn1d`` and its QAT form."""
    dtypes = checked_dtype_configs("linear_pattern_configs", dtype_configs)
    to_reference = {"root": nn.Linear, "reference": nnqr.Linear}
    return [
        pattern_config(nn.Linear, dtypes, qat=nnqat.Linear, **to_reference),
        pattern_config(nnqat.Linear, dtypes, **to_reference),
        pattern_config(F.linear, dtypes, input_type_to_index=WEIGHT_BIAS_ARGS),
        pattern_config((nn.Linear, nn.ReLU), dtypes, fuser=fuse_linear_relu, fused=nni.LinearReLU),
        pattern_config((nn.Linear, F.relu), dtypes, fuser=fuse_linear_relu, fused=nni.LinearReLU),
        pattern_config(nni.LinearReLU, dtypes, qat=nniqat.LinearReLU, **to_reference),
        pattern_config(nniqat.LinearReLU, dtypes, **to_reference),
        pattern_config((F.linear, nn.ReLU), dtypes),
        pattern_config((F.linear, F.relu), dtypes),
        pattern_config(
            (nn.Linear, nn.BatchNorm1d), dtypes, fuser=fuse_linear_bn, fused=nni.LinearBn1d
        ),
        pattern_config(nni.LinearBn1d, dtypes, qat=nniqat.LinearBn1d, **to_reference),
        pattern_config(nniqat.LinearBn1d, dtypes, **to_reference),
    ]


def batch_norm_pattern_configs(
    dtype_configs: Sequence[DTypeConfig],
) -> list[BackendPatternConfig]:
    """BatchNorm2d/3d, 8 patterns: BN + ReLU (module or ``F.relu``) fusion into
    ``BNReLU2d``/``BNReLU3d``, the BN module alone, and the fused modules."""
    dtypes = checked_dtype_configs("batch_norm_pattern_configs", dtype_configs)
    fusions = (
        (nn.BatchNorm2d, nni.BNReLU2d, fuse_bn2d_relu),
        (nn.BatchNorm3d, nni.BNReLU3d, fuse_bn3d_relu),
    )
    configs = []
    for bn, fused, fuser in fusions:
        configs += [
            pattern_config((bn, nn.ReLU), dtypes, fuser=fuser, fused=fused),
            pattern_config((bn, F.relu), dtypes, fuser=fuser, fused=fused),
            pattern_config(bn, dtypes),
        ]
    configs += [pattern_config(fused, dtypes) for _, fused, _ in fusions]
    return configs


def rnn_pattern_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """GRUCell, LSTMCell, RNNCell, LSTM and GRU with their reference modules.

    The native backends pass dynamic dtype configs here (``is_dynamic=True``):
    weights are quantized ahead of time, activations on the fly.
    """
    dtypes = checked_dtype_configs("rnn_pattern_configs", dtype_configs)
    rnns = (
        (nn.GRUCell, nnqr.GRUCell),
        (nn.LSTMCell, nnqr.LSTMCell),
        (nn.RNNCell, nnqr.RNNCell),
        (nn.LSTM, nnqr.LSTM),
        (nn.GRU, nnqr.GRU),
    )
    return [pattern_config(rnn, dtypes, root=rnn, reference=ref) for rnn, ref in rnns]


def embedding_pattern_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """Embedding and EmbeddingBag and their QAT modules.

    The native backends pass weight-only dtype configs here (float input and
    output, quint8 or quint4x2 weight).
    """
    dtypes = checked_dtype_configs("embedding_pattern_configs", dtype_configs)
    configs = []
    for embedding, qat, reference in (
        (nn.Embedding, nnqat.Embedding, nnqr.Embedding),
        (nn.EmbeddingBag, nnqat.EmbeddingBag, nnqr.EmbeddingBag),
    ):
        configs += [
            pattern_config(embedding, dtypes, qat=qat, root=embedding, reference=reference),
            pattern_config(qat, dtypes, root=embedding, reference=reference),
        ]
    return configs
