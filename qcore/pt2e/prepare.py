"""prepare_pt2e / prepare_qat_pt2e: annotate a torch.export graph, insert observers.

The quantizer is a :class:`qcore.Quantizer` or a backend name. For a name, the
backend plugin's own Quantizer (``qcore_backend_quantizer`` hook) is used if it
has one, else the one compiled from its BackendConfig. Observers are inserted
by the engine both front doors share (``qcore.engine.observe``).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.config.errors import describe
from qcore.engine.explain import Entry, Report, Status, attach_report
from qcore.engine.observe import ObserverPlan, insert_observers
from qcore.pt2e.backend_quantizer import PATTERN_KEY, REASON_KEY, BackendQuantizer
from qcore.pt2e.fold import fold_conv_bn
from qcore.pt2e.graph import annotations_of, as_exported_module, is_tensor_node
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


def quiet_deepcopy(gm: GraphModule, memo: dict | None = None) -> GraphModule:
    """A deep copy; torch 2.13's pytree warns (FutureWarning) copying export's specs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return copy.deepcopy(gm, memo)


def resolve_quantizer(quantizer: Any, is_qat: bool) -> tuple[Quantizer, str, tuple]:
    """(quantizer, backend name, kernels) for a Quantizer or a backend name."""
    if isinstance(quantizer, str):
        from qcore.plugin import get_backend

        backend = get_backend(quantizer)
        own = backend.quantizer(is_qat=is_qat)
        if own is not None and not isinstance(own, Quantizer):
            raise TypeError(
                f"backend {backend.name!r}: qcore_backend_quantizer returned {describe(own)}; "
                "expected a qcore.Quantizer"
            )
        chosen = own or BackendQuantizer(backend.config, is_qat=is_qat, backend_name=backend.name)
        return chosen, backend.name, backend.kernels
    if isinstance(quantizer, Quantizer):
        name = getattr(quantizer, "backend_name", None) or type(quantizer).__name__
        kernels: tuple = tuple(getattr(quantizer, "kernels", ()) or ())
        if not kernels and getattr(quantizer, "backend_name", None):
            # a backend's own Quantizer (X86Quantizer) lowers to that backend's kernels
            kernels = _installed_kernels(quantizer.backend_name)
        return quantizer, name, kernels
    raise TypeError(
        f"quantizer: got {describe(quantizer)}; expected a qcore.Quantizer or a backend "
        "name such as 'x86'"
    )


def _installed_kernels(name: str) -> tuple:
    from qcore.plugin import BackendLoadError, UnknownBackendError, get_backend

    try:
        return get_backend(name).kernels
    except (UnknownBackendError, BackendLoadError):
        return ()


def _make_fixed(spec: Any) -> torch.nn.Module:
    from qcore.observers import FixedQParamsObserver

    return FixedQParamsObserver(
        scale=spec.scale,
        zero_point=spec.zero_point,
        dtype=spec.dtype,
        quant_min=spec.quant_min if spec.quant_min is not None else 0,
        quant_max=spec.quant_max if spec.quant_max is not None else 255,
    )


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
        if node.op != "call_function" or "val" in node.meta and not is_tensor_node(node):
            # Graph inputs, observers, and ops on sizes or integers (nothing to quantize).
            kind = "observer" if node.target in observer_names else op
            entries.append(Entry(node.name, kind, Status.NOT_AN_OP))
        elif node.meta.get(PATTERN_KEY) or node.meta.get("quantization_annotation"):
            entries.append(
                Entry(node.name, op, Status.QUANTIZED, "", node.meta.get(PATTERN_KEY, ""))
            )
        else:
            reason = node.meta.get(REASON_KEY) or "the quantizer did not annotate it"
            entries.append(Entry(node.name, op, Status.FLOAT, reason))
    return Report(backend, entries)


def _prepare(model: Any, quantizer: Any, is_qat: bool) -> GraphModule:
    gm = quiet_deepcopy(as_exported_module(model))
    chosen, backend_name, kernels = resolve_quantizer(quantizer, is_qat)
    if not is_qat:
        fold_conv_bn(gm)
    gm = chosen.transform_for_annotation(gm)
    gm = chosen.annotate(gm)
    chosen.validate(gm)
    plan = insert_observers(gm, annotations_of(gm), _make_fixed)
    _run_callback(gm, chosen, plan)
    names = tuple(plan.points_of_observer)
    full_range = bool(getattr(chosen, "full_range", False))
    gm.meta[PT2E_STATE_KEY] = Pt2eState(backend_name, kernels, is_qat, names, full_range)
    attach_report(gm, _report(gm, backend_name, set(names)))
    replace_export_guard(gm)
    return gm


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
