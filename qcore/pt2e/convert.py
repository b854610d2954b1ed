"""convert_pt2e: observers -> quantize/dequantize on plain integer tensors, then kernels.

The reference form (``lower=False``, and always for a torchao Quantizer) is
``torch.ops.quantized_decomposed`` quantize -> dequantize with constants folded
(:mod:`qcore.pt2e.qdq`), the form torchao's own convert gives. For lowering, activation
observers become ``qcore.ops`` pairs (the engine's shared conversion, bit-exact
with fbgemm) and constants are folded the same way; then each
``dequantize -> linear/conv [-> post-ops] [-> quantize]`` becomes a
:class:`~qcore.engine.reference.ReferenceModule` and the backend's kernels
replace it (``qcore.engine.lower``), as on the FX path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore import ops
from qcore.engine.backend_annotator import is_quantized_dtype
from qcore.engine.constants import Constants
from qcore.engine.convert import _replace_observer
from qcore.engine.explain import (
    POST_OPS_KEY,
    Entry,
    Report,
    Status,
    attach_report,
    report_of,
)
from qcore.engine.lower import lower as lower_to_kernels
from qcore.engine.lower import quantize_float32
from qcore.engine.observe import DerivedObserver
from qcore.engine.reference import QParams, qparams_of
from qcore.engine.scripting import keep_model_when_scripted
from qcore.observers.nonfinite import (
    check_observers,
    constants_observed,
    warn_of_nonfinite_weights,
)
from qcore.pt2e.graph import refuse_train_eval
from qcore.pt2e.guard import ExportedCodeTracer, run_guard_first
from qcore.pt2e.patterns import packet
from qcore.pt2e.prepare import (
    PT2E_STATE_KEY,
    Pt2eState,
    control_flow_subgraphs,
    quiet_deepcopy,
)
from qcore.pt2e.qdq import duplicate_dequantize, fold_quantized_constants, replace_observer
from qcore.pt2e.reference import UNFUSED_ADD_KEY, to_reference_modules
from qcore.pt2e.train_eval import move_exported_model_to_eval

__all__ = ["convert_pt2e"]

aten = torch.ops.aten


def _state_of(model: Any) -> Pt2eState:
    state = (
        getattr(model, "meta", {}).get(PT2E_STATE_KEY) if isinstance(model, GraphModule) else None
    )
    if state is None:
        raise TypeError(
            f"model: got {type(model).__name__}; expected a model returned by "
            "qcore.prepare_pt2e or qcore.prepare_qat_pt2e"
        )
    return state


def _qparams(gm: GraphModule, observer: Any, full_range: bool) -> QParams:
    if isinstance(observer, DerivedObserver):
        scale, zero_point = observer.derive(gm)
        scale, zero_point = scale.reshape(-1), zero_point.reshape(-1)
        per_channel = scale.numel() > 1 or observer.ch_axis is not None
        info = torch.iinfo(ops.storage_dtype(observer.dtype))
        quant_min = info.min if observer.quant_min is None else observer.quant_min
        quant_max = info.max if observer.quant_max is None else observer.quant_max
        axis = (observer.ch_axis or 0) if per_channel else None
        return QParams(scale, zero_point, observer.dtype, quant_min, quant_max, axis=axis)
    return qparams_of(observer, full_range=full_range)


def _fold_constant(
    gm: GraphModule, node: Node, observer: Any, full_range: bool, constants: Constants
) -> None:
    """Quantize a constant now; the graph keeps its integers and a dequantize."""
    graph, source = gm.graph, node.args[0]
    qparams = _qparams(gm, observer, full_range)
    value = constants.value(source)
    base = f"{source.name}_{node.target}"
    limits = (qparams.quant_min, qparams.quant_max, qparams.dtype)
    with graph.inserting_before(node):
        if qparams.per_channel:
            integer = ops.quantize_per_channel(
                value, qparams.scale, qparams.zero_point, qparams.axis, *limits
            )
            gm.register_buffer(f"{base}_scale", qparams.scale.to(torch.float32))
            gm.register_buffer(f"{base}_zero_point", qparams.zero_point.to(torch.int64))
            args: tuple = (
                graph.get_attr(f"{base}_scale"),
                graph.get_attr(f"{base}_zero_point"),
                qparams.axis,
                *limits,
            )
            function = ops.dequantize_per_channel
        else:
            scale = float(qparams.scale.reshape(-1)[0])
            zero_point = int(qparams.zero_point.reshape(-1)[0])
            integer = ops.quantize_per_tensor(value, scale, zero_point, *limits)
            args, function = (scale, zero_point, *limits), ops.dequantize_per_tensor
        gm.register_buffer(f"{base}_int", integer)
        dequantized = graph.call_function(function, (graph.get_attr(f"{base}_int"), *args))
    node.replace_all_uses_with(dequantized)
    graph.erase_node(node)


def _is_static(observer: Any) -> bool:
    dtype = getattr(observer, "dtype", torch.float32)
    return (
        is_quantized_dtype(dtype)
        and dtype != torch.float16
        and not getattr(observer, "is_dynamic", False)
        and type(observer).__name__ != "ReuseInputObserver"
    )


def _to_eval(gm: GraphModule) -> None:
    """Batch norms and dropouts exported in training mode (QAT) switch to eval
    (attention's dropout and the feature and alpha dropouts too)."""
    move_exported_model_to_eval(gm)
    for node in list(gm.graph.nodes):
        # a training batch norm's count of batches: in eval it would count every call
        if _counts_batches(node) and not node.users:
            gm.graph.erase_node(node)


def _counts_batches(node: Node) -> bool:
    counter = node.args[0] if node.args else None
    return (
        packet(node) is aten.add_
        and isinstance(counter, Node)
        and counter.op == "get_attr"
        and str(counter.target).endswith("num_batches_tracked")
    )


def _switch_to_eval(gm: GraphModule) -> None:
    """Observers and fake-quants to eval, without the model's own ``eval`` (an
    exported model's may refuse to run); exported batch norms and dropouts too."""
    for module in gm.modules():
        module.training = False
    _to_eval(gm)


def _convert_graph(gm: GraphModule, state: Pt2eState, *, decomposed: bool, fold: bool) -> None:
    """Replace ``gm``'s observers (in place), then those of its control-flow subgraphs."""
    modules = dict(gm.named_modules())
    names = set(state.observer_names)
    constants = Constants(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node.target not in names:
            continue
        observer = modules[node.target]
        if decomposed:
            replace_observer(gm, node, observer, state.full_range)
        elif _is_static(observer) and node.args[0] in constants:
            _fold_constant(gm, node, observer, state.full_range, constants)
        else:
            _replace_observer(gm, node, observer, full_range=state.full_range)
    if decomposed and fold:
        fold_quantized_constants(gm)
    if decomposed:
        duplicate_dequantize(gm)
    for name in control_flow_subgraphs(gm):
        sub = gm.get_submodule(name)
        sub_state = sub.meta.get(PT2E_STATE_KEY) if isinstance(sub, GraphModule) else None
        if sub_state is not None:
            _convert_graph(sub, sub_state, decomposed=decomposed, fold=fold)
            del sub.meta[PT2E_STATE_KEY]
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    _delete_unused_constants(gm)
    gm.recompile()


def convert_reference(
    prepared: GraphModule,
    *,
    decomposed: bool = True,
    fold_quantize: bool = True,
    why: str = "reference form (not lowered)",
) -> GraphModule:
    """A converted copy in reference form.

    ``decomposed``: ``torch.ops.quantized_decomposed`` quantize/dequantize (the
    ecosystem's reference form, :mod:`qcore.pt2e.qdq`); else ``qcore.ops``, the
    form the lowering starts from. ``fold_quantize``: quantize constant inputs
    (weights) now, keeping their integers.
    """
    state = _state_of(prepared)
    # NaN statistics are an error naming the node; skipped NaN/inf one warning
    graphs = _observed_graphs(prepared, state)
    check_observers(*graphs, stage="convert_pt2e")
    warn_of_nonfinite_weights(constants_observed(*graphs), "convert_pt2e")
    memo = {id(state): state}  # its kernels are not copied only to be dropped below
    gm = quiet_deepcopy(prepared, memo)
    _switch_to_eval(gm)
    _convert_graph(gm, state, decomposed=decomposed, fold=fold_quantize)
    run_guard_first(gm)
    # A converted model is done with the kernels (engine functions, which do
    # not pickle): torch.save takes it whole.
    del gm.meta[PT2E_STATE_KEY]
    attach_report(gm, _reference_report(report_of(prepared), gm, state, why))
    return gm


def _observed_graphs(gm: GraphModule, state: Pt2eState, prefix: str = "") -> list[tuple]:
    """(prefix, graph, observer names) of ``gm`` and of its control-flow subgraphs."""
    graphs = [(prefix, gm, state.observer_names)]
    for name in control_flow_subgraphs(gm):
        sub = gm.get_submodule(name)
        sub_state = sub.meta.get(PT2E_STATE_KEY) if isinstance(sub, GraphModule) else None
        if sub_state is not None:
            graphs += _observed_graphs(sub, sub_state, f"{prefix}.{name}" if prefix else name)
    return graphs


def _delete_unused_constants(gm: GraphModule) -> None:
    """Drop the parameters and buffers no ``get_attr`` reads any more: the float
    weights folded into integers, the integers a kernel packed. Tensors of modules
    the graph calls are theirs to keep."""
    read = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    # Modules the graph calls, and subgraphs it passes to control flow (scan): their own.
    called = {node.target for node in gm.graph.nodes if node.op == "call_module"}
    called |= {name for name in read if isinstance(_get_or_none(gm, name), torch.nn.Module)}
    named = [
        *gm.named_parameters(remove_duplicate=False),
        *gm.named_buffers(remove_duplicate=False),
    ]
    for name, _ in named:
        owner_name, _, attr = name.rpartition(".")
        owner_path = owner_name.split(".") if owner_name else []
        inside_called = any(
            ".".join(owner_path[:depth]) in called for depth in range(1, len(owner_path) + 1)
        )
        if name in read or inside_called:
            continue
        owner = gm.get_submodule(owner_name) if owner_name else gm
        if hasattr(owner, attr):
            delattr(owner, attr)


def _get_or_none(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _compute_dtype(gm: GraphModule) -> torch.dtype:
    """The floating-point dtype the graph's inputs and ops compute in (float32 if none)."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op in ("placeholder", "call_function") and isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.dtype != torch.float32:
                return value.dtype
    return torch.float32


def _reference_report(
    prepared: Report | None, gm: GraphModule, state: Pt2eState, why: str
) -> Report:
    by_name = {entry.node: entry for entry in (prepared.entries if prepared else [])}
    entries = []
    for node in gm.graph.nodes:
        entry = by_name.get(node.name) or Entry(node.name, "quantize/dequantize", Status.NOT_AN_OP)
        if entry.status is Status.QUANTIZED:
            entry = entry.with_status(Status.REFERENCE, why)
        entries.append(entry)
    return Report(state.backend_name, entries)


def convert_pt2e(
    model: GraphModule, lower: bool | None = None, *, fold_quantize: bool = True
) -> GraphModule:
    """Convert a calibrated (or trained) prepared model; returns a new module.

    ``lower=False`` gives the reference form: ``torch.ops.quantized_decomposed``
    quantize/dequantize on plain integer tensors around the float ops, as
    torchao's own convert produces (for torch.compile, torch.export, ExecuTorch).
    ``lower=True`` lets the backend's kernels replace the patterns they support
    (the kernels :func:`qcore.convert_fx` uses). The default lowers for a backend
    name or a qcore Quantizer, and gives the reference form for a torchao
    Quantizer (which names no backend). ``fold_quantize=False`` keeps the
    weights' quantize ops in the reference form instead of their integers.
    ``qcore.explain`` tells what ran where.

    Example::

        >>> converted = qcore.convert_pt2e(prepared)              # int8 kernels
        >>> reference = qcore.convert_pt2e(prepared, lower=False) # for torch.compile
    """
    if lower is not None and not isinstance(lower, bool):
        raise TypeError(f"lower: got {lower!r}; expected True, False or None")
    if not isinstance(fold_quantize, bool):
        raise TypeError(f"fold_quantize: got {fold_quantize!r}; expected True or False")
    state = _state_of(model)
    if lower and state.foreign:
        raise ValueError(
            f"lower=True: the model was prepared with a torchao Quantizer "
            f"({state.backend_name}), which names no backend whose kernels could take it; "
            "convert with lower=False, or prepare with a backend name or a qcore Quantizer"
        )
    if lower is None:
        lower = not state.foreign
    computes_in = _compute_dtype(model)
    if lower and computes_in != torch.float32:
        # torch's int8 kernels take and return float32 around them
        why = f"torch's int8 kernels take float32 models; this one computes in {computes_in}"
        return refuse_train_eval(
            convert_reference(model, decomposed=True, fold_quantize=fold_quantize, why=why)
        )
    if not lower:
        return refuse_train_eval(
            convert_reference(model, decomposed=True, fold_quantize=fold_quantize)
        )
    gm = convert_reference(model, decomposed=False)
    report: Report = report_of(gm)
    references = to_reference_modules(gm, {e.node for e in report.reference})
    nodes = {n.name: n for n in gm.graph.nodes}
    kept = [
        e.with_status(Status.FLOAT, nodes[e.node].meta[UNFUSED_ADD_KEY])
        if UNFUSED_ADD_KEY in nodes[e.node].meta
        else e
        for e in report.entries
        if e.node in nodes
    ]
    absorbed = {e.node: e for e in report.entries if e.node not in nodes}
    for name, pattern in references.items():
        kept.append(Entry(name, pattern, Status.REFERENCE, "no kernel took it", pattern))
        for post in nodes[name].meta.get(POST_OPS_KEY, []):
            op = absorbed[post].op if post in absorbed else post
            kept.append(Entry(post, op, Status.REFERENCE, f"a post-op of {name}", pattern))
    attach_report(gm, Report(state.backend_name, kept))
    lowered = lower_to_kernels(
        gm, state.kernels, state.backend_name, observed_ranges=not state.full_range
    )
    quantize_float32(lowered)
    _delete_unused_constants(lowered)
    lowered._tracer_cls = ExportedCodeTracer  # torch.load re-traces with it
    # its kernels hand torch.jit.script other modules: script a copy, not the model
    return keep_model_when_scripted(refuse_train_eval(lowered))
