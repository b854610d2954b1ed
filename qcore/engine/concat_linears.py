"""Linears that read one quantized input, computed as one: q/k/v projections.

In the reference form each linear reads its own dequantize of the shared quantized
input; a compiler lowers each to its own int8 GEMM (oneDNN's qlinear: three calls
of 64 columns where one of 192 would do, each with its fixed cost). Concatenating
their int8 weights along the output channels gives one linear whose output holds
theirs side by side: each is a slice of it. It is exact when every weight is
quantized per output channel (each channel keeps its own scale and zero point)
and the input's quantization is the same for all: the same integers, scales and
sums as before. Inductor's ``enable_concat_linear`` does this for float and
weight-only int8 linears; the static int8 graph is left to the reference form.

A merged linear's output is wider, so its slices are strided; a ``view`` of one
may then be impossible where it was possible before (merging the token dimension
with the features). Every ``view`` the slices reach through the views attention
applies (reshape, transpose, permute, unflatten) becomes a ``reshape``: the same
values, a copy only where a view cannot be made. Linears whose output is quantized
again (the compiler fuses that into its GEMM), written in place, returned from the
graph, or read through any other view (split, as_strided, diagonal, expand: some
compute from strides made for the unmerged output) are left alone.
``qcore.compile`` merges a twin of the reference form and checks the compiled
model's first call against the unmerged one.
"""

from __future__ import annotations

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
from torch.fx import GraphModule, Node

from qcore.engine.constants import attribute

__all__ = ["concat_sibling_linears"]

_qd = torch.ops.quantized_decomposed
_aten = torch.ops.aten
_INPUT_DEQUANTIZE = _qd.dequantize_per_tensor.default
_WEIGHT_DEQUANTIZE = _qd.dequantize_per_channel.default
_VIEWS = {_aten.view.default, _aten._unsafe_view.default}
# The views an attention block applies to its projections, followed to their
# readers; any other view of a slice (expand, select, split, diagonal, as_strided)
# leaves the group apart: Inductor and eager code compute some of them from strides
# made for the unmerged output.
_VIEW_LIKE = _VIEWS | {
    _aten.reshape.default,
    _aten.transpose.int,
    _aten.permute.default,
    _aten.unflatten.int,
    _aten.t.default,
}


def concat_sibling_linears(gm: GraphModule) -> int:
    """Merge, in place, each set of two or more linears of ``gm`` that read one
    quantized input and have per-output-channel int8 weights; returns how many
    merged linears there are now."""
    merged = 0
    replaced: set[str] = set()
    for node in list(gm.graph.nodes):
        for members in _sibling_groups(gm, node):
            _merge(gm, members, f"_concat_linear_{merged}")
            replaced.update(_constant_targets(members))
            merged += 1
    if merged:
        gm.graph.eliminate_dead_code()
        _drop_unread(gm, replaced)
        gm.recompile()
    return merged


class _Member:
    """One linear of a group: its node, its weight dequantize and their constants."""

    def __init__(self, linear: Node, weight: Node, constants: list[torch.Tensor | None]) -> None:
        self.linear = linear
        self.weight = weight
        self.int_weight, self.scale, self.zero_point, self.bias = constants


def _sibling_groups(gm: GraphModule, quantized: Node) -> list[list[_Member]]:
    groups: dict[tuple, list[_Member]] = {}
    for dequantize in quantized.users:
        if dequantize.target != _INPUT_DEQUANTIZE or dequantize.args[0] is not quantized:
            continue
        member = _member(gm, dequantize)
        if member is None:
            continue
        # the same input quantization, and weights of one integer range and dtype
        key = (dequantize.args[1:], tuple(sorted(dequantize.kwargs.items())))
        key += (member.weight.args[4:], tuple(sorted(member.weight.kwargs.items())))
        key += (member.int_weight.shape[1:],)
        groups.setdefault(key, []).append(member)
    return [members for members in groups.values() if len(members) > 1]


def _member(gm: GraphModule, dequantize: Node) -> _Member | None:
    if len(dequantize.users) != 1:
        return None
    linear = next(iter(dequantize.users))
    if linear.target != _aten.linear.default or linear.args[0] is not dequantize or linear.kwargs:
        return None
    weight = linear.args[1]
    bias = linear.args[2] if len(linear.args) > 2 else None
    if not isinstance(weight, Node) or weight.target != _WEIGHT_DEQUANTIZE:
        return None
    if len(weight.users) != 1 or len(weight.args) < 7 or weight.args[3] != 0:
        return None  # per-channel along the output channels only
    constants = [_constant(gm, arg) for arg in (*weight.args[:3], bias)]
    if any(value is None for value in constants[:3]) or (bias is not None and constants[3] is None):
        return None
    if constants[0].dim() != 2 or not _slices_are_safe(linear):
        return None
    return _Member(linear, weight, constants)


def _constant(gm: GraphModule, node: object) -> torch.Tensor | None:
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    value = attribute(gm, node.target)
    return value.detach() if isinstance(value, torch.Tensor) else None


def _constant_targets(members: list[_Member]) -> set[str]:
    nodes = [arg for m in members for arg in (*m.weight.args[:3], *m.linear.args[2:])]
    return {node.target for node in nodes if isinstance(node, Node) and node.op == "get_attr"}


def _drop_unread(gm: GraphModule, targets: set[str]) -> None:
    """Delete the constants in ``targets`` no node reads any more: the merged
    buffers hold their values, and the module should not hold them twice."""
    read = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    for target in targets - read:
        owner_path, _, attribute = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        delattr(owner, attribute)


def _slices_are_safe(linear: Node) -> bool:
    """Whether a strided slice may stand for ``linear``'s output: nothing quantizes
    it (the compiler would fuse that into the GEMM), writes into it or returns it
    through views."""
    stack = list(linear.users)
    while stack:
        user = stack.pop()
        if user.op == "output":
            return False
        if user.op != "call_function":
            continue
        if user.target in (_qd.quantize_per_tensor.default, _qd.quantize_per_tensor.tensor):
            return False
        schema = getattr(user.target, "_schema", None)
        if schema is None or schema.is_mutable:
            return False
        if user.target in _VIEW_LIKE:
            stack.extend(user.users)
        elif any(result.alias_info is not None for result in schema.returns):
            # a view this walk does not follow (split, unbind, diagonal, as_strided:
            # strides computed for the unmerged output, or writes through it)
            return False
    return True


def _merge(gm: GraphModule, members: list[_Member], name: str) -> None:
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    members.sort(key=lambda member: order[member.linear])
    first = members[0]
    concatenated = {
        "weight": torch.cat([member.int_weight for member in members]),
        "scale": torch.cat([member.scale.reshape(-1) for member in members]),
        "zero_point": torch.cat([member.zero_point.reshape(-1) for member in members]),
    }
    if any(member.bias is not None for member in members):  # adding 0.0 changes nothing
        dtype = next(member.bias.dtype for member in members if member.bias is not None)
        concatenated["bias"] = torch.cat([_bias(member, dtype) for member in members])
    for suffix, value in concatenated.items():
        gm.register_buffer(f"{name}_{suffix}", value)
    graph = gm.graph
    with graph.inserting_before(first.linear):
        constants = {suffix: graph.get_attr(f"{name}_{suffix}") for suffix in concatenated}
        weight = graph.call_function(
            _WEIGHT_DEQUANTIZE,
            (constants["weight"], constants["scale"], constants["zero_point"], 0)
            + tuple(first.weight.args[4:]),
            dict(first.weight.kwargs),
        )
        merged = graph.call_function(
            _aten.linear.default, (first.linear.args[0], weight, constants.get("bias"))
        )
        start = 0
        for member in members:
            width = member.int_weight.shape[0]
            piece = graph.call_function(_aten.slice.Tensor, (merged, -1, start, start + width))
            start += width
            member.linear.replace_all_uses_with(piece)
            _views_become_reshapes(piece)


def _bias(member: _Member, dtype: torch.dtype) -> torch.Tensor:
    if member.bias is not None:
        return member.bias
    return torch.zeros(member.int_weight.shape[0], dtype=dtype)


def _views_become_reshapes(piece: Node) -> None:
    stack = list(piece.users)
    while stack:
        user = stack.pop()
        if user.op != "call_function" or user.target not in _VIEW_LIKE:
            continue
        if user.target in _VIEWS:
            user.target = _aten.reshape.default
        stack.extend(user.users)
