"""convert_pt2e: observers -> quantize/dequantize on plain integer tensors, then kernels.

Activation observers become ``qcore.ops`` quantize -> dequantize pairs (the
engine's shared conversion). Observers of constants (weights, biases) are
folded: the integer tensor is stored and only its dequantize runs. With
``lower=True``, each ``dequantize -> linear/conv [-> post-ops] [-> quantize]`` becomes a
:class:`~qcore.engine.reference.ReferenceModule` and the backend's kernels
replace it (``qcore.engine.lower``), as on the FX path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore import ops
from qcore.engine.backend_annotator import is_quantized_dtype
from qcore.engine.convert import _replace_observer
from qcore.engine.explain import Entry, Report, Status, attach_report, report_of
from qcore.engine.lower import lower as lower_to_kernels
from qcore.engine.observe import DerivedObserver
from qcore.engine.reference import QParams, qparams_of
from qcore.pt2e.patterns import packet
from qcore.pt2e.prepare import PT2E_STATE_KEY, Pt2eState, quiet_deepcopy
from qcore.pt2e.reference import to_reference_modules

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


def _constant(gm: GraphModule, node: Node) -> torch.Tensor:
    owner_name, _, name = node.target.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    return getattr(owner, name).detach()


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


def _fold_constant(gm: GraphModule, node: Node, observer: Any, full_range: bool) -> None:
    """Quantize a constant now; the graph keeps its integers and a dequantize."""
    graph, source = gm.graph, node.args[0]
    qparams = _qparams(gm, observer, full_range)
    value = _constant(gm, source)
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
    """Batch norms and dropouts exported in training mode (QAT) switch to eval."""
    for node in gm.graph.nodes:
        if packet(node) is aten.batch_norm and len(node.args) > 5 and node.args[5]:
            node.args = (*node.args[:5], False, *node.args[6:])
        elif packet(node) is aten.dropout and len(node.args) > 2 and node.args[2]:
            node.args = (*node.args[:2], False, *node.args[3:])


def convert_reference(prepared: GraphModule) -> GraphModule:
    """A converted copy in reference form (decomposed quantize/dequantize)."""
    state = _state_of(prepared)
    # Derived observers keep their spec, which names graph nodes: share it
    # (it is frozen) rather than deep-copy nodes with their fake tensors.
    memo = {
        id(module.spec): module.spec
        for module in prepared.modules()
        if isinstance(module, DerivedObserver)
    }
    memo[id(state)] = state  # its kernels are not copied only to be dropped below
    gm = quiet_deepcopy(prepared, memo)
    gm.eval()
    _to_eval(gm)
    modules = dict(gm.named_modules())
    names = set(state.observer_names)
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node.target not in names:
            continue
        observer = modules[node.target]
        if node.args[0].op == "get_attr" and _is_static(observer):
            _fold_constant(gm, node, observer, state.full_range)
        else:
            _replace_observer(gm, node, observer, full_range=state.full_range)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    _delete_unused_constants(gm)
    gm.recompile()
    # A converted model is done with the kernels (engine functions, which do
    # not pickle): torch.save takes it whole.
    del gm.meta[PT2E_STATE_KEY]
    attach_report(gm, _reference_report(report_of(prepared), gm, state))
    return gm


def _delete_unused_constants(gm: GraphModule) -> None:
    """Drop the parameters and buffers no ``get_attr`` reads any more: the float
    weights folded into integers, the integers a kernel packed. Tensors of modules
    the graph calls are theirs to keep."""
    read = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    called = {node.target for node in gm.graph.nodes if node.op == "call_module"}
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


def _reference_report(prepared: Report | None, gm: GraphModule, state: Pt2eState) -> Report:
    by_name = {entry.node: entry for entry in (prepared.entries if prepared else [])}
    entries = []
    for node in gm.graph.nodes:
        entry = by_name.get(node.name) or Entry(node.name, "quantize/dequantize", Status.NOT_AN_OP)
        if entry.status is Status.QUANTIZED:
            entry = entry.with_status(Status.REFERENCE, "reference form (not lowered)")
        entries.append(entry)
    return Report(state.backend_name, entries)


def convert_pt2e(model: GraphModule, lower: bool = True) -> GraphModule:
    """Convert a calibrated (or trained) prepared model; returns a new module.

    The result holds decomposed quantize/dequantize ops on plain integer
    tensors; with ``lower=True`` (the default) the backend's kernels then
    replace the linear and conv patterns they support, the same kernels as
    :func:`qcore.convert_fx` uses. ``qcore.explain`` tells what ran where.

    Example::

        >>> converted = qcore.convert_pt2e(prepared)              # int8 kernels
        >>> reference = qcore.convert_pt2e(prepared, lower=False) # for torch.compile
    """
    if not isinstance(lower, bool):
        raise TypeError(f"lower: got {lower!r}; expected True or False")
    gm = convert_reference(model)
    if not lower:
        return gm
    state = _state_of(model)
    report: Report = report_of(gm)
    references = to_reference_modules(gm, {e.node for e in report.reference})
    kept = [e for e in report.entries if e.node in {n.name for n in gm.graph.nodes}]
    for name, pattern in references.items():
        kept.append(Entry(name, pattern, Status.REFERENCE, "no kernel took it", pattern))
    attach_report(gm, Report(state.backend_name, kept))
    lowered = lower_to_kernels(gm, state.kernels, state.backend_name)
    _delete_unused_constants(lowered)
    return lowered
