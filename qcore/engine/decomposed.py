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

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
from torch.fx import GraphModule, Node

from qcore import ops

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


def _weighted_op(module: torch.nn.Module) -> tuple[torch.nn.Module, bool] | None:
    """(the conv or linear, followed by a relu) a reference module runs, or None."""
    parts = list(module) if isinstance(module, torch.nn.Sequential) else [module]
    child, rest = parts[0], parts[1:]
    if type(child) not in (*_CONVS, torch.nn.Linear):
        return None
    if rest and not (len(rest) == 1 and isinstance(rest[0], torch.nn.ReLU)):
        return None
    if type(child) in _CONVS and (child.padding_mode != "zeros" or isinstance(child.padding, str)):
        return None
    return child, bool(rest)


def weights_in_graph(gm: GraphModule) -> int:
    """Each conv/linear reference module (plain or with a fused relu) becomes its
    integer weight, a ``quantized_decomposed`` dequantize and the aten op, in place:
    the graph torchao's PT2E convert gives, which compilers' int8 passes match.
    The numbers are the reference module's (it runs on the same dequantized
    weights). Returns how many were rewritten; others stay modules."""
    from qcore.engine.reference import ReferenceModule

    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        reference = gm.get_submodule(node.target)
        found = _weighted_op(reference.module) if isinstance(reference, ReferenceModule) else None
        if found is None or list(reference.weight_qparams) not in (["weight"], ["0.weight"]):
            continue
        ((name, qparams),) = reference.weight_qparams.items()
        if qparams.dtype != torch.qint8:
            continue
        child, relu = found
        prefix = node.name
        gm.register_buffer(f"{prefix}_weight_int8", reference.integer_weight(name).clone())
        limits = (qparams.quant_min, qparams.quant_max, torch.int8)
        with graph.inserting_before(node):
            integer = graph.get_attr(f"{prefix}_weight_int8")
            if qparams.per_channel:
                gm.register_buffer(f"{prefix}_weight_scale", qparams.scale.to(torch.float32))
                gm.register_buffer(f"{prefix}_weight_zero_point", qparams.zero_point.long())
                weight = graph.call_function(
                    qd.dequantize_per_channel.default,
                    (
                        integer,
                        graph.get_attr(f"{prefix}_weight_scale"),
                        graph.get_attr(f"{prefix}_weight_zero_point"),
                        qparams.axis,
                        *limits,
                    ),
                )
            else:
                scale = float(qparams.scale.reshape(-1)[0])
                zero_point = int(qparams.zero_point.reshape(-1)[0])
                weight = graph.call_function(
                    qd.dequantize_per_tensor.default, (integer, scale, zero_point, *limits)
                )
            bias = None
            if child.bias is not None:
                gm.register_buffer(f"{prefix}_bias", child.bias.detach().clone())
                bias = graph.get_attr(f"{prefix}_bias")
            if isinstance(child, torch.nn.Linear):
                out = graph.call_function(
                    torch.ops.aten.linear.default, (node.args[0], weight, bias)
                )
            else:
                out = graph.call_function(
                    _CONVS[type(child)],
                    (
                        node.args[0],
                        weight,
                        bias,
                        list(child.stride),
                        list(child.padding),
                        list(child.dilation),
                        child.groups,
                    ),
                )
            if relu:
                out = graph.call_function(torch.ops.aten.relu.default, (out,))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.delete_all_unused_submodules()
        graph.lint()
        gm.recompile()
    return rewritten
