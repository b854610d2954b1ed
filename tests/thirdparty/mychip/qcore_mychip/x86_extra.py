"""Adds the tutorial's constrained quint8 dtype config to x86's Linear."""

import torch

from qcore import BackendPatternConfig, hookimpl
from qcore_mychip.plugin import weighted_int8_dtype_config

QCORE_PLUGIN_API_VERSION = 1


@hookimpl
def qcore_backend_pattern_configs(backend):
    return [BackendPatternConfig(torch.nn.Linear).add_dtype_config(weighted_int8_dtype_config)]
