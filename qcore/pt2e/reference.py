"""Weighted aten ops in reference form, as the ReferenceModules the kernels take.

``dequantize(x) -> aten.conv2d(x, dequantize(w_int), bias) [-> relu] [-> quantize]``
becomes one ``ReferenceModule`` around an equivalent float ``nn.Conv2d`` (or
``ConvReLU2d``) holding the same integer weight and qparams, so the FX path's
kernels (``qcore.kernels``) lower it unchanged. Other post-ops the quantizer
fused into the pattern (a residual add, then an activation such as hardtanh or
gelu) make it a :class:`~qcore.pt2e.fused.WeightedWithPostOps`, called with
the residual operand as its second input. Without a
quantize after it, the output stays float (oneDNN's kernels can produce that).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
from torch import nn
from torch.fx import GraphModule, Node
from torch.nn.utils import skip_init

from qcore import ops
from qcore.engine.explain import POST_OPS_KEY, UNLOWERABLE_KEY
from qcore.engine.reference import QParams, ReferenceModule
from qcore.pt2e.fused import WeightedWithPostOps
from qcore.pt2e.patterns import packet

__all__ = ["UNFUSED_ADD_KEY", "to_reference_modules"]

#: Node meta of an add the quantizer annotated with the weighted op before it that
#: stays apart: why (it computes in float, on the weighted kernel's float output).
UNFUSED_ADD_KEY = "qcore_unfused_add"
_BROADCASTS = (
    "its other operand broadcasts: a weighted kernel sums only an operand of its own "
    "output's shape, so this add computes in float on that kernel's float output"
)

aten = torch.ops.aten
_RELU = {aten.relu, aten.relu_}
_CONV = {aten.conv1d: 1, aten.conv2d: 2, aten.conv3d: 3}
_CONV_RELU = {1: nni.ConvReLU1d, 2: nni.ConvReLU2d, 3: nni.ConvReLU3d}
_ADDS = {aten.add, aten.add_}
_QDQ = {ops.quantize_per_tensor, ops.dequantize_per_tensor}
_ACTIVATIONS = {
    aten.hardtanh: nn.Hardtanh,
    aten.hardtanh_: nn.Hardtanh,
    aten.hardswish: nn.Hardswish,
    aten.hardswish_: nn.Hardswish,
    aten.silu: nn.SiLU,
    aten.silu_: nn.SiLU,
    aten.leaky_relu: nn.LeakyReLU,
    aten.leaky_relu_: nn.LeakyReLU,
    aten.tanh: nn.Tanh,
    aten.tanh_: nn.Tanh,
    aten.gelu: nn.GELU,
}


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
    # skip_init: no random initialization, which would draw from the user's RNG
    if op is aten.linear:
        module = skip_init(
            nn.Linear, weight.shape[1], weight.shape[0], bias=has_bias, dtype=weight.dtype
        )
    else:
        dims = _CONV[op]
        stride, padding, dilation, groups = (list(node.args[3:7]) + [None] * 4)[:4]
        if isinstance(padding, str):
            return None
        module = skip_init(
            getattr(nn, f"Conv{dims}d"),
            weight.shape[1] * (groups or 1),
            weight.shape[0],
            tuple(weight.shape[2:]),
            stride=stride or 1,
            padding=padding or 0,
            dilation=dilation or 1,
            groups=groups or 1,
            bias=has_bias,
            dtype=weight.dtype,
        )
    with torch.no_grad():
        module.weight.copy_(weight)
        if has_bias:
            module.bias.copy_(bias)
    return module


def _activation(node: Node) -> nn.Module | None:
    """The module computing ``node``'s activation op, or None if it is not one."""
    op, args, kwargs = packet(node), list(node.args[1:]), dict(node.kwargs)
    if op in _RELU:
        return nn.ReLU()
    if op in _ACTIVATIONS:
        return _ACTIVATIONS[op](*args, **kwargs)
    return None


def _same_shape(a: Node, b: Node) -> bool:
    """Whether both nodes' recorded values have one shape: a residual add fuses into
    its weighted op (whose kernels sum into an accumulator of the output's shape) only
    then, never where the other operand broadcasts (a (1, T, C) position embedding
    added to a (B, T, C) linear output, a per-channel parameter added to a conv)."""
    shapes = [_recorded_shape(n) for n in (a, b)]
    return shapes[0] is not None and shapes[0] == shapes[1]


def _recorded_shape(node: Any) -> Any:
    """The shape export recorded for ``node``'s value, looked up through the quantize
    and dequantize nodes convert adds (which record none); None if there is none."""
    while isinstance(node, Node):
        value = node.meta.get("val")
        if value is not None:
            return getattr(value, "shape", None)
        if node.op != "call_function" or node.target not in _QDQ or not node.args:
            return None
        node = node.args[0]
    return None


def _post_ops(node: Node, fusable: set[str]) -> tuple[list[Node], Any, nn.Module | None]:
    """(post-op nodes in order, the residual operand or None, the activation module).

    Only ops the quantizer made part of the pattern (``fusable``) join it: a
    residual add (the other operand a tensor of the output's shape), then an
    activation; or an activation alone.
    """
    nodes, other, activation = [], None, None
    tail = node
    users = list(tail.users)
    user = users[0] if len(users) == 1 and users[0].name in fusable else None
    if user is not None and packet(user) in _ADDS and not user.kwargs:
        operands = list(user.args[:2])
        if len(user.args) == 2 and operands.count(tail) == 1:
            other = operands[1] if operands[0] is tail else operands[0]
            if isinstance(other, Node) and _same_shape(other, tail):
                nodes.append(user)
                tail = user
                users = list(tail.users)
                user = users[0] if len(users) == 1 and users[0].name in fusable else None
            else:
                if isinstance(other, Node):
                    user.meta[UNFUSED_ADD_KEY] = _BROADCASTS
                other = None
    if user is not None and (other is None or packet(user) in _RELU):
        activation = _activation(user)
        if activation is not None:
            nodes.append(user)
    return nodes, other, activation


def _read_both_ways(quantized: list[Node], users: list[Node]) -> str:
    readers = [u for q in quantized for u in q.users]
    in_float = [u for u in users if u not in quantized]
    return (
        f"its output is read both quantized (by {', '.join(_names(readers))}) and in float "
        f"(by {', '.join(_names(in_float))}): a kernel gives one of the two, so it stays "
        "in reference form (the quantizer left that float reader unquantized)"
    )


def _names(nodes: list[Node]) -> list[str]:
    """The names of the ops reading ``nodes``' values, through a dequantize."""
    names = []
    for node in nodes:
        if _is_call(node, ops.dequantize_per_tensor) and node.users:
            names.extend(user.name for user in node.users)
        else:
            names.append(node.name)
    return names


def _replace(gm: GraphModule, node: Node, fusable: set[str]) -> tuple[str, str] | None:
    op = packet(node)
    if op is not aten.linear and op not in _CONV:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, weight_node, bias_node = args[:3]
    found = _weight(gm, weight_node)
    bias = _bias(gm, bias_node)
    if not _is_call(x, ops.dequantize_per_tensor) or found is None or bias is False:
        return None
    post_nodes, other, activation = _post_ops(node, fusable)
    tail = post_nodes[-1] if post_nodes else node
    users = list(tail.users)
    quantized = [u for u in users if _is_call(u, ops.quantize_per_tensor)]
    if quantized and len(users) != 1:
        node.meta[UNLOWERABLE_KEY] = _read_both_ways(quantized, users)
        return None
    module = _float_module(op, node, found[0], bias)
    if module is None:
        return None
    name = "weight"
    if other is not None or not isinstance(activation, (nn.ReLU, type(None))):
        module = WeightedWithPostOps(module, residual_add=other is not None, activation=activation)
        name = "0.weight"
    elif activation is not None:
        fused_class = nni.LinearReLU if op is aten.linear else _CONV_RELU[_CONV[op]]
        module, name = fused_class(module, nn.ReLU()), "0.weight"
    reference = ReferenceModule(module, {name: found[1]}, type(module))
    target = f"{node.name}_reference"
    gm.add_submodule(target, reference)
    with gm.graph.inserting_before(tail):
        inputs = (x,) if other is None else (x, other)
        replacement = gm.graph.call_module(target, inputs)
    replacement.meta["val"] = tail.meta.get("val")
    replacement.meta[POST_OPS_KEY] = [post.name for post in post_nodes]  # explain keeps them
    tail.replace_all_uses_with(replacement)
    for dead in [*reversed(post_nodes), node]:
        gm.graph.erase_node(dead)
    return replacement.name, type(module).__name__


def to_reference_modules(gm: GraphModule, fusable: set[str]) -> dict[str, str]:
    """Replace the weighted patterns in place; returns {new node name: pattern}.

    ``fusable`` names the ops the quantizer made part of a quantized pattern:
    only those join a weighted op as its post-ops.
    """
    replaced = {}
    for node in list(gm.graph.nodes):
        if packet(node) not in _CONV and packet(node) is not aten.linear:
            continue  # post-op nodes a replacement erased are never looked at
        found = _replace(gm, node, fusable)
        if found is not None:
            replaced[found[0]] = found[1]
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return replaced
