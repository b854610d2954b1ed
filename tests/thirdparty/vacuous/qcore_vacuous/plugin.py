"""A backend that looks complete and quantizes nothing.

It declares Linear and Conv2d patterns, but its dtype configs require
power-of-two scales, which the default QConfigMapping's observers never give:
every op stays float. Its kernels: one for Linear that refuses every match, one
for a module class no conformance model can be built for, with no reason
declared. ``qcore check vacuous`` must fail the kernel check and the model
checks (tests/test_conformance_vacuous.py); before issue 16 it passed them.
"""

import torch
import torch.ao.nn.quantized.reference as nnqr

from qcore import (
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    Kernel,
    ObservationType,
    hookimpl,
)

QCORE_PLUGIN_API_VERSION = 1

BACKEND = "vacuous"

shift_scaled = DTypeWithConstraints(dtype=torch.quint8, scale_power_of_two=True)
int8 = DTypeConfig(
    input_dtype=shift_scaled,
    output_dtype=shift_scaled,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
)


class VacuousBlock(torch.nn.Module):
    """A module class of the vendor's own: nothing qcore knows how to build."""


def refuse(match):
    raise NotImplementedError("the vacuous chip runs nothing yet")


@hookimpl
def qcore_backend_pattern_configs(backend):
    different = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    return [
        BackendPatternConfig(module)
        .set_observation_type(different)
        .add_dtype_config(int8)
        .set_root_module(module)
        .set_reference_quantized_module(reference)
        for module, reference in ((torch.nn.Linear, nnqr.Linear), (torch.nn.Conv2d, nnqr.Conv2d))
    ]


@hookimpl
def qcore_backend_kernels(backend):
    return [
        Kernel("vacuous.linear", torch.nn.Linear, BACKEND, refuse),
        Kernel("vacuous.block", VacuousBlock, BACKEND, refuse),
    ]
