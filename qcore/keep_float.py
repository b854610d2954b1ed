"""Layers kept float by choice: which layers can be, and saying why in explain.

``qcore.quantize`` keeps layers (conv/linear, and quantized function calls such
as add and matmul) float for two reasons: they run
slower in int8 (``keep_float_if_slower``, :mod:`qcore.latency`) or the model
misses its accuracy budget with them quantized (``accuracy_budget``,
:mod:`qcore.accuracy`). Both search over a :data:`Build`, which converts the
model with a set of module names kept float (QConfig None, recalibrated), and
both record their reason per kept layer here, where ``qcore.explain`` reads it.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.engine.explain import Entry, Status, attach_report, report_of
from qcore.engine.float_islands import restate_float_inputs
from qcore.kernels.packed import PackedWeights

__all__ = [
    "Build",
    "Candidates",
    "followers",
    "functional_ops",
    "keep_float_mapping",
    "mark_kept_float",
    "sole_readers",
    "weighted_layers",
]

#: A quantized function call, as QConfigMapping.set_module_name_object_type_order
#: names it: (the path of the module whose forward calls it, the function, its index
#: among that module's calls of it).
OpKey = tuple[str, Any, int]

#: ``build(names)``: the converted model with those modules' QConfigs set to None.
Build = Callable[[frozenset[str]], GraphModule]


def weighted_layers(converted: GraphModule, model: torch.nn.Module | None = None) -> list[str]:
    """Module names of the converted model's quantized conv/linear kernels, in order.

    Convert gives a module called twice a copy per call (``b`` and ``b_1``); with
    the float ``model`` each is named by the module the user's model calls, once.
    """
    report = report_of(converted)
    quantized = {entry.node for entry in report.quantized} if report is not None else set()
    called = {} if model is None else _traced_modules(model)
    names = []
    for node in converted.graph.nodes:
        if node.op == "call_module" and node.name in quantized:
            if isinstance(converted.get_submodule(node.target), PackedWeights):
                names.append(called.get(node.name, node.target))
    return list(dict.fromkeys(names))


def _traced(model: torch.nn.Module) -> GraphModule:
    from qcore.engine.custom_config import as_custom_config
    from qcore.engine.trace import trace

    return trace(model, as_custom_config(None))


def _traced_modules(model: torch.nn.Module) -> dict[str, str]:
    """Node name -> the module it calls, in ``model`` traced as prepare traces it."""
    return {n.name: n.target for n in _traced(model).graph.nodes if n.op == "call_module"}


def functional_ops(model: torch.nn.Module, converted: GraphModule) -> dict[str, OpKey]:
    """The converted model's quantized function calls (add, matmul, cat, ...), by
    node name, each with the key a QConfigMapping keeps that one call float by.

    The keys count calls in the traced graph as prepare assigns QConfigs
    (qcore.engine.qconfigs), so they name the same calls. Method calls (reshape,
    transpose) have no such key; they follow their input anyway.
    """
    from qcore.engine.qconfigs import node_scope

    report = report_of(converted)
    if report is None:
        return {}
    quantized = {e.node for e in report.ops if e.status in (Status.QUANTIZED, Status.REFERENCE)}
    seen: dict[tuple[str, Any], int] = defaultdict(int)
    keys: dict[str, OpKey] = {}
    for node in _traced(model).graph.nodes:
        if node.op != "call_function":
            continue
        path, _ = node_scope(node, type(model))
        index = seen[path, node.target]
        seen[path, node.target] += 1
        if node.name in quantized:
            keys[node.name] = (path, node.target, index)
    return keys


def followers(
    model: torch.nn.Module,
    converted: GraphModule,
    candidates: list[str],
    ops: Mapping[str, OpKey],
) -> dict[str, tuple[str, ...]]:
    """For each candidate, the quantized ops only it feeds and that read nothing
    else (an activation module after a conv, a relu call), up to the next
    conv/linear: module names, or node names of function calls in ``ops``.
    Keeping a conv float while its ReLU6 still quantizes would leave the rounding
    where it was; these go float with it.
    """
    report = report_of(converted)
    if report is None:
        return {}
    quantized = {e.node for e in report.ops if e.status in (Status.QUANTIZED, Status.REFERENCE)}
    reported = {e.node for e in report.entries}
    wanted = set(candidates)
    found: dict[str, list[str]] = defaultdict(list)
    for node in _traced(model).graph.nodes:
        leader = node.target if node.op == "call_module" else node.name
        if leader not in wanted or node.op not in ("call_module", "call_function"):
            continue
        for user in sole_readers(node):
            if user.name not in reported:  # fused into the layer (a batch norm): go on
                continue
            if user.name not in quantized:
                break
            if user.op == "call_module" and user.target not in wanted:  # not the next layer
                found[leader].append(user.target)
            elif user.name in ops:
                found[leader].append(user.name)
            else:
                break
    return {name: tuple(dict.fromkeys(names)) for name, names in found.items()}


def sole_readers(node: Node) -> Iterator[Node]:
    """The nodes after ``node`` that each have one reader, the next, which reads
    nothing else: an activation only a layer feeds, and the one after it."""
    current = node
    while len(current.users) == 1:
        (user,) = current.users
        if user.all_input_nodes != [current]:
            return
        yield user
        current = user


def keep_float_mapping(
    mapping: Any,
    names: frozenset[str],
    ops: Mapping[str, OpKey],
    float_with: Mapping[str, tuple[str, ...]] | None = None,
) -> Any:
    """A copy of ``mapping`` with QConfig None for each of ``names`` and what goes
    float with it (``float_with``, from :func:`followers`): a module name, or a
    function call's node name from :func:`functional_ops`."""
    mapping = mapping.copy()
    expanded = set(names)
    for name in names:
        expanded.update((float_with or {}).get(name, ()))
    for name in sorted(expanded):
        if name in ops:
            mapping.set_module_name_object_type_order(*ops[name], None)
        else:
            mapping.set_module_name(name, None)
    return mapping


@dataclass(frozen=True)
class Candidates:
    """What ``accuracy_budget`` and ``keep_float_if_slower`` may keep float: the
    conv/linear layers and the quantized function calls (``names``), the calls'
    QConfigMapping keys (``ops``), and what goes float with each (``float_with``)."""

    names: list[str] = field(default_factory=list)
    ops: dict[str, OpKey] = field(default_factory=dict)
    float_with: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: torch.nn.Module, converted: GraphModule) -> Candidates:
        ops = functional_ops(model, converted)
        names = [*weighted_layers(converted, model), *ops]
        return cls(names, ops, followers(model, converted, names, ops))


def mark_kept_float(model: GraphModule, reasons: Mapping[str, str]) -> GraphModule:
    """``model`` with each module (or node) named in ``reasons`` shown float in its
    explain report, with that reason. Returns ``model`` (its report replaced)."""
    report = report_of(model)
    if report is None or not reasons:
        return model
    by_node = {name: reason for name, reason in reasons.items() if "." not in name}
    by_node.update(
        (node.name, reasons[node.target])
        for node in model.graph.nodes
        if node.op == "call_module" and node.target in reasons
    )
    # an op explained by its float input names the input's reason: keep it current
    restated = restate_float_inputs(
        [e.node for e in report.entries], {e.node: e.reason for e in report.entries}, by_node
    )
    entries = [
        Entry(e.node, e.op, Status.FLOAT, by_node[e.node], e.pattern)
        if e.node in by_node
        else replace(e, reason=restated[e.node])
        for e in report.entries
    ]
    marked = copy.copy(report)  # keeps whatever else the report records
    marked.entries = entries
    attach_report(model, marked)
    return model
