"""Exported convolutions with ``padding="same"``/``"valid"`` given explicit padding.

``nn.Conv2d(..., padding="same")`` exports as ``aten.conv2d.padding``, an overload
no int8 kernel, Inductor int8 pass or algorithm reads: such a conv would be
annotated, then left in reference form. Where integers give the same padding
(always for ``"valid"``; for ``"same"`` when each dimension's total padding is even,
:func:`qcore.engine.conv_padding.explicit_padding`), the node becomes the default
overload with them, before annotation. The function is unchanged.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from qcore.engine.conv_padding import explicit_padding

__all__ = ["explicit_conv_padding"]

aten = torch.ops.aten
_STRING_PADDED = {aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding}


def _arguments(node: Node) -> dict:
    """The op's arguments by name, defaults filled in."""
    values = {}
    for index, argument in enumerate(node.target._schema.arguments):
        if index < len(node.args):
            values[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            values[argument.name] = node.kwargs[argument.name]
        else:
            values[argument.name] = argument.default_value
    return values


def _per_dim(value: int | list[int], dims: int) -> list[int]:
    return [value] * dims if isinstance(value, int) else list(value)


def explicit_conv_padding(gm: GraphModule) -> int:
    """Rewrite each string-padded conv of ``gm`` (in place) whose padding integers
    can say; returns how many."""
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _STRING_PADDED:
            continue
        weight = node.args[1].meta.get("val") if isinstance(node.args[1], Node) else None
        if not isinstance(weight, torch.Tensor):
            continue
        values = _arguments(node)
        kernel_size = tuple(weight.shape[2:])
        dims = len(kernel_size)
        padding = explicit_padding(values["padding"], kernel_size, values["dilation"])
        if padding is None:
            continue
        node.target = node.target.overloadpacket.default
        node.args = (
            values["input"],
            values["weight"],
            values["bias"],
            _per_dim(values["stride"], dims),
            padding,
            _per_dim(values["dilation"], dims),
            values["groups"],
        )
        node.kwargs = {}
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
