"""ACME's chip: every hook answers whatever ``backend`` it is asked about.

The chip has a conv-relu unit of its own (AcmeConvReLU2d, made by its own fuser),
takes qint8 activations, and needs scales of at least 2**-12. None of this may
change what ``quantize(model, backend="native")`` does for a user who never
asked for "acme" (tests/test_installed_plugins.py, the thirdparty environment).
"""

import torch

from qcore import (
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    QConfig,
    QConfigMapping,
    hookimpl,
)
from qcore.observers import MinMaxObserver

QCORE_PLUGIN_API_VERSION = 1

qint8 = DTypeWithConstraints(dtype=torch.qint8, scale_min_lower_bound=2**-12)
ACME_INT8 = DTypeConfig(
    input_dtype=qint8, output_dtype=qint8, weight_dtype=torch.qint8, bias_dtype=torch.float
)


class AcmeConvReLU2d(torch.nn.Sequential):
    """The chip's fused conv-relu unit; only ACME's kernels know it."""


def fuse_conv_relu(is_qat, conv, relu):
    return AcmeConvReLU2d(conv, relu)


@hookimpl
def qcore_backend_pattern_configs(backend):
    return [
        BackendPatternConfig(torch.nn.Linear)
        .add_dtype_config(ACME_INT8)
        .set_root_module(torch.nn.Linear)
        .set_reference_quantized_module(torch.ao.nn.quantized.reference.Linear),
        BackendPatternConfig((torch.nn.Conv2d, torch.nn.ReLU))
        .set_fused_module(AcmeConvReLU2d)
        .set_fuser_method(fuse_conv_relu),
        BackendPatternConfig(AcmeConvReLU2d)
        .add_dtype_config(ACME_INT8)
        .set_root_module(torch.nn.Conv2d)
        .set_reference_quantized_module(torch.ao.nn.quantized.reference.Conv2d),
    ]


@hookimpl
def qcore_default_qconfig_mapping(backend, is_qat):
    activation = MinMaxObserver.with_args(
        dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, eps=2**-12
    )
    weight = MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    return QConfigMapping().set_global(QConfig(activation=activation, weight=weight))
