"""Weighted aten ops in reference form, as the ReferenceModules the kernels take.

``dequantize(x) -> aten.conv2d(x, dequantize(w_int), bias) [-> relu] -> quantize``
becomes one ``ReferenceModule`` around an equivalent float ``nn.Conv2d`` (or
``ConvReLU2d``) holding the same integer weight and qparams, so the FX path's
kernels (``qcore.kernels``) lower it unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
from torch import nn
from torch.fx import GraphModule, Node

from qcore import ops
from qcore.engine.reference import QParams, ReferenceModule
from qcore.pt2e.patterns import packet

__all__ = ["to_reference_modules"]

aten = torch.ops.aten
_RELU = {aten.relu, aten.relu_}
_CONV = {aten.conv1d: 1, aten.conv2d: 2, aten.conv3d: 3}
_CONV_RELU = {1: nni.ConvReLU1d, 2: nni.ConvReLU2d, 3: nni.ConvReLU3d}


def _is_call(node: Any, function: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is function


def _attr(gm: GraphModule, node: Any) -> torch.Tensor:
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part)
    return value


def _weight(gm: GraphModule, node: Any) -> tuple[torch.Tensor, QParams] | None:
    """(dequantized weight, its qparams) if ``node`` dequantizes a stored integer weight."""
    if _is_call(node, ops.dequantize_per_channel):
        integer, scale, zero_point, axis, quant_min, quant_max, dtype = node.args
        scale, zero_point = _attr(gm, scale), _attr(gm, zero_point)
        qscheme = torch.per_channel_affine
    elif _is_call(node, ops.dequantize_per_tensor):
        integer, scale, zero_point, quant_min, quant_max, dtype = node.args
        scale, zero_point, axis = torch.tensor([scale]), torch.tensor([zero_point]), None
        qscheme = torch.per_tensor_affine
    else:
        return None
    if not isinstance(integer, Node) or integer.op != "get_attr":
        return None
    qparams = QParams(scale, zero_point, dtype, quant_min, quant_max, qscheme, axis)
    if axis is None:
        dequantized = ops.dequantize_per_tensor(
            _attr(gm, integer), float(scale[0]), int(zero_point[0]), quant_min, quant_max, dtype
        )
    else:
        dequantized = ops.dequantize_per_channel(
            _attr(gm, integer), scale, zero_point, axis, quant_min, quant_max, dtype
        )
    return dequantized, qparams


def _bias(gm: GraphModule, node: Any) -> torch.Tensor | None | bool:
    """The float bias; False when it is neither absent, a constant nor a dequantized one."""
    if node is None:
        return None
    if isinstance(node, Node) and node.op == "get_attr":
        return _attr(gm, node).detach().float()
    if _is_call(node, ops.dequantize_per_tensor) or _is_call(node, ops.dequantize_per_channel):
        if node.args[0].op == "get_attr":
            args = [_attr(gm, a) if isinstance(a, Node) else a for a in node.args]
            return node.target(*args).float()
    return False


def _float_module(op: Any, node: Node, weight: torch.Tensor, bias: Any) -> nn.Module | None:
    has_bias = bias is not None
    if op is aten.linear:
        module = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
    else:
        dims = _CONV[op]
        stride, padding, dilation, groups = (list(node.args[3:7]) + [None] * 4)[:4]
        if isinstance(padding, str):
            return None
        module = getattr(nn, f"Conv{dims}d")(
            weight.shape[1] * (groups or 1),
            weight.shape[0],
            tuple(weight.shape[2:]),
            stride=stride or 1,
            padding=padding or 0,
            dilation=dilation or 1,
            groups=groups or 1,
            bias=has_bias,
        )
    with torch.no_grad():
        module.weight.copy_(weight)
        if has_bias:
            module.bias.copy_(bias)
    return module


def _replace(gm: GraphModule, node: Node) -> tuple[str, str] | None:
    op = packet(node)
    if op is not aten.linear and op not in _CONV:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, weight_node, bias_node = args[:3]
    found = _weight(gm, weight_node)
    bias = _bias(gm, bias_node)
    if not _is_call(x, ops.dequantize_per_tensor) or found is None or bias is False:
        return None
    tail = node
    users = list(node.users)
    relu = len(users) == 1 and packet(users[0]) in _RELU
    if relu:
        tail = users[0]
    users = list(tail.users)
    if len(users) != 1 or not _is_call(users[0], ops.quantize_per_tensor):
        return None
    module = _float_module(op, node, found[0], bias)
    if module is None:
        return None
    if relu:
        dims = _CONV.get(op)
        fused_class = nni.LinearReLU if op is aten.linear else _CONV_RELU[dims]
        module, name = fused_class(module, nn.ReLU()), "0.weight"
    else:
        name = "weight"
    reference = ReferenceModule(module, {name: found[1]}, type(module))
    target = f"{node.name}_reference"
    gm.add_submodule(target, reference)
    with gm.graph.inserting_before(tail):
        replacement = gm.graph.call_module(target, (x,))
    replacement.meta["val"] = tail.meta.get("val")
    tail.replace_all_uses_with(replacement)
    for dead in (tail, node) if relu else (node,):
        gm.graph.erase_node(dead)
    return replacement.name, type(module).__name__


def to_reference_modules(gm: GraphModule) -> dict[str, str]:
    """Replace the weighted patterns in place; returns {new node name: pattern}."""
    replaced = {}
    for node in list(gm.graph.nodes):
        if packet(node) not in _CONV and packet(node) is not aten.linear:
            continue  # relu nodes a replacement erased are never looked at
        found = _replace(gm, node)
        if found is not None:
            replaced[found[0]] = found[1]
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return replaced
