"""Leave float the pass-through ops that nothing quantized reads or feeds.

An op that shares its input's qparams (reshape, transpose, max_pool, cat, a
scalar add) has no int8 arithmetic of its own: quantizing it pays only when its
input is already int8, or when an op after it computes in int8. When its input
is float and everything that reads it is float (or the graph's float output),
quantizing it adds a quantize and a dequantize for nothing: time, and the
rounding error of one more int8 step.

An *island* is a set of such ops fed only by float roots or by each other. It
stays float unless some op outside it reads one of its outputs as int8. Which
float ops are roots:

* by default, torch.ao FX's: an op with a reuse-input QConfig (torch.ao's
  default mapping gives ``reshape`` one) whose input is float. torch.ao quantizes
  a pass-through op after any other float op (``linear -> max_pool`` with the
  linear's QConfig None gets a quantize and a dequantize around the pool), and
  the peers' tests count those; qcore follows, so a ported model converts to the
  same graph;
* inside :func:`islands_from_any_float_op`, every float op: qcore's own searches
  (``keep_float_if_slower``, ``accuracy_budget``) keep layers float to gain
  speed or accuracy, and the pass-through ops those alone feed go float with
  them (a transformer's head reshapes and transposes).

A graph input is never a root: a model quantizes its float inputs where they
enter, as torch.ao's does (``x -> max_pool`` alone is quantized).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch.fx import Node

from qcore.quantizer.spec import (
    DerivedQuantizationSpec,
    QuantizationAnnotation,
    SharedQuantizationSpec,
)

__all__ = [
    "FLOAT_ISLAND_REASON",
    "NOTHING_TO_GAIN",
    "REUSES_FLOAT_REASON",
    "float_input_reason",
    "float_islands",
    "fused_only_ops",
    "gains_nothing",
    "islands_from_any_float_op",
    "restate_float_inputs",
]

FLOAT_ISLAND_REASON = (
    "its input is float and nothing after it computes in int8: quantizing it would "
    "only add a quantize and a dequantize"
)
REUSES_FLOAT_REASON = (
    "it keeps its input's quantization (a reuse-input QConfig), and its input is float"
)
#: Reasons for an op with a QConfig to stay float that lose the user nothing.
NOTHING_TO_GAIN = frozenset({FLOAT_ISLAND_REASON, REUSES_FLOAT_REASON})
_FLOAT_INPUT = "its input is float: "


def float_input_reason(producer: str, producer_reason: str) -> str:
    """Why an op the backend quantizes only fused into the op before it (``torch.relu``,
    in ``add -> relu``) runs in float: that op, ``producer``, runs in float.

    Example::

        >>> float_input_reason("fc1", "no QConfig for this pattern in the QConfigMapping")
        'its input is float: fc1 runs in float (no QConfig for this pattern in the QConfigMapping)'
    """
    return f"{_FLOAT_INPUT}{producer} runs in float ({producer_reason})"


def gains_nothing(reason: str) -> bool:
    """Whether an op left float for ``reason`` loses the user nothing: quantizing it
    would add a quantize for no int8 arithmetic, or it is quantized only fused into
    the op before it and that op runs in float (on its own, on a float input, it
    would have nothing to compute in int8)."""
    return reason in NOTHING_TO_GAIN or reason.startswith(_FLOAT_INPUT)


def fused_only_ops(patterns: Iterable[Any], ops_of: Callable[[Any], Iterable[Any]]) -> set[Any]:
    """The ops that ``patterns`` (complex format: ``op`` or ``(op, arg0_pattern, ...)``)
    quantize only as part of a larger pattern, never alone: ``torch.relu`` in
    torch.ao's ``(torch.relu, operator.add)``. ``ops_of(item)`` gives the ops a
    pattern item stands for (none for a match-anything position)."""
    alone: set[Any] = set()
    joined: set[Any] = set()
    for pattern in patterns:
        if not isinstance(pattern, tuple):
            alone.update(ops_of(pattern))
            continue
        stack = list(pattern)
        while stack:
            item = stack.pop()
            if isinstance(item, tuple):
                stack.extend(item)
            else:
                joined.update(ops_of(item))
    return joined - alone


def restate_float_inputs(
    names: Sequence[str], reasons: dict[str, str], changed: dict[str, str]
) -> dict[str, str]:
    """``reasons`` (node name -> reason, ``names`` in graph order) with each one written
    by :func:`float_input_reason` updated where its producer's reason was replaced by
    ``changed`` (a layer the search kept float, first explained as having no QConfig)."""
    old: dict[str, str] = {}
    updated = dict(reasons)
    for name in names:
        if name in changed:
            old[name], updated[name] = reasons.get(name, ""), changed[name]
            continue
        for producer, before in old.items():
            if reasons.get(name) == float_input_reason(producer, before):
                old[name] = reasons[name]
                updated[name] = float_input_reason(producer, updated[producer])
                break
    return updated


# Scoped to one call of qcore's own search (a context variable: per thread and
# task, reset on exit), never set by a user's prepare.
_ANY_FLOAT_OP_IS_A_ROOT: ContextVar[bool] = ContextVar("any_float_op_is_a_root", default=False)


@contextmanager
def islands_from_any_float_op() -> Iterator[None]:
    """Within the block, prepare leaves float the pass-through ops after any float op."""
    token = _ANY_FLOAT_OP_IS_A_ROOT.set(True)
    try:
        yield
    finally:
        _ANY_FLOAT_OP_IS_A_ROOT.reset(token)


def _sources(node: Node, annotation: QuantizationAnnotation) -> list[Node] | None:
    """The producers whose qparams the node's output takes (None: it has its own).

    An edge's (``SharedQuantizationSpec((x, node))``, a derived spec) when the op
    quantizes its input; the producer node's (``SharedQuantizationSpec(x)``) when it
    reuses its input's quantization (torch.ao's ReuseInputObserver)."""
    spec = annotation.output_qspec
    if isinstance(spec, SharedQuantizationSpec):
        points = [spec.edge_or_node]
    elif isinstance(spec, DerivedQuantizationSpec):
        points = list(spec.derived_from)
    else:
        return None
    sources = []
    for point in points:
        if isinstance(point, tuple) and point[1] is node and point[0] in annotation.input_qspec_map:
            sources.append(point[0])
        elif isinstance(point, Node) and point in node.all_input_nodes:
            sources.append(point)
        else:
            return None
    return sources + [p for p in annotation.input_qspec_map if p not in sources] or None


def float_islands(
    nodes: Iterable[Node],
    annotations: dict[Node, QuantizationAnnotation],
    reusing_float: set[Node],
) -> set[Node]:
    """The pass-through nodes to leave float: returns them, their annotations removed.

    ``nodes`` in graph order; ``reusing_float``: the reuse-input ops whose input
    is float (the default roots). A node is fed by float when each input it
    quantizes comes from a root or from another fed-by-float node. Such a node is
    kept int8 only when a node outside the island reads it with a quantization
    spec or reuses its qparams (a conv taking int8).
    """
    any_float_op = _ANY_FLOAT_OP_IS_A_ROOT.get()

    def is_root(producer: Node) -> bool:
        if any_float_op:
            return producer.op != "placeholder" and _output_spec(annotations, producer) is None
        return producer in reusing_float

    order = list(nodes)
    fed_by_float: set[Node] = set()
    for node in order:
        annotation = annotations.get(node)
        sources = _sources(node, annotation) if annotation is not None else None
        if sources is None:
            continue
        if all(producer in fed_by_float or is_root(producer) for producer in sources):
            fed_by_float.add(node)

    dropped: set[Node] = set()
    for node in reversed(order):  # users are decided before their producers
        if node not in fed_by_float:
            continue
        read_as_int8 = any(
            user not in dropped and _reads_quantized(user, annotations.get(user), node)
            for user in node.users
        )
        if not read_as_int8:
            dropped.add(node)
    for node in dropped:
        annotation = annotations[node]
        annotation.output_qspec = None
        annotation.input_qspec_map.clear()
    return dropped


def _output_spec(annotations: dict[Node, QuantizationAnnotation], node: Node):
    annotation = annotations.get(node)
    return annotation.output_qspec if annotation is not None else None


def _reads_quantized(user: Node, annotation: QuantizationAnnotation | None, producer: Node) -> bool:
    """Whether ``user`` takes ``producer``'s output as int8 (or reuses its qparams)."""
    if annotation is None:
        return False
    if annotation.input_qspec_map.get(producer) is not None:
        return True
    return producer in (_sources(user, annotation) or ())
