"""What kernels share: engine-scoped packing and torch's quantized tensors.

A converted model carries its backend's kernels whatever the global
``torch.backends.quantized.engine`` says: each kernel's weights are packed for its
own engine, and no kernel reads or sets that global while it runs. Only packing
touches it, because torch's prepack ops (``quantized::linear_prepack``,
``conv2d_prepack``, ...) take no engine argument and pack for the global one:
:func:`packed_for` sets it, packs and restores it under one module-level lock, and
packs again if another thread set it meanwhile.

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
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "PAIR_SUMS_OVERFLOW",
    "TORCH_QUANTIZED_DTYPE",
    "int8_products_saturate",
    "pair_sums_overflow_here",
    "packed_for",
    "packing_for",
    "pair_sums_may_saturate",
    "saturates_uint8_products",
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

SATURATING_ENGINES = ("fbgemm", "x86", "onednn")
"""Engines whose int8 kernels multiply u8*s8 pairs with 16-bit sums on x86 (fbgemm's,
and oneDNN's, which torch's x86 engine also runs)."""

EXACT_ENGINE = "qnnpack"
"""The engine whose int8 conv/linear widen products to 16 bits and sum them in 32 bits
on x86: a kernel whose sums could saturate elsewhere is packed for it instead."""

_INT16_MAX = 32767


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


def saturates_uint8_products(kernel: torch.nn.Module) -> bool:
    """Whether a lowered kernel's uint8 * int8 products may saturate on this CPU: it says
    it multiplies them (``sums_uint8_products``, torch's int8 conv and linear) on an
    engine that sums pairs of them in 16 bits here."""
    return (
        getattr(kernel, "sums_uint8_products", False)
        and getattr(kernel, "engine", None) in SATURATING_ENGINES
        and int8_products_saturate()
    )


PAIR_SUMS_OVERFLOW = (
    "its input uses all 8 bits, and this CPU sums pairs of int8 products in 16 bits "
    "(no VNNI), which this layer's weights overflow"
)


def pair_sums_overflow_here(kernel: torch.nn.Module) -> bool:
    """Whether a lowered kernel's 16-bit pair sums can overflow on this CPU: it sums
    uint8 * int8 products on such an engine (:func:`saturates_uint8_products`), its
    input uses the 8th bit (``kernel.input_max``, which lowering sets: the largest
    uint8 value multiplying the weights, None for 7 bits), and its weights are large
    enough (:func:`pair_sums_may_saturate`)."""
    input_max = getattr(kernel, "input_max", None)
    return (
        input_max is not None
        and saturates_uint8_products(kernel)
        and pair_sums_may_saturate(
            kernel.weight_int, input_max, getattr(kernel, "output_channel_axis", 0)
        )
    )


def pair_sums_may_saturate(weight_int: torch.Tensor, input_max: int, output_axis: int = 0) -> bool:
    """Whether some pair of uint8 (<= ``input_max``) * int8 products, summed in 16 bits,
    can leave int16, whichever two of an output channel's weights the engine's packing
    pairs: only products of the same sign add up, so each channel's two largest
    positive (and negative) weights decide. ``output_axis`` is the weight's output
    channel dimension (1 for transposed convs: a superset of each group's inputs)."""
    weight = weight_int.detach().to(torch.int32)
    if weight.dim() < 2:
        weight = weight.reshape(1, -1)
    else:
        weight = weight.movedim(output_axis, 0).reshape(weight.shape[output_axis], -1)
    if weight.shape[1] < 2:
        return False
    positive = weight.clamp(min=0).topk(2, dim=1).values.sum(dim=1).max().item()
    negative = (-weight).clamp(min=0).topk(2, dim=1).values.sum(dim=1).max().item()
    return input_max * positive > _INT16_MAX or input_max * negative > _INT16_MAX + 1


def quiet_quantized_tensors() -> None:
    """Spend torch's once-per-process deprecation warning silently."""
    global _spent
    if _spent:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.quantize_per_tensor(torch.zeros(1, dtype=torch.float32), 1.0, 0, torch.quint8)
    _spent = True


# torch's prepack ops read the process-wide quantized engine, so packing for an engine
# means setting that global, packing, and restoring it. Two threads doing that at once
# interleave: one packs for the other's engine, and the last to restore leaves the
# user's setting changed. One lock for every set-pack-restore in qcore. Re-entrant: a
# kernel packed inside ``using_engine`` (the conformance suite, tests) packs in the
# same thread. No kernel's output depends on the global while a model runs (the
# clamp reads it as a hint and checks what torch's op did), so the moment the global
# holds a kernel's engine changes no output of any other qcore model.
_ENGINE_LOCK = threading.RLock()


def _check_engine(engine: str) -> None:
    if engine not in torch.backends.quantized.supported_engines:
        raise RuntimeError(
            f"quantized engine {engine!r} is not available in this torch build; "
            f"available: {torch.backends.quantized.supported_engines}"
        )


@contextlib.contextmanager
def packing_for(engine: str) -> Iterator[None]:
    """torch's global quantized engine set to ``engine`` for a prepack call, under the
    module's lock, and restored after (also when packing raises)."""
    _check_engine(engine)
    with _ENGINE_LOCK:
        previous = torch.backends.quantized.engine
        if previous == engine:
            yield
            return
        torch.backends.quantized.engine = engine
        try:
            yield
        finally:
            # A thread outside qcore may have set the global meanwhile: its setting stays.
            if torch.backends.quantized.engine == engine:
                torch.backends.quantized.engine = previous


def packed_for(engine: str, pack: Callable[[], Any]) -> Any:
    """``pack()`` (a torch prepack call) run with the global engine set to ``engine``.

    The lock keeps qcore's threads apart, not the user's: one may set the global
    while ``pack`` runs, and torch's prepack then packs for that engine (outputs a
    step off, or many where ``engine`` was chosen for exact sums). So it packs again
    until a call starts and ends under ``engine``; a prepack that raised under another
    engine (torch has no x86 conv prepack for some weights) is tried again too, else
    lowering would leave that layer in reference form."""
    for _ in range(_PACKING_ATTEMPTS):
        with packing_for(engine):
            try:
                packed = pack()
            except RuntimeError:
                if torch.backends.quantized.engine == engine:
                    raise
                continue
            if torch.backends.quantized.engine == engine:
                return packed
    raise RuntimeError(
        f"could not pack weights for the {engine!r} engine: another thread kept setting "
        f"torch.backends.quantized.engine ({_PACKING_ATTEMPTS} attempts)"
    )


_PACKING_ATTEMPTS = 100


@contextlib.contextmanager
def using_engine(engine: str) -> Iterator[None]:
    """torch's global quantized engine set to ``engine`` for the block, under the lock
    :func:`packing_for` takes, then restored.

    Not for kernels (they carry their engine): for code that runs torch's own quantized
    models (torch.ao's) or torch.jit-loaded ones, which pack or compute for the global
    engine, as their users do. The global is process-wide: other threads see it too.
    """
    with packing_for(engine):
        yield


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
