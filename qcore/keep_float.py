"""Layers kept float by choice: which layers can be, and saying why in explain.

``qcore.quantize`` keeps conv/linear layers float for two reasons: they run
slower in int8 (``keep_float_if_slower``, :mod:`qcore.latency`) or the model
misses its accuracy budget with them quantized (``accuracy_budget``,
:mod:`qcore.accuracy`). Both search over a :data:`Build`, which converts the
model with a set of module names kept float (QConfig None, recalibrated), and
both record their reason per kept layer here, where ``qcore.explain`` reads it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

from torch.fx import GraphModule

from qcore.engine.explain import Entry, Status, attach_report, report_of
from qcore.kernels.packed import PackedWeights

__all__ = ["Build", "mark_kept_float", "weighted_layers"]

#: ``build(names)``: the converted model with those modules' QConfigs set to None.
Build = Callable[[frozenset[str]], GraphModule]


def weighted_layers(converted: GraphModule) -> list[str]:
    """Module names of the converted model's quantized conv/linear kernels, in order."""
    report = report_of(converted)
    quantized = {entry.node for entry in report.quantized} if report is not None else set()
    names = []
    for node in converted.graph.nodes:
        if node.op == "call_module" and node.name in quantized:
            if isinstance(converted.get_submodule(node.target), PackedWeights):
                names.append(node.target)
    return names


def mark_kept_float(model: GraphModule, reasons: Mapping[str, str]) -> GraphModule:
    """``model`` with each module named in ``reasons`` shown float in its explain
    report, with that reason. Returns ``model`` (its report replaced)."""
    report = report_of(model)
    if report is None or not reasons:
        return model
    by_node = {
        node.name: reasons[node.target]
        for node in model.graph.nodes
        if node.op == "call_module" and node.target in reasons
    }
    entries = [
        Entry(e.node, e.op, Status.FLOAT, by_node[e.node], e.pattern) if e.node in by_node else e
        for e in report.entries
    ]
    marked = copy.copy(report)  # keeps whatever else the report records
    marked.entries = entries
    attach_report(model, marked)
    return model
