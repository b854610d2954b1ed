"""Small float models whose reference graph holds a kernel's pattern.

The conformance suite (:mod:`qcore.conformance`) checks every kernel a backend
registers against the reference form. For that it needs a model in which the
kernel's pattern appears; :func:`model_for` builds one from the pattern alone
(module classes, functions, method names, torch.export's aten overloads, and
forward chains of those such as ``(torch.nn.Linear, torch.nn.ReLU)``).

A pattern it cannot build returns None: the kernel then fails ``qcore check``
unless its plugin declares why in ``Kernel.no_model_reason``.

Example::

    >>> built = model_for(torch.nn.Linear)
    >>> built.model(*built.inputs).shape
    torch.Size([4, 8])
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
import torch.nn.functional as F
from torch import nn

__all__ = ["KernelModel", "model_for"]

aten = torch.ops.aten


@dataclass(frozen=True)
class KernelModel:
    """A float model holding a pattern, its example inputs, and how to quantize it.

    ``path`` is ``"fx"`` or ``"pt2e"`` (a pattern of aten overloads appears only in
    torch.export graphs); ``quantization`` the QConfig kinds the kernel may be meant
    for, tried in order: ``"static"`` (the backend's default mapping),
    ``"static_global"`` (its global QConfig for every op), ``"dynamic"``,
    ``"weight_only"``.
    """

    model: nn.Module
    inputs: tuple
    path: str = "fx"
    quantization: tuple[str, ...] = ("static", "static_global", "dynamic")

    def calibration(self, batches: int = 4) -> list[tuple]:
        """Batches like the example inputs (random data of the same shapes and dtypes)."""
        return [tuple(_like(x) for x in self.inputs) for _ in range(batches)]


def _like(x: torch.Tensor) -> torch.Tensor:
    if x.is_floating_point():
        return torch.randn_like(x)
    return torch.randint_like(x, 0, int(x.max()) + 1)


class _Call(nn.Module):
    """``forward`` calls ``fn``: symbolic tracing records the functions it calls."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor, *others: torch.Tensor) -> Any:
        return self.fn(x, *others)


class _Chain(nn.Module):
    """``first`` on the input (after ``producers``, if any), then each of ``then``
    on the result."""

    def __init__(self, first: nn.Module, then: list[nn.Module], producers: list[nn.Module]) -> None:
        super().__init__()
        self.producers = nn.ModuleList(producers)
        self.first = first
        self.then = nn.ModuleList(then)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for producer in self.producers:
            x = producer(x)
        y = self.first(x)
        for op in self.then:
            y = op(y)
        return y


class _Chain2(_Chain):
    """:class:`_Chain` for a first op of two inputs (add, mul, cat, matmul)."""

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if len(self.producers):
            x, other = self.producers[0](x), self.producers[1](other)
        y = self.first(x, other)
        for op in self.then:
            y = op(y)
        return y


def _producer(x: torch.Tensor) -> nn.Module:
    """A 1x1 conv (a linear layer for a 2-d input) keeping ``x``'s shape: every
    backend quantizes its output, so the op after it gets a quantized input."""
    if x.dim() == 2:
        return nn.Linear(x.shape[1], x.shape[1])
    return getattr(nn, f"Conv{x.dim() - 2}d")(x.shape[1], x.shape[1], 1)


def _x(*shape: int) -> Callable[[], tuple]:
    return lambda: (torch.randn(*shape),)


_X1, _X2, _X3 = _x(2, 4, 16), _x(2, 4, 8, 8), _x(2, 2, 6, 6, 6)
_XL = _x(4, 16)


def _two(*shape: int) -> Callable[[], tuple]:
    return lambda: (torch.randn(*shape), torch.randn(*shape))


# op -> (a zero-argument factory of the module that runs it, its example inputs)
_FIRST: dict[Any, tuple[Callable[[], nn.Module], Callable[[], tuple]]] = {
    nn.Linear: (lambda: nn.Linear(16, 8), _XL),
    nni.LinearReLU: (lambda: nn.Sequential(nn.Linear(16, 8), nn.ReLU()), _XL),
    nni.LinearLeakyReLU: (lambda: nn.Sequential(nn.Linear(16, 8), nn.LeakyReLU(0.1)), _XL),
    nni.LinearTanh: (lambda: nn.Sequential(nn.Linear(16, 8), nn.Tanh()), _XL),
    nn.Conv1d: (lambda: nn.Conv1d(4, 4, 3), _X1),
    nn.Conv2d: (lambda: nn.Conv2d(4, 4, 3), _X2),
    nn.Conv3d: (lambda: nn.Conv3d(2, 3, 3), _X3),
    nni.ConvReLU1d: (lambda: nn.Sequential(nn.Conv1d(4, 4, 3), nn.ReLU()), _X1),
    nni.ConvReLU2d: (lambda: nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()), _X2),
    nni.ConvReLU3d: (lambda: nn.Sequential(nn.Conv3d(2, 3, 3), nn.ReLU()), _X3),
    nn.ConvTranspose1d: (lambda: nn.ConvTranspose1d(4, 4, 3), _X1),
    nn.ConvTranspose2d: (lambda: nn.ConvTranspose2d(4, 4, 3), _X2),
    nn.ConvTranspose3d: (lambda: nn.ConvTranspose3d(2, 3, 3), _X3),
    nn.LSTM: (lambda: _FirstOutput(nn.LSTM(16, 8)), _x(5, 2, 16)),
    nn.GRU: (lambda: _FirstOutput(nn.GRU(16, 8)), _x(5, 2, 16)),
    nn.LSTMCell: (lambda: _FirstOutput(nn.LSTMCell(16, 8)), _XL),
    nn.GRUCell: (lambda: nn.GRUCell(16, 8), _XL),
    nn.RNNCell: (lambda: nn.RNNCell(16, 8), _XL),
    nn.Embedding: (lambda: nn.Embedding(10, 8), lambda: (torch.randint(0, 10, (4, 3)),)),
    nn.EmbeddingBag: (
        lambda: nn.EmbeddingBag(10, 8, mode="sum"),
        lambda: (torch.randint(0, 10, (4, 3)),),
    ),
    nn.BatchNorm2d: (lambda: nn.BatchNorm2d(4), _X2),
    nn.BatchNorm3d: (lambda: nn.BatchNorm3d(2), _X3),
    nni.BNReLU2d: (lambda: nn.Sequential(nn.BatchNorm2d(4), nn.ReLU()), _X2),
    nni.BNReLU3d: (lambda: nn.Sequential(nn.BatchNorm3d(2), nn.ReLU()), _X3),
    nn.LayerNorm: (lambda: nn.LayerNorm(16), _X1),
    F.layer_norm: (lambda: _Call(lambda x: F.layer_norm(x, (16,))), _X1),
    nn.GroupNorm: (lambda: nn.GroupNorm(2, 4), _X2),
    F.group_norm: (lambda: _Call(lambda x: F.group_norm(x, 2)), _X2),
    nn.InstanceNorm1d: (lambda: nn.InstanceNorm1d(4), _X1),
    nn.InstanceNorm2d: (lambda: nn.InstanceNorm2d(4), _X2),
    nn.InstanceNorm3d: (lambda: nn.InstanceNorm3d(2), _X3),
    F.instance_norm: (lambda: _Call(F.instance_norm), _X2),
    nn.Hardswish: (nn.Hardswish, _X2),
    F.hardswish: (lambda: _Call(F.hardswish), _X2),
    nn.ELU: (nn.ELU, _X2),
    F.elu: (lambda: _Call(F.elu), _X2),
    nn.LeakyReLU: (lambda: nn.LeakyReLU(0.1), _X2),
    F.leaky_relu: (lambda: _Call(lambda x: F.leaky_relu(x, 0.1)), _X2),
    nn.Sigmoid: (nn.Sigmoid, _X2),
    torch.sigmoid: (lambda: _Call(torch.sigmoid), _X2),
    F.sigmoid: (lambda: _Call(F.sigmoid), _X2),
    "sigmoid": (lambda: _Call(lambda x: x.sigmoid()), _X2),
    nn.Tanh: (nn.Tanh, _X2),
    torch.tanh: (lambda: _Call(torch.tanh), _X2),
    F.tanh: (lambda: _Call(F.tanh), _X2),
    "tanh": (lambda: _Call(lambda x: x.tanh()), _X2),
    nn.Hardsigmoid: (nn.Hardsigmoid, _X2),
    F.hardsigmoid: (lambda: _Call(F.hardsigmoid), _X2),
    nn.ReLU: (nn.ReLU, _X2),
    F.relu: (lambda: _Call(F.relu), _X2),
    torch.relu: (lambda: _Call(torch.relu), _X2),
    "relu": (lambda: _Call(lambda x: x.relu()), _X2),
    "relu_": (lambda: _Call(lambda x: x.relu_()), _X2),
    nn.ReLU6: (nn.ReLU6, _X2),
    F.relu6: (lambda: _Call(F.relu6), _X2),
    nn.Hardtanh: (nn.Hardtanh, _X2),
    F.hardtanh: (lambda: _Call(F.hardtanh), _X2),
    torch.clamp: (lambda: _Call(lambda x: torch.clamp(x, -1.0, 1.0)), _X2),
    "clamp": (lambda: _Call(lambda x: x.clamp(-1.0, 1.0)), _X2),
    operator.add: (lambda: _Call(operator.add), _two(2, 4, 8, 8)),
    torch.add: (lambda: _Call(torch.add), _two(2, 4, 8, 8)),
    operator.mul: (lambda: _Call(operator.mul), _two(2, 4, 8, 8)),
    torch.mul: (lambda: _Call(torch.mul), _two(2, 4, 8, 8)),
    torch.cat: (lambda: _Call(lambda a, b: torch.cat([a, b], 1)), _two(2, 4, 8, 8)),
    torch.matmul: (lambda: _Call(torch.matmul), _two(2, 8, 8)),
    torch.bmm: (lambda: _Call(torch.bmm), _two(2, 8, 8)),
    nn.MaxPool1d: (lambda: nn.MaxPool1d(2), _X1),
    nn.MaxPool2d: (lambda: nn.MaxPool2d(2), _X2),
    nn.MaxPool3d: (lambda: nn.MaxPool3d(2), _X3),
    F.max_pool1d: (lambda: _Call(lambda x: F.max_pool1d(x, 2)), _X1),
    F.max_pool2d: (lambda: _Call(lambda x: F.max_pool2d(x, 2)), _X2),
    F.max_pool3d: (lambda: _Call(lambda x: F.max_pool3d(x, 2)), _X3),
    nn.PixelShuffle: (lambda: nn.PixelShuffle(2), _X2),
    nn.PixelUnshuffle: (lambda: nn.PixelUnshuffle(2), _X2),
    F.pixel_shuffle: (lambda: _Call(lambda x: F.pixel_shuffle(x, 2)), _X2),
    F.pixel_unshuffle: (lambda: _Call(lambda x: F.pixel_unshuffle(x, 2)), _X2),
    nn.ChannelShuffle: (lambda: nn.ChannelShuffle(2), _X2),
    torch.channel_shuffle: (lambda: _Call(lambda x: torch.channel_shuffle(x, 2)), _X2),
    nn.Identity: (nn.Identity, _X2),
    nn.Dropout: (nn.Dropout, _X2),
    F.dropout: (lambda: _Call(lambda x: F.dropout(x, training=False)), _X2),
    torch.flatten: (lambda: _Call(lambda x: torch.flatten(x, 1)), _X2),
    torch.transpose: (lambda: _Call(lambda x: torch.transpose(x, 1, 2)), _X2),
    torch.squeeze: (lambda: _Call(lambda x: torch.squeeze(x, 1)), _x(2, 1, 8, 8)),
    torch.unsqueeze: (lambda: _Call(lambda x: torch.unsqueeze(x, 1)), _X2),
    torch.narrow: (lambda: _Call(lambda x: torch.narrow(x, 1, 0, 2)), _X2),
    torch.repeat_interleave: (lambda: _Call(lambda x: torch.repeat_interleave(x, 2, 1)), _X2),
    torch.stack: (lambda: _Call(lambda x: torch.stack([x, x], 1)), _X2),
    "flatten": (lambda: _Call(lambda x: x.flatten(1)), _X2),
    "reshape": (lambda: _Call(lambda x: x.reshape(2, 4, 64)), _X2),
    "view": (lambda: _Call(lambda x: x.view(2, 4, 64)), _X2),
    "transpose": (lambda: _Call(lambda x: x.transpose(1, 2)), _X2),
    "permute": (lambda: _Call(lambda x: x.permute(0, 2, 3, 1)), _X2),
    "contiguous": (lambda: _Call(lambda x: x.transpose(2, 3).contiguous()), _X2),
    "squeeze": (lambda: _Call(lambda x: x.squeeze(1)), _x(2, 1, 8, 8)),
    "unsqueeze": (lambda: _Call(lambda x: x.unsqueeze(1)), _X2),
    "narrow": (lambda: _Call(lambda x: x.narrow(1, 0, 2)), _X2),
    "repeat": (lambda: _Call(lambda x: x.repeat(1, 2, 1, 1)), _X2),
    "repeat_interleave": (lambda: _Call(lambda x: x.repeat_interleave(2, 1)), _X2),
    "detach": (lambda: _Call(lambda x: x.detach()), _X2),
    nn.AvgPool1d: (lambda: nn.AvgPool1d(2), _X1),
    nn.AvgPool2d: (lambda: nn.AvgPool2d(2), _X2),
    nn.AvgPool3d: (lambda: nn.AvgPool3d(2), _X3),
    nn.AdaptiveAvgPool1d: (lambda: nn.AdaptiveAvgPool1d(4), _X1),
    nn.AdaptiveAvgPool2d: (lambda: nn.AdaptiveAvgPool2d(2), _X2),
    nn.AdaptiveAvgPool3d: (lambda: nn.AdaptiveAvgPool3d(2), _X3),
    F.avg_pool1d: (lambda: _Call(lambda x: F.avg_pool1d(x, 2)), _X1),
    F.avg_pool2d: (lambda: _Call(lambda x: F.avg_pool2d(x, 2)), _X2),
    F.avg_pool3d: (lambda: _Call(lambda x: F.avg_pool3d(x, 2)), _X3),
    F.adaptive_avg_pool1d: (lambda: _Call(lambda x: F.adaptive_avg_pool1d(x, 4)), _X1),
    F.adaptive_avg_pool2d: (lambda: _Call(lambda x: F.adaptive_avg_pool2d(x, 2)), _X2),
    F.adaptive_avg_pool3d: (lambda: _Call(lambda x: F.adaptive_avg_pool3d(x, 2)), _X3),
    F.interpolate: (lambda: _Call(lambda x: F.interpolate(x, scale_factor=0.5, mode="area")), _X2),
    torch.mean: (lambda: _Call(lambda x: torch.mean(x, (2, 3), keepdim=True)), _X2),
    "mean": (lambda: _Call(lambda x: x.mean((2, 3), keepdim=True)), _X2),
}

# A fused chain's later ops, applied to the first op's result.
_THEN: dict[Any, Callable[[], nn.Module]] = {
    nn.ReLU: nn.ReLU,
    F.relu: lambda: _Call(F.relu),
    torch.relu: lambda: _Call(torch.relu),
    "relu": lambda: _Call(lambda y: y.relu()),
}

# torch.export's aten overloads: the float op that exports as each (PT2E patterns).
_ATEN: dict[Any, Any] = {
    aten.relu.default: F.relu,
    aten.relu_.default: "relu_",
    aten.add.Tensor: torch.add,
    aten.add_.Tensor: "add_",
    aten.mul.Tensor: torch.mul,
    aten.mul_.Tensor: "mul_",
    aten.sigmoid.default: torch.sigmoid,
    aten.tanh.default: torch.tanh,
    aten.cat.default: torch.cat,
    aten.matmul.default: torch.matmul,
    aten.bmm.default: torch.bmm,
    aten.hardswish.default: F.hardswish,
    aten.hardswish_.default: "hardswish_",
    aten.hardtanh.default: F.hardtanh,
    aten.hardtanh_.default: "hardtanh_",
    aten.max_pool1d.default: F.max_pool1d,
    aten.max_pool2d.default: F.max_pool2d,
    aten.max_pool3d.default: F.max_pool3d,
    aten.flatten.using_ints: torch.flatten,
    aten.reshape.default: "reshape",
    aten.view.default: "view",
    aten.permute.default: "permute",
    aten.transpose.int: "transpose",
    aten.channel_shuffle.default: torch.channel_shuffle,
    aten.contiguous.default: "contiguous",
    aten.squeeze.dim: "squeeze",
    aten.unsqueeze.default: "unsqueeze",
    aten.dropout.default: F.dropout,
    aten.avg_pool2d.default: F.avg_pool2d,
    aten.adaptive_avg_pool2d.default: F.adaptive_avg_pool2d,
    aten.mean.dim: "mean",
}

# In-place forms only torch.export sees (their FX patterns are the out-of-place ones).
_FIRST["hardswish_"] = (lambda: _Call(lambda x: F.hardswish(x, inplace=True)), _X2)
_FIRST["hardtanh_"] = (lambda: _Call(lambda x: F.hardtanh(x, inplace=True)), _X2)
_THEN["relu_"] = lambda: _Call(lambda y: y.relu_())
# x += y on a tensor of the model's own (writing into an input is export's business)
_FIRST["add_"] = (lambda: _Call(lambda a, b: a.clone().add_(b)), _two(2, 4, 8, 8))
_FIRST["mul_"] = (lambda: _Call(lambda a, b: a.clone().mul_(b)), _two(2, 4, 8, 8))

_DYNAMIC_ONLY = (nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell, nn.RNNCell)
_WEIGHT_ONLY = (nn.Embedding, nn.EmbeddingBag)


class _ConvAdd(nn.Module):
    """``conv(x) + y``, then relu if ``relu``: what the onednn config fuses into
    ``ConvAdd2d``/``ConvAddReLU2d``."""

    def __init__(self, relu: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3)
        self.relu = nn.ReLU() if relu else nn.Identity()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(x) + y)


def _conv_add_inputs() -> tuple:
    return torch.randn(2, 4, 8, 8), torch.randn(2, 4, 6, 6)


_FIRST[nni.ConvAdd2d] = (lambda: _ConvAdd(relu=False), _conv_add_inputs)
_FIRST[nni.ConvAddReLU2d] = (lambda: _ConvAdd(relu=True), _conv_add_inputs)


class _FirstOutput(nn.Module):
    """A recurrent layer's output sequence (its hidden state left out), an LSTM cell's h."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def _pt2e_fused() -> dict[Any, tuple[Callable[[], nn.Module], Callable[[], tuple]]]:
    """PT2E's fused containers: the float chains a Quantizer fuses into them."""
    try:
        from qcore.pt2e.fused import WeightedWithPostOps
    except ImportError:  # qcore's PT2E path needs torch.export
        return {}
    return {
        WeightedWithPostOps: (lambda: _ConvAdd(relu=True), _conv_add_inputs),
    }


def _first(op: Any) -> tuple[Callable[[], nn.Module], Callable[[], tuple]] | None:
    return _FIRST.get(op) or _pt2e_fused().get(op)


def model_for(pattern: Any, seed: int = 0, *, produced: bool = False) -> KernelModel | None:
    """A float model whose reference graph holds ``pattern``, or None.

    ``pattern`` is a kernel's pattern: one op or a tuple of ops in forward order.
    Weights and inputs are drawn with ``seed``. ``produced``: each input first goes
    through a 1x1 conv (or linear layer), for backends that quantize an op such as
    max pooling only where its input comes out of a quantized op.

    Example::

        >>> built = model_for((torch.nn.Conv2d, torch.nn.ReLU))
        >>> type(built.model.first).__name__, built.path
        ('Conv2d', 'fx')
    """
    chain = pattern if isinstance(pattern, tuple) else (pattern,)
    path = "pt2e" if any(op in _ATEN for op in chain) else "fx"
    if path == "fx" and any(op in _pt2e_fused() for op in chain):
        path = "pt2e"
    ops = [_ATEN.get(op, op) for op in chain]
    first = _first(ops[0])
    if first is None or not all(op in _THEN for op in ops[1:]):
        return None
    torch.manual_seed(seed)
    make, make_inputs = first
    inputs = make_inputs()
    chain = _Chain2 if len(inputs) == 2 else _Chain
    producers = [_producer(x) for x in inputs] if produced else []
    model = chain(make(), [_THEN[op]() for op in ops[1:]], producers).eval()
    quantization: tuple[str, ...] = ("static", "static_global", "dynamic")
    if produced and not all(x.is_floating_point() for x in inputs):
        return None
    if ops[0] in _DYNAMIC_ONLY:
        quantization = ("dynamic",)
    elif ops[0] in _WEIGHT_ONLY:
        quantization = ("weight_only",)
    return KernelModel(model, inputs, path, quantization)
