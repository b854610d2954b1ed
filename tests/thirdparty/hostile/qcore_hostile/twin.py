"""One module serving two backends (entry points twin-a and twin-b)."""

import torch

from qcore import BackendPatternConfig, hookimpl
from qcore_hostile.common import INT8

QCORE_PLUGIN_API_VERSION = 1

PATTERNS = {"twin-a": torch.nn.Linear, "twin-b": torch.nn.Conv2d}


@hookimpl
def qcore_backend_pattern_configs(backend):
    return [BackendPatternConfig(PATTERNS[backend]).add_dtype_config(INT8)]
