"""prepare: trace a copy, fuse, decide, annotate, insert observers.

The prepared GraphModule carries a :class:`PreparedState` in
``gm.meta["qcore_state"]``: what convert needs (the backend, the decisions)
and the explain entries.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import TensorMetadata
from torch.nn.modules.batchnorm import _BatchNorm

from qcore.config import BackendConfig, BackendPatternConfig, DTypeConfig
from qcore.config.compat import observer_facts_reused
from qcore.config.errors import QCoreWarning, caller_stacklevel
from qcore.engine.addmm import linear_from_addmm
from qcore.engine.backend_annotator import Decision, annotate_with_backend_config, spec_from_ctr
from qcore.engine.boundaries import output_values
from qcore.engine.collector import collector_paused
from qcore.engine.custom_modules import CustomCall, swap_observed
from qcore.engine.explain import Entry, Report, Status, attach_report
from qcore.engine.fidelity import cloned, record_shapes
from qcore.engine.float_islands import gains_nothing
from qcore.engine.fuse import fuse_graph
from qcore.engine.infer import inferred_tensor_nodes
from qcore.engine.kept_float import kept_float
from qcore.engine.observe import insert_observers, name_observers_per_call
from qcore.engine.qconfigs import assign_qconfigs, pattern_qconfig, unmatched_names
from qcore.engine.standalone import (
    PrepareOne,
    StandaloneCall,
    annotate_standalone_inputs,
    swap_standalone,
)
from qcore.engine.trace import CustomConfig, modes_of, set_modes, trace
from qcore.quantizer.spec import QuantizationAnnotation

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
    custom_calls: tuple[CustomCall, ...] = ()
    """Custom and non-traceable module calls with a QConfig (convert may swap them)."""
    quantized_inputs: tuple[int, ...] = ()
    quantized_outputs: tuple[int, ...] = ()
    """Graph inputs and outputs that are torch quantized tensors once converted."""
    qconfig_mapping: Any = None
    """The mapping prepare assigned QConfigs from (convert accepts the same one again)."""
    standalone_calls: tuple[StandaloneCall, ...] = ()
    """Calls of standalone modules (prepared GraphModules of their own)."""

    def __deepcopy__(self, memo: dict) -> PreparedState:
        # The backend's config and kernels are the registry's (or the caller's) and
        # never written to; copying them with every model copy (convert's among
        # them) cost more than copying a small model's modules.
        shared = {"backend_config": self.backend_config, "kernels": self.kernels}
        copied = {
            field.name: copy.deepcopy(getattr(self, field.name), memo)
            for field in fields(self)
            if field.name not in shared
        }
        return PreparedState(**shared, **copied)


def _tensor_nodes(gm: GraphModule, example_inputs: tuple | None) -> set[Node]:
    """Nodes whose value is a Tensor, found by running copies of the example inputs.

    The probe runs on clones, so in-place ops in the model never touch the caller's
    tensors. torch.ao never runs the example inputs, so models whose inputs do not
    run are accepted too: their tensor nodes are then inferred from the graph, as
    they are without a warning when there are none (``quantize_dynamic``).
    """
    if example_inputs is None:
        return inferred_tensor_nodes(gm)
    if all("type" in node.meta for node in gm.graph.nodes):  # trace's probe ran them
        return _float_valued(gm)
    modes = modes_of(gm)
    gm.eval()  # the probe run must not move batch-norm statistics
    try:
        with torch.no_grad():
            record_shapes(gm, *cloned(example_inputs))
    except Exception as error:  # noqa: BLE001 - any failure of the user's forward
        warnings.warn(
            f"prepare: the example inputs did not run through the model "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); which values are "
            "tensors was inferred from the graph instead. Pass example inputs the model runs on.",
            QCoreWarning,
            stacklevel=5,
        )
        return inferred_tensor_nodes(gm)
    finally:
        set_modes(gm, modes)
    return _float_valued(gm)


def _float_valued(gm: GraphModule) -> set[Node]:
    """The nodes a probe run recorded a floating-point value for."""
    return {node for node in gm.graph.nodes if _holds_float(node.meta.get("tensor_meta"))}


def _carries_values(node: Node, tensor_nodes: set[Node]) -> bool:
    """A tensor of any dtype (integer indices too), not a size: what the probe
    recorded, or where it did not run, what was inferred."""
    if "type" in node.meta:
        return _holds(node.meta.get("tensor_meta"), lambda meta: True)
    return node in tensor_nodes or node.op == "placeholder"


def _holds_float(meta: Any) -> bool:
    """A floating-point tensor, or a container holding one: what can be quantized.

    Bool masks and integer indices are tensors too, but never observed.
    """
    return _holds(meta, lambda tensor: tensor.dtype.is_floating_point)


def _holds(meta: Any, wanted: Any) -> bool:
    """A tensor's recorded metadata ``wanted`` accepts, or a container holding one."""
    if isinstance(meta, TensorMetadata):
        return wanted(meta)
    if isinstance(meta, (list, tuple)):
        return any(_holds(item, wanted) for item in meta)
    if isinstance(meta, dict):
        return any(_holds(item, wanted) for item in meta.values())
    return False


def _fused_qconfig(
    gm: GraphModule,
    modules: dict,
    new_node: Node,
    old_nodes: list[Node],
    qconfigs: dict,
    notes: dict,
) -> None:
    # the root module is the last of old_nodes, first in forward order
    root, *others = reversed(old_nodes)
    # A BatchNorm folded into its layer's weights is gone: its QConfig does not
    # count, as in torch.ao (whose check compares what the fused module holds).
    others = [node for node in others if not _folded_away(gm, modules, new_node, node)]
    found = [qconfigs.get(node) for node in [*reversed(others), root]]
    qconfig = pattern_qconfig(found[-1], found[:-1])
    if qconfig is not None or all(other is None for other in found):
        qconfigs[new_node] = qconfig
    elif found[-1] is None:  # the layer set to None: what is fused into it goes with it
        qconfigs[new_node] = None
        followers = [n.name for n in others]
        notes[new_node] = (
            f"no QConfig for {old_nodes[-1].name} in the QConfigMapping ({', '.join(followers)}, "
            f"fused into it, {'runs' if len(followers) == 1 else 'run'} in float with it)"
        )
    else:
        qconfigs[new_node] = None
        notes[new_node] = (
            f"the fused modules ({', '.join(n.name for n in reversed(old_nodes))}) have "
            "different QConfigs; give them the same one"
        )


def _folded_away(gm: GraphModule, modules: dict, fused_node: Node, node: Node) -> bool:
    """``node`` called a BatchNorm the fusion folded into the layer's weights (eval):
    the fused module no longer holds one."""
    if node.op != "call_module" or not isinstance(modules.get(node.target), _BatchNorm):
        return False
    fused = gm.get_submodule(fused_node.target) if fused_node.op == "call_module" else None
    return fused is not None and not any(isinstance(m, _BatchNorm) for m in fused.modules())


def _attach_qconfigs(gm: GraphModule, qconfigs: dict[Node, Any]) -> None:
    """Each called module carries its QConfig as ``.qconfig``, as after torch.ao's
    prepare (users and custom modules' from_float read it); convert removes it."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and node in qconfigs:
            gm.get_submodule(node.target).qconfig = qconfigs[node]


def _swap_qat_modules(gm: GraphModule, decisions: list[Decision]) -> None:
    modules = dict(gm.named_modules(remove_duplicate=False))
    for decision in decisions:
        qat_class = decision.match.config.qat_module
        root = decision.match.root
        if qat_class is None or root.op != "call_module":
            continue
        float_module = modules[root.target]
        # torch.ao's from_float reads the qconfig of the fused module's first part
        # (LinearReLU -> its Linear), as propagate_qconfig_ would have set it.
        for part in float_module.modules():
            part.qconfig = decision.qconfig
        qat_module = qat_class.from_float(float_module)
        parent_name, _, attr = root.target.rpartition(".")
        setattr(gm.get_submodule(parent_name) if parent_name else gm, attr, qat_module)


def _eval_modules(gm: GraphModule) -> dict[str, torch.nn.Module]:
    """The modules a training model holds in eval mode, by name: batch norms frozen for
    fine-tuning (``model.train(); bn.eval()``), dropouts switched off. None in a model
    in eval mode (QAT prepare trains all of it)."""
    if not gm.training:
        return {}
    return {
        name: module
        for name, module in gm.named_modules(remove_duplicate=False)
        if name and not module.training
    }


def _restore_eval(gm: GraphModule, in_eval: dict[str, torch.nn.Module], fused: set[str]) -> None:
    """QAT prepare trains the whole model (fusion wants its parts in one mode); what the
    user set to eval in a training model goes back to eval, as prepare_fx and
    convert_fx keep each module's mode. A QAT ConvBn holding a frozen batch norm gets
    ``freeze_bn_stats()`` (torch.ao's switch: running statistics, not updated, through
    any later ``train()``); a module still where it was (a batch norm left unfused, a
    dropout) goes back to eval mode. Modules swapped for QAT ones are new, and train."""
    for name in fused:
        module = gm.get_submodule(name)
        if hasattr(module, "freeze_bn_stats"):
            module.freeze_bn_stats()
        else:  # a fused module without the switch: its batch norms as the user set them
            for part in module.modules():
                if isinstance(part, _BatchNorm):
                    part.eval()
    for name, module in gm.named_modules(remove_duplicate=False):
        if in_eval.get(name) is module:
            module.eval()


@observer_facts_reused()
@collector_paused()
def prepare(
    model: torch.nn.Module,
    qconfig_mapping: Any,
    example_inputs: tuple | None,
    backend_name: str,
    backend_config: BackendConfig,
    kernels: tuple,
    *,
    is_qat: bool,
    custom_config: CustomConfig,
    make_fixed: Any,
    prepare_standalone: PrepareOne | None = None,
) -> GraphModule:
    """``prepare_standalone(module, settings, qconfig)`` prepares a standalone submodule
    (needed when ``custom_config`` names any)."""
    gm = trace(model, custom_config, example_inputs)
    linear_from_addmm(gm, torch.addmm, torch.nn.functional.linear)
    in_eval = _eval_modules(gm) if is_qat else {}
    frozen_fused: set[str] = set()
    if is_qat:
        gm.train()
    modules = dict(gm.named_modules(remove_duplicate=False))
    nodes = list(gm.graph.nodes)
    qconfigs = assign_qconfigs(nodes, modules, qconfig_mapping, type(model))
    _warn_unmatched(unmatched_names(model, qconfig_mapping))
    notes: dict[Node, str] = {}

    def on_fused(new: Node, old: list[Node]) -> None:
        _fused_qconfig(gm, modules, new, old, qconfigs, notes)
        if any(isinstance(in_eval.get(str(node.target)), _BatchNorm) for node in old):
            frozen_fused.add(str(new.target))

    fuse_graph(gm, backend_config, is_qat, on_fused)
    custom_calls = swap_observed(gm, qconfigs, custom_config)
    modules = dict(gm.named_modules(remove_duplicate=False))
    nodes = list(gm.graph.nodes)
    tensor_nodes = _tensor_nodes(gm, example_inputs)
    # after the probe run, which must not reach the standalone modules' observers
    standalone_calls = (
        swap_standalone(gm, qconfigs, custom_config, prepare_standalone)
        if prepare_standalone is not None
        else {}
    )
    modules = dict(gm.named_modules(remove_duplicate=False))
    observed_calls = {node: call.qconfig for node, call in custom_calls.items() if call.static}
    stays_float = kept_float(gm, lambda node: _carries_values(node, tensor_nodes))
    annotations, decisions, entries = annotate_with_backend_config(
        nodes, modules, backend_config, qconfigs, tensor_nodes, notes, observed_calls, stays_float
    )
    annotate_standalone_inputs(standalone_calls, qconfigs, annotations, entries)
    _observe_quantized_outputs(gm, annotations, qconfigs, qconfig_mapping, custom_config)
    _check_float32(annotations)
    _attach_qconfigs(gm, qconfigs)
    if is_qat:
        _swap_qat_modules(gm, decisions)
        _restore_eval(gm, in_eval, frozen_fused)
    plan = insert_observers(gm, annotations, make_fixed, recompile=False)  # renaming does
    for node in gm.graph.nodes:
        if node.name not in entries:  # the observers just inserted
            entries[node.name] = Entry(node.name, "observer", Status.NOT_AN_OP)
    state = PreparedState(
        backend_name,
        backend_config,
        kernels,
        is_qat,
        tuple(Accepted.of(decision) for decision in decisions),
        name_observers_per_call(gm, plan.points_of_observer),
        custom_calls=tuple(custom_calls.values()),
        quantized_inputs=custom_config.input_quantized_indexes,
        quantized_outputs=custom_config.output_quantized_indexes,
        qconfig_mapping=qconfig_mapping,
        standalone_calls=tuple(standalone_calls.values()),
    )
    gm.meta[STATE_KEY] = state
    report = Report(backend_name, [entries[n.name] for n in gm.graph.nodes])
    _warn_skipped(attach_report(gm, report), qconfigs)
    return gm


def _warn_unmatched(names: list[str]) -> None:
    if names:
        warnings.warn(
            f"prepare: qconfig_mapping sets a QConfig for {'; '.join(names)}, which names "
            "no module of the model: nothing gets that QConfig from it. Module names are "
            "those of model.named_modules().",
            QCoreWarning,
            stacklevel=caller_stacklevel(),
        )


def _check_float32(annotations: dict[Node, QuantizationAnnotation]) -> None:
    """FX's quantize ops take float32: a bfloat16, float16 or float64 value to be
    quantized is an error here, not at the converted model's first call."""
    for node, annotation in annotations.items():
        for point in annotation.quantized_values(node):
            meta = point.meta.get("tensor_meta")
            dtype = getattr(meta, "dtype", torch.float32)
            if dtype.is_floating_point and dtype != torch.float32:
                raise ValueError(
                    f"model: node {point.name!r} computes in {dtype} and would be quantized; "
                    "FX quantization takes float32 models (torch.ao's convert refuses the "
                    "others too). Call model.float() and pass float32 inputs, or, for a "
                    "bfloat16 or float16 model, use prepare_pt2e, which keeps the model's "
                    "dtype around its int8 ops."
                )


def _observe_quantized_outputs(
    gm: GraphModule,
    annotations: dict[Node, QuantizationAnnotation],
    qconfigs: dict[Node, Any],
    qconfig_mapping: Any,
    custom_config: CustomConfig,
) -> None:
    """An output asked for as int8 (``output_quantized_idxs``) is always observed,
    as torch.ao does, even when the op before it stays float."""
    if not custom_config.output_quantized_indexes:
        return
    values = output_values(gm)
    for index in custom_config.output_quantized_indexes:
        node = values[index] if index < len(values) else None
        if not isinstance(node, Node):
            continue  # convert names the index in its error
        annotation = annotations.setdefault(node, QuantizationAnnotation(_annotated=True))
        qconfig = qconfigs.get(node) or getattr(qconfig_mapping, "global_qconfig", None)
        if annotation.output_qspec is None and getattr(qconfig, "activation", None) is not None:
            annotation.output_qspec = spec_from_ctr(qconfig.activation, {})


def _warn_skipped(report: Report, qconfigs: dict[Node, Any]) -> None:
    """One warning, only for operators the user asked to quantize that stay float."""
    asked = {node.name for node, qconfig in qconfigs.items() if qconfig is not None}
    # an op left float because quantizing it gains nothing is no loss to warn about
    skipped = [e for e in report.float if e.node in asked and not gains_nothing(e.reason)]
    if not skipped:
        return
    kinds = sorted({e.op for e in skipped})
    warnings.warn(
        f"{len(skipped)} operator(s) with a QConfig stay in float on backend "
        f"{report.backend!r} ({', '.join(kinds[:5])}{', ...' if len(kinds) > 5 else ''}). "
        "qcore.explain(model), on the model this call returns, gives the reason for each.",
        QCoreWarning,
        stacklevel=caller_stacklevel(),  # the user's prepare_fx, quantize, ... call
    )
