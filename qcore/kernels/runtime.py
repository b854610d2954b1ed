"""What kernels share: engine-scoped packing and torch's quantized tensors.

torch's int8 kernels take torch.quint8/qint8 tensors. torch 2.13 deprecates
creating them and warns, once per process (TORCH_WARN_ONCE). qcore's kernels
use them only inside a converted model, so at lowering time qcore spends that
one warning under a filter: a converted model's forward then prints nothing,
while qcore leaves the user's own warning filters untouched.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import warnings
from collections.abc import Iterator

import torch

__all__ = [
    "TORCH_QUANTIZED_DTYPE",
    "int8_products_saturate",
    "using_engine",
    "quiet_quantized_tensors",
    "to_torch_qtensor",
]

TORCH_QUANTIZED_DTYPE = {
    torch.quint8: torch.quint8,
    torch.uint8: torch.quint8,
    torch.qint8: torch.qint8,
    torch.int8: torch.qint8,
    torch.qint32: torch.qint32,
    torch.int32: torch.qint32,
}

_spent = False

SATURATING_ENGINES = ("fbgemm", "x86")
"""Engines whose int8 kernels multiply u8*s8 pairs with 16-bit sums on x86."""


@functools.cache
def int8_products_saturate() -> bool:
    """Whether fbgemm's and oneDNN's int8 kernels saturate on this CPU.

    x86 CPUs without VNNI (or AMX) sum pairs of u8*s8 products in 16 bits
    (``vpmaddubsw``): with activations above 127 the sums saturate and results
    drift by many quantization steps. That is why torch.ao's fbgemm/x86 qconfigs
    use ``reduce_range`` (7-bit activations). With VNNI the sums are 32-bit.
    """
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    return not (torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported())


def quiet_quantized_tensors() -> None:
    """Spend torch's once-per-process deprecation warning silently."""
    global _spent
    if _spent:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.quantize_per_tensor(torch.zeros(1), 1.0, 0, torch.quint8)
    _spent = True


@contextlib.contextmanager
def using_engine(engine: str) -> Iterator[None]:
    """torch's global quantized engine set to ``engine`` for the block: to pack
    weights for it whatever the user's setting, or to run ops that read the
    global engine (clamp, add, pooling) as the backend's users do."""
    if engine not in torch.backends.quantized.supported_engines:
        raise RuntimeError(
            f"quantized engine {engine!r} is not available in this torch build; "
            f"available: {torch.backends.quantized.supported_engines}"
        )
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def to_torch_qtensor(integer: torch.Tensor, qparams) -> torch.Tensor:
    """A torch quantized tensor from qcore's integer tensor and its QParams."""
    quiet_quantized_tensors()
    dtype = TORCH_QUANTIZED_DTYPE[qparams.dtype]
    if qparams.per_channel:
        return torch._make_per_channel_quantized_tensor(
            integer, qparams.scale.double(), qparams.zero_point.long(), qparams.axis
        )
    torch_int = integer.to(torch.uint8 if dtype == torch.quint8 else integer.dtype)
    return torch._make_per_tensor_quantized_tensor(
        torch_int, float(qparams.scale.reshape(-1)[0]), int(qparams.zero_point.reshape(-1)[0])
    )
