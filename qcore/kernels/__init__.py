"""The int8 kernels plugins register: a library backends pick from by engine."""

from qcore.kernels.weighted import (
    ActivationQParams,
    QuantizedConv,
    QuantizedLinear,
    weighted_kernels,
)

__all__ = ["ActivationQParams", "QuantizedConv", "QuantizedLinear", "weighted_kernels"]
