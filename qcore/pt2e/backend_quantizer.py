"""A backend's BackendConfig, compiled into a Quantizer for torch.export graphs.

Each pattern config with DTypeConfigs is translated to aten ops
(:mod:`qcore.pt2e.patterns`). Matching goes from the graph's end, larger
patterns first, each node once (as the FX front door). A match is quantized
when the QConfig that applies to it (the backend's default QConfigMapping
unless one is given) satisfies one of the pattern's DTypeConfigs; its inputs,
weight, bias and output are then annotated per the pattern's ObservationType.
Every node left alone gets a reason in ``node.meta["qcore_reason"]``.

Example::

    >>> quantizer = BackendQuantizer.for_backend("mychip")
    >>> prepared = qcore.prepare_pt2e(exported.module(), quantizer)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.config import BackendConfig, BackendPatternConfig, DTypeConfig, ObservationType
from qcore.config.compat import find_accepting_dtype_config
from qcore.config.errors import describe
from qcore.engine.backend_annotator import is_quantized_dtype
from qcore.engine.float_islands import float_input_reason, fused_only_ops
from qcore.engine.kept_float import kept_float
from qcore.engine.reference import observed_qparams
from qcore.pt2e.canonical import canonicalize
from qcore.pt2e.graph import carries_values, is_tensor_node
from qcore.pt2e.patterns import WEIGHTED, aten_ops, aten_pattern, match_aten, packet, pattern_size
from qcore.quantizer.quantizer import ANNOTATION_KEY, Quantizer
from qcore.quantizer.spec import (
    DerivedQuantizationSpec,
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    QuantizationSpecBase,
    SharedQuantizationSpec,
)

__all__ = ["BackendQuantizer", "REASON_KEY", "PATTERN_KEY"]

REASON_KEY = "qcore_reason"
PATTERN_KEY = "qcore_pattern"
_PER_CHANNEL = (torch.per_channel_affine, torch.per_channel_symmetric)


@dataclass
class _Rule:
    pattern: Any
    configs: list[BackendPatternConfig]


def _compile(backend: BackendConfig) -> tuple[list[_Rule], list[str]]:
    """Rules sorted largest first, and the patterns that have no aten form."""
    rules: dict[str, _Rule] = {}
    untranslated = []
    for config in backend.configs:
        if not config.dtype_configs:
            continue
        translated = aten_pattern(config.pattern_complex_format)
        if translated is None:
            untranslated.append(config.describe_pattern())
            continue
        rules.setdefault(repr(translated), _Rule(translated, [])).configs.append(config)
    ordered = sorted(rules.values(), key=lambda rule: -pattern_size(rule.pattern))
    return ordered, untranslated


def _qualname(cls: Any) -> str:
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def _qconfig_for(node: Node, mapping: Any) -> Any:
    """The QConfig for ``node``: global < object type < module name (torch.ao's order)."""
    qconfig = mapping.global_qconfig
    op = packet(node)
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    module_class = _qualname(stack[-1][1]) if stack else None
    for key, value in mapping.object_type_qconfigs.items():
        ops = aten_ops(key)
        if (ops is not None and op in ops and not isinstance(key, type)) or (
            isinstance(key, type) and _qualname(key) == module_class
        ):
            qconfig = value
            break
    path = stack[-1][0] if stack else ""
    while path:
        if path in mapping.module_name_qconfigs:
            return mapping.module_name_qconfigs[path]
        path = path.rsplit(".", 1)[0] if "." in path else ""
    return qconfig


class _Specs:
    """QuantizationSpecs built from a QConfig's constructors, one per constructor."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[QuantizationSpecBase, Any]] = {}

    def of(self, ctr: Any) -> tuple[QuantizationSpecBase, Any]:
        """(spec, a sample observer) for ``ctr``."""
        key = id(ctr)
        if key not in self.cache:
            observer = ctr()
            spec: QuantizationSpecBase
            if type(observer).__name__ == "FixedQParamsObserver":
                scale, zero_point = observer.calculate_qparams()
                spec = FixedQParamsQuantizationSpec(
                    dtype=observer.dtype,
                    scale=float(scale.reshape(-1)[0]),
                    zero_point=int(zero_point.reshape(-1)[0]),
                    quant_min=int(observer.quant_min),
                    quant_max=int(observer.quant_max),
                )
            else:
                # The constructor carries its range (reduce_range too): left unset.
                spec = QuantizationSpec(
                    dtype=observer.dtype,
                    observer_or_fake_quant_ctr=ctr,
                    is_dynamic=bool(getattr(observer, "is_dynamic", False)),
                )
            self.cache[key] = (spec, observer)
        return self.cache[key]


def _product_of_scales(observers: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    act_scale, _ = observed_qparams(observers[0])
    weight_scale, _ = observed_qparams(observers[1])
    scale = (act_scale * weight_scale).to(torch.float32)
    return scale, torch.zeros_like(scale, dtype=torch.int32)


class BackendQuantizer(Quantizer):
    """The Quantizer compiled from ``backend_config`` and a QConfigMapping.

    ``qconfig_mapping=None`` takes the backend plugin's default (QAT's with
    ``is_qat=True``). ``untranslated`` lists the patterns with no aten form.

    As on the FX path (and in torch.ao), observers built from a QConfig choose
    qparams for their own range (``reduce_range`` halves it) while convert
    quantizes over the dtype's full range: ``full_range`` is True.

    ``only_unannotated=True`` runs it after another quantizer
    (:class:`qcore.pt2e.extended.ExtendedQuantizer`): it annotates only nodes the
    other left alone. A match touching an annotated node is recorded in
    ``shadowed`` as (node, pattern); the reason a node stays float goes to
    ``rejected`` as (node, reason), leaving the other quantizer's reason in place.
    """

    full_range = True

    def __init__(
        self,
        backend_config: BackendConfig,
        qconfig_mapping: Any = None,
        *,
        is_qat: bool = False,
        backend_name: str | None = None,
        only_unannotated: bool = False,
    ) -> None:
        if not isinstance(backend_config, BackendConfig):
            raise TypeError(
                f"backend_config: got {describe(backend_config)}; expected a qcore BackendConfig"
            )
        self.backend_config = backend_config
        self.backend_name = backend_name or backend_config.name or "custom"
        self.is_qat = is_qat
        if qconfig_mapping is None:
            from qcore.api import default_mapping_for

            qconfig_mapping = default_mapping_for(self.backend_name, is_qat)
        self.qconfig_mapping = qconfig_mapping
        self.rules, self.untranslated = _compile(backend_config)
        self.fused_only = fused_only_ops(
            (rule.pattern for rule in self.rules),
            lambda item: item if isinstance(item, frozenset) else (),
        )
        self.only_unannotated = only_unannotated
        self.shadowed: list[tuple[Node, str]] = []
        self.rejected: list[tuple[Node, str]] = []

    @classmethod
    def for_backend(cls, name: str, qconfig_mapping: Any = None, *, is_qat: bool = False):
        """The compiled quantizer of the installed backend ``name``."""
        from qcore.plugin import get_backend

        backend = get_backend(name)
        return cls(backend.config, qconfig_mapping, is_qat=is_qat, backend_name=backend.name)

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        """String-padded convs and ``addmm`` linears in the forms the backend's patterns
        and kernels read (:func:`qcore.pt2e.canonicalize`)."""
        canonicalize(model)
        return model

    def annotate(self, model: GraphModule) -> GraphModule:
        matches = self._match(model)
        specs = _Specs()
        done: set[int] = set()
        for node in model.graph.nodes:  # forward, so producers are annotated first
            found = matches.get(node)
            if found is None or id(found) in done:
                continue
            done.add(id(found))
            nodes, config, qconfig, dtype_config = found
            _annotate_match(nodes, config, qconfig, dtype_config, specs, self.qconfig_mapping)
        return model

    def _match(self, model: GraphModule) -> dict[Node, tuple]:
        self.shadowed, self.rejected = [], []
        matched: dict[Node, tuple] = {}
        stays_float = kept_float(model, carries_values)
        for node in reversed(model.graph.nodes):
            if node.op != "call_function" or node in matched:
                continue
            if not _floating_output(node):
                # integer arithmetic (position ids, lengths): no observer takes it
                node.meta[REASON_KEY] = "computes no floating-point tensor (integers, a mask)"
                continue
            if node in stays_float:
                node.meta[REASON_KEY] = stays_float[node]
                continue
            reasons = []
            for rule in self.rules:
                nodes = match_aten(node, rule.pattern)
                if not nodes or any(n in matched or n in stays_float for n in nodes):
                    continue
                if self.only_unannotated and any(_annotated(n) for n in nodes):
                    # Another quantizer has it: record the overlap, leave its annotations.
                    if _annotated(node):
                        self.shadowed.append((node, rule.configs[0].describe_pattern()))
                    continue
                accepted, reason = self._decide(nodes, rule)
                if accepted is None:
                    reasons.append(reason)
                    continue
                for member in nodes:
                    matched[member] = accepted
                    member.meta[PATTERN_KEY] = accepted[1].describe_pattern()
                    member.meta.pop(REASON_KEY, None)  # an earlier quantizer's "why not"
                break
            if node in matched or _annotated(node):
                continue
            if self.only_unannotated:
                if reasons:
                    self.rejected.append((node, reasons[0]))
                continue
            node.meta[REASON_KEY] = (
                reasons[0]
                if reasons
                else (f"no pattern in backend {self.backend_name!r} matches {packet(node)}")
            )
        if not self.only_unannotated:  # else the other quantizer's reasons stand
            self._explain_float_inputs(model, matched)
        return matched

    def _explain_float_inputs(self, model: GraphModule, matched: dict[Node, tuple]) -> None:
        """An op quantized only fused into the op before it (a backend with
        ``linear -> relu`` and no ``relu`` alone) runs in float when that op does:
        the reason is its float input, whichever of its patterns was tried. In graph
        order, so a chain of them names the first float layer's reason."""
        for node in model.graph.nodes:
            if node in matched or packet(node) not in self.fused_only or _annotated(node):
                continue
            if REASON_KEY not in node.meta or _qconfig_for(node, self.qconfig_mapping) is None:
                continue
            inputs = [arg for arg in node.all_input_nodes if is_tensor_node(arg)]
            producer = inputs[0] if len(inputs) == 1 else None
            if producer is None or producer in matched or _annotated(producer):
                continue
            if producer.op == "call_function" and REASON_KEY in producer.meta:
                reason = float_input_reason(producer.name, producer.meta[REASON_KEY])
                node.meta[REASON_KEY] = reason

    def _decide(self, nodes: list[Node], rule: _Rule) -> tuple[tuple | None, str]:
        root = next((n for n in reversed(nodes) if packet(n) in WEIGHTED), nodes[-1])
        qconfig = _qconfig_for(root, self.qconfig_mapping)
        if qconfig is None:
            return None, f"no QConfig for {packet(root)} in the QConfigMapping"
        rejections = []
        for config in rule.configs:
            dtype_config, why = find_accepting_dtype_config(config, qconfig, is_qat=self.is_qat)
            if dtype_config is not None:
                return (nodes, config, qconfig, dtype_config), ""
            rejections += why
        pattern = rule.configs[0].describe_pattern()
        return None, f"QConfig rejected by pattern {pattern}: " + "; ".join(rejections)


def _floating_output(node: Node) -> bool:
    """False for a node export says gives an integer or bool tensor; True otherwise
    (a float tensor, or no single tensor recorded)."""
    value = node.meta.get("val")
    return not isinstance(value, torch.Tensor) or value.is_floating_point()


def _annotate_match(
    nodes: list[Node],
    config: BackendPatternConfig,
    qconfig: Any,
    dtype_config: DTypeConfig,
    specs: _Specs,
    mapping: Any,
) -> None:
    output_node = nodes[0]
    observation = config.observation_type
    if observation is ObservationType.INPUT_OUTPUT_NOT_OBSERVED:
        return
    act = None
    if is_quantized_dtype(dtype_config.input_dtype) and qconfig.activation is not None:
        act, sample = specs.of(qconfig.activation)
        if type(sample).__name__ == "ReuseInputObserver":
            _share_with_producer(output_node)
            return
        if isinstance(act, FixedQParamsQuantizationSpec):
            output = act
            act = None  # inputs: the producer's qparams, else the global activation's
            fallback = mapping.global_qconfig
            if fallback is not None and fallback.activation is not None:
                act = specs.of(fallback.activation)[0]
            _annotate_inputs(nodes, act, None, None, dtype_config, only_unobserved=True)
            _annotation(output_node).output_qspec = output
            return
    weight = None
    if is_quantized_dtype(dtype_config.weight_dtype) and qconfig.weight is not None:
        weight = specs.of(qconfig.weight)
    edges = _annotate_inputs(nodes, act, weight, qconfig, dtype_config, only_unobserved=False)
    output = _annotation(output_node)
    if observation is ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT:
        for producer, consumer in edges[1:]:
            if (producer, consumer) != edges[0]:  # cat((y, y)): y is one edge, the first
                _annotation(consumer).input_qspec_map[producer] = SharedQuantizationSpec(edges[0])
        if edges:
            output.output_qspec = SharedQuantizationSpec(edges[0])
    elif is_quantized_dtype(dtype_config.output_dtype) and act is not None:
        output.output_qspec = act


def _annotated(node: Node) -> bool:
    return node.meta.get(ANNOTATION_KEY) is not None


def _annotation(node: Node) -> QuantizationAnnotation:
    annotation = node.meta.get(ANNOTATION_KEY)
    if annotation is None:
        annotation = node.meta[ANNOTATION_KEY] = QuantizationAnnotation(_annotated=True)
    return annotation


def _output_spec(node: Node) -> Any:
    annotation = node.meta.get(ANNOTATION_KEY)
    return None if annotation is None else annotation.output_qspec


def _share_with_producer(node: Node) -> None:
    producer = next((a for a in node.args if is_tensor_node(a)), None)
    if producer is not None and _output_spec(producer) is not None:
        _annotation(node).output_qspec = SharedQuantizationSpec(producer)


def _annotate_inputs(
    nodes: list[Node],
    act: QuantizationSpecBase | None,
    weight: tuple | None,
    qconfig: Any,
    dtype_config: DTypeConfig,
    *,
    only_unobserved: bool,
) -> list[tuple[Node, Node]]:
    """Annotate the match's input edges; returns the activation edges, in order."""
    members = set(nodes)
    edges = []
    for node in reversed(nodes):  # forward order
        weighted = packet(node) in WEIGHTED
        for index, arg in enumerate(node.args):
            items = arg if isinstance(arg, (list, tuple)) else [arg]
            for item in items:
                if item in members or not is_tensor_node(item):
                    continue
                if weighted and index == 1:
                    if weight is not None:
                        _annotation(node).input_qspec_map[item] = weight[0]
                    continue
                if weighted and index == 2:
                    _annotate_bias(node, item, weight, dtype_config)
                    continue
                if item.op == "get_attr" or act is None:
                    continue  # a parameter of a non-weighted op (layer_norm's weight)
                if only_unobserved and _output_spec(item) is not None:
                    continue
                _annotation(node).input_qspec_map[item] = act
                edges.append((item, node))
    return edges


def _annotate_bias(node: Node, bias: Node, weight: tuple | None, dtype_config: DTypeConfig):
    if weight is None or not is_quantized_dtype(dtype_config.bias_dtype):
        return  # a float bias: the kernel takes it as is
    act_input = node.args[0]
    weight_spec, weight_observer = weight
    per_channel = getattr(weight_observer, "qscheme", None) in _PER_CHANNEL
    _annotation(node).input_qspec_map[bias] = DerivedQuantizationSpec(
        derived_from=[(act_input, node), (node.args[1], node)],
        derive_qparams_fn=_product_of_scales,
        dtype=torch.qint32,
        quant_min=-(2**31),
        quant_max=2**31 - 1,
        qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
        ch_axis=0 if per_channel else None,
    )
