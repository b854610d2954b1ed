"""A vendor's addition to x86, a backend it does not own: a GELU pattern and kernel.

Misbehaves as QCORE_HOSTILE_X86 says ("exit-import", "hook-error"); unset, it
is well behaved and adds int8 GELU, which x86 itself leaves in float.
"""

import os

import torch
import torch.nn.functional as F

from qcore import BackendPatternConfig, Kernel, ObservationType, hookimpl
from qcore_hostile.common import INT8

MODE = os.environ.get("QCORE_HOSTILE_X86", "")

QCORE_PLUGIN_API_VERSION = 1

if MODE == "exit-import":
    raise SystemExit(3)


class QuantizedGELU(torch.nn.Module):
    """GELU on a torch quantized tensor, quantized to the output's qparams (and range)."""

    honors_quant_range = True

    def __init__(self, scale: float, zero_point: int, dtype: torch.dtype, quant_range) -> None:
        super().__init__()
        self.scale, self.zero_point, self.dtype = scale, zero_point, dtype
        info = torch.iinfo(dtype)
        low, high = quant_range or (info.min, info.max)
        self.low, self.high = (low - zero_point) * scale, (high - zero_point) * scale

    def forward(self, x):
        y = F.gelu(x.dequantize()).clamp(self.low, self.high)
        return torch.quantize_per_tensor(y, self.scale, self.zero_point, self.dtype)


def lower_gelu(match):
    if match.output is None:
        raise ValueError("the output stays float")
    out = match.output
    return QuantizedGELU(out.scale, out.zero_point, out.dtype, out.quant_range)


@hookimpl
def qcore_backend_pattern_configs(backend):
    if MODE == "hook-error":
        raise RuntimeError("vendor SDK not initialised")
    different = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    return [
        BackendPatternConfig(pattern).set_observation_type(different).add_dtype_config(INT8)
        for pattern in (torch.nn.GELU, F.gelu)
    ]


@hookimpl
def qcore_backend_kernels(backend):
    return [
        Kernel("hostile.gelu", pattern, "x86", lower_gelu)
        for pattern in (torch.nn.GELU, F.gelu, torch.ops.aten.gelu.default)
    ]
