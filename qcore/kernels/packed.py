"""Kernels holding packed weights, and how they survive state_dict and pickling.

torch's packed weights (``LinearPackedParamsBase`` and friends) are opaque
engine-specific objects. A :class:`PackedWeights` kernel keeps what it packed
from as ordinary buffers -- the integer weight, its scale and zero point, the
float bias -- so ``state_dict()`` holds plain tensors, ``load_state_dict``
re-packs from the loaded ones, and pickling (``torch.save`` of the whole model,
``copy.deepcopy``) drops the packed object and re-packs on load, for the
kernel's own engine whatever ``torch.backends.quantized.engine`` says then
(:func:`qcore.kernels.runtime.packed_for`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from qcore.config.errors import QCoreWarning
from qcore.engine.reference import QParams, ReferenceModule, weighted_child
from qcore.kernels.runtime import (
    EXACT_ENGINE,
    PAIR_SUMS_OVERFLOW,
    TORCH_QUANTIZED_DTYPE,
    packed_for,
    pair_sums_overflow_here,
    quiet_quantized_tensors,
)

__all__ = ["OutputQParamsState", "PackedWeights", "warn_adapted_on_load"]


class OutputQParamsState(torch.nn.Module):
    """Keeps a kernel's output ``scale``/``zero_point`` (Python numbers, as torch's
    ops take them) in the state_dict, as torch.ao's quantized modules do."""

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if hasattr(self, "scale"):
            destination[prefix + "scale"] = torch.tensor(self.scale, dtype=torch.float64)
            destination[prefix + "zero_point"] = torch.tensor(self.zero_point, dtype=torch.long)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        if hasattr(self, "scale"):
            for key in ("scale", "zero_point"):
                if prefix + key in state_dict:
                    value = state_dict.pop(prefix + key)
                    setattr(self, key, float(value) if key == "scale" else int(value))
                elif strict:
                    missing_keys.append(prefix + key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )


class PackedWeights(OutputQParamsState):
    """Base class: integer weight + qparams as buffers, packed for ``engine``.

    Subclasses set their fields, call :meth:`set_weight` (or register their own
    buffers), then :meth:`repack`; they implement :meth:`pack`.
    """

    returns_quantized = True

    #: Whether :meth:`pack` calls torch's ``quantized`` prepack ops, which pack for the
    #: global engine (so :meth:`repack` sets it to the kernel's, under a lock); oneDNN's
    #: ``torch.ops.onednn`` prepack ops read no global.
    packs_for_global_engine = True

    #: Whether the kernel multiplies uint8 activations by int8 weights (torch's int8 conv
    #: and linear, oneDNN's): fbgemm and oneDNN sum pairs of those products in 16 bits on
    #: CPUs without VNNI (``qcore.kernels.runtime.saturates_uint8_products``).
    sums_uint8_products = False

    #: The largest uint8 value multiplying the weights where the input may use the 8th
    #: bit, or None (7 bits; set at lowering for kernels that ``sums_uint8_products``).
    input_max = None  # not annotated: TorchScript reads class annotations

    #: Whether the kernel runs on another engine than its backend's (:meth:`move_to`: the
    #: backend's kernel is wrong for this layer on this CPU). torch.jit.load packs
    #: torch's weights for the global engine, the backend's: the scripted form of such
    #: a kernel computes the reference's numbers instead.
    left_backend_engine = False

    def __init__(self, engine: str) -> None:
        super().__init__()
        self.engine = engine
        self._packed: Any = None

    def set_weight(
        self, integer: torch.Tensor, qparams: QParams, bias: torch.Tensor | None
    ) -> None:
        self.register_buffer("weight_int", integer.detach().clone())
        self.register_buffer("weight_scale", qparams.scale.detach().double().reshape(-1).clone())
        zero_point = qparams.zero_point.detach().reshape(-1).clone()
        if not zero_point.is_floating_point():  # float zero points: embeddings' float qparams
            zero_point = zero_point.long()
        self.register_buffer("weight_zero_point", zero_point)
        self.weight_axis = qparams.axis
        self.weight_dtype = qparams.dtype
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def set_weight_from(self, reference: ReferenceModule) -> None:
        """The (only) weight of a ReferenceModule, and its child's bias."""
        if len(reference.weight_qparams) != 1:
            raise ValueError(f"expected one quantized weight, got {list(reference.weight_qparams)}")
        (name,) = reference.weight_qparams
        bias = getattr(weighted_child(reference.module), "bias", None)
        self.set_weight(reference.integer_weight(name), reference.weight_qparams[name], bias)

    def can_move_to(self, engine: str) -> bool:
        """Whether :meth:`move_to` may pack this kernel for ``engine``: its ops are
        torch's ``quantized`` ops (they run on whichever engine packed the weights)
        and torch was built with that engine."""
        return self.packs_for_global_engine and engine in torch.backends.quantized.supported_engines

    def move_to(self, engine: str) -> None:
        """Pack the weights for ``engine`` instead: the kernel then runs there, and
        keeps that engine through state_dict loads and pickling."""
        self.engine = engine
        self.left_backend_engine = True
        self.repack()

    def qweight(self) -> torch.Tensor:
        """The weight as a torch quantized tensor (float16 weights stay float16)."""
        if self.weight_dtype == torch.float16:
            return self.weight_int.float()
        quiet_quantized_tensors()
        if self.weight_dtype == torch.quint4x2:
            return self._qweight_4bit()
        dtype = TORCH_QUANTIZED_DTYPE[self.weight_dtype]
        if self.weight_axis is not None:
            return torch._make_per_channel_quantized_tensor(
                self.weight_int, self.weight_scale, self.weight_zero_point, self.weight_axis
            )
        storage = self.weight_int.to(torch.uint8 if dtype == torch.quint8 else torch.int8)
        return torch._make_per_tensor_quantized_tensor(
            storage, float(self.weight_scale[0]), int(self.weight_zero_point[0])
        )

    def _qweight_4bit(self) -> torch.Tensor:
        """quint4x2 packs two values a byte: quantize the dequantized weight again."""
        from qcore import ops

        if self.weight_axis is None:
            raise ValueError("4-bit weights are quantized per channel (embedding rows)")
        args = (self.weight_scale, self.weight_zero_point, self.weight_axis, 0, 15, torch.quint4x2)
        dequantized = ops.dequantize_per_channel(self.weight_int, *args)
        return torch.quantize_per_channel(
            dequantized, self.weight_scale, self.weight_zero_point, self.weight_axis, torch.quint4x2
        )

    def pack(self) -> Any:
        """The packed object for the kernel's engine (called inside ``packed_for``)."""
        raise NotImplementedError

    def repack(self) -> None:
        if not self.packs_for_global_engine:
            self._packed = self.pack()
            return
        self._packed = packed_for(self.engine, self.pack)

    def wrong_on_this_cpu(self) -> str | None:
        """Why the engine this kernel is packed for computes it wrong on this CPU, or
        None. Lowering decides on the CPU that converts; a model saved there and loaded
        on another asks again (:meth:`check_on_load`)."""
        return PAIR_SUMS_OVERFLOW if pair_sums_overflow_here(self) else None

    def check_on_load(self) -> None:
        """Run on the exact engine where this CPU computes the packed engine's kernel
        wrong (a model converted on another CPU), or warn where it cannot move; explain
        reads ``load_note``."""
        trouble = self.wrong_on_this_cpu()
        if trouble is None:
            return
        if self.can_move_to(EXACT_ENGINE):
            self.engine, self.left_backend_engine = EXACT_ENGINE, True  # packed by the caller
            self.load_note = f"runs on {EXACT_ENGINE}'s kernel on this CPU: {trouble}"
            warn_adapted_on_load()
        else:
            self.load_note = f"may compute wrong numbers on this CPU: {trouble}"
            warnings.warn(_WRONG_ON_LOAD, QCoreWarning, stacklevel=2)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.check_on_load()
        self.repack()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_packed"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.check_on_load()
        self.repack()


def warn_adapted_on_load() -> None:
    """The one warning for kernels that changed how they run on the CPU loading them."""
    warnings.warn(_ADAPTED_ON_LOAD, QCoreWarning, stacklevel=3)


# One text each, so Python's warning filter shows each once however many kernels moved.
_ADAPTED_ON_LOAD = (
    "This model was converted on a CPU whose int8 kernels differ from this one's; "
    "the layers this CPU would compute wrong as converted run another way here "
    f"({EXACT_ENGINE}'s kernel, or 7-bit dynamic inputs). qcore.explain(model) names them; "
    "convert on this CPU for its own choice"
)
_WRONG_ON_LOAD = (
    "This model was converted on a CPU whose int8 kernels differ from this one's; "
    "some of its layers compute wrong numbers here and cannot move to another engine. "
    "qcore.explain(model) names them: convert the model again on this CPU"
)
