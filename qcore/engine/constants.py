"""Constants of a graph: what convert may compute once instead of at every call.

A weight is a ``get_attr`` node, or pure ops on such (BiT standardizes its conv
weights with a functional batch norm in forward): :class:`Constants` says which
nodes are computable from parameters and buffers alone, and their values, for
both front doors (FX graphs call methods, exported ones aten ops).

Observers of such weights see their value before convert: a weight passed to
``F.linear``/``F.conv2d`` is observed like any input, so it is only seen when the
model runs. Dynamic quantization needs no calibration run: torch.ao observes such
weights at convert, and so does qcore.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.engine.observe import OBSERVER_PREFIX

__all__ = [
    "RANDOM_WORDS",
    "Constants",
    "attribute",
    "free_name",
    "observe_constants",
    "reached_by_inputs",
    "unobserved",
    "written_buffers",
]


def unobserved(observer: torch.nn.Module) -> bool:
    """Whether a min/max observer has seen no value yet."""
    low = getattr(observer, "min_val", None)
    return isinstance(low, torch.Tensor) and (low.numel() == 0 or bool(torch.isinf(low).any()))


def observe_constants(gm: GraphModule) -> None:
    """Show each observer of a ``get_attr`` constant its value, if it saw nothing yet."""
    for node in gm.graph.nodes:
        if node.op != "call_module" or not str(node.target).startswith(OBSERVER_PREFIX):
            continue
        source = node.args[0] if node.args else None
        if getattr(source, "op", None) != "get_attr":
            continue
        observer = gm.get_submodule(node.target)
        if unobserved(observer):
            with torch.no_grad():
                observer(attribute(gm, source.target).detach())


#: Ops that draw random numbers never compute a constant (whatever their inputs).
RANDOM_WORDS = ("rand", "bernoulli", "dropout", "normal", "multinomial", "uniform", "exponential")


def _name(node: Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _writes_first_argument(node: Node) -> bool:
    """An in-place op: by its schema (aten), or by torch's naming (``add_``, a method)."""
    if node.op not in ("call_method", "call_function"):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return _name(node).endswith("_")
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _aliased_sources(node: Node) -> list[Node]:
    """``node`` and the nodes whose storage it may share: through views and in-place
    ops (their schema returns an alias of an argument), never through an op that
    returns a new tensor, such as the conv whose output a ``relu_`` overwrites.
    An op without a schema may alias any input; a method, the tensor it is called on."""
    seen, stack, found = set(), [node], []
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        found.append(current)
        if current.op == "call_method":
            stack.extend(arg for arg in current.args[:1] if isinstance(arg, Node))
            continue
        if current.op != "call_function":
            continue
        schema = getattr(current.target, "_schema", None)
        if schema is None:
            stack.extend(current.all_input_nodes)
            continue
        if not schema.returns or schema.returns[0].alias_info is None:
            continue
        for argument, value in zip(schema.arguments, current.args, strict=False):
            if argument.alias_info is not None and isinstance(value, Node):
                stack.append(value)
    return found


def written_buffers(gm: GraphModule) -> set[str]:
    """get_attr targets an in-place op writes to (never constant: they change at run time)."""
    written = set()
    for node in gm.graph.nodes:
        if node.args and isinstance(node.args[0], Node) and _writes_first_argument(node):
            for producer in _aliased_sources(node.args[0]):
                if producer.op == "get_attr":
                    written.add(producer.target)
    return written


def _pure(node: Node) -> bool:
    if node.op not in ("call_function", "call_method") or _writes_first_argument(node):
        return False
    if node.op == "call_function" and node.is_impure():
        return False
    return not any(word in _name(node) for word in RANDOM_WORDS)


def free_name(gm: GraphModule, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``... : the first name no attribute of ``gm`` has."""
    name, index = base, 0
    while hasattr(gm, name):
        index += 1
        name = f"{base}_{index}"
    return name


def attribute(gm: GraphModule, target: str) -> Any:
    """What a ``get_attr`` node with ``target`` reads from ``gm``."""
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


class Constants:
    """Which nodes of ``gm`` are computable from its constants alone, by pure ops
    (from parameters and buffers no in-place op writes), and their values.

    Example::

        >>> constants = Constants(gm)
        >>> weight = constants.value(node) if node in constants else None
    """

    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm
        self._written = written_buffers(gm)
        self._known: dict[Node, bool] = {}

    def __contains__(self, node: Any) -> bool:
        if not isinstance(node, Node):
            return False
        if node not in self._known:
            if node.op == "get_attr":
                self._known[node] = node.target not in self._written
            else:
                inputs = node.all_input_nodes
                self._known[node] = _pure(node) and bool(inputs) and all(i in self for i in inputs)
        return self._known[node]

    def value(self, node: Node) -> torch.Tensor:
        """``node``'s value (``node in self`` must hold), computed without autograd."""
        with torch.no_grad():
            return self._evaluate(node, {}).detach()

    def _evaluate(self, node: Node, values: dict[Node, Any]) -> Any:
        if node not in values:
            if node.op == "get_attr":
                values[node] = attribute(self.gm, node.target)
            else:
                args = torch.fx.node.map_arg(node.args, lambda n: self._evaluate(n, values))
                kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self._evaluate(n, values))
                if node.op == "call_method":
                    values[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    values[node] = node.target(*args, **kwargs)
        return values[node]


def reached_by_inputs(gm: GraphModule, is_tensor: Any) -> set[Node]:
    """The nodes whose values a model input's values reach, through tensors.

    A size read off an input (``x.shape[1]``, ``aten.sym_size``) is not a tensor and
    carries no values on: ``arange(x.shape[1]) * inv_freq`` (rotary position angles)
    is not reached, nor anything computed from parameters and buffers alone. A
    buffer the forward writes into counts as reached (it holds what was written).
    ``is_tensor(node)`` says whether a node's value is a tensor.
    """
    written = written_buffers(gm)
    reached: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node.op == "get_attr" and node.target in written:
            reached.add(node)
        elif any(arg in reached and is_tensor(arg) for arg in node.all_input_nodes):
            reached.add(node)
    return reached
