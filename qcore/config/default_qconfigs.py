"""The default QConfigMappings of the native backends (fbgemm, qnnpack, x86).

One builder, parametrised by backend, for what plugins return from the
``qcore_default_qconfig_mapping`` hook. The result is equivalent to torch.ao's
``get_default_qconfig_mapping(backend)`` (post-training, version 0) and
``get_default_qat_qconfig_mapping(backend)`` (QAT, version 1), built
explicitly from torch.ao.quantization's QConfig, QConfigMapping, observer and
fake-quantize classes until qcore has observers of its own.

torch.ao is imported when a mapping is built, not when this module is.

Example::

    >>> mapping = default_qconfig_mapping("qnnpack", is_qat=False)
    >>> mapping.global_qconfig.activation
    functools.partial(<class '...HistogramObserver'>, reduce_range=False){}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qcore.config.errors import ConfigError

__all__ = [
    "NATIVE_QCONFIG_STYLES",
    "NativeQConfigStyle",
    "default_qconfig",
    "default_qconfig_mapping",
]


@dataclass(frozen=True)
class NativeQConfigStyle:
    """How a native backend's default QConfig differs from the others'."""

    reduce_range: bool
    """Activations use 7 bits (avoids overflow in fbgemm's/x86's vpmaddubsw)."""
    per_channel_weights: bool
    """Weights are observed per output channel."""
    per_tensor_transposed_conv: bool
    """Transposed convs get a per-tensor weight observer (per-channel is not
    supported for them; pytorch issue 47535)."""


NATIVE_QCONFIG_STYLES = {
    "fbgemm": NativeQConfigStyle(
        reduce_range=True, per_channel_weights=True, per_tensor_transposed_conv=True
    ),
    "qnnpack": NativeQConfigStyle(
        reduce_range=False, per_channel_weights=False, per_tensor_transposed_conv=False
    ),
    "x86": NativeQConfigStyle(
        reduce_range=True, per_channel_weights=True, per_tensor_transposed_conv=True
    ),
}
"""The backends :func:`default_qconfig_mapping` knows, and their style."""


def _style(backend: str) -> NativeQConfigStyle:
    style = NATIVE_QCONFIG_STYLES.get(backend)
    if style is None:
        raise ConfigError(
            f"default_qconfig_mapping backend: got {backend!r}; expected one of "
            f"{sorted(NATIVE_QCONFIG_STYLES)}"
        )
    return style


def _weight(is_qat: bool, per_channel: bool, fused: bool) -> Any:
    """The int8 symmetric weight observer (PTQ) or fake-quantize (QAT)."""
    from torch.ao.quantization import (
        FakeQuantize,
        FusedMovingAvgObsFakeQuantize,
        MinMaxObserver,
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
        PerChannelMinMaxObserver,
    )

    qscheme = torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric
    if not is_qat:
        observer = PerChannelMinMaxObserver if per_channel else MinMaxObserver
        return observer.with_args(dtype=torch.qint8, qscheme=qscheme)
    observer = MovingAveragePerChannelMinMaxObserver if per_channel else MovingAverageMinMaxObserver
    if fused:
        return FusedMovingAvgObsFakeQuantize.with_args(
            observer=observer, quant_min=-128, quant_max=127, dtype=torch.qint8, qscheme=qscheme
        )
    return FakeQuantize.with_args(
        observer=observer,
        quant_min=-128,
        quant_max=127,
        dtype=torch.qint8,
        qscheme=qscheme,
        reduce_range=False,
    )


def default_qconfig(backend: str, is_qat: bool = False) -> Any:
    """The backend's global default QConfig (torch.ao's ``get_default_qconfig``
    or, with ``is_qat=True``, ``get_default_qat_qconfig``)."""
    from torch.ao.quantization import (
        FusedMovingAvgObsFakeQuantize,
        HistogramObserver,
        MovingAverageMinMaxObserver,
        QConfig,
    )

    style = _style(backend)
    if is_qat:
        activation = FusedMovingAvgObsFakeQuantize.with_args(
            observer=MovingAverageMinMaxObserver,
            quant_min=0,
            quant_max=255,
            reduce_range=style.reduce_range,
        )
    else:
        activation = HistogramObserver.with_args(reduce_range=style.reduce_range)
    weight = _weight(is_qat, style.per_channel_weights, fused=True)
    return QConfig(activation=activation, weight=weight)


def default_qconfig_mapping(backend: str, is_qat: bool = False) -> Any:
    """The backend's default torch.ao QConfigMapping for PTQ or QAT.

    The global QConfig is :func:`default_qconfig`; on top of it: ``reshape``
    reuses its input's observer; transposed convs get a per-tensor weight
    observer where the backend needs one; layer norm keeps float weights;
    PReLU gets quint8 weights; and the fixed-qparams ops (sigmoid,
    hardsigmoid, softmax, tanh) get fixed-qparams observers (fake-quantizes
    in QAT) matching ``qcore.config.standard_ops.FIXED_QPARAMS_OP_CONSTRAINTS``.
    """
    import torch.nn.functional as F
    from torch import nn
    from torch.ao.quantization import (
        FixedQParamsFakeQuantize,
        FixedQParamsObserver,
        HistogramObserver,
        MinMaxObserver,
        NoopObserver,
        PlaceholderObserver,
        QConfig,
        QConfigMapping,
        ReuseInputObserver,
    )

    from qcore.config.standard_activation_ops import FIXED_QPARAMS_OP_CONSTRAINTS

    style = _style(backend)
    qconfig = default_qconfig(backend, is_qat)
    per_tensor_weight = _weight(is_qat, per_channel=False, fused=False)
    transposed = (
        QConfig(activation=qconfig.activation, weight=per_tensor_weight)
        if style.per_tensor_transposed_conv
        else qconfig
    )
    float_weight = QConfig(activation=qconfig.activation, weight=PlaceholderObserver)
    mapping = (
        QConfigMapping()
        .set_global(qconfig)
        .set_object_type("reshape", QConfig(activation=ReuseInputObserver, weight=NoopObserver))
    )
    for op in (
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
        F.conv_transpose1d,
        F.conv_transpose2d,
        F.conv_transpose3d,
    ):
        mapping.set_object_type(op, transposed)
    mapping.set_object_type(F.layer_norm, float_weight)
    mapping.set_object_type(nn.LayerNorm, float_weight)
    mapping.set_object_type(nn.PReLU, QConfig(activation=HistogramObserver, weight=MinMaxObserver))

    # One QConfig per distinct fixed range, shared by the ops that have it.
    fixed_qconfigs: dict[int, Any] = {}
    for op, constraints in FIXED_QPARAMS_OP_CONSTRAINTS.items():
        fixed = fixed_qconfigs.get(id(constraints))
        if fixed is None:
            observer = FixedQParamsObserver.with_args(
                scale=constraints.scale_exact_match,
                zero_point=constraints.zero_point_exact_match,
                dtype=constraints.dtype,
                quant_min=constraints.quant_min_lower_bound,
                quant_max=constraints.quant_max_upper_bound,
            )
            activation = (
                FixedQParamsFakeQuantize.with_args(observer=observer) if is_qat else observer
            )
            fixed = fixed_qconfigs[id(constraints)] = QConfig(
                activation=activation, weight=per_tensor_weight
            )
        mapping.set_object_type(op, fixed)
    return mapping
