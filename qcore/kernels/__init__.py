"""The int8 kernel library plugins register, by engine: ``kernels_for("fbgemm")``.

Modules by family: ``weighted`` (linear, conv, conv-transpose), ``binary``
(add, mul, cat, matmul), ``activations``, ``norms``, ``shape`` (pooling and
shape ops on int8 as they are), ``layout`` (elementwise ops in the
input's memory order), ``dynamic`` (dynamic linear, LSTM, GRU),
``dynamic_cells`` (dynamic LSTMCell, GRUCell, RNNCell),
``embedding`` (weight-only), ``onednn`` (x86's fused kernels); ``packed``
(save/load of packed weights), ``runtime`` (the engine in use, scoped) and
``library`` (the full set per engine).
"""

from qcore.engine.reference import QParams
from qcore.kernels.library import ENGINES, PACKED_AS, UNAVAILABLE, kernels_for
from qcore.kernels.weighted import QuantizedConv, QuantizedConvTranspose, QuantizedLinear
from qcore.plugin.kernels import ActivationQParams

__all__ = [
    "ENGINES",
    "PACKED_AS",
    "UNAVAILABLE",
    "ActivationQParams",
    "QParams",
    "QuantizedConv",
    "QuantizedConvTranspose",
    "QuantizedLinear",
    "kernels_for",
    "weighted_kernels",
]


def weighted_kernels(engine: str) -> list:
    """The whole library for ``engine`` (kept for plugins written before kernels_for)."""
    return kernels_for(engine)
