"""Observers that observe nothing: fixed qparams, and placeholders carrying a dtype."""

from __future__ import annotations

from typing import Any

import torch

from qcore.observers.base import EPS, ObserverBase

__all__ = ["FixedQParamsObserver", "NoopObserver", "PlaceholderObserver", "ReuseInputObserver"]


class FixedQParamsObserver(ObserverBase):
    """Always returns the given (scale, zero_point); for ops with a known output
    range (sigmoid: [0, 1], tanh: [-1, 1])."""

    scale: torch.Tensor
    zero_point: torch.Tensor

    def __init__(
        self,
        scale: float,
        zero_point: int,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        quant_min: int = 0,
        quant_max: int = 255,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        if is_dynamic:
            raise NotImplementedError(f"{type(self).__name__} does not support is_dynamic=True")
        super().__init__(dtype=dtype, is_dynamic=is_dynamic, **kwargs)
        self.quant_min = quant_min
        self.quant_max = quant_max
        self.qscheme = qscheme
        self.register_buffer("scale", torch.tensor([scale], dtype=torch.float))
        self.register_buffer("zero_point", torch.tensor([zero_point], dtype=torch.int))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale, self.zero_point


class PlaceholderObserver(ObserverBase):
    """Records nothing; carries a dtype (float16, or a quantized dtype with
    ``is_dynamic=True`` for dynamic quantization, whose qparams are chosen at run time)."""

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        custom_op_name: str = "",
        compute_dtype: torch.dtype | None = None,
        quant_min: int | None = None,
        quant_max: int | None = None,
        qscheme: torch.qscheme | None = None,
        eps: float | None = None,
        is_dynamic: bool = False,
    ) -> None:
        super().__init__(dtype=dtype, is_dynamic=is_dynamic or compute_dtype is not None)
        self.qscheme = torch.per_tensor_affine if qscheme is None else qscheme
        self.quant_min = quant_min
        self.quant_max = quant_max
        self.eps = EPS if eps is None else eps
        self.custom_op = custom_op_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, is_dynamic={self.is_dynamic}"

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError(
            f"PlaceholderObserver(dtype={self.dtype}) has no qparams: it only carries a dtype "
            "(dynamic quantization chooses its qparams at run time)"
        )


class NoopObserver(ObserverBase):
    """Records nothing, has no qparams; carries a dtype (float16 by default)."""

    def __init__(self, dtype: torch.dtype = torch.float16, custom_op_name: str = "") -> None:
        super().__init__(dtype=dtype, is_dynamic=False)
        self.custom_op = custom_op_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("NoopObserver has no qparams")


class ReuseInputObserver(ObserverBase):
    """Marks an op (reshape) whose output reuses its input's observer."""

    def __init__(self) -> None:
        super().__init__(torch.quint8, is_dynamic=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("ReuseInputObserver has no qparams: its input's observer has them")
