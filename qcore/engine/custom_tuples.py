"""Custom modules whose forward returns a tuple (torch.ao's static LSTM).

Such a module is observed at its inputs only: the quantized module gives each
element of ``(out, (h, c))`` its own qparams, which one run on zeros at its
input qparams reads (a quantized module's output qparams are its constants).
Its users get the same structure with each element dequantized, and a consumer
that quantizes one element takes its int8 tensor as is, at those qparams
(torch.ao's rule), so the numbers match torch.ao's.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import TensorMetadata

from qcore import ops
from qcore.engine.backend_annotator import returns_container
from qcore.engine.boundaries import skip_requantize
from qcore.kernels.runtime import TORCH_QUANTIZED_DTYPE

__all__ = ["LeafQParams", "dequantize_elements", "is_reference_dequantize", "tuple_output_qparams"]


def dequantize_elements(
    gm: GraphModule, node: Node, meta: tuple | list, leaves: dict[tuple, LeafQParams]
) -> None:
    """A tuple output's users get the same structure with each tensor dequantized (as
    torch.ao does for its LSTM); a user that reads one element gets that element,
    and one that quantizes it again to the qparams it has takes the int8 tensor."""
    graph = gm.graph
    users = list(node.users)
    last = [node]
    quantized_leaves: dict[tuple, Node] = {}

    def add(op: str, target: Any, args: tuple) -> Node:
        with graph.inserting_after(last[0]):
            last[0] = graph.create_node(op, target, args)
        return last[0]

    def build(value: Node, part: Any, path: tuple) -> Node:
        if isinstance(part, TensorMetadata):
            quantized_leaves[path] = value
            return add("call_method", "dequantize", (value,))
        if not isinstance(part, (tuple, list)):
            return value
        items = [
            build(add("call_function", operator.getitem, (value, i)), item, (*path, i))
            for i, item in enumerate(part)
        ]
        return add("call_function", tuple, (items,))

    dequantized = build(node, meta, ())
    for user in users:
        user.replace_input_with(node, dequantized)
    _take_elements_directly(graph)
    graph.eliminate_dead_code()
    for path, (scale, zero_point, dtype) in leaves.items():
        if path in quantized_leaves:
            skip_requantize(gm, quantized_leaves[path], scale, zero_point, dtype)


def _take_elements_directly(graph: torch.fx.Graph) -> None:
    """``tuple([a, b])[i]`` is the i-th item (torch.ao's reroute of tuple getitems)."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        source, index = node.args
        is_built = (
            isinstance(source, Node)
            and source.op == "call_function"
            and source.target is tuple
            and isinstance(index, int)
        )
        if is_built:
            node.replace_all_uses_with(source.args[0][index])


# (scale, zero_point, torch quantized dtype) of one element of a tuple output
LeafQParams = tuple[float, int, torch.dtype]


def tuple_output_qparams(
    converted: GraphModule, classes: list[type]
) -> dict[str, dict[tuple, LeafQParams]]:
    """The qparams of each int8 element of the quantized custom modules' tuple outputs,
    by path (``(1, 0)`` for LSTM's h), and the consumers of those elements made to
    quantize them to those qparams (torch.ao's rule: a consumer takes the module's
    int8 tensor as is). A quantized module's output qparams are its own constants,
    so one run on zeros at its input qparams reads them.
    """
    found: dict[str, dict[tuple, LeafQParams]] = {}
    for node in list(converted.graph.nodes):
        if node.op != "call_module" or not returns_container(node):
            continue
        module = converted.get_submodule(node.target)
        if type(module) not in classes:
            continue
        try:
            args = _probe(node.args)
        except _NoProbe:
            continue  # the consumers requantize with their own calibrated qparams
        with torch.no_grad():
            output = module(*args)
        leaves = dict(_quantized_leaves(output, ()))
        found[node.name] = leaves
        for path, qparams in leaves.items():
            leaf = _element(node, path)
            if leaf is not None:
                _quantize_consumers_to(leaf, qparams)
    return found


class _NoProbe(Exception):
    """An input's shape or qparams are not known: the module is not probed."""


def _probe(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_probe(item) for item in value)
    if not isinstance(value, Node):
        return value
    meta = _source_meta(value)
    if not is_reference_dequantize(value):
        return torch.zeros(meta.shape, dtype=meta.dtype)
    _, scale, zero_point, _, _, dtype = value.args
    if isinstance(scale, Node) or dtype not in TORCH_QUANTIZED_DTYPE:
        raise _NoProbe
    zeros = torch.zeros(meta.shape)
    return torch.quantize_per_tensor(
        zeros, float(scale), int(zero_point), TORCH_QUANTIZED_DTYPE[dtype]
    )


def _source_meta(node: Node) -> TensorMetadata:
    """The shape of the float value a quantize/dequantize chain carries."""
    while isinstance(node, Node):
        meta = node.meta.get("tensor_meta")
        if isinstance(meta, TensorMetadata):
            return meta
        node = node.args[0] if node.args else None
    raise _NoProbe


def _quantized_leaves(value: Any, path: tuple):
    if isinstance(value, torch.Tensor):
        if value.is_quantized and value.qscheme() == torch.per_tensor_affine:
            yield path, (float(value.q_scale()), int(value.q_zero_point()), value.dtype)
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _quantized_leaves(item, (*path, index))


def _element(node: Node, path: tuple) -> Node | None:
    """The node that reads element ``path`` of ``node``'s output, if the graph has one."""
    for index in path:
        picks = [
            user
            for user in node.users
            if user.op == "call_function"
            and user.target is operator.getitem
            and user.args[1] == index
        ]
        if not picks:
            return None
        node = picks[0]
    return node


def _quantize_consumers_to(leaf: Node, qparams: LeafQParams) -> None:
    """The consumers' quantize -> dequantize pairs after ``leaf`` take its qparams."""
    scale, zero_point, dtype = qparams
    for user in list(leaf.users):
        if user.op != "call_function" or user.target is not ops.quantize_per_tensor:
            continue
        _, _, _, quant_min, quant_max, user_dtype = user.args
        full = torch.iinfo(ops.storage_dtype(dtype))
        same_kind = TORCH_QUANTIZED_DTYPE.get(user_dtype) == dtype
        if not same_kind or (quant_min, quant_max) != (full.min, full.max):
            continue  # another dtype or a narrower range: requantizing is the reference
        for pair in [user, *user.users]:
            if pair.op == "call_function" and pair.target in (
                ops.quantize_per_tensor,
                ops.dequantize_per_tensor,
            ):
                pair.args = (pair.args[0], scale, zero_point, *pair.args[3:])


def is_reference_dequantize(node: Node) -> bool:
    return node.op == "call_function" and node.target is ops.dequantize_per_tensor
