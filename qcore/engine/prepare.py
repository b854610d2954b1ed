"""prepare: trace a copy, fuse, decide, annotate, insert observers.

The prepared GraphModule carries a :class:`PreparedState` in
``gm.meta["qcore_state"]``: what convert needs (the backend, the decisions)
and the explain entries.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import ShapeProp

from qcore.config import BackendConfig, BackendPatternConfig, DTypeConfig
from qcore.config.errors import QCoreWarning
from qcore.engine.backend_annotator import Decision, annotate_with_backend_config
from qcore.engine.explain import Entry, Report, Status, attach_report
from qcore.engine.fuse import fuse_graph
from qcore.engine.observe import insert_observers
from qcore.engine.qconfigs import assign_qconfigs, qconfig_equals
from qcore.engine.trace import CustomConfig, trace

__all__ = ["STATE_KEY", "Accepted", "PreparedState", "prepare"]

STATE_KEY = "qcore_state"


@dataclass(frozen=True)
class Accepted:
    """A quantized pattern, by node names (the state outlives graph copies)."""

    root_name: str
    root_op: str
    root_target: Any
    config: BackendPatternConfig
    qconfig: Any
    dtype_config: DTypeConfig

    @classmethod
    def of(cls, decision: Decision) -> Accepted:
        root = decision.match.root
        return cls(
            root.name,
            root.op,
            root.target,
            decision.match.config,
            decision.qconfig,
            decision.dtype_config,
        )


@dataclass
class PreparedState:
    """What convert needs from prepare; holds names, never graph nodes."""

    backend_name: str
    backend_config: BackendConfig
    kernels: tuple
    is_qat: bool
    accepted: tuple[Accepted, ...] = ()
    observer_names: tuple[str, ...] = ()
    front_door: str = "fx"


def _tensor_nodes(gm: GraphModule, example_inputs: tuple) -> set[Node]:
    """Nodes whose value is a Tensor, found by running the example inputs."""
    training = gm.training
    gm.eval()  # the probe run must not move batch-norm statistics
    with torch.no_grad():
        ShapeProp(gm).propagate(*example_inputs)
    gm.train(training)
    return {node for node in gm.graph.nodes if "tensor_meta" in node.meta}


def _fused_qconfig(new_node: Node, old_nodes: list[Node], qconfigs: dict, notes: dict) -> None:
    found = [qconfigs.get(node) for node in old_nodes]
    first = found[-1]  # the root module, first in forward order
    if all(qconfig_equals(first, other) for other in found):
        qconfigs[new_node] = first
    else:
        qconfigs[new_node] = None
        notes[new_node] = (
            f"the fused modules ({', '.join(n.name for n in reversed(old_nodes))}) have "
            "different QConfigs; give them the same one"
        )


def _swap_qat_modules(gm: GraphModule, decisions: list[Decision]) -> None:
    modules = dict(gm.named_modules())
    for decision in decisions:
        qat_class = decision.match.config.qat_module
        root = decision.match.root
        if qat_class is None or root.op != "call_module":
            continue
        float_module = modules[root.target]
        float_module.qconfig = decision.qconfig
        qat_module = qat_class.from_float(float_module)
        parent_name, _, attr = root.target.rpartition(".")
        setattr(gm.get_submodule(parent_name) if parent_name else gm, attr, qat_module)


def prepare(
    model: torch.nn.Module,
    qconfig_mapping: Any,
    example_inputs: tuple,
    backend_name: str,
    backend_config: BackendConfig,
    kernels: tuple,
    *,
    is_qat: bool,
    custom_config: CustomConfig,
    make_fixed: Any,
) -> GraphModule:
    gm = trace(model, custom_config)
    if is_qat:
        gm.train()
    modules = dict(gm.named_modules())
    nodes = list(gm.graph.nodes)
    qconfigs = assign_qconfigs(nodes, modules, qconfig_mapping, type(model))
    notes: dict[Node, str] = {}
    fuse_graph(
        gm, backend_config, is_qat, lambda new, old: _fused_qconfig(new, old, qconfigs, notes)
    )
    modules = dict(gm.named_modules())
    nodes = list(gm.graph.nodes)
    tensor_nodes = _tensor_nodes(gm, example_inputs)
    annotations, decisions, entries = annotate_with_backend_config(
        nodes, modules, backend_config, qconfigs, tensor_nodes, notes
    )
    if is_qat:
        _swap_qat_modules(gm, decisions)
    plan = insert_observers(gm, annotations, make_fixed)
    for node in gm.graph.nodes:
        if node.name not in entries:  # the observers just inserted
            entries[node.name] = Entry(node.name, "observer", Status.NOT_AN_OP)
    state = PreparedState(
        backend_name,
        backend_config,
        kernels,
        is_qat,
        tuple(Accepted.of(decision) for decision in decisions),
        tuple(plan.points_of_observer),
    )
    gm.meta[STATE_KEY] = state
    report = Report(backend_name, [entries[n.name] for n in gm.graph.nodes])
    _warn_skipped(attach_report(gm, report), qconfigs)
    return gm


def _warn_skipped(report: Report, qconfigs: dict[Node, Any]) -> None:
    """One warning, only for operators the user asked to quantize that stay float."""
    asked = {node.name for node, qconfig in qconfigs.items() if qconfig is not None}
    skipped = [e for e in report.float if e.node in asked]
    if not skipped:
        return
    kinds = sorted({e.op for e in skipped})
    warnings.warn(
        f"{len(skipped)} operator(s) with a QConfig stay in float on backend "
        f"{report.backend!r} ({', '.join(kinds[:5])}{', ...' if len(kinds) > 5 else ''}). "
        "qcore.explain(prepared_model) gives the reason for each.",
        QCoreWarning,
        stacklevel=5,
    )
