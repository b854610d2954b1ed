"""Reference quantized modules: the float module with its weights quantized.

A :class:`ReferenceModule` keeps the integer weights and their qparams (what a
kernel packs) and runs the float module on the dequantized weights (what the
reference semantics compute). It works for any weighted module: linear, conv,
conv-transpose, embedding, RNNs, and torch.ao's fused containers (whose
weights live in their first child).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qcore import ops

__all__ = [
    "QParams",
    "ReferenceModule",
    "fake_quantize",
    "observed_qparams",
    "qparams_of",
    "weight_names",
]

_PER_CHANNEL = (
    torch.per_channel_affine,
    torch.per_channel_symmetric,
    torch.per_channel_affine_float_qparams,
)


@dataclass(frozen=True)
class QParams:
    """Quantization parameters of one tensor: what a kernel reads from
    ``match.module.weight_qparams[name]`` (public as ``qcore.QParams`` and
    ``qcore.kernels.QParams``).

    * ``scale``: float tensor, one element per tensor, or one per channel along
      ``axis``;
    * ``zero_point``: integer tensor shaped like ``scale`` (0 for symmetric qint8);
    * ``dtype``: the quantized dtype, e.g. ``torch.qint8`` (``torch.float16`` for a
      float16 weight: scale 1, zero point 0, a cast);
    * ``quant_min`` / ``quant_max``: the integer range the values were clamped to;
    * ``qscheme``: e.g. ``torch.per_channel_symmetric``;
    * ``axis``: the channel axis of per-channel qparams, None per tensor.

    The integers themselves are ``match.module.integer_weight(name)``:
    ``clamp(round(w / scale) + zero_point, quant_min, quant_max)``.

    Example::

        >>> qparams = match.module.weight_qparams["weight"]
        >>> qparams.per_channel, qparams.scale.shape
        (True, torch.Size([64]))
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    dtype: torch.dtype
    quant_min: int
    quant_max: int
    qscheme: Any = torch.per_tensor_affine
    axis: int | None = None

    @property
    def per_channel(self) -> bool:
        return self.axis is not None


def _dtype_range(dtype: torch.dtype) -> tuple[int, int]:
    if dtype == torch.quint4x2:
        return 0, 15
    info = torch.iinfo(ops.storage_dtype(dtype))
    return info.min, info.max


def qparams_of(observer: Any, *, full_range: bool = False) -> QParams:
    """The qparams an observer or fake-quant computed.

    ``full_range`` clamps with the dtype's whole range (torch.ao FX semantics)
    instead of the observer's quant_min/quant_max.
    """
    dtype = observer.dtype
    if dtype == torch.float16:  # fp16 weights (dynamic fp16): a cast, no scale or zero point
        return QParams(torch.ones(1), torch.zeros(1, dtype=torch.long), dtype, 0, 0)
    scale, zero_point = observed_qparams(observer)
    qscheme = getattr(observer, "qscheme", torch.per_tensor_affine)
    if full_range or getattr(observer, "quant_min", None) is None:
        quant_min, quant_max = _dtype_range(dtype)
    else:
        quant_min, quant_max = int(observer.quant_min), int(observer.quant_max)
    axis = getattr(observer, "ch_axis", None) if qscheme in _PER_CHANNEL else None
    return QParams(scale, zero_point, dtype, quant_min, quant_max, qscheme, axis)


def observed_qparams(observer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` of an observer; of a fake quant that fake-quantizes and
    has observed, the ones its forward applies: its ``scale`` and ``zero_point``
    buffers, what training (and the prepared model in eval) computed with. torch's
    ``FusedMovingAvgObsFakeQuantize`` (torch.ao's default QAT weights) computes them
    inside its fused kernel, up to 0.4% off its own ``calculate_qparams()``: one
    trained weight in five landed on another integer at convert (torch.ao's convert
    too). It writes them only while fake quantization is on, so a fake quant switched
    off (calibrated as an observer) gives ``calculate_qparams()``. For the other fake
    quants the two are the same."""
    scale = getattr(observer, "scale", None)
    zero_point = getattr(observer, "zero_point", None)
    enabled = getattr(observer, "fake_quant_enabled", None)
    if (
        isinstance(scale, torch.Tensor)
        and isinstance(zero_point, torch.Tensor)
        and isinstance(enabled, torch.Tensor)
        and bool(enabled.reshape(-1)[0])
        and _has_observed(getattr(observer, "activation_post_process", None))
    ):
        zero_point = zero_point.detach()
        if not zero_point.is_floating_point():  # float zero points: float qparams
            zero_point = zero_point.to(torch.int64)
        return scale.detach().clone(), zero_point.clone()
    return observer.calculate_qparams()


def _has_observed(observer: Any) -> bool:
    low = getattr(observer, "min_val", None)
    return isinstance(low, torch.Tensor) and low.numel() > 0 and bool(torch.isfinite(low).all())


def fake_quantize(tensor: torch.Tensor, qparams: QParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer tensor, dequantized float tensor)."""
    if qparams.dtype == torch.float16:
        half = tensor.detach().to(torch.float16)
        return half, half.to(tensor.dtype)
    args = (qparams.quant_min, qparams.quant_max, qparams.dtype)
    if qparams.per_channel:
        integer = ops.quantize_per_channel(
            tensor.detach(), qparams.scale, qparams.zero_point, qparams.axis, *args
        )
        return integer, ops.dequantize_per_channel(
            integer, qparams.scale, qparams.zero_point, qparams.axis, *args
        )
    integer = ops.quantize_per_tensor(tensor.detach(), qparams.scale, qparams.zero_point, *args)
    return integer, ops.dequantize_per_tensor(integer, qparams.scale, qparams.zero_point, *args)


def weighted_child(module: torch.nn.Module) -> torch.nn.Module:
    """The module holding the weights: a fused container's first child."""
    if isinstance(module, torch.nn.Sequential) and len(module) > 0:
        return module[0]
    return module


def weight_names(module: torch.nn.Module) -> list[str]:
    """Names of the weight parameters to quantize, relative to ``module``."""
    child = weighted_child(module)
    prefix = "0." if child is not module else ""
    # Recurrent layers and cells hold several weights (weight_ih_l0, weight_hh, ...).
    if isinstance(child, (torch.nn.RNNBase, torch.nn.RNNCellBase)):
        return [prefix + name for name, _ in child.named_parameters() if name.startswith("weight")]
    return [prefix + "weight"] if isinstance(getattr(child, "weight", None), torch.Tensor) else []


class ReferenceModule(torch.nn.Module):
    """A float module running on dequantized weights, keeping the integer ones.

    ``original_type`` is the class of the module before conversion (e.g.
    ``ConvReLU2d``): kernels are chosen by it. ``module`` is taken over, its weights
    replaced by their dequantized values: pass a copy to keep the original (convert
    passes the modules of its own copy of the prepared model).
    """

    def __init__(
        self, module: torch.nn.Module, weight_qparams: dict[str, QParams], original_type: type
    ) -> None:
        super().__init__()
        self.module = module
        self.original_type = original_type
        self.weight_qparams = dict(weight_qparams)
        for index, (name, qparams) in enumerate(self.weight_qparams.items()):
            owner_name, _, attr = name.rpartition(".")
            owner = self.module.get_submodule(owner_name) if owner_name else self.module
            integer, dequantized = fake_quantize(getattr(owner, attr), qparams)
            self.register_buffer(f"weight_int_{index}", integer)
            setattr(owner, attr, torch.nn.Parameter(dequantized, requires_grad=False))
        if isinstance(self.module, torch.nn.RNNBase):
            self.module.flatten_parameters()

    def integer_weight(self, name: str) -> torch.Tensor:
        return getattr(self, f"weight_int_{list(self.weight_qparams).index(name)}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __prepare_scriptable__(self) -> torch.nn.Module:
        """What torch.jit.script compiles: the float module on the dequantized weights,
        which is all forward runs (a pattern left in reference form)."""
        return self.module

    def extra_repr(self) -> str:
        dtypes = sorted({str(q.dtype).replace("torch.", "") for q in self.weight_qparams.values()})
        return f"reference {self.original_type.__name__}, weights {'/'.join(dtypes)}"
