"""prepare_pt2e / prepare_qat_pt2e: annotate a torch.export graph, insert observers.

The quantizer is a :class:`qcore.Quantizer` or a backend name. For a name, the
backend plugin's own Quantizer (``qcore_backend_quantizer`` hook) is used if it
has one, extended by what other distributions add to that backend, else the one
compiled from its BackendConfig; "native" is always compiled from the union
(:mod:`qcore.pt2e.extended`). Observers are inserted by the engine both front
doors share (``qcore.engine.observe``).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.config.errors import QCoreWarning, caller_stacklevel, describe
from qcore.engine.explain import Entry, Report, Status, attach_report
from qcore.engine.observe import ObserverPlan, insert_observers
from qcore.observers import register_with_torchao
from qcore.observers.fake_quantize import fixed_qparams_module
from qcore.pt2e.aliasing import make_writes_visible
from qcore.pt2e.backend_quantizer import PATTERN_KEY, REASON_KEY
from qcore.pt2e.fold import fold_conv_bn, fold_linear_bn
from qcore.pt2e.foreign import (
    ForeignQuantizer,
    check_no_tensor_kwargs,
    is_foreign_quantizer,
    observer_like_torchao,
)
from qcore.pt2e.graph import (
    annotations_of,
    as_exported_module,
    is_tensor_node,
    refuse_train_eval,
)
from qcore.pt2e.guard import replace_export_guard
from qcore.pt2e.patterns import packet
from qcore.quantizer.quantizer import Quantizer

__all__ = ["PT2E_STATE_KEY", "Pt2eState", "prepare_pt2e", "prepare_qat_pt2e", "resolve_quantizer"]

PT2E_STATE_KEY = "qcore_pt2e_state"


@dataclass
class Pt2eState:
    """What convert_pt2e needs: the backend's kernels and the observers' names."""

    backend_name: str
    kernels: tuple
    is_qat: bool
    observer_names: tuple[str, ...]
    full_range: bool = False
    """Quantize over the dtype's whole range (QConfig semantics), not the observer's."""
    foreign: bool = False
    """Prepared with a torchao Quantizer: converts to the reference form, as torchao does."""


def quiet_deepcopy(gm: GraphModule, memo: dict | None = None) -> GraphModule:
    """A deep copy; torch 2.13's pytree warns (FutureWarning) copying export's specs.

    The nodes' ``meta["val"]`` fake tensors are shared, not copied: they describe
    shapes and dtypes only, and passes (torchao's too) compare them by identity.
    """
    memo = {} if memo is None else memo
    for module in gm.modules():
        if isinstance(module, GraphModule):
            for node in module.graph.nodes:
                value = node.meta.get("val")
                if isinstance(value, torch.Tensor):
                    memo[id(value)] = value
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return copy.deepcopy(gm, memo)


def resolve_quantizer(quantizer: Any, is_qat: bool) -> tuple[Quantizer, str, tuple]:
    """(quantizer, backend name, kernels) for a Quantizer or a backend name."""
    if isinstance(quantizer, str):
        from qcore.plugin import get_backend
        from qcore.pt2e.extended import quantizer_for_backend

        backend = get_backend(quantizer)
        return quantizer_for_backend(backend, is_qat), backend.name, backend.kernels
    if isinstance(quantizer, Quantizer):
        name = getattr(quantizer, "backend_name", None) or type(quantizer).__name__
        kernels: tuple = tuple(getattr(quantizer, "kernels", ()) or ())
        if not kernels and getattr(quantizer, "backend_name", None):
            # a backend's own Quantizer (X86Quantizer) lowers to that backend's kernels
            kernels = _installed_kernels(quantizer.backend_name)
        return quantizer, name, kernels
    if is_foreign_quantizer(quantizer):
        return ForeignQuantizer(quantizer), type(quantizer).__name__, ()
    raise TypeError(
        f"quantizer: got {describe(quantizer)}; expected a qcore.Quantizer, a torchao "
        "Quantizer (an object with annotate/validate methods) or a backend name such as 'x86'"
    )


def _installed_kernels(name: str) -> tuple:
    from qcore.plugin import BackendLoadError, UnknownBackendError, get_backend

    try:
        return get_backend(name).kernels
    except (UnknownBackendError, BackendLoadError):
        return ()


def _run_callback(gm: GraphModule, quantizer: Quantizer, plan: ObserverPlan) -> None:
    """Let the quantizer see (and replace) each point's observer."""
    observers = {point: gm.get_submodule(name) for point, name in plan.observer_of_point.items()}
    seen = dict(observers)
    quantizer.prepare_obs_or_fq_callback(gm, observers)
    for name, points in plan.points_of_observer.items():
        replaced = {id(observers[p]) for p in points if observers[p] is not seen[p]}
        if not replaced:
            continue
        chosen = {id(observers[p]): observers[p] for p in points}
        if len(chosen) != 1:
            listed = ", ".join(
                p.name if isinstance(p, Node) else f"{p[0].name}->{p[1].name}" for p in points
            )
            raise ValueError(
                f"prepare_obs_or_fq_callback replaced the observer of only some of the points "
                f"sharing {name!r} ({listed}); replace it for all of them"
            )
        setattr(gm, name, next(iter(chosen.values())))


def _report(gm: GraphModule, backend: str, observer_names: set[str]) -> Report:
    entries = []
    for node in gm.graph.nodes:
        op = str(packet(node) or node.target)
        if node.op == "call_function" and _returns_float_tensors(node):
            # an LSTM, a GRU, a split: it computes, in float (a quantizer annotates
            # ops of one tensor output); "not an op" hid it from every count
            reason = node.meta.get(REASON_KEY) or "returns several tensors: it runs in float"
            entries.append(Entry(node.name, op, Status.FLOAT, reason))
        elif node.op != "call_function" or "val" in node.meta and not is_tensor_node(node):
            # Graph inputs, observers, and ops on sizes or integers (nothing to quantize).
            kind = "observer" if node.target in observer_names else op
            entries.append(Entry(node.name, kind, Status.NOT_AN_OP))
        elif node.meta.get(PATTERN_KEY) or node.meta.get("quantization_annotation"):
            # A reason on a quantized node says what was not used (qcore.pt2e.extended).
            reason = node.meta.get(REASON_KEY) or ""
            entries.append(
                Entry(node.name, op, Status.QUANTIZED, reason, node.meta.get(PATTERN_KEY, ""))
            )
        else:
            reason = node.meta.get(REASON_KEY) or "the quantizer did not annotate it"
            entries.append(Entry(node.name, op, Status.FLOAT, reason))
    return Report(backend, entries)


def _returns_float_tensors(node: Node) -> bool:
    """A tuple or list of values holding a floating-point tensor."""
    value = node.meta.get("val")
    return isinstance(value, (tuple, list)) and any(
        isinstance(item, torch.Tensor) and item.is_floating_point() for item in value
    )


def _warn_if_nothing_quantized(report: Report) -> None:
    """One warning when the quantizer annotated no op: the converted model would be
    the float model, which torchao gives without a word (SqueezeBERT on x86: its
    linears are 1x1 conv1ds, which X86InductorQuantizer leaves float)."""
    if report.quantized or not report.float:
        return
    kinds = sorted({entry.op for entry in report.float})
    first = report.float[0]
    warnings.warn(
        f"prepare_pt2e: {report.backend!r} quantizes nothing in this model; its "
        f"{len(report.float)} op(s) stay float ({', '.join(kinds[:5])}"
        f"{', ...' if len(kinds) > 5 else ''}), e.g. {first.op}: {first.reason}. "
        "qcore.explain(prepared) gives the reason for each.",
        QCoreWarning,
        stacklevel=caller_stacklevel(),
    )


def control_flow_subgraphs(gm: GraphModule) -> list[str]:
    """Attribute names of the subgraphs ``gm`` runs through control flow: scan's
    combine_fn and while_loop's body_fn, quantized like the graph around them."""
    names = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        index = _SUBGRAPH_ARG.get(node.target)
        if index is None or len(node.args) <= index:
            continue
        sub = node.args[index]
        if isinstance(sub, Node) and sub.op == "get_attr":
            names.append(sub.target)
    return names


_SUBGRAPH_ARG = {
    getattr(torch.ops.higher_order, name): index
    for name, index in (("scan", 0), ("while_loop", 1))
    if hasattr(torch.ops.higher_order, name)
}


def _writes_buffer(consumer: Node, producer: Node, buffers: set[str]) -> bool:
    """Whether ``consumer`` writes in place into ``producer``, a view of a buffer only
    (observing it would make the op write into the observer's output instead)."""
    schema = getattr(consumer.target, "_schema", None) if consumer.op == "call_function" else None
    if schema is None or not consumer.args or consumer.args[0] is not producer:
        return False
    alias = schema.arguments[0].alias_info if schema.arguments else None
    if alias is None or not alias.is_write:
        return False
    seen, stack, found = set(), [producer], False
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            return False  # depends on an input: an ordinary tensor
        found |= node.op == "get_attr" and node.target in buffers
        stack.extend(node.all_input_nodes)
    return found


def _is_tensor_output(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


_QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)


def _check_quantizable_dtypes(annotations: dict) -> None:
    """The quantize ops take float32, bfloat16 and float16: a float64 value to be
    quantized is an error naming it here, not a bare assertion at convert (torchao's
    too)."""
    for node, annotation in annotations.items():
        for point in annotation.quantized_values(node):
            dtype = getattr(point.meta.get("val"), "dtype", torch.float32)
            if dtype.is_floating_point and dtype not in _QUANTIZABLE:
                raise ValueError(
                    f"model: node {point.name!r} computes in {dtype} and would be quantized; "
                    "the quantize ops take float32, bfloat16 and float16 values. Export the "
                    "model in one of those (model.float() and float32 inputs, say)."
                )


def _prepare_graph(
    gm: GraphModule, chosen: Quantizer, is_qat: bool
) -> tuple[GraphModule, ObserverPlan]:
    """Annotate ``gm`` (modified in place, or replaced by the quantizer's transform),
    insert its observers, then prepare its control-flow subgraphs the same way."""
    foreign = isinstance(chosen, ForeignQuantizer)
    make_writes_visible(gm)  # before any quantize/dequantize copies values apart
    if not is_qat:
        fold_conv_bn(gm)
        fold_linear_bn(gm)
    gm = chosen.transform_for_annotation(gm)
    gm = chosen.annotate(gm)
    chosen.validate(gm)
    annotations = annotations_of(gm, foreign=foreign)
    _check_quantizable_dtypes(annotations)
    if foreign:
        check_no_tensor_kwargs(annotations)
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    plan = insert_observers(
        gm,
        annotations,
        partial(fixed_qparams_module, is_qat=is_qat),
        make_observer=partial(observer_like_torchao, is_qat=is_qat) if foreign else None,
        observe_edge=lambda producer, consumer: not _writes_buffer(consumer, producer, buffers),
        observe_output=_is_tensor_output,
        before_rewire=lambda plan: _run_callback(gm, chosen, plan),
    )
    for name in control_flow_subgraphs(gm):
        sub = gm.get_submodule(name)
        if isinstance(sub, GraphModule):
            prepared, sub_plan = _prepare_graph(sub, chosen, is_qat)
            full_range = bool(getattr(chosen, "full_range", False))
            prepared.meta[PT2E_STATE_KEY] = Pt2eState(
                "", (), is_qat, tuple(sub_plan.points_of_observer), full_range, foreign
            )
            owner, _, attr = name.rpartition(".")
            setattr(gm.get_submodule(owner) if owner else gm, attr, prepared)
    return gm, plan


def _prepare(model: Any, quantizer: Any, is_qat: bool) -> GraphModule:
    register_with_torchao()  # its QAT toggles then know qcore's fake quants
    if not isinstance(model, (GraphModule, torch.export.ExportedProgram)):
        as_exported_module(model, require_export=True)  # the model's error comes first
    chosen, backend_name, kernels = resolve_quantizer(quantizer, is_qat)
    foreign = isinstance(chosen, ForeignQuantizer)
    gm = quiet_deepcopy(as_exported_module(model, require_export=not foreign))
    gm, plan = _prepare_graph(gm, chosen, is_qat)
    names = tuple(plan.points_of_observer)
    full_range = bool(getattr(chosen, "full_range", False))
    gm.meta[PT2E_STATE_KEY] = Pt2eState(backend_name, kernels, is_qat, names, full_range, foreign)
    _warn_if_nothing_quantized(attach_report(gm, _report(gm, backend_name, set(names))))
    replace_export_guard(gm)
    return refuse_train_eval(gm)


def prepare_pt2e(model: Any, quantizer: Any) -> GraphModule:
    """Annotate a copy of an exported model with ``quantizer`` and insert observers.

    ``model`` is ``torch.export.export(m, example_inputs).module()`` (or the
    ExportedProgram); ``quantizer`` a :class:`qcore.Quantizer` or a backend name.
    Eval batch norms are folded into the convolutions before them.

    Example::

        >>> exported = torch.export.export(model.eval(), example_inputs).module()
        >>> prepared = qcore.prepare_pt2e(exported, "x86")
        >>> for batch in calibration_data:
        ...     prepared(*batch)
        >>> converted = qcore.convert_pt2e(prepared)
    """
    return _prepare(model, quantizer, is_qat=False)


def prepare_qat_pt2e(model: Any, quantizer: Any) -> GraphModule:
    """Like :func:`prepare_pt2e` for quantization-aware training: a backend name
    gets its QAT QConfigMapping (fake-quantize modules); batch norms are kept
    and train as usual. Train the result, then :func:`qcore.convert_pt2e`.

    Example::

        >>> exported = torch.export.export(model.train(), example_inputs).module()
        >>> prepared = qcore.prepare_qat_pt2e(exported, "x86")
    """
    return _prepare(model, quantizer, is_qat=True)
