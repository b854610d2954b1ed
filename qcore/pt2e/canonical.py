"""Exported ops rewritten into the forms int8 kernels, algorithms and Inductor's int8
passes read, before annotation. Each rewrite computes the same function.

- ``nn.Conv2d(..., padding="same")`` exports as ``aten.conv2d.padding``, an overload
  none of them reads: such a conv would be annotated, then left in reference form.
  Where integers give the same padding (always for ``"valid"``; for ``"same"`` when
  each dimension's total padding is even,
  :func:`qcore.engine.conv_padding.explicit_padding`) the node becomes the default
  overload with them (:func:`explicit_conv_padding`).
- A linear written as ``torch.addmm(bias, x, weight)`` (transformers' ``Conv1D``, in
  GPT-2) exports as ``aten.addmm``, which no backend pattern matches: the model's
  every projection stayed float. With a constant weight and a 1-D constant bias it
  becomes ``aten.linear(x, weight.T, bias)`` (:func:`linear_from_addmm`).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.operator_schemas import normalize_function

from qcore.engine.addmm import linear_from_addmm as rewrite_addmm
from qcore.engine.conv_padding import explicit_padding, per_dim

__all__ = ["canonicalize", "explicit_conv_padding", "linear_from_addmm"]

aten = torch.ops.aten
_STRING_PADDED = {aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding}


def _arguments(node: Node) -> dict:
    """The op's arguments by name, defaults filled in."""
    return normalize_function(
        node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True
    ).kwargs


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
            per_dim(values["stride"], dims),
            padding,
            per_dim(values["dilation"], dims),
            values["groups"],
        )
        node.kwargs = {}
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def linear_from_addmm(gm: GraphModule) -> int:
    """Rewrite each ``aten.addmm(bias, x, weight)`` of ``gm`` (in place) whose weight is
    a 2-D constant, bias a 1-D constant and scalars 1 into ``aten.linear`` on the
    weight transposed (a new parameter, so a weight used elsewhere is left as it
    is); returns how many."""
    return rewrite_addmm(gm, aten.addmm.default, aten.linear.default)


def canonicalize(gm: GraphModule) -> int:
    """Every rewrite of this module on ``gm`` (in place); returns how many nodes changed."""
    return explicit_conv_padding(gm) + linear_from_addmm(gm)
