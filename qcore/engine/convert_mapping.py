"""convert's ``qconfig_mapping``: ops whose QConfig it sets to None stay float.

``qcore.convert_fx(prepared, qconfig_mapping=...)`` accepts the argument a user
porting from torch.ao passes: the prepare mapping again, where any QConfig may
be None. This module applies it to qcore's own prepared state (its accepted
patterns and observers; nothing of torch.ao runs): those ops stay float (a QAT
module returns to its float class), and an observer between ops that are all
float then goes. Any other change is an error naming the op.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.ao.nn.intrinsic import _FusedModule
from torch.fx import GraphModule, Node

from qcore.config.errors import describe
from qcore.config.qconfig import as_qconfig_mapping
from qcore.engine.custom_config import UnsupportedSetting
from qcore.engine.explain import Report, Status, attach_report, report_of
from qcore.engine.prepare import STATE_KEY, PreparedState
from qcore.engine.qconfigs import assign_qconfigs, qconfig_equals

__all__ = ["with_convert_mapping"]

NONE_AT_CONVERT = "its QConfig is None in convert_fx's qconfig_mapping"


def _mapped_type(module: torch.nn.Module) -> type:
    """The class a user's mapping names for ``module``: a QAT module's float class,
    a fused module's first part (torch.ao's _update_qconfig_for_qat/_fusion)."""
    if isinstance(module, _FusedModule) and isinstance(module, torch.nn.Sequential):
        return _mapped_type(module[0])
    for cls in type(module).__mro__:
        for attribute in ("_FLOAT_CONV_MODULE", "_FLOAT_MODULE"):
            float_class = cls.__dict__.get(attribute)
            if isinstance(float_class, type) and not issubclass(float_class, _FusedModule):
                return float_class
    return type(module)


def _qconfigs(prepared: GraphModule, mapping: Any, observers: set[str]) -> dict[str, Any]:
    """node name -> QConfig for every node but the observers, as torch.ao's convert
    assigns them: inputs and the output get None, constants the global QConfig."""
    modules = dict(prepared.named_modules(remove_duplicate=False))
    nodes = [n for n in prepared.graph.nodes if n.op != "call_module" or n.target not in observers]
    found = assign_qconfigs(nodes, modules, mapping, type(prepared), class_of=_mapped_type)
    return {
        node.name: found.get(node, mapping.global_qconfig if node.op == "get_attr" else None)
        for node in nodes
    }


def with_convert_mapping(prepared: GraphModule, qconfig_mapping: Any) -> GraphModule:
    """``prepared`` with the ops ``qconfig_mapping`` sets to None made float (a copy;
    ``prepared`` itself when nothing changes)."""
    state: PreparedState = prepared.meta[STATE_KEY]
    if qconfig_mapping is None:
        return prepared
    mapping = as_qconfig_mapping(qconfig_mapping)
    if state.qconfig_mapping is None:
        raise UnsupportedSetting(
            f"qconfig_mapping: got {describe(qconfig_mapping)}; this model was prepared "
            "without a QConfigMapping to compare it with: pass none"
        )
    observers = set(state.observer_names)
    before = _qconfigs(prepared, as_qconfig_mapping(state.qconfig_mapping), observers)
    after = _qconfigs(prepared, mapping, observers)
    for name, qconfig in after.items():
        if qconfig is not None and not qconfig_equals(qconfig, before[name]):
            raise UnsupportedSetting(
                f"qconfig_mapping: changing QConfigs at convert is not supported: this mapping "
                f"gives {name!r} another QConfig than prepare did; at convert each QConfig is "
                "the prepare one or None (that op then stays float)"
            )
    dropped = {name for name, qc in after.items() if qc is None and before[name] is not None}
    if not dropped:
        return prepared
    gm = copy.deepcopy(prepared)
    gone = _drop_observers(gm, observers, dropped, after)
    _float_qat_modules(gm, dropped)
    gm.meta[STATE_KEY] = dataclasses.replace(
        state,
        accepted=tuple(a for a in state.accepted if a.root_name not in dropped),
        observer_names=tuple(n for n in state.observer_names if n not in gone),
    )
    report = report_of(gm)
    present = {node.name for node in gm.graph.nodes}
    entries = [
        entry.with_status(Status.FLOAT, NONE_AT_CONVERT) if entry.node in dropped else entry
        for entry in report.entries
        if entry.node in present
    ]
    attach_report(gm, Report(report.backend, entries))
    return gm


def _drop_observers(
    gm: GraphModule, names: set[str], dropped: set[str], after: dict[str, Any]
) -> set[str]:
    """torch.ao's rule: an observer goes when every node it sits between has a None
    QConfig at convert (and one of them had one at prepare); another observer
    there keeps it."""
    gone = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node.target not in names:
            continue
        neighbours = [n for n in node.args if isinstance(n, Node)] + list(node.users)
        if all(n.name in after and after[n.name] is None for n in neighbours) and any(
            n.name in dropped for n in neighbours
        ):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            gone.add(node.target)
    gm.graph.lint()
    gm.recompile()
    # a shared observer still called elsewhere stays an observer there
    return gone - {node.target for node in gm.graph.nodes if node.op == "call_module"}


def _float_qat_modules(gm: GraphModule, dropped: set[str]) -> None:
    """A QAT module left float returns to its float class (batch norm folded)."""
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.name not in dropped:
            continue
        module = gm.get_submodule(node.target)
        if hasattr(module, "weight_fake_quant") and hasattr(module, "to_float"):
            parent_name, _, attr = node.target.rpartition(".")
            setattr(gm.get_submodule(parent_name) if parent_name else gm, attr, module.to_float())
