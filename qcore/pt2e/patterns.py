"""BackendConfig patterns (FX modules, functions, methods) as torch.export aten ops.

A BackendConfig names what FX graph mode sees: ``nn.Conv2d``, ``F.relu``,
``operator.add``, ``"reshape"``, fused modules like ``ConvReLU2d``. A
torch.export graph has aten ops instead. :func:`aten_pattern` translates a
pattern in complex format (``(op, arg0_pattern, ...)``, last op first) into
the same shape over sets of aten op packets; a fused module becomes the
chain of the ops it fuses. Batch norms after a conv are folded before
annotation (eval graphs), so chains through a batch norm drop it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from qcore.engine.match import is_match_all

__all__ = ["WEIGHTED", "AtenPattern", "aten_ops", "aten_pattern", "match_aten"]

aten = torch.ops.aten

# The aten ops with (input, weight, bias, ...) arguments.
WEIGHTED = frozenset(
    {
        aten.linear,
        aten.conv1d,
        aten.conv2d,
        aten.conv3d,
        aten.conv_transpose1d,
        aten.conv_transpose2d,
        aten.conv_transpose3d,
    }
)
_BATCH_NORM = frozenset({aten.batch_norm, aten._native_batch_norm_legit_no_training})


def _table() -> dict[Any, tuple]:
    table: dict[Any, tuple] = {}

    def put(ops: tuple, *keys: Any) -> None:
        for key in keys:
            table[key] = ops

    put((aten.linear,), nn.Linear, F.linear)
    for n in (1, 2, 3):
        conv = getattr(aten, f"conv{n}d")
        put((conv,), getattr(nn, f"Conv{n}d"), getattr(F, f"conv{n}d"))
        transpose = getattr(aten, f"conv_transpose{n}d")
        put((transpose,), getattr(nn, f"ConvTranspose{n}d"), getattr(F, f"conv_transpose{n}d"))
        put((getattr(aten, f"max_pool{n}d"),), getattr(nn, f"MaxPool{n}d"))
        put((getattr(aten, f"avg_pool{n}d"),), getattr(nn, f"AvgPool{n}d"))
        put(
            (getattr(aten, f"adaptive_avg_pool{n}d"),),
            getattr(nn, f"AdaptiveAvgPool{n}d"),
            getattr(F, f"adaptive_avg_pool{n}d"),
        )
        put(tuple(_BATCH_NORM), getattr(nn, f"BatchNorm{n}d"))
    put((aten.max_pool2d, aten.max_pool2d_with_indices), F.max_pool2d)
    put((aten.max_pool1d,), F.max_pool1d)
    put((aten.max_pool3d,), F.max_pool3d)
    put((aten.avg_pool1d,), F.avg_pool1d)
    put((aten.avg_pool2d,), F.avg_pool2d)
    put((aten.avg_pool3d,), F.avg_pool3d)
    put((aten.relu, aten.relu_), nn.ReLU, F.relu, torch.relu, "relu", "relu_")
    put((aten.hardtanh, aten.hardtanh_), nn.Hardtanh, nn.ReLU6, F.hardtanh, F.hardtanh_, F.relu6)
    put((aten.hardswish, aten.hardswish_), nn.Hardswish, F.hardswish)
    put((aten.hardsigmoid, aten.hardsigmoid_), nn.Hardsigmoid, F.hardsigmoid, "hardsigmoid")
    put((aten.sigmoid, aten.sigmoid_), nn.Sigmoid, torch.sigmoid, "sigmoid", "sigmoid_")
    put((aten.tanh, aten.tanh_), nn.Tanh, torch.tanh, "tanh", "tanh_")
    put((aten.softmax, aten._softmax), nn.Softmax, F.softmax)
    put((aten.leaky_relu, aten.leaky_relu_), nn.LeakyReLU, F.leaky_relu)
    put((aten.elu, aten.elu_), nn.ELU, F.elu)
    put((aten.gelu,), nn.GELU, F.gelu)
    put((aten.add, aten.add_), operator.add, torch.add)
    put((aten.mul, aten.mul_), operator.mul, torch.mul)
    put((aten.matmul, aten.bmm), torch.matmul)
    put((aten.cat, aten.concat), torch.cat)
    put((aten.flatten,), torch.flatten, "flatten")
    put((aten.reshape, aten.view), "reshape", "view")
    put((aten.transpose,), torch.transpose, "transpose")
    put((aten.permute,), "permute")
    put((aten.mean,), torch.mean, "mean")
    put((aten.squeeze,), torch.squeeze, "squeeze")
    put((aten.unsqueeze,), torch.unsqueeze, "unsqueeze")
    put((aten.clamp,), torch.clamp, "clamp")
    put((aten.layer_norm,), nn.LayerNorm, F.layer_norm)
    put((aten.dropout,), nn.Dropout, F.dropout)
    put((aten.pixel_shuffle,), nn.PixelShuffle, F.pixel_shuffle)
    put((aten.channel_shuffle,), nn.ChannelShuffle, torch.channel_shuffle)
    put((aten.upsample_nearest2d, aten.upsample_bilinear2d), F.interpolate)
    put((aten.contiguous,), "contiguous")
    put((aten.embedding,), nn.Embedding, F.embedding)
    return table


_ATEN: dict[Any, tuple] = _table()

# Fused modules: the chain of float modules they stand for, in forward order.
_FUSED: dict[type, tuple] = {
    nni.LinearReLU: (nn.Linear, nn.ReLU),
    nni.LinearBn1d: (nn.Linear,),
    nni.BNReLU2d: (nn.BatchNorm2d, nn.ReLU),
    nni.BNReLU3d: (nn.BatchNorm3d, nn.ReLU),
}
for _n in (1, 2, 3):
    _conv = getattr(nn, f"Conv{_n}d")
    _FUSED[getattr(nni, f"ConvReLU{_n}d")] = (_conv, nn.ReLU)
    _FUSED[getattr(nni, f"ConvBn{_n}d")] = (_conv,)
    _FUSED[getattr(nni, f"ConvBnReLU{_n}d")] = (_conv, nn.ReLU)


def aten_ops(op: Any) -> frozenset | None:
    """The aten op packets an FX op becomes under torch.export, or None if unknown."""
    try:
        found = _ATEN.get(op)
    except TypeError:  # unhashable
        return None
    return frozenset(found) if found else None


AtenPattern = Any
"""``frozenset(packets)`` or ``(frozenset(packets), arg0_pattern, ...)``."""


def _chain(ops: list[frozenset], args: tuple) -> AtenPattern:
    """``ops`` in forward order as a complex pattern; ``args`` hang off the first."""
    pattern: AtenPattern = (ops[0], *args) if args else ops[0]
    for op in ops[1:]:
        pattern = (op, pattern)
    return pattern


def aten_pattern(pattern: Any) -> AtenPattern | None:
    """Translate an FX complex-format pattern; None if some op has no aten form."""
    op, arg_patterns = (pattern[0], pattern[1:]) if isinstance(pattern, tuple) else (pattern, ())
    if is_match_all(op):
        return "any"
    args = []
    for sub in arg_patterns:
        translated = aten_pattern(sub)
        if translated is None:
            return None
        args.append(translated)
    chain = _FUSED.get(op, (op,)) if isinstance(op, type) else (op,)
    ops = [aten_ops(item) for item in chain]
    if any(found is None for found in ops):
        return None
    if len(ops) == 1 and ops[0] == _BATCH_NORM and args and _ends_in_conv(args[0]):
        return args[0] if len(args) == 1 else None  # conv -> bn: folded away
    return _chain(ops, tuple(args))


def _ends_in_conv(pattern: AtenPattern) -> bool:
    op = pattern[0] if isinstance(pattern, tuple) else pattern
    return isinstance(op, frozenset) and bool(op & WEIGHTED)


def packet(node: Any) -> Any:
    """The op packet of a call_function node (``aten.conv2d`` for ``aten.conv2d.default``)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    return getattr(node.target, "overloadpacket", node.target)


def match_aten(node: Any, pattern: AtenPattern, *, is_output: bool = True) -> list[Node] | None:
    """The nodes of ``pattern`` ending at ``node`` (output first), or None.

    Nodes inside the match other than its output must have one user only.
    """
    if pattern == "any":
        return []
    op, arg_patterns = (pattern[0], pattern[1:]) if isinstance(pattern, tuple) else (pattern, ())
    if packet(node) not in op:
        return None
    if not is_output and len(node.users) > 1:
        return None
    if len(node.args) < len(arg_patterns):
        return None
    nodes = [node]
    for arg, sub in zip(node.args, arg_patterns, strict=False):
        found = match_aten(arg, sub, is_output=False)
        if found is None:
            return None
        nodes += found
    return nodes


def pattern_size(pattern: AtenPattern) -> int:
    if pattern == "any":
        return 0
    if isinstance(pattern, tuple):
        return 1 + sum(pattern_size(sub) for sub in pattern[1:])
    return 1
