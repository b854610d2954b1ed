"""What a symbolically traced graph means by an in-place write and by a view.

torch.fx records ``y.mul_(2)`` as a ``call_method`` node nothing reads (later code
reads ``y``), and treats every ``call_method`` as pure: convert's dead-code pass
dropped the multiplication, on qcore as on torch.ao, and the int8 model computed
without it. An ``nn.ReLU(inplace=True)`` whose result is ignored went the same way,
and a view made before such a write read a quantized copy from before it.
:func:`make_traced_writes_visible` makes every such read go through the write
(:mod:`qcore.engine.aliasing`).

Writes are known by name: methods and torch functions ending in ``_`` (not the
ones that change only a tensor's shape or flags), functions called with
``inplace=True``, and modules built with ``inplace=True``. Views are known by
what the example inputs show: a node whose result lives in its first argument's
storage on the probe run (``reshape`` and ``contiguous`` are views only sometimes).
Without example inputs, the ops that always return a view count.
"""

from __future__ import annotations

import functools
import inspect
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.engine.aliasing import AliasedWriteError, AliasRules, make_writes_visible

__all__ = [
    "AliasedWriteError",
    "ProbedStorages",
    "eliminate_dead_code_keeping_state_writes",
    "make_traced_writes_visible",
]


@dataclass(frozen=True)
class ProbedStorages:
    """Where each node's result lived on a probe run of the traced graph."""

    of: dict[Node, frozenset[int]]
    """The storages a node's result's tensors live in."""
    tensors: frozenset[Node]
    """The nodes whose result is one tensor (not a tuple of them)."""
    returns_input: frozenset[Node]
    """Module calls that returned their first input itself, as in-place modules do."""

    def is_view(self, node: Node, source: Node) -> bool:
        mine, theirs = self.of.get(node), self.of.get(source)
        return bool(mine) and bool(theirs) and mine <= theirs


_NOT_DATA_WRITES = frozenset(
    {
        "as_strided_", "detach_", "requires_grad_", "resize_", "resize_as_", "retain_grad",
        "set_", "share_memory_", "squeeze_", "swapaxes_", "swapdims_", "t_", "transpose_",
        "unsqueeze_",
    }
)  # fmt: skip
_IN_PLACE_OPERATORS = frozenset(
    {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv}
)
_ALWAYS_VIEW_METHODS = frozenset(
    {
        "view", "view_as", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand",
        "expand_as", "narrow", "select", "movedim", "swapaxes", "swapdims", "unflatten",
        "detach", "chunk", "split", "unbind", "tensor_split", "diagonal", "unfold",
    }
)  # fmt: skip
_ALWAYS_VIEW_FUNCTIONS = frozenset(
    getattr(torch, name) for name in _ALWAYS_VIEW_METHODS if hasattr(torch, name)
)


def _is_in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_DATA_WRITES


@functools.cache
def _inplace_parameter(function: Any) -> inspect.Signature | None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    return signature if "inplace" in signature.parameters else None


def _called_in_place(node: Node) -> bool:
    signature = _inplace_parameter(node.target)
    if signature is None:
        return False
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


def _writes(
    node: Node, modules: dict[str, torch.nn.Module], storages: ProbedStorages | None
) -> bool:
    if node.op == "call_method":
        return _is_in_place_name(node.target)
    if node.op == "call_function":
        if node.target in _IN_PLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "")
        if _is_in_place_name(name) and getattr(torch, name, None) is node.target:
            return True
        return _called_in_place(node)
    if node.op == "call_module":
        if storages is not None and node in storages.returns_input:
            return True  # a non-traceable module writing its input, say
        return getattr(modules.get(node.target), "inplace", False) is True
    return False


def _is_basic_index(index: Any) -> bool:
    """``a[0]``, ``a[:, 1:]``, ``a[..., None]``: indexing that returns a view."""
    if isinstance(index, tuple):
        return all(_is_basic_index(part) for part in index)
    return index is None or index is Ellipsis or isinstance(index, (int, slice))


def _rules(modules: dict[str, torch.nn.Module], storages: ProbedStorages | None) -> AliasRules:
    def written(node: Node) -> Node | None:
        if node.args and isinstance(node.args[0], Node) and _writes(node, modules, storages):
            return node.args[0]
        return None

    def is_view(node: Node) -> bool:
        if node.op not in ("call_method", "call_function") or not node.args:
            return False
        source = node.args[0]
        if not isinstance(source, Node) or written(node) is not None:
            return False
        if storages is not None:
            # an item of a module's tuple (an LSTM's h_n) is not a view of its output
            if node.target is operator.getitem and source not in storages.tensors:
                return is_view(source) and storages.is_view(node, source)
            return storages.is_view(node, source)
        if node.op == "call_method":
            return node.target in _ALWAYS_VIEW_METHODS
        if node.target is operator.getitem:
            return _is_basic_index(node.args[1])
        return node.target in _ALWAYS_VIEW_FUNCTIONS

    def way_out(node: Node) -> str:
        stack = list((node.meta.get("nn_module_stack") or {}).keys())
        name = stack[-1] if stack else None
        where = (
            f"prepare_custom_config={{'non_traceable_module_name': [{name!r}]}}"
            if name
            else "prepare_custom_config's 'non_traceable_module_name'"
        )
        return (
            "write the result to a new tensor instead (out-of-place op), or keep the module "
            f"doing it in float and exact with {where}"
        )

    return AliasRules(written, is_view, way_out)


def make_traced_writes_visible(gm: GraphModule, storages: ProbedStorages | None = None) -> int:
    """Make every read after an in-place write in traced ``gm`` see it (in place);
    returns how many reads moved. ``storages`` (from a probe run) tells views apart;
    without it, the ops that always return a view count. Raises
    :class:`AliasedWriteError` for a write through a view whose memory is read after."""
    modules = dict(gm.named_modules())
    return make_writes_visible(gm, _rules(modules, storages))


def _writes_caller_state(node: Node, modules: dict[str, torch.nn.Module]) -> bool:
    """An in-place write (or an ``out=`` one) into a module's buffer or parameter, or
    a caller's input, directly or through views of it: state a later call or the
    caller reads."""
    written = node.kwargs.get("out") if node.op == "call_function" else None
    if node.args and isinstance(node.args[0], Node) and _writes(node, modules, None):
        written = node.args[0]
    return isinstance(written, Node) and _is_state(written)


def _is_state(target: Node) -> bool:
    """A buffer, a parameter or an input, or a view of one."""
    while target.op in ("call_method", "call_function") and target.args:
        is_view = (
            target.target in _ALWAYS_VIEW_METHODS
            if target.op == "call_method"
            else target.target in _ALWAYS_VIEW_FUNCTIONS
            or (target.target is operator.getitem and _is_basic_index(target.args[1]))
        )
        if not is_view or not isinstance(target.args[0], Node):
            return False
        target = target.args[0]
    return target.op in ("get_attr", "placeholder")


def eliminate_dead_code_keeping_state_writes(gm: GraphModule) -> None:
    """torch.fx's dead-code pass, keeping writes into state (``self.acc.add_(y)``).

    torch.fx takes every ``call_method`` for pure, and a running buffer's update has
    no user when forward reads the buffer through a second ``get_attr``: convert
    dropped it, and the int8 model's state never moved."""
    modules = dict(gm.named_modules())
    gm.graph.eliminate_dead_code(
        is_impure_node=lambda node: node.is_impure() or _writes_caller_state(node, modules)
    )
