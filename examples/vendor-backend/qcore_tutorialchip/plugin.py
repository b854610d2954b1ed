"""The hooks qcore calls for the ``tutorialchip`` backend.

qcore imports this module (the entry point ``qcore.backends: tutorialchip``)
only when the backend is asked for; ``qcore backends`` lists it from the
package metadata alone.
"""

import torch
import torch.ao.nn.intrinsic as nni

from qcore import (
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    Kernel,
    ObservationType,
    hookimpl,
)
from qcore_tutorialchip.kernels import IntegerConv2d, IntegerLinear

# The plugin API this module was written for; qcore refuses a plugin of another.
QCORE_PLUGIN_API_VERSION = 1

BACKEND = "tutorialchip"

# Seed 002's constraints: the chip's requantizer takes scales down to 2**-12.
quint8_with_constraints = DTypeWithConstraints(
    dtype=torch.quint8,
    quant_min_lower_bound=0,
    quant_max_upper_bound=255,
    scale_min_lower_bound=2**-12,
)
weighted_int8_dtype_config = DTypeConfig(
    input_dtype=quint8_with_constraints,
    output_dtype=quint8_with_constraints,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
)


def fuse_conv2d_relu(is_qat, conv, relu):
    """Return a fused ConvReLU2d from individual conv and relu modules."""
    return nni.ConvReLU2d(conv, relu)


@hookimpl
def qcore_backend_pattern_configs(backend):
    """Linear, and conv2d-relu (fused from Conv2d followed by ReLU)."""
    if backend != BACKEND:
        return None
    different = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    return [
        BackendPatternConfig(torch.nn.Linear)
        .set_observation_type(different)
        .add_dtype_config(weighted_int8_dtype_config)
        .set_root_module(torch.nn.Linear)
        .set_qat_module(torch.ao.nn.qat.Linear)
        .set_reference_quantized_module(torch.ao.nn.quantized.reference.Linear),
        BackendPatternConfig((torch.nn.Conv2d, torch.nn.ReLU))
        .set_fused_module(nni.ConvReLU2d)
        .set_fuser_method(fuse_conv2d_relu),
        BackendPatternConfig(nni.ConvReLU2d)
        .set_observation_type(different)
        .add_dtype_config(weighted_int8_dtype_config)
        .set_root_module(torch.nn.Conv2d)
        .set_qat_module(torch.ao.nn.intrinsic.qat.ConvReLU2d)
        .set_reference_quantized_module(torch.ao.nn.quantized.reference.Conv2d),
    ]


@hookimpl
def qcore_backend_kernels(backend):
    """The chip's integer kernels for the two patterns above."""
    if backend != BACKEND:
        return None
    return [
        Kernel("tutorialchip.linear", torch.nn.Linear, BACKEND, IntegerLinear.lower),
        Kernel("tutorialchip.conv2d_relu", nni.ConvReLU2d, BACKEND, IntegerConv2d.lower),
    ]


@hookimpl
def qcore_default_qconfig_mapping(backend, is_qat):
    """QConfigs within the chip's constraints (torch.ao's defaults use eps 2**-23).

    Activations: histogram observer (PTQ) or fake quant (QAT), quint8 0..255, eps
    2**-12. Weights: qint8 symmetric per tensor, what the kernels take.
    """
    if backend != BACKEND:
        return None
    from qcore import (
        FakeQuantize,
        HistogramObserver,
        MinMaxObserver,
        MovingAverageMinMaxObserver,
        QConfig,
        QConfigMapping,
    )

    range_and_eps = dict(dtype=torch.quint8, quant_min=0, quant_max=255, eps=2**-12)
    symmetric_int8 = dict(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    if is_qat:
        activation = FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, **range_and_eps)
        weight = FakeQuantize.with_args(
            observer=MinMaxObserver, quant_min=-128, quant_max=127, **symmetric_int8
        )
    else:
        activation = HistogramObserver.with_args(**range_and_eps)
        weight = MinMaxObserver.with_args(**symmetric_int8)
    return QConfigMapping().set_global(QConfig(activation=activation, weight=weight))
