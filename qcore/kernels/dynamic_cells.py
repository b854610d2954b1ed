"""Dynamic recurrent cells: ``nn.LSTMCell``, ``nn.GRUCell`` and ``nn.RNNCell`` on int8
(qint8, per tensor or per channel) or float16 weights, float activations in and out.

Each runs torch's ``quantized_lstm_cell_dynamic`` / ``quantized_gru_cell_dynamic`` /
``quantized_rnn_tanh_cell_dynamic`` / ``quantized_rnn_relu_cell_dynamic`` on its two
packed linears (input-hidden, hidden-hidden), the ops behind
``torch.ao.nn.quantized.dynamic.LSTMCell``/``GRUCell``/``RNNCell``, so its outputs
are torch.ao's (fp16 too: lowering drops the reference form's float16 rounding of
the input before the kernel, as torch.ao's does).

Rounding that legitimately differs from the reference form: torch's int8 cell ops
quantize the input *and* the hidden state on the fly, to 7 bits on fbgemm and x86
whatever the QConfig says (the ops take no ``reduce_range``; measured, the same as
``linear_dynamic(..., reduce_range=True)``), to 8 bits on qnnpack; the reference
quantizes the input alone, to the QConfig's range.

Example::

    >>> model = nn.Sequential(nn.GRUCell(8, 16))
    >>> quantized = qcore.quantize_dynamic(model, backend="fbgemm")
    >>> type(quantized.get_submodule("0")).__name__
    'DynamicCell'
"""

from __future__ import annotations

import dataclasses

import torch

from qcore.engine.reference import ReferenceModule
from qcore.kernels.common import require
from qcore.kernels.dynamic import dynamic_reference
from qcore.kernels.packed import PackedWeights
from qcore.kernels.runtime import to_torch_qtensor
from qcore.plugin.kernels import KernelMatch

__all__ = ["DynamicCell"]

_CELLS = (torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell)
_WEIGHTS = ("weight_ih", "weight_hh")


def _mode(cell: torch.nn.Module) -> str:
    if isinstance(cell, torch.nn.LSTMCell):
        return "LSTM"
    if isinstance(cell, torch.nn.GRUCell):
        return "GRU"
    return "RNN_TANH" if cell.nonlinearity == "tanh" else "RNN_RELU"


def _batched(x: torch.Tensor, name: str, input_size: int) -> torch.Tensor:
    """``x`` as a batch: torch.nn's cells take one unbatched (1-D) sample too."""
    if x.dim() not in (1, 2):
        raise ValueError(f"{name}: expected input to be 1-D or 2-D, got shape {list(x.shape)}")
    if x.size(-1) != input_size:
        raise ValueError(
            f"{name}: input has {x.size(-1)} features, expected input_size={input_size}"
        )
    return x.unsqueeze(0) if x.dim() == 1 else x


def _state(
    x: torch.Tensor, hx: torch.Tensor | None, unbatched: bool, name: str, hidden_size: int
) -> torch.Tensor:
    """The hidden (or cell) state as a batch, zeros where not given (torch.nn's default)."""
    if hx is None:
        return torch.zeros(x.size(0), hidden_size, dtype=x.dtype, device=x.device)
    expected = [hidden_size] if unbatched else [x.size(0), hidden_size]
    if list(hx.shape) != expected:
        raise ValueError(
            f"{name}: expected a hidden state of shape {expected}, got {list(hx.shape)}"
        )
    return hx.unsqueeze(0) if unbatched else hx


def _run_cell(
    mode: str,
    x: torch.Tensor,
    hx: torch.Tensor | None,
    packed_ih: torch.classes.quantized.LinearPackedParamsBase,
    packed_hh: torch.classes.quantized.LinearPackedParamsBase,
    b_ih: torch.Tensor,
    b_hh: torch.Tensor,
    sizes: list[int],
) -> torch.Tensor:
    """One GRU or RNN step on torch's dynamic cell op (eager and TorchScript)."""
    unbatched = x.dim() == 1
    x = _batched(x, mode + " cell", sizes[0])
    h = _state(x, hx, unbatched, mode + " cell", sizes[1])
    if mode == "GRU":
        h = torch.ops.quantized.quantized_gru_cell_dynamic(x, h, packed_ih, packed_hh, b_ih, b_hh)
    elif mode == "RNN_TANH":
        h = torch.ops.quantized.quantized_rnn_tanh_cell_dynamic(
            x, h, packed_ih, packed_hh, b_ih, b_hh
        )
    else:
        h = torch.ops.quantized.quantized_rnn_relu_cell_dynamic(
            x, h, packed_ih, packed_hh, b_ih, b_hh
        )
    return h.squeeze(0) if unbatched else h


def _run_lstm_cell(
    x: torch.Tensor,
    hx: tuple[torch.Tensor, torch.Tensor] | None,
    packed_ih: torch.classes.quantized.LinearPackedParamsBase,
    packed_hh: torch.classes.quantized.LinearPackedParamsBase,
    b_ih: torch.Tensor,
    b_hh: torch.Tensor,
    sizes: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step on torch's dynamic cell op (eager and TorchScript)."""
    unbatched = x.dim() == 1
    x = _batched(x, "LSTM cell", sizes[0])
    if hx is None:
        h = _state(x, None, unbatched, "LSTM cell", sizes[1])
        c = h
    else:
        h = _state(x, hx[0], unbatched, "LSTM cell", sizes[1])
        c = _state(x, hx[1], unbatched, "LSTM cell", sizes[1])
    h, c = torch.ops.quantized.quantized_lstm_cell_dynamic(
        x, [h, c], packed_ih, packed_hh, b_ih, b_hh
    )
    if unbatched:
        return h.squeeze(0), c.squeeze(0)
    return h, c


class DynamicCell(PackedWeights):
    """Dynamically quantized LSTMCell, GRUCell or RNNCell (int8 or fp16 weights),
    with torch.nn's interface: ``cell(x, hx=None)``, batched (2-D) or unbatched (1-D)."""

    returns_quantized = False

    def __init__(self, reference: ReferenceModule, fp16: bool, engine: str) -> None:
        super().__init__(engine)
        cell = reference.module
        require(isinstance(cell, _CELLS), f"not an LSTMCell/GRUCell/RNNCell: {type(cell)}")
        require(sorted(reference.weight_qparams) == sorted(_WEIGHTS), "weights other than w_ih/hh")
        self.mode = _mode(cell)
        self.input_size, self.hidden_size = cell.input_size, cell.hidden_size
        self.has_bias = cell.bias
        self.fp16 = fp16
        # The QParams keep dtype, scheme and axis; scale and zero point are buffers
        # (a loaded state_dict brings its own).
        self._qparams = dict(reference.weight_qparams)
        for name in _WEIGHTS:
            qparams = self._qparams[name]
            self.register_buffer(f"{name}_int", reference.integer_weight(name).clone())
            self.register_buffer(f"{name}_scale", qparams.scale.detach().double().reshape(-1))
            self.register_buffer(f"{name}_zero_point", qparams.zero_point.detach().reshape(-1))
        for name in ("bias_ih", "bias_hh"):
            bias = getattr(cell, name)
            self.register_buffer(name, None if bias is None else bias.detach().float().clone())
        self.repack()

    def _weight(self, name: str) -> torch.Tensor:
        integer = getattr(self, f"{name}_int")
        if self.fp16:
            return integer.float()
        qparams = dataclasses.replace(
            self._qparams[name],
            scale=getattr(self, f"{name}_scale"),
            zero_point=getattr(self, f"{name}_zero_point"),
        )
        return to_torch_qtensor(integer, qparams)

    def pack(self):
        """(packed w_ih, packed w_hh, b_ih, b_hh): what torch's cell ops take."""
        prepack = (
            torch.ops.quantized.linear_prepack_fp16
            if self.fp16
            else torch.ops.quantized.linear_prepack
        )
        gates = {"LSTM": 4, "GRU": 3}.get(self.mode, 1)
        biases = [getattr(self, name) for name in ("bias_ih", "bias_hh")]
        packed = [prepack(self._weight(w), b) for w, b in zip(_WEIGHTS, biases, strict=True)]
        # The ops read the bias from the packed linears; their bias arguments are
        # required tensors all the same.
        zeros = torch.zeros(gates * self.hidden_size)
        return (*packed, *(zeros if b is None else b for b in biases))

    def forward(self, x: torch.Tensor, hx=None):
        sizes = [self.input_size, self.hidden_size]
        if self.mode == "LSTM":
            return _run_lstm_cell(x, hx, *self._packed, sizes)
        return _run_cell(self.mode, x, hx, *self._packed, sizes)

    def extra_repr(self) -> str:
        kind = {"LSTM": "LSTMCell", "GRU": "GRUCell"}.get(self.mode, "RNNCell")
        nonlinearity = f", nonlinearity={self.mode[4:].lower()}" if kind == "RNNCell" else ""
        return (
            f"{kind}({self.input_size}, {self.hidden_size}, bias={self.has_bias}"
            f"{nonlinearity}), weights={'float16' if self.fp16 else 'qint8'}, "
            f"engine={self.engine}"
        )

    def __prepare_scriptable__(self) -> torch.nn.Module:
        """What ``torch.jit.script`` compiles instead: an LSTM cell takes and returns
        a pair of tensors, the others one, which one TorchScript forward cannot."""
        return (_ScriptedLSTMCell if self.mode == "LSTM" else _ScriptedCell)(self)

    @classmethod
    def lower(cls, match: KernelMatch) -> DynamicCell:
        reference, fp16, _ = dynamic_reference(match)
        return cls(reference, fp16, match.engine)


class _Scripted(torch.nn.Module):
    """A :class:`DynamicCell`'s packed weights (the same objects) and sizes, with a
    typed forward. torch.jit.save writes the packed linears as torch's own
    (``LinearPackedParamsBase`` pickles its weight and bias); torch.jit.load packs
    them for ``torch.backends.quantized.engine``: load under the kernel's engine."""

    def __init__(self, cell: DynamicCell) -> None:
        super().__init__()
        self._packed_ih, self._packed_hh, self.b_ih, self.b_hh = cell._packed
        self.mode = cell.mode
        self.sizes = [cell.input_size, cell.hidden_size]


class _ScriptedCell(_Scripted):
    def forward(self, x: torch.Tensor, hx: torch.Tensor | None = None) -> torch.Tensor:
        return _run_cell(
            self.mode, x, hx, self._packed_ih, self._packed_hh, self.b_ih, self.b_hh, self.sizes
        )


class _ScriptedLSTMCell(_Scripted):
    def forward(
        self, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _run_lstm_cell(
            x, hx, self._packed_ih, self._packed_hh, self.b_ih, self.b_hh, self.sizes
        )
