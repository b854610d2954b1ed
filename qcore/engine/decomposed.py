"""The FX reference form in the ecosystem's ops: qcore.ops -> quantized_decomposed.

``convert_fx`` lowers from a graph of :mod:`qcore.ops` calls, which follow
fbgemm bit for bit, so a kernel and its reference agree exactly. The reference
form users get (``convert_to_reference_fx``) speaks ``torch.ops.quantized_decomposed``
instead, as torchao's PT2E graphs, ExecuTorch and Inductor's int8 passes do, and as
qcore's own PT2E reference form does (:mod:`qcore.pt2e.qdq`). The numerics are then
the decomposed ops' (``round(x * (1 / scale)) + zero_point``): a value exactly half
way between two steps may land one step away from qcore.ops' rounding.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
from torch.fx import GraphModule, Node

from qcore import ops
from qcore.engine.conv_padding import explicit_padding

__all__ = ["to_decomposed", "weights_in_graph"]

qd = torch.ops.quantized_decomposed

_PER_TENSOR = {
    ops.quantize_per_tensor: (qd.quantize_per_tensor.default, qd.quantize_per_tensor.tensor),
    ops.dequantize_per_tensor: (
        qd.dequantize_per_tensor.default,
        qd.dequantize_per_tensor.tensor,
    ),
}
_PER_CHANNEL = {
    ops.quantize_per_channel: qd.quantize_per_channel.default,
    ops.dequantize_per_channel: qd.dequantize_per_channel.default,
}


def to_decomposed(gm: GraphModule) -> GraphModule:
    """Replace ``gm``'s qcore.ops quantize/dequantize calls (in place) by their
    ``quantized_decomposed`` equivalents, plain integer dtypes in place of torch's
    quantized ones; returns ``gm``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _PER_TENSOR:
            x, scale, zero_point, *rest = node.args
            default, tensor = _PER_TENSOR[node.target]
            tensors = isinstance(scale, Node) or isinstance(zero_point, Node)
            node.target = tensor if tensors else default
            node.args = (x, scale, zero_point, *_plain_dtype(rest))
        elif node.target in _PER_CHANNEL:
            node.target = _PER_CHANNEL[node.target]
            node.args = (*node.args[:4], *_plain_dtype(list(node.args[4:])))
        elif node.target is ops.fake_quantize_dynamic:
            _dynamic(graph, node)
    graph.lint()
    gm.recompile()
    return gm


def _plain_dtype(rest: list) -> list:
    """(quant_min, quant_max, dtype) with dtype as the plain integer one."""
    if len(rest) == 3:
        rest[2] = ops.storage_dtype(rest[2])
    return rest


def _dynamic(graph, node: Node) -> None:
    """``fake_quantize_dynamic(x, quant_min, quant_max, dtype)``: choose_qparams ->
    quantize -> dequantize, as torchao's dynamic reference graphs have it."""
    source, quant_min, quant_max, dtype = node.args
    target = ops.storage_dtype(dtype)
    eps = torch.finfo(torch.float32).eps
    with graph.inserting_before(node):
        chosen = graph.call_function(
            qd.choose_qparams.tensor, (source, quant_min, quant_max, eps, target)
        )
        scale = graph.call_function(operator.getitem, (chosen, 0))
        zero_point = graph.call_function(operator.getitem, (chosen, 1))
        args = (scale, zero_point, quant_min, quant_max, target)
        quantized = graph.call_function(qd.quantize_per_tensor.tensor, (source, *args))
        replacement = graph.call_function(qd.dequantize_per_tensor.tensor, (quantized, *args))
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


_CONVS = {
    torch.nn.Conv1d: torch.ops.aten.conv1d.default,
    torch.nn.Conv2d: torch.ops.aten.conv2d.default,
    torch.nn.Conv3d: torch.ops.aten.conv3d.default,
}


# onednn's conv + add fused modules: (the second input is added after the conv, a relu?)
_CONV_ADD = {nni.ConvAdd2d: False, nni.ConvAddReLU2d: True}


@dataclass(frozen=True)
class _Weighted:
    """What a reference module runs: ``layer``, then a second input added where
    ``adds`` (onednn's conv + add), then the modules ``after`` it in order."""

    layer: torch.nn.Module
    after: tuple[torch.nn.Module, ...]
    adds: bool
    padding: list[int]


def _weighted_op(module: torch.nn.Module) -> _Weighted | None:
    """The conv or linear a reference module runs, and what follows it; None where
    the module is none of those."""
    parts = list(module) if isinstance(module, torch.nn.Sequential) else [module]
    layer, after = parts[0], parts[1:]
    adds = type(module) in _CONV_ADD
    if adds and _CONV_ADD[type(module)]:
        after.append(module.relu)
    if type(layer) not in (*_CONVS, torch.nn.Linear):
        return None
    padding: list[int] = []
    if type(layer) in _CONVS:
        found = explicit_padding(layer.padding, layer.kernel_size, layer.dilation)
        if layer.padding_mode != "zeros" or found is None:
            return None  # reflect or asymmetric "same" padding: aten's conv has no such form
        padding = found
    return _Weighted(layer, tuple(after), adds, padding)


def weights_in_graph(gm: GraphModule) -> int:
    """Each conv/linear reference module (plain, fused with an activation, or
    onednn's conv + add) becomes its integer weight, a ``quantized_decomposed``
    dequantize and the aten ops, in place:
    the graph torchao's PT2E convert gives, which compilers' int8 passes match.
    The numbers are the reference module's (it runs on the same dequantized
    weights). Returns how many were rewritten; others stay modules."""
    from qcore.engine.reference import ReferenceModule

    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_module" or node.kwargs:
            continue
        reference = gm.get_submodule(node.target)
        found = _weighted_op(reference.module) if isinstance(reference, ReferenceModule) else None
        if found is None or list(reference.weight_qparams) not in (["weight"], ["0.weight"]):
            continue
        if len(node.args) != (2 if found.adds else 1):
            continue
        ((name, qparams),) = reference.weight_qparams.items()
        if qparams.dtype != torch.qint8:
            continue
        with graph.inserting_before(node):
            out = _call_weighted(gm, node, found, reference.integer_weight(name), qparams)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.delete_all_unused_submodules()
        graph.lint()
        gm.recompile()
    return rewritten


def _call_weighted(
    gm: GraphModule, node: Node, found: _Weighted, integer: torch.Tensor, qparams: Any
) -> Node:
    """The nodes computing ``node``'s reference module from its integer weight."""
    graph, prefix, layer = gm.graph, node.name, found.layer
    gm.register_buffer(f"{prefix}_weight_int8", integer.clone())
    limits = (qparams.quant_min, qparams.quant_max, torch.int8)
    weight_int8 = graph.get_attr(f"{prefix}_weight_int8")
    if qparams.per_channel:
        gm.register_buffer(f"{prefix}_weight_scale", qparams.scale.to(torch.float32))
        gm.register_buffer(f"{prefix}_weight_zero_point", qparams.zero_point.long())
        scale = graph.get_attr(f"{prefix}_weight_scale")
        zero_point = graph.get_attr(f"{prefix}_weight_zero_point")
        weight = graph.call_function(
            qd.dequantize_per_channel.default,
            (weight_int8, scale, zero_point, qparams.axis, *limits),
        )
    else:
        scale = float(qparams.scale.reshape(-1)[0])
        zero_point = int(qparams.zero_point.reshape(-1)[0])
        weight = graph.call_function(
            qd.dequantize_per_tensor.default, (weight_int8, scale, zero_point, *limits)
        )
    bias = None
    if layer.bias is not None:
        gm.register_buffer(f"{prefix}_bias", layer.bias.detach().clone())
        bias = graph.get_attr(f"{prefix}_bias")
    x = node.args[0]
    if isinstance(layer, torch.nn.Linear):
        out = graph.call_function(torch.ops.aten.linear.default, (x, weight, bias))
    else:
        geometry = (list(layer.stride), found.padding, list(layer.dilation), layer.groups)
        out = graph.call_function(_CONVS[type(layer)], (x, weight, bias, *geometry))
    if found.adds:
        out = graph.call_function(torch.ops.aten.add.Tensor, (out, node.args[1]))
    for index, module in enumerate(found.after):
        if isinstance(module, torch.nn.ReLU):
            out = graph.call_function(torch.ops.aten.relu.default, (out,))
        else:  # tanh, leaky relu, ... as the reference runs them
            gm.add_submodule(f"{prefix}_after_{index}", module)
            out = graph.call_module(f"{prefix}_after_{index}", (out,))
    return out
