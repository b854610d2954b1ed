"""In-place writes that views made earlier must see, made explicit before quantizing.

``torch.export`` keeps a model's in-place ops (``a += b`` is ``aten.add_(a, b)``) and
its views (``v = a.view(...)``): in float, ``v`` shares ``a``'s memory, so a read of
``v`` after the write sees it. Quantizing puts quantize/dequantize pairs, which copy,
between producers and readers: the write then lands in one copy and ``v`` reads
another, from before the write. torchao's quantizers return such a model's output
unchanged in shape and wrong in value (1.87 out of 1.99 off on a four-layer test).

:func:`make_writes_visible` rewrites each such read to go through the write: a view
made before ``aten.add_(a, b)`` and read after it is made again from the add's
result, right after it (what ``ExportedProgram.run_decompositions()`` does by
functionalizing the whole graph, here on only the reads that need it, so the rest of
the graph keeps the ops and names it was exported with). A write through a view into
memory something else reads afterwards is not rewritten: :class:`AliasedWriteError`
says where, and how to export the model functionalized.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

__all__ = ["AliasedWriteError", "make_writes_visible"]

_FUNCTIONALIZE = (
    "export it functionalized: torch.export.export(model, example_inputs)"
    ".run_decompositions({}).module()"
)


class AliasedWriteError(ValueError):
    """A model writes in place into memory that other values share in a way qcore
    cannot make explicit; quantizing it would give wrong values."""


def _schema(node: Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _writes_first_argument(node: Node) -> bool:
    schema = _schema(node)
    if schema is None or not schema.arguments or not node.args:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _is_view(node: Node) -> bool:
    """An op whose result shares its first argument's memory (view, transpose, ...)."""
    schema = _schema(node)
    if schema is None or _writes_first_argument(node) or not isinstance(node.args[0], Node):
        return False
    return any(ret.alias_info is not None for ret in schema.returns)


def _views_of(base: Node, before: Node, order: dict[Node, int]) -> list[Node]:
    """The views of ``base`` (views of views too) made before ``before``, in order."""
    found, frontier = [], [base]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if _is_view(user) and user.args[0] is node and order[user] < order[before]:
                found.append(user)
                frontier.append(user)
    return sorted(found, key=order.__getitem__)


def make_writes_visible(gm: GraphModule) -> int:
    """Rewrite ``gm`` (in place) so every read after an in-place write sees it; returns
    how many reads were moved onto a write's result. Raises :class:`AliasedWriteError`
    for a write through a view whose memory is read afterwards."""
    moved, order = 0, None
    for write in list(gm.graph.nodes):
        if not _writes_first_argument(write) or not isinstance(write.args[0], Node):
            continue
        if order is None:  # again only after a rewrite inserted nodes
            order = {node: index for index, node in enumerate(gm.graph.nodes)}
        target = write.args[0]
        if _is_view(target):
            base = target.args[0]
            late = [u for u in base.users if u is not target and order[u] > order[write]]
            if late or _views_of(base, write, order) != [target]:
                raise AliasedWriteError(
                    f"{write.name} ({write.target}) writes in place into {target.name}, a "
                    f"view of {base.name}, whose memory is read elsewhere too: quantizing "
                    f"copies values between them; {_FUNCTIONALIZE}"
                )
            continue
        made = _move_late_reads(gm, write, target, order)
        if made:
            moved, order = moved + made, None
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def _move_late_reads(gm: GraphModule, write: Node, base: Node, order: dict[Node, int]) -> int:
    """Each view of ``base`` made before ``write`` and read after it, made again from
    ``write``'s result; the late reads go to the new view, as do late reads of ``base``
    itself to ``write``. Returns how many reads moved."""
    moved, again = 0, {base: write}
    anchor = write
    for view in _views_of(base, write, order):
        late = [u for u in view.users if order[u] > order[write]]
        source = again.get(view.args[0])
        if source is None:
            continue
        with gm.graph.inserting_after(anchor):
            new = gm.graph.call_function(view.target, (source, *view.args[1:]), view.kwargs)
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
