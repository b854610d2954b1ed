"""Dynamic kernels: int8 (or fp16) weights, float activations in and out.

Linear becomes ``torch.ops.quantized.linear_dynamic`` (``linear_relu_dynamic``,
``linear_dynamic_fp16``); LSTM and GRU become ``torch.quantized_lstm`` /
``torch.quantized_gru`` on cell parameters packed per layer and direction, the
ops behind torch.ao.nn.quantized.dynamic (its cells: ``dynamic_cells``). int8
kernels quantize their input on the fly to the range the reference's dynamic
fake-quantize uses (``reduce_range`` when it is 7-bit, fbgemm's overflow guard).
On a CPU where fbgemm's int8 products saturate (x86 without VNNI) they always use
7 bits there, as torch.ao's dynamic modules always do: 8-bit inputs would be off
by many steps.

Rounding that legitimately differs from the reference: the recurrent kernels
also quantize their hidden state and gate inputs at every step, where the
reference runs the float cell on dequantized weights; fp16 kernels keep the
activation in float32, where the reference rounds it to float16.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from qcore.engine.reference import ReferenceModule, weighted_child
from qcore.kernels.common import require
from qcore.kernels.packed import PackedWeights, warn_adapted_on_load
from qcore.kernels.runtime import SATURATING_ENGINES, int8_products_saturate
from qcore.plugin.kernels import KernelMatch, KernelUnavailable

__all__ = ["DynamicLinear", "DynamicRNN"]

# torch's ops, bound once: a lookup through torch.ops costs about as much as the
# Python around a kernel call. TorchScript compiles them as the ops themselves.
_linear_relu_dynamic_fp16 = torch.ops.quantized.linear_relu_dynamic_fp16
_linear_dynamic_fp16 = torch.ops.quantized.linear_dynamic_fp16
_linear_relu_dynamic = torch.ops.quantized.linear_relu_dynamic
_linear_dynamic = torch.ops.quantized.linear_dynamic


def dynamic_reference(match: KernelMatch) -> tuple[ReferenceModule, bool, bool]:
    """(reference module, fp16 weights?, reduce_range) of a dynamic match, else refuse."""
    reference = match.module
    require(isinstance(reference, ReferenceModule), "its weights are not quantized")
    require(match.output is None, "its output is quantized (a static pattern)")
    dtypes = {q.dtype for q in reference.weight_qparams.values()}
    require(len(dtypes) == 1, f"weights mix dtypes {dtypes}")
    (dtype,) = dtypes
    if dtype == torch.float16:
        require(not match.inputs and not match.dynamic, "fp16 weights with a quantized input")
        if match.engine == "qnnpack":
            raise KernelUnavailable("qnnpack has no fp16 packed linear (linear_prepack_fp16)")
        return reference, True, False
    require(dtype == torch.qint8, f"dynamic kernels take qint8 or float16 weights, not {dtype}")
    require(len(match.dynamic) == 1, "its input is not dynamically quantized")
    require(
        all(not q.per_channel for q in reference.weight_qparams.values())
        or isinstance(weighted_child(reference.module), (torch.nn.Linear, torch.nn.RNNCellBase)),
        "per-channel recurrent weights",
    )
    saturates = match.engine in SATURATING_ENGINES and int8_products_saturate()
    return reference, False, match.dynamic[0].reduce_range or saturates


def _seven_bits_where_sums_saturate(kernel: DynamicLinear | DynamicRNN) -> None:
    """``check_on_load`` of the dynamic kernels: lowered on a CPU with VNNI, an 8-bit
    dynamic input saturates the 16-bit pair sums of one without; 7 bits there, as
    lowering on that CPU chooses."""
    if kernel.fp16 or kernel.reduce_range:
        return
    if kernel.engine in SATURATING_ENGINES and int8_products_saturate():
        kernel.reduce_range = True
        kernel.load_note = (
            "quantizes its input to 7 bits on this CPU, which sums pairs of int8 "
            "products in 16 bits (no VNNI)"
        )
        warn_adapted_on_load()


class DynamicLinear(PackedWeights):
    """Dynamically quantized linear (optionally with relu), int8 or fp16 weights."""

    returns_quantized = False

    def __init__(
        self, reference: ReferenceModule, fp16: bool, reduce_range: bool, relu: bool, engine: str
    ) -> None:
        super().__init__(engine)
        child = weighted_child(reference.module)
        self.in_features, self.out_features = child.in_features, child.out_features
        self.fp16, self.reduce_range, self.relu = fp16, reduce_range, relu
        self.set_weight_from(reference)
        self.repack()

    def pack(self):
        if self.fp16:
            return torch.ops.quantized.linear_prepack_fp16(self.qweight(), self.bias)
        return torch.ops.quantized.linear_prepack(self.qweight(), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp16:
            if self.relu:
                return _linear_relu_dynamic_fp16(x, self._packed)
            return _linear_dynamic_fp16(x, self._packed)
        if self.relu:
            return _linear_relu_dynamic(x, self._packed, self.reduce_range)
        return _linear_dynamic(x, self._packed, self.reduce_range)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weights={'float16' if self.fp16 else 'qint8'}, relu={self.relu}, "
            f"reduce_range={self.reduce_range}, engine={self.engine}"
        )

    check_on_load = _seven_bits_where_sums_saturate

    @classmethod
    def lower(cls, match: KernelMatch, relu: bool = False):
        reference, fp16, reduce_range = dynamic_reference(match)
        return cls(reference, fp16, reduce_range, relu, match.engine)


class DynamicRNN(PackedWeights):
    """Dynamically quantized LSTM or GRU (int8 or fp16 weights), nn.LSTM/nn.GRU's interface."""

    returns_quantized = False

    def __init__(self, reference: ReferenceModule, fp16: bool, reduce_range: bool, engine: str):
        super().__init__(engine)
        rnn = reference.module
        require(isinstance(rnn, (torch.nn.LSTM, torch.nn.GRU)), f"not an LSTM/GRU: {type(rnn)}")
        require(getattr(rnn, "proj_size", 0) == 0, "LSTM with proj_size")
        self.mode = "LSTM" if isinstance(rnn, torch.nn.LSTM) else "GRU"
        self.input_size, self.hidden_size = rnn.input_size, rnn.hidden_size
        self.num_layers, self.bidirectional = rnn.num_layers, rnn.bidirectional
        # pack gives zero biases to a layer without them: torch's quantized LSTM
        # requires biases ("quantized LSTM requires biases" at every call)
        self.batch_first, self.has_bias = rnn.batch_first, True
        self.dropout = float(rnn.dropout)
        self.fp16, self.reduce_range = fp16, reduce_range
        self.weight_names = list(reference.weight_qparams)
        for name in self.weight_names:
            qparams = reference.weight_qparams[name]
            require(not qparams.per_channel, "per-channel recurrent weights")
            self.register_buffer(f"{name}_int", reference.integer_weight(name).clone())
            self.register_buffer(f"{name}_scale", qparams.scale.detach().double().reshape(-1))
            self.register_buffer(f"{name}_zero_point", qparams.zero_point.detach().reshape(-1))
        for name, value in rnn.named_parameters():
            if name.startswith("bias"):
                self.register_buffer(name, value.detach().float().clone())
        self.repack()

    def _weight(self, name: str) -> torch.Tensor:
        integer = getattr(self, f"{name}_int")
        if self.fp16:
            return integer.float()
        return torch._make_per_tensor_quantized_tensor(
            integer.to(torch.int8),
            float(getattr(self, f"{name}_scale")[0]),
            int(getattr(self, f"{name}_zero_point")[0]),
        )

    def _bias(self, name: str) -> torch.Tensor:
        gates = 4 if self.mode == "LSTM" else 3
        value = getattr(self, name, None)
        return value if value is not None else torch.zeros(gates * self.hidden_size)

    def pack(self):
        cells = []
        for layer in range(self.num_layers):
            for suffix in ("", "_reverse") if self.bidirectional else ("",):
                w_ih, w_hh = (self._weight(f"weight_{k}_l{layer}{suffix}") for k in ("ih", "hh"))
                b_ih, b_hh = (self._bias(f"bias_{k}_l{layer}{suffix}") for k in ("ih", "hh"))
                if self.fp16:
                    packed_ih = torch.ops.quantized.linear_prepack_fp16(w_ih, b_ih)
                    packed_hh = torch.ops.quantized.linear_prepack_fp16(w_hh, b_hh)
                    cells.append(
                        torch.ops.quantized.make_quantized_cell_params_fp16(packed_ih, packed_hh)
                    )
                else:
                    packed_ih = torch.ops.quantized.linear_prepack(w_ih, b_ih)
                    packed_hh = torch.ops.quantized.linear_prepack(w_hh, b_hh)
                    cells.append(
                        torch.ops.quantized.make_quantized_cell_params_dynamic(
                            packed_ih, packed_hh, b_ih, b_hh, self.reduce_range
                        )
                    )
        return cells

    def forward(self, x: torch.Tensor, hx=None):
        if isinstance(x, PackedSequence):
            return self._forward_packed(x, hx)
        if x.dim() != 3:
            raise ValueError(f"DynamicRNN takes batched input (3 dims), got shape {tuple(x.shape)}")
        if hx is None:
            directions = 2 if self.bidirectional else 1
            batch = x.size(0 if self.batch_first else 1)
            zeros = torch.zeros(
                self.num_layers * directions, batch, self.hidden_size, dtype=x.dtype
            )
            hx = (zeros, zeros) if self.mode == "LSTM" else zeros
        common = (
            self.has_bias,
            self.num_layers,
            self.dropout,
            False,
            self.bidirectional,
            self.batch_first,
        )
        if self.mode == "LSTM":
            dtype = torch.float16 if self.fp16 else torch.qint8
            output, h, c = torch.quantized_lstm(
                x, hx, self._packed, *common, dtype=dtype, use_dynamic=True
            )
            return output, (h, c)
        return torch.quantized_gru(x, hx, self._packed, *common)

    def _forward_packed(self, x: PackedSequence, hx: Any) -> tuple[PackedSequence, Any]:
        """nn.LSTM/nn.GRU's forward on a PackedSequence (``pack_padded_sequence``):
        the state is in the caller's batch order, the sequence sorted."""
        data, batch_sizes, sorted_indices, unsorted_indices = x
        lstm = self.mode == "LSTM"
        if hx is None:
            directions = 2 if self.bidirectional else 1
            shape = (self.num_layers * directions, int(batch_sizes[0]), self.hidden_size)
            zeros = torch.zeros(shape, dtype=data.dtype)
            state = [zeros, zeros] if lstm else zeros
        else:
            reorder = (
                (lambda t: t)
                if sorted_indices is None
                else (lambda t: t.index_select(1, sorted_indices))
            )
            state = [reorder(hx[0]), reorder(hx[1])] if lstm else reorder(hx)
        common = (self.has_bias, self.num_layers, self.dropout, False, self.bidirectional)
        if lstm:
            dtype = torch.float16 if self.fp16 else torch.qint8
            output, *hidden = torch.quantized_lstm(
                data, batch_sizes, state, self._packed, *common, dtype=dtype, use_dynamic=True
            )
        else:
            output, *hidden = torch.quantized_gru(data, batch_sizes, state, self._packed, *common)
        if unsorted_indices is not None:
            hidden = [h.index_select(1, unsorted_indices) for h in hidden]
        packed = PackedSequence(output, batch_sizes, sorted_indices, unsorted_indices)
        return packed, (tuple(hidden) if lstm else hidden[0])

    def extra_repr(self) -> str:
        return (
            f"{self.mode}({self.input_size}, {self.hidden_size}, num_layers={self.num_layers}), "
            f"weights={'float16' if self.fp16 else 'qint8'}, engine={self.engine}"
        )

    def __prepare_scriptable__(self) -> torch.nn.Module:
        """What ``torch.jit.script`` compiles instead: LSTM and GRU take and return
        different types, which one TorchScript forward cannot."""
        return (_ScriptedLSTM if self.mode == "LSTM" else _ScriptedGRU)(self)

    check_on_load = _seven_bits_where_sums_saturate

    @classmethod
    def lower(cls, match: KernelMatch):
        reference, fp16, reduce_range = dynamic_reference(match)
        return cls(reference, fp16, reduce_range, match.engine)


class _ScriptedRNN(torch.nn.Module):
    """A :class:`DynamicRNN`'s packed cells and settings, with a typed forward."""

    def __init__(self, rnn: DynamicRNN) -> None:
        super().__init__()
        self._packed = rnn._packed
        self.has_bias, self.num_layers, self.dropout = rnn.has_bias, rnn.num_layers, rnn.dropout
        self.bidirectional, self.batch_first = rnn.bidirectional, rnn.batch_first
        self.hidden_size, self.fp16 = rnn.hidden_size, rnn.fp16

    def _zeros(self, x: torch.Tensor) -> torch.Tensor:
        directions = 2 if self.bidirectional else 1
        batch = x.size(0) if self.batch_first else x.size(1)
        return torch.zeros(self.num_layers * directions, batch, self.hidden_size, dtype=x.dtype)


class _ScriptedLSTM(_ScriptedRNN):
    def forward(
        self, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if x.dim() != 3:
            raise ValueError("DynamicRNN takes batched input (3 dims)")
        if hx is None:
            zeros = self._zeros(x)
            state = [zeros, zeros]
        else:
            state = [hx[0], hx[1]]
        dtype = torch.float16 if self.fp16 else torch.qint8
        output, h, c = torch.quantized_lstm(
            x, state, self._packed, self.has_bias, self.num_layers, self.dropout, False,
            self.bidirectional, self.batch_first, dtype=dtype, use_dynamic=True,
        )  # fmt: skip
        return output, (h, c)


class _ScriptedGRU(_ScriptedRNN):
    def forward(
        self, x: torch.Tensor, hx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 3:
            raise ValueError("DynamicRNN takes batched input (3 dims)")
        state = self._zeros(x) if hx is None else hx
        return torch.quantized_gru(
            x, state, self._packed, self.has_bias, self.num_layers, self.dropout, False,
            self.bidirectional, self.batch_first,
        )  # fmt: skip
