"""Which QConfig applies to each node, by torch.ao's precedence rules.

Precedence, lowest to highest: global, object type (the module class, the
function or the method name; for a function, also the class of the module it
is called in), module name regex (first match wins), module name (a parent's
entry covers its children), and (module name, object type, index).

Works with qcore's QConfigMapping and with torch.ao's, which share these
attribute names.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.fx import Node
from torch.nn.utils.parametrize import type_before_parametrizations

__all__ = [
    "assign_qconfigs",
    "node_scope",
    "unmatched_names",
    "pattern_qconfig",
    "qconfig_equals",
]


def node_scope(node: Node, root_type: type) -> tuple[str, type]:
    """(module path, module class) of the module whose forward made ``node``."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", root_type
    path, cls = list(stack.values())[-1]
    return path, cls


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _by_module_name(mapping: Any, name: str, fallback: Any) -> Any:
    while name:
        if name in mapping.module_name_qconfigs:
            return mapping.module_name_qconfigs[name]
        name = _parent(name)
    return fallback


def _by_type_or_name(mapping: Any, object_type: Any, module_name: str, fallback: Any) -> Any:
    qconfig = mapping.object_type_qconfigs.get(object_type, fallback)
    for regex, regex_qconfig in mapping.module_name_regex_qconfigs.items():
        if re.match(regex, module_name):
            qconfig = regex_qconfig
            break
    return _by_module_name(mapping, module_name, qconfig)


def _by_order(mapping: Any, path: str, object_type: Any, index: int, fallback: Any) -> Any:
    return mapping.module_name_object_type_order_qconfigs.get((path, object_type, index), fallback)


def assign_qconfigs(
    nodes: list[Node],
    modules: Mapping[str, torch.nn.Module],
    mapping: Any,
    root_type: type,
    class_of: Callable[[torch.nn.Module], type] = type_before_parametrizations,
) -> dict[Node, Any]:
    """node -> its QConfig (or None) for every call node; ``class_of`` gives the
    class a module is looked up by (convert maps a QAT module to its float class)."""
    seen: dict[str, dict[Any, int]] = defaultdict(lambda: defaultdict(int))
    result: dict[Node, Any] = {}
    base = mapping.global_qconfig
    for node in nodes:
        if node.op == "call_function":
            path, module_type = node_scope(node, root_type)
            own = mapping.object_type_qconfigs.get(node.target, base)
            qconfig = _by_type_or_name(mapping, module_type, path, own)
            index = seen[path][node.target]
            seen[path][node.target] += 1
            result[node] = _by_order(mapping, path, node.target, index, qconfig)
        elif node.op == "call_method":
            path, module_type = node_scope(node, root_type)
            qconfig = _by_type_or_name(mapping, node.target, path, base)
            result[node] = _by_type_or_name(mapping, module_type, path, qconfig)
        elif node.op == "call_module":
            module_type = class_of(modules[node.target])
            qconfig = _by_type_or_name(mapping, module_type, node.target, base)
            parent = _parent(node.target)
            index = seen[parent][module_type]
            seen[parent][module_type] += 1
            result[node] = _by_order(mapping, parent, module_type, index, qconfig)
    return result


def unmatched_names(model: torch.nn.Module, mapping: Any) -> list[str]:
    """The mapping's module names and name regexes that name no module of ``model``
    (a typo there quantizes, silently, what the user meant to keep float)."""
    names = {name for name, _ in model.named_modules()}
    found = [f"module name {name!r}" for name in mapping.module_name_qconfigs if name not in names]
    found += [
        f"module name regex {regex!r}"
        for regex in mapping.module_name_regex_qconfigs
        if not any(re.match(regex, name) for name in names)
    ]
    found += [
        f"module name {name!r} (object type {object_type!r}, index {index})"
        for name, object_type, index in mapping.module_name_object_type_order_qconfigs
        if name not in names
    ]
    return found


def _ctr_key(ctr: Any) -> Any:
    """Constructors from with_args are partials; compare what they build."""
    if ctr is None:
        return None
    inner = getattr(ctr, "p", ctr)  # torch.ao's _PartialWrapper keeps the partial in .p
    func = getattr(inner, "func", inner)
    keywords = getattr(inner, "keywords", {}) or {}
    return (func, tuple(sorted((k, repr(v)) for k, v in keywords.items())))


def qconfig_equals(a: Any, b: Any) -> bool:
    """Whether two QConfigs build the same observers."""
    if a is None or b is None:
        return a is b
    return _ctr_key(a.activation) == _ctr_key(b.activation) and _ctr_key(a.weight) == _ctr_key(
        b.weight
    )


def pattern_qconfig(root: Any, others: list[Any]) -> Any:
    """The QConfig of a pattern (or fused module) whose root node has ``root`` and
    whose other nodes have ``others``; None when they differ.

    A dynamic QConfig on the root also covers nodes with none of their own: a
    dynamic pattern observes no activation, so ``set_object_type(nn.Linear,
    default_dynamic_qconfig)`` quantizes ``F.relu(linear(x))`` as the fused
    linear_relu_dynamic without a QConfig for relu (torch.ao's FX raises a
    LookupError asking for one; its eager quantize_dynamic ignores the relu).
    """
    if all(qconfig_equals(root, other) for other in others):
        return root
    if root is None or any(
        other is not None and not qconfig_equals(root, other) for other in others
    ):
        return None
    from qcore.config.compat import qconfig_dtypes

    return root if qconfig_dtypes(root)[2] else None
