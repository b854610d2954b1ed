"""quantize_pt2e: prepare, calibrate and convert an exported model in one call,
optionally within an accuracy budget.

The accuracy budget runs the search ``qcore.quantize`` runs on the FX path
(:func:`qcore.accuracy.keep_float_for_budget`) over a PT2E :data:`~qcore.keep_float.Build`:
the candidates are the exported graph's quantized conv/linear ops, each named by
the module that calls it (``node.meta["nn_module_stack"]``); a build keeps those
modules float with ``QConfigMapping.set_module_name(path, None)`` in the backend's
:class:`~qcore.pt2e.BackendQuantizer`, then calibrates and converts. Models that
torch.fx cannot trace (transformers' BERT, ViT, Wav2Vec2) get the same search.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.config.errors import QCoreWarning, describe
from qcore.engine.explain import Status, report_of
from qcore.engine.qconfigs import node_scope
from qcore.keep_float import mark_kept_float, sole_readers
from qcore.pt2e.backend_quantizer import BackendQuantizer
from qcore.pt2e.convert import convert_pt2e
from qcore.pt2e.graph import as_exported_module
from qcore.pt2e.patterns import WEIGHTED, packet
from qcore.pt2e.prepare import prepare_pt2e

__all__ = ["activation_followers", "module_path", "quantize_pt2e", "weighted_layer_paths"]


def module_path(node: Node) -> str:
    """The path of the innermost module whose forward called ``node`` ("" for the root)."""
    return node_scope(node, type(None))[0]


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def weighted_layer_paths(prepared: GraphModule) -> list[str]:
    """Module paths of the conv/linear ops ``prepared`` quantizes, in graph order.

    An op the root module calls itself (path "") is no candidate: no module name
    keeps it float. A module called twice is one candidate.
    """
    report = report_of(prepared)
    quantized = {e.node for e in report.quantized} if report is not None else set()
    paths = [
        module_path(node)
        for node in prepared.graph.nodes
        if packet(node) in WEIGHTED and node.name in quantized
    ]
    return list(dict.fromkeys(path for path in paths if path))


def activation_followers(prepared: GraphModule, paths: list[str]) -> dict[str, tuple[str, ...]]:
    """For each candidate path, the activation modules only its conv/linear feeds and
    that read nothing else (a Hardswish or ReLU module after it), in a chain up to the
    next layer: each a module of its own, so ``set_module_name`` keeps just it float.
    Keeping a layer float while its activation still quantizes would leave the
    rounding where it was (:func:`qcore.keep_float.followers` on the FX path)."""
    report = report_of(prepared)
    if report is None:
        return {}
    quantized = {e.node for e in report.ops if e.status in (Status.QUANTIZED, Status.REFERENCE)}
    wanted = set(paths)
    nodes_at: dict[str, list[Node]] = {}
    for node in prepared.graph.nodes:
        if node.op == "call_function":
            nodes_at.setdefault(module_path(node), []).append(node)
    found: dict[str, list[str]] = {}
    for node in prepared.graph.nodes:
        leader = module_path(node)
        if packet(node) not in WEIGHTED or leader not in wanted or node.name not in quantized:
            continue
        for user in sole_readers(node):
            if user.op == "call_module":  # the observer between them: go on
                continue
            path = module_path(user)
            alone = [n.name for n in nodes_at.get(path, [])] == [user.name]
            if user.name not in quantized or path in wanted or not path or not alone:
                break
            found.setdefault(leader, []).append(path)
    return {path: tuple(dict.fromkeys(names)) for path, names in found.items()}


def _mark_paths(model: GraphModule, reasons: Mapping[str, str]) -> GraphModule:
    """:func:`qcore.keep_float.mark_kept_float` with each module path in ``reasons``
    read as the float ops of the converted graph that module called; each reason
    names its module (the graph's node names are aten's: ``linear_1``)."""
    report = report_of(model)
    if report is None or not reasons:
        return model
    floats = {e.node for e in report.entries if e.status == Status.FLOAT}
    by_node: dict[str, str] = {}
    for node in model.graph.nodes:
        if node.op != "call_function" or node.name not in floats:
            continue
        path = module_path(node)
        # the longest kept path around the node names its reason
        owner = max((p for p in reasons if _under(path, p)), key=len, default=None)
        if owner is not None:
            by_node[node.name] = f"{reasons[owner]} (module {owner})"
    return mark_kept_float(model, by_node)


def quantize_pt2e(
    model: Any,
    backend: str,
    calibration_data: Iterable[Any],
    *,
    qconfig_mapping: Any = None,
    input_fn: Callable[[Any], Any] | None = None,
    accuracy_budget: Any = None,
) -> GraphModule:
    """Post-training quantization of an exported model in one call: prepare with
    ``backend``'s :class:`BackendQuantizer` (``qconfig_mapping``, default the
    backend's), calibrate on ``calibration_data`` (batches read as
    ``qcore.quantize`` reads them, ``input_fn`` too), convert to its kernels.
    ``model`` (``torch.export.export(m, inputs).module()`` or the ExportedProgram)
    is not modified. The quantizer is the one compiled from the backend's
    BackendConfig, whose QConfigMapping can name modules: where a plugin ships a
    Quantizer of its own (x86's ``X86Quantizer``, which ``prepare_pt2e(model,
    "x86")`` uses), this recipe differs from it (on x86: a conv's output before a
    residual add is quantized here, fused into oneDNN's conv-add there).

    ``accuracy_budget`` (``qcore.MinSQNR(db=...)``, a number of dB, or
    ``qcore.MetricBudget``) keeps the fewest conv/linear modules float that bring
    the model within the budget, by the search ``qcore.quantize`` runs
    (:mod:`qcore.accuracy`); ``qcore.explain`` gives each kept one the measure
    with it float and int8. Where nothing meets the budget it warns
    (``qcore.AccuracyBudgetNotMet``) and returns the closest model.

    Example::

        >>> exported = torch.export.export(bert.eval(), (ids,)).module()
        >>> quantized = qcore.quantize_pt2e(exported, "x86", batches,
        ...                                 accuracy_budget=qcore.MinSQNR(db=30.0))
        >>> print(qcore.explain(quantized))   # kept float (accuracy budget): ...
    """
    from qcore import accuracy
    from qcore.api import default_mapping_for
    from qcore.calibration import calibrate, calibration_calls
    from qcore.config.qconfig import as_qconfig_mapping

    if not isinstance(backend, str):
        raise TypeError(
            f"backend: got {describe(backend)}; expected an installed backend's name, "
            "e.g. 'x86' (the search builds its QConfigMapping; for a Quantizer object "
            "use qcore.prepare_pt2e)"
        )
    budget = accuracy.as_budget(accuracy_budget)
    float_model = as_exported_module(model, require_export=True)
    if isinstance(calibration_data, Iterable) and not isinstance(
        calibration_data, (torch.Tensor, dict, str, bytes)
    ):
        calibration_data = list(calibration_data)  # read once per candidate
    calls = list(calibration_calls(float_model, calibration_data, input_fn))
    base = qconfig_mapping if qconfig_mapping is not None else default_mapping_for(backend, False)

    def build(mapping: Any) -> GraphModule:
        prepared = prepare_pt2e(float_model, BackendQuantizer.for_backend(backend, mapping))
        calibrate(prepared, calls)
        return prepared

    prepared = build(base)
    converted = convert_pt2e(prepared)
    if budget is None:
        return converted
    candidates = weighted_layer_paths(prepared)
    float_with = activation_followers(prepared, candidates)
    del prepared

    def build_keeping_float(paths: frozenset[str]) -> GraphModule:
        if not paths:
            return converted
        mapping = as_qconfig_mapping(base).copy()
        for path in sorted({*paths, *(f for p in paths for f in float_with.get(p, ()))}):
            mapping.set_module_name(path, None)
        # the first conversion already said what stays float
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QCoreWarning)
            return convert_pt2e(build(mapping))

    gauge = accuracy.gauge_for(budget, float_model, calibration_data, input_fn)
    return accuracy.keep_float_for_budget(
        build_keeping_float, candidates, gauge, float_with, mark=_mark_paths
    )
