"""Which nodes compute tensors, read off the graph when the model cannot be run.

prepare normally learns this by running the example inputs (``ShapeProp``).
When they do not run, a node is taken to compute a floating-point tensor
unless it produces a size, a shape, a Python number, a bool mask or a
container of them: what torch.ao assumes without ever running the model.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

__all__ = ["inferred_tensor_nodes"]

# Methods and functions whose result is never a tensor.
_NON_TENSOR_METHODS = {
    "size", "dim", "numel", "item", "tolist", "stride", "nelement", "ndimension",
    # bool results: masks are tensors, but never quantized
    "eq", "ne", "lt", "le", "gt", "ge", "bool", "isnan", "isinf", "logical_and", "logical_or",
    "logical_not",
}  # fmt: skip
_NON_TENSOR_FUNCTIONS = {
    len, getattr, torch.numel, int, float, bool,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    operator.not_, operator.and_, operator.or_,
    torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.isnan, torch.isinf,
    torch.logical_and, torch.logical_or, torch.logical_not,
}  # fmt: skip
_NON_TENSOR_ATTRIBUTES = {"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad"}
_ARITHMETIC = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.mod,
    operator.neg,
    operator.getitem,
}


def _is_tensor_attribute(gm: GraphModule, target: str) -> bool:
    owner_name, _, name = target.rpartition(".")
    try:
        owner = gm.get_submodule(owner_name) if owner_name else gm
    except AttributeError:
        return False
    return isinstance(getattr(owner, name, None), torch.Tensor)


def _computes_tensor(node: Node, gm: GraphModule, tensors: set[Node]) -> bool:
    if node.op == "placeholder":
        return True
    if node.op == "get_attr":
        return _is_tensor_attribute(gm, node.target)
    if node.op == "call_module":
        return True
    if node.op == "call_method":
        if node.target in _NON_TENSOR_METHODS:
            return False
        return bool(node.args) and node.args[0] in tensors
    if node.op == "call_function":
        if node.target in _NON_TENSOR_FUNCTIONS:
            if node.target is getattr and len(node.args) > 1:
                return node.args[1] not in _NON_TENSOR_ATTRIBUTES and node.args[0] in tensors
            return False
        if node.target in _ARITHMETIC:
            # x + 1 is a tensor, x.size(1) + 1 is not; indexing follows its container.
            return any(isinstance(a, Node) and a in tensors for a in node.args)
        return True
    return False


def inferred_tensor_nodes(gm: GraphModule) -> set[Node]:
    """The nodes of ``gm`` taken to compute tensors, in one pass in graph order."""
    tensors: set[Node] = set()
    for node in gm.graph.nodes:
        if _computes_tensor(node, gm, tensors):
            tensors.add(node)
    return tensors
