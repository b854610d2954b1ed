"""Fold eval-mode batch norms into the convolution or linear before them.

torch.export keeps ``conv -> batch_norm`` apart; a backend runs them as one
conv with adjusted weight and bias, so the weight is quantized after folding
(as torchao's PT2E flow does).
"""

from __future__ import annotations

import warnings

import torch
from torch.fx import GraphModule, Node

from qcore.config.errors import QCoreWarning
from qcore.pt2e.patterns import packet

__all__ = ["fold_conv_bn", "fold_linear_bn"]

aten = torch.ops.aten
_CONVS = {aten.conv1d, aten.conv2d, aten.conv3d}
_TRANSPOSED = {aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d}


def _attr(gm: GraphModule, node: object) -> torch.Tensor | None:
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    owner_name, _, name = node.target.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    return getattr(owner, name)


def _bn_args(node: Node) -> tuple | None:
    """(input, weight, bias, mean, var, eps) of an eval batch norm, else None."""
    if packet(node) is aten.batch_norm:
        x, weight, bias, mean, var, training, _momentum, eps = node.args[:8]
        return None if training else (x, weight, bias, mean, var, eps)
    if packet(node) is aten._native_batch_norm_legit_no_training:
        x, weight, bias, mean, var, _momentum, eps = node.args[:7]
        return (x, weight, bias, mean, var, eps)
    return None


def _output_of(bn: Node) -> Node | None:
    """The node carrying the normalized tensor (getitem 0 of the tuple form)."""
    if packet(bn) is aten.batch_norm:
        return bn
    users = list(bn.users)
    if len(users) == 1 and users[0].args[1:] == (0,):
        return users[0]
    return None


def fold_conv_bn(gm: GraphModule) -> int:
    """Fold every ``conv -> eval batch_norm`` (conv_transpose too, ungrouped) whose conv
    has no other user; returns how many."""
    return _fold(gm, _CONVS) + _fold(gm, _TRANSPOSED, _ungrouped)


def _ungrouped(conv: Node) -> bool:
    # A transposed conv's weight is (in, out / groups, ...): with groups, an output
    # channel's slice is not one index of dimension 1.
    groups = conv.args[6] if len(conv.args) > 6 else conv.kwargs.get("groups", 1)
    return groups == 1


def _linear_folds(linear: Node) -> bool:
    """BatchNorm1d normalizes dim 1; a linear works on the last one. Only for a
    2-D output are they the same dimension."""
    value = linear.meta.get("val")
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        return True
    warnings.warn(
        f"Not fusing linear+bn at {linear.name!r}: its output has "
        f"{value.dim() if isinstance(value, torch.Tensor) else 'unknown'} dimensions; "
        "the batch norm normalizes dimension 1 and the linear the last, which only "
        "coincide for 2-D outputs",
        QCoreWarning,
        stacklevel=3,
    )
    return False


def fold_linear_bn(gm: GraphModule) -> int:
    """Fold every ``linear -> eval batch_norm`` (BatchNorm1d on a 2-D output) whose
    linear has no other user; returns how many. Other shapes are left as they are,
    with a warning."""
    return _fold(gm, {aten.linear}, _linear_folds)


def _fold(gm: GraphModule, ops: set, accept=None) -> int:
    folded = 0
    for bn in list(gm.graph.nodes):
        found = _bn_args(bn)
        if found is None:
            continue
        conv, bn_weight, bn_bias, mean, var, eps = found
        if packet(conv) not in ops or len(conv.users) != 1:
            continue
        if accept is not None and not accept(conv):
            continue
        weight = _attr(gm, conv.args[1])
        bias_node = conv.args[2] if len(conv.args) > 2 else None
        bias = _attr(gm, bias_node)
        tensors = [_attr(gm, n) for n in (bn_weight, bn_bias, mean, var)]
        output = _output_of(bn)
        if weight is None or (bias_node is not None and bias is None) or output is None:
            continue
        if any(t is None for t in tensors):
            continue
        gamma, beta, running_mean, running_var = (t.detach() for t in tensors)
        with torch.no_grad():
            factor = gamma * torch.rsqrt(running_var + eps)
            shape = [1] * weight.dim()
            shape[1 if packet(conv) in _TRANSPOSED else 0] = -1  # the output channels
            new_weight = weight.detach() * factor.reshape(shape)
            old_bias = bias.detach() if bias is not None else torch.zeros_like(running_mean)
            new_bias = (old_bias - running_mean) * factor + beta
        base = conv.name
        gm.register_parameter(f"{base}_folded_weight", torch.nn.Parameter(new_weight, False))
        gm.register_parameter(f"{base}_folded_bias", torch.nn.Parameter(new_bias, False))
        with gm.graph.inserting_before(conv):
            weight_node = gm.graph.get_attr(f"{base}_folded_weight")
            bias_node = gm.graph.get_attr(f"{base}_folded_bias")
        weight_node.meta["val"] = conv.args[1].meta.get("val")
        bias_node.meta["val"] = bn_bias.meta.get("val")
        args = list(conv.args) + [None] * max(0, 3 - len(conv.args))
        args[1], args[2] = weight_node, bias_node
        conv.args = tuple(args)
        output.replace_all_uses_with(conv)
        for node in (output, bn):
            if not node.users and node in gm.graph.nodes:
                gm.graph.erase_node(node)
        folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return folded
