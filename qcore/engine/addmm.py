"""A linear written as ``torch.addmm(bias, x, weight)``, rewritten into a linear.

transformers' ``Conv1D`` (every projection of GPT-2 and its relatives) stores its
weight as (in, out) and computes ``torch.addmm(bias, x, weight)``. No backend pattern
matches ``addmm``, so such a model's projections stayed float on both front doors
(FX traces ``torch.addmm``, torch.export gives ``aten.addmm``) while the shape ops
between them were still quantized: rounding for nothing. With a 2-D constant weight,
a 1-D constant bias and both scalars 1 the node becomes a linear on the weight
transposed, the same function, which each backend's linear pattern takes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.engine.constants import attribute, free_name

__all__ = ["linear_from_addmm"]


def _parameter(gm: GraphModule, node: object) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads, else None."""
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    value = attribute(gm, node.target)
    return value if isinstance(value, torch.Tensor) else None


def linear_from_addmm(gm: GraphModule, addmm: Any, linear: Any) -> int:
    """Rewrite each ``addmm(bias, x, weight)`` node of ``gm`` (target ``addmm``: FX's
    ``torch.addmm`` or ``aten.addmm.default``), in place, into ``linear(x, weight.T,
    bias)`` (target ``linear``) where the weight is a 2-D constant, the bias a 1-D
    constant of the weight's output size and ``beta = alpha = 1``; returns how many.

    The transposed weight is a new parameter of ``gm`` (so a weight used elsewhere is
    left as it is), with the old one's ``requires_grad``.

    Example::

        >>> rewritten = linear_from_addmm(traced, torch.addmm, torch.nn.functional.linear)
    """
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not addmm:
            continue
        if len(node.args) != 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
            continue
        bias_node, x, weight_node = node.args
        weight, bias = _parameter(gm, weight_node), _parameter(gm, bias_node)
        if weight is None or bias is None or weight.dim() != 2 or bias.dim() != 1:
            continue
        if bias.shape[0] != weight.shape[1]:
            continue
        name = free_name(gm, f"{node.name}_linear_weight")
        transposed = weight.detach().t().contiguous()
        gm.register_parameter(name, torch.nn.Parameter(transposed, weight.requires_grad))
        with gm.graph.inserting_before(node):
            transposed_node = gm.graph.get_attr(name)
        transposed_node.meta["val"] = transposed
        node.target = linear
        node.args = (x, transposed_node, bias_node)
        node.kwargs = {}
        rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewritten
