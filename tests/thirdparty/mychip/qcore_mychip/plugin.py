"""The BackendConfig tutorial's backend, as a qcore plugin."""

import torch

from qcore import (
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
    hookimpl,
)

QCORE_PLUGIN_API_VERSION = 1

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
    return torch.ao.nn.intrinsic.ConvReLU2d(conv, relu)


@hookimpl
def qcore_backend_pattern_configs(backend):
    different = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    return [
        BackendPatternConfig(torch.nn.Linear)
        .set_observation_type(different)
        .add_dtype_config(weighted_int8_dtype_config)
        .set_root_module(torch.nn.Linear)
        .set_qat_module(torch.ao.nn.qat.Linear)
        .set_reference_quantized_module(torch.ao.nn.quantized.reference.Linear),
        BackendPatternConfig((torch.nn.Conv2d, torch.nn.ReLU))
        .set_fused_module(torch.ao.nn.intrinsic.ConvReLU2d)
        .set_fuser_method(fuse_conv2d_relu),
        BackendPatternConfig(torch.ao.nn.intrinsic.ConvReLU2d)
        .set_observation_type(different)
        .add_dtype_config(weighted_int8_dtype_config)
        .set_root_module(torch.nn.Conv2d)
        .set_qat_module(torch.ao.nn.intrinsic.qat.ConvReLU2d)
        .set_reference_quantized_module(torch.ao.nn.quantized.reference.Conv2d),
    ]


@hookimpl
def qcore_backend_kernels(backend):
    return []
