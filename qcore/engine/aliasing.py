"""In-place writes that later reads must see, made explicit in a graph before quantizing.

A graph keeps a model's in-place ops (``a.add_(b)``, ``aten.add_``, an
``nn.ReLU(inplace=True)``) as nodes whose later readers still read ``a``, and its
views (``v = a.view(...)``) as nodes that share ``a``'s memory. In float that is
right: every reader reads the same memory, after the write. Quantizing puts
quantize/dequantize pairs, which copy, between producers and readers: the write
then lands in one copy and a later reader of ``a`` or ``v`` reads another, from
before the write. And an in-place op whose own result nothing reads is dead code to
torch.fx, which drops it. torch.ao's and torchao's int8 models of such a model are
wrong by most of the output's range, with no error.

:func:`make_writes_visible` rewrites each such read to go through the write: later
reads of ``a`` read the write's result (an in-place op returns the tensor it wrote),
and a view made before the write and read after it is made again from that result,
right after it. A write *through* a view into memory that something else reads
afterwards cannot be made explicit this way: :class:`AliasedWriteError` says where,
and the front door's rules say how to get out of it.

What counts as a write and as a view differs between the front doors (aten schemas
for PT2E, torch functions, methods and modules for FX): :class:`AliasRules`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

__all__ = ["AliasRules", "AliasedWriteError", "make_writes_visible"]


class AliasedWriteError(ValueError):
    """A model writes in place into memory that other values share in a way qcore
    cannot make explicit; quantizing it would give wrong values."""


@dataclass(frozen=True)
class AliasRules:
    """What one front door's graphs mean by a write and by a view."""

    written: Callable[[Node], Node | None]
    """The node a node writes into in place (its result is that tensor), or None."""
    is_view: Callable[[Node], bool]
    """Whether a node's result shares its first argument's memory."""
    way_out: Callable[[Node], str]
    """How the user avoids a write through a view (ends the error message)."""


def _views_of(base: Node, before: Node, order: dict[Node, int], rules: AliasRules) -> list[Node]:
    """The views of ``base`` (views of views too) made before ``before``, in order."""
    found, frontier = [], [base]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if order[user] < order[before] and user.args[:1] == (node,) and rules.is_view(user):
                found.append(user)
                frontier.append(user)
    return sorted(found, key=order.__getitem__)


def _never_quantized(node: Node) -> bool:
    """Whether ``node``'s value is known to be an integer or bool tensor (a relative
    position index built in forward): no quantize copies it, so every reader of its
    memory sees a write through any view of it, as in float."""
    value = node.meta.get("val", node.meta.get("tensor_meta"))
    dtype = getattr(value, "dtype", None)
    return isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex)


def make_writes_visible(gm: GraphModule, rules: AliasRules) -> int:
    """Rewrite ``gm`` (in place) so every read after an in-place write sees it; returns
    how many reads were moved onto a write's result. Raises :class:`AliasedWriteError`
    for a write through a view whose memory is read afterwards."""
    moved, order = 0, None
    for write in list(gm.graph.nodes):
        target = rules.written(write)
        if target is None:
            continue
        if order is None:  # again only after a rewrite inserted nodes
            order = {node: index for index, node in enumerate(gm.graph.nodes)}
        if rules.is_view(target) and not _never_quantized(target):
            base = target.args[0]
            late = [u for u in base.users if u is not target and order[u] > order[write]]
            if late or _views_of(base, write, order, rules) != [target]:
                raise AliasedWriteError(
                    f"{write.name} ({getattr(write.target, '__name__', write.target)}) "
                    f"writes in place into {target.name}, a view of {base.name}, whose "
                    "memory is read elsewhere too: quantizing copies values between them; "
                    f"{rules.way_out(write)}"
                )
        made = _move_late_reads(gm, write, target, order, rules)
        if made:
            moved, order = moved + made, None
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def _move_late_reads(
    gm: GraphModule, write: Node, base: Node, order: dict[Node, int], rules: AliasRules
) -> int:
    """Each view of ``base`` made before ``write`` and read after it, made again from
    ``write``'s result; the late reads go to the new view, as do late reads of ``base``
    itself to ``write``. Returns how many reads moved."""
    moved, again = 0, {base: write}
    anchor = write
    for view in _views_of(base, write, order, rules):
        late = [u for u in view.users if order[u] > order[write]]
        source = again.get(view.args[0])
        if source is None:
            continue
        with gm.graph.inserting_after(anchor):
            new = gm.graph.create_node(view.op, view.target, (source, *view.args[1:]), view.kwargs)
        new.meta = dict(view.meta)
        again[view], anchor = new, new
        for user in late:
            user.replace_input_with(view, new)
        moved += len(late)
    for user in [u for u in base.users if u is not write and order[u] > order[write]]:
        user.replace_input_with(base, write)
        moved += 1
    for new in reversed([node for view, node in again.items() if view is not base]):
        if not new.users:  # a link of a chain nothing late reads through
            gm.graph.erase_node(new)
    return moved
