"""What an exported graph means by an in-place write and by a view: its ops' schemas.

``torch.export`` keeps a model's in-place ops (``a += b`` is ``aten.add_(a, b)``) and
its views (``v = a.view(...)``). :func:`make_writes_visible` makes every read after
such a write go through it (:mod:`qcore.engine.aliasing`); without it torchao's
quantizers return a model that views before ``a += b`` 1.87 off on a range of 1.99.
A write through a view into memory read elsewhere is refused, with the way out:
export functionalized, which is what ``run_decompositions`` does to the whole graph.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from qcore.engine import aliasing
from qcore.engine.aliasing import AliasedWriteError

__all__ = ["AliasedWriteError", "make_writes_visible"]


def _schema(node: Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _written(node: Node) -> Node | None:
    schema = _schema(node)
    if schema is None or not schema.arguments or not node.args:
        return None
    alias = schema.arguments[0].alias_info
    target = node.args[0]
    return target if alias is not None and alias.is_write and isinstance(target, Node) else None


def _is_view(node: Node) -> bool:
    """An op whose result shares its first argument's memory (view, transpose, ...)."""
    schema = _schema(node)
    if schema is None or _written(node) is not None or not isinstance(node.args[0], Node):
        return False
    return any(ret.alias_info is not None for ret in schema.returns)


def _functionalize(_: Node) -> str:
    return (
        "export it functionalized: torch.export.export(model, example_inputs)"
        ".run_decompositions({}).module()"
    )


EXPORTED_GRAPH_RULES = aliasing.AliasRules(_written, _is_view, _functionalize)


def make_writes_visible(gm: GraphModule) -> int:
    """Make every read after an in-place write in exported ``gm`` see it (in place);
    returns how many reads moved. Raises :class:`AliasedWriteError` for a write
    through a view whose memory is read afterwards."""
    return aliasing.make_writes_visible(gm, EXPORTED_GRAPH_RULES)
