"""Fake quantization for quantization-aware training.

A :class:`FakeQuantize` wraps an observer (its ``activation_post_process``):
while the observer is enabled it records statistics and refreshes ``scale``
and ``zero_point``; while fake quantization is enabled the output is the input
quantized and dequantized in float (with a straight-through gradient), as
``torch.fake_quantize_per_*_affine`` computes it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qcore import ops
from qcore.observers.base import _PER_CHANNEL, _PER_TENSOR, _SYMMETRIC, _with_args
from qcore.observers.fixed import FixedQParamsObserver
from qcore.observers.minmax import (
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
)

__all__ = [
    "FakeQuantize",
    "FakeQuantizeBase",
    "FixedQParamsFakeQuantize",
    "fixed_qparams_module",
    "FusedMovingAvgObsFakeQuantize",
    "disable_fake_quant",
    "disable_observer",
    "enable_fake_quant",
    "enable_observer",
]


class FakeQuantizeBase(nn.Module):
    """The switches: ``fake_quant_enabled`` and ``observer_enabled`` are uint8
    buffers (so DDP replicates them), toggled by the enable/disable methods."""

    fake_quant_enabled: torch.Tensor
    observer_enabled: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fake_quant_enabled", torch.tensor([1], dtype=torch.uint8))
        self.register_buffer("observer_enabled", torch.tensor([1], dtype=torch.uint8))

    def enable_fake_quant(self, enabled: bool = True) -> None:
        self.fake_quant_enabled[0] = 1 if enabled else 0

    def disable_fake_quant(self) -> None:
        self.enable_fake_quant(False)

    def enable_observer(self, enabled: bool = True) -> None:
        self.observer_enabled[0] = 1 if enabled else 0

    def disable_observer(self) -> None:
        self.enable_observer(False)

    with_args = classmethod(_with_args)


class FakeQuantize(FakeQuantizeBase):
    """Observe with ``observer(**observer_kwargs)``, then quantize-dequantize.

    ``quant_min``/``quant_max``, when both given, are passed on to the observer
    (and checked against ``dtype``'s range). qcore's observers skip NaN and ±inf,
    so a non-finite training batch leaves ``scale`` and ``zero_point`` as the
    finite values make them (the fake-quantized output of a NaN is still NaN).
    """

    scale: torch.Tensor
    zero_point: torch.Tensor

    def __init__(
        self,
        observer: Any = MovingAverageMinMaxObserver,
        quant_min: int | None = None,
        quant_max: int | None = None,
        is_dynamic: bool = False,
        **observer_kwargs: Any,
    ) -> None:
        super().__init__()
        if quant_min is not None and quant_max is not None:
            if quant_min > quant_max:
                raise ValueError(f"quant_min={quant_min} is greater than quant_max={quant_max}")
            dtype = observer_kwargs.get("dtype", torch.quint8)
            dtype = getattr(getattr(observer, "p", None), "keywords", {}).get("dtype", dtype)
            info = torch.iinfo(dtype)
            if quant_min < info.min or quant_max > info.max:
                raise ValueError(
                    f"quant_min..quant_max = {quant_min}..{quant_max} is outside {dtype}'s "
                    f"range {info.min}..{info.max}"
                )
            observer_kwargs.update(quant_min=quant_min, quant_max=quant_max)
        observer_kwargs["is_dynamic"] = is_dynamic
        self.activation_post_process = observer(**observer_kwargs)
        post = self.activation_post_process
        self.quant_min = post.quant_min
        self.quant_max = post.quant_max
        self.is_dynamic = post.is_dynamic
        self.dtype = post.dtype
        self.qscheme = post.qscheme
        self.ch_axis = getattr(post, "ch_axis", -1)
        if self.qscheme not in _PER_CHANNEL + _PER_TENSOR:
            raise ValueError(f"{type(self).__name__}: unsupported qscheme {self.qscheme}")
        self.is_per_channel = self.qscheme in _PER_CHANNEL
        zp_dtype = (
            torch.float if self.qscheme == torch.per_channel_affine_float_qparams else torch.int
        )
        self.register_buffer("scale", torch.tensor([1.0], dtype=torch.float))
        self.register_buffer("zero_point", torch.tensor([0], dtype=zp_dtype))

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.activation_post_process.calculate_qparams()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.observer_enabled[0] == 1:
            self.activation_post_process(x.detach())
            scale, zero_point = self.calculate_qparams()
            scale = scale.to(self.scale.device)
            zero_point = zero_point.to(self.zero_point.device)
            if self.scale.shape != scale.shape:
                self.scale.resize_(scale.shape)
                self.zero_point.resize_(zero_point.shape)
            self.scale.copy_(scale)
            self.zero_point.copy_(zero_point)
        if self.fake_quant_enabled[0] == 1:
            post = self.activation_post_process
            if self.is_per_channel:
                x = ops.fake_quantize_per_channel(
                    x, self.scale, self.zero_point, self.ch_axis, post.quant_min, post.quant_max
                )
            else:
                x = ops.fake_quantize_per_tensor(
                    x, self.scale, self.zero_point, post.quant_min, post.quant_max
                )
        return x

    def extra_repr(self) -> str:
        post = self.activation_post_process
        return (
            f"fake_quant_enabled={self.fake_quant_enabled}, "
            f"observer_enabled={self.observer_enabled}, quant_min={post.quant_min}, "
            f"quant_max={post.quant_max}, dtype={self.dtype}, qscheme={self.qscheme}, "
            f"ch_axis={self.ch_axis}, scale={self.scale}, zero_point={self.zero_point}"
        )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args) -> None:
        # scale/zero_point take the saved shape (per-channel ones grow on first forward)
        for name in ("scale", "zero_point"):
            if prefix + name in state_dict:
                getattr(self, name).resize_(state_dict[prefix + name].shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args)


class FixedQParamsFakeQuantize(FakeQuantize):
    """Fake quantization with the fixed qparams of a :class:`FixedQParamsObserver`."""

    def __init__(self, observer: Any) -> None:
        super().__init__(observer=observer)
        if not isinstance(self.activation_post_process, FixedQParamsObserver):
            raise TypeError(
                f"{type(self).__name__}'s observer must build a FixedQParamsObserver, "
                f"got {type(self.activation_post_process).__name__}"
            )
        if self.qscheme not in _PER_TENSOR:
            raise ValueError(f"{type(self).__name__} supports per-tensor qschemes only")
        self._observer_ctr = observer
        self.scale = self.activation_post_process.scale
        self.zero_point = self.activation_post_process.zero_point

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale, self.zero_point

    def extra_repr(self) -> str:
        post = self.activation_post_process
        return (
            f"fake_quant_enabled={self.fake_quant_enabled}, "
            f"observer_enabled={self.observer_enabled}, scale={self.scale}, "
            f"zero_point={self.zero_point}, dtype={self.dtype}, quant_min={post.quant_min}, "
            f"quant_max={post.quant_max}, qscheme={self.qscheme}"
        )


def fixed_qparams_module(spec: Any, is_qat: bool = False) -> torch.nn.Module:
    """What a FixedQParamsQuantizationSpec builds: a FixedQParamsObserver, wrapped in
    a FixedQParamsFakeQuantize for quantization-aware training (torchao's rule), so
    training sees the op's output rounded. A range left None is the dtype's."""
    quant_min, quant_max = spec.quant_min, spec.quant_max
    if quant_min is None or quant_max is None:
        info = torch.iinfo(ops.storage_dtype(spec.dtype))
        quant_min = info.min if quant_min is None else quant_min
        quant_max = info.max if quant_max is None else quant_max
    observer = FixedQParamsObserver.with_args(
        scale=spec.scale,
        zero_point=spec.zero_point,
        dtype=spec.dtype,
        qscheme=spec.qscheme or torch.per_tensor_affine,
        quant_min=quant_min,
        quant_max=quant_max,
    )
    return FixedQParamsFakeQuantize(observer) if is_qat else observer()


class FusedMovingAvgObsFakeQuantize(FakeQuantize):
    """torch.ao's fused observer + fake quant, with the same arguments, computed by the
    unfused path (a moving-average observer, then fake quant). torch's fused kernel
    computes the qparams in its own float arithmetic: scales can differ in the last
    digits from this (unfused, torch.ao observer) computation."""

    def __init__(
        self,
        observer: Any = MovingAverageMinMaxObserver,
        quant_min: int = 0,
        quant_max: int = 255,
        **observer_kwargs: Any,
    ) -> None:
        super().__init__(observer, quant_min, quant_max, **observer_kwargs)
        if not isinstance(
            self.activation_post_process,
            (MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver),
        ):
            raise TypeError(
                f"{type(self).__name__} works with a moving-average min/max observer, got "
                f"{type(self.activation_post_process).__name__}"
            )
        # torch.ao's fused module keeps its switches as int64
        self.register_buffer("fake_quant_enabled", torch.tensor([1], dtype=torch.long))
        self.register_buffer("observer_enabled", torch.tensor([1], dtype=torch.long))
        self.is_symmetric_quant = self.qscheme in _SYMMETRIC


def _apply(method: str):
    def switch(module: nn.Module) -> None:
        if isinstance(module, FakeQuantizeBase) or (
            # torch.ao's fake quants have the same switches
            hasattr(module, "fake_quant_enabled") and hasattr(module, method)
        ):
            getattr(module, method)()

    switch.__name__ = method
    switch.__doc__ = f"Call ``{method}()`` on a fake-quant module (for ``model.apply``)."
    return switch


disable_fake_quant = _apply("disable_fake_quant")
enable_fake_quant = _apply("enable_fake_quant")
disable_observer = _apply("disable_observer")
enable_observer = _apply("enable_observer")
