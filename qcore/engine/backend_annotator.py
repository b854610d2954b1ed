"""The BackendConfig front door: matches + QConfigs -> annotations and reasons.

For each pattern match, the QConfig of its nodes is checked against the
pattern's DTypeConfigs; the first one it satisfies decides how the match's
inputs and output are observed (per ObservationType). Everything not
quantized gets a reason for ``qcore.explain``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.fx import Node
from torch.fx.passes.shape_prop import TensorMetadata

from qcore.config import BackendConfig, BackendPatternConfig, DTypeConfig, ObservationType
from qcore.config.compat import find_accepting_dtype_config
from qcore.config.pattern import format_pattern
from qcore.engine.custom_config import UnsupportedSetting
from qcore.engine.explain import Entry, Status, op_name
from qcore.engine.float_islands import (
    FLOAT_ISLAND_REASON,
    REUSES_FLOAT_REASON,
    float_input_reason,
    float_islands,
    fused_only_ops,
)
from qcore.engine.match import Match, find_matches, is_match_all, node_op
from qcore.engine.qconfigs import pattern_qconfig
from qcore.engine.reference import observed_qparams
from qcore.observers import (
    FakeQuantize,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PlaceholderObserver,
)
from qcore.ops import storage_dtype
from qcore.quantizer.spec import (
    DerivedQuantizationSpec,
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    SharedQuantizationSpec,
)

__all__ = [
    "Decision",
    "annotate_with_backend_config",
    "returns_container",
    "reuse_observed_inputs",
]

_QUANTIZED_DTYPES = {
    torch.quint8,
    torch.qint8,
    torch.qint32,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.quint4x2,
    torch.float16,
}


def is_quantized_dtype(dtype: Any) -> bool:
    return dtype in _QUANTIZED_DTYPES


@dataclass
class Decision:
    """An accepted match: the pattern will be quantized with ``dtype_config``."""

    match: Match
    qconfig: Any
    dtype_config: DTypeConfig


def spec_from_ctr(ctr: Any, cache: dict[int, QuantizationSpec]) -> QuantizationSpec:
    """The QuantizationSpec an observer constructor describes (cached by constructor)."""
    key = id(ctr)
    if key not in cache:
        observer = ctr()
        # The constructor already carries its range (and reduce_range): the
        # spec leaves quant_min/quant_max unset so they are not applied twice.
        cache[key] = QuantizationSpec(
            dtype=observer.dtype,
            observer_or_fake_quant_ctr=ctr,
            is_dynamic=bool(getattr(observer, "is_dynamic", False)),
        )
    return cache[key]


def _flat_node_args(node: Node) -> list[tuple[int, Node]]:
    """(argument position, node) for every Node among the args, lists flattened."""
    found = []
    for index, arg in enumerate(node.args):
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        for item in items:
            if isinstance(item, Node):
                found.append((index, item))
    return found


def _fusion_hint(node: Node, backend: BackendConfig, modules: Mapping, matched: set) -> str:
    """When a fusion rule covers part of an unfused chain, name the missing rule."""
    chain = [node]
    while True:
        prev = chain[0].args[0] if chain[0].args else None
        if not (isinstance(prev, Node) and prev.op.startswith("call") and len(prev.users) == 1):
            break
        if prev in matched or len(chain) >= 3:
            break
        chain.insert(0, prev)
    while len(chain) < 3 and len(chain[-1].users) == 1:
        nxt = next(iter(chain[-1].users))
        if not nxt.op.startswith("call") or nxt in matched:
            break
        chain.append(nxt)
    ops = [node_op(n, modules) for n in chain]
    rules = [c.pattern for c in backend.configs if c.fuser_method is not None and c.pattern]
    for rule in rules:
        rule_ops = list(rule) if isinstance(rule, tuple) else [rule]
        iterator = iter(ops)
        if len(rule_ops) < len(ops) and all(op in iterator for op in rule_ops):
            if rule_ops[0] == ops[0] and rule_ops[-1] == ops[-1]:
                return (
                    f"; no fusion rule for {format_pattern(tuple(ops))} in backend "
                    f"{backend.name!r} (it fuses {format_pattern(rule)})"
                )
    return ""


def annotate_with_backend_config(
    nodes: list[Node],
    modules: Mapping[str, torch.nn.Module],
    backend: BackendConfig,
    qconfigs: Mapping[Node, Any],
    tensor_nodes: set[Node],
    fusion_notes: Mapping[Node, str],
    custom_calls: Mapping[Node, Any] | None = None,
    kept_float: Mapping[Node, str] | None = None,
) -> tuple[dict[Node, QuantizationAnnotation], list[Decision], dict[str, Entry]]:
    """Annotations for the accepted matches, the decisions, and an Entry per node.

    ``custom_calls``: observed custom module calls and their QConfigs; their tensor
    inputs and output are observed with the QConfig's activation (torch.ao's rule).
    ``kept_float``: nodes that stay float whatever the config, with the reason
    (:func:`qcore.engine.kept_float.kept_float`); a match holding one stays float.
    """
    custom_calls = custom_calls or {}
    kept_float = kept_float or {}
    # Which argument is the weight: a fused pattern (F.linear, F.relu) says nothing,
    # torch.ao asks the root op's own config (F.linear: weight 1, bias 2), so does qcore.
    op_indexes = {
        c.pattern: c._input_type_to_index
        for c in backend.configs
        if c._input_type_to_index and c.pattern is not None and not isinstance(c.pattern, tuple)
    }
    quant_configs = [c for c in backend.configs if c.dtype_configs]
    matches = find_matches(nodes, quant_configs, modules)
    annotations: dict[Node, QuantizationAnnotation] = {}
    decisions: list[Decision] = []
    entries: dict[str, Entry] = {}
    spec_cache: dict[int, QuantizationSpec] = {}
    seen: set[int] = set()
    fused_only = fused_only_ops(
        (c.pattern_complex_format for c in backend.configs),
        lambda op: () if is_match_all(op) else (op,),
    )
    after_float: list[Node] = []  # such ops with no match: float if what feeds them is

    for node in nodes:
        op = op_name(node, modules)
        if not node.op.startswith("call"):
            entries[node.name] = Entry(node.name, op, Status.NOT_AN_OP)
            continue
        if node in custom_calls:
            _annotate_custom_call(node, custom_calls[node], tensor_nodes, annotations, spec_cache)
            entries[node.name] = Entry(
                node.name,
                op,
                Status.QUANTIZED,
                "",
                f"custom module {type(modules[node.target]).__name__}",
            )
            continue
        match = matches.get(node)
        if match is not None and match.output not in tensor_nodes:
            match = None  # list arithmetic (``[1] * n``), a bool mask: nothing to quantize
        kept = next((n for n in match.nodes if n in kept_float), None) if match else None
        if kept is not None:
            entries[node.name] = Entry(node.name, op, Status.FLOAT, kept_float[kept])
            continue
        if returns_container(node) and not _quantizes_weights(match):
            # observers take one tensor: it runs in float on what it is given (a dynamic
            # LSTM, whose weights are quantized and its tuple output float, is no such
            # op). One that takes a tuple too (nn.Identity on LSTM's (out, (h, c)))
            # passes it along; one that computes (nn.MultiheadAttention) is a float op.
            if _takes_a_container(node):
                reason = "passes a tuple or list of tensors along, not one tensor"
                entries[node.name] = Entry(node.name, op, Status.NOT_AN_OP, reason)
            else:
                reason = "returns several tensors, which no pattern quantizes: it runs in float"
                entries[node.name] = Entry(node.name, op, Status.FLOAT, reason)
            continue
        if match is None and node not in tensor_nodes:
            reason = "computes no floating-point tensor (a shape, a size, a mask)"
            entries[node.name] = Entry(node.name, op, Status.NOT_AN_OP, reason)
            continue
        if match is None:
            reason = fusion_notes.get(node) or (
                f"no pattern in backend {backend.name!r} matches {op}"
                + _fusion_hint(node, backend, modules, set(matches))
            )
            if qconfigs.get(node) is None and node not in fusion_notes:
                reason = f"no QConfig for {op} in the QConfigMapping"
            elif node not in fusion_notes and node_op(node, modules) in fused_only:
                after_float.append(node)
            entries[node.name] = Entry(node.name, op, Status.FLOAT, reason)
            continue
        pattern = match.config.describe_pattern()
        if id(match) in seen:
            continue
        seen.add(id(match))
        qconfig, reason = _match_qconfig(match, qconfigs)
        if qconfig is None and fusion_notes.get(match.root):
            reason = fusion_notes[match.root]  # its parts' QConfigs differ: say so
        dtype_config = None
        if reason is None:
            dtype_config, rejections = find_accepting_dtype_config(match.config, qconfig)
            if dtype_config is None:
                reason = f"QConfig rejected by pattern {pattern}: " + "; ".join(rejections)
        if reason is None and fusion_notes.get(match.root):
            reason = fusion_notes[match.root]
        reasons_of = dict.fromkeys(match.nodes, reason)
        if qconfig is None and not fusion_notes.get(match.root):
            reasons_of.update(_behind_a_float_root(match, qconfigs, modules))
        for member in match.nodes:
            member_op = op_name(member, modules)
            if reason is not None:
                entries[member.name] = Entry(
                    member.name, member_op, Status.FLOAT, reasons_of[member], pattern
                )
            else:
                entries[member.name] = Entry(member.name, member_op, Status.QUANTIZED, "", pattern)
        if reason is not None:
            continue
        decisions.append(Decision(match, qconfig, dtype_config))
        indexes = match.config._input_type_to_index or op_indexes.get(match.root.target, {})
        _annotate(match, qconfig, dtype_config, tensor_nodes, annotations, spec_cache, indexes)
    reuse_observed_inputs(annotations)
    share_inputs_of_cat(annotations)
    reusing_float = {
        node
        for decision in decisions
        if not _quantizes_weights(decision.match)  # weights are quantized at convert
        and not any(_quantizes(annotations.get(n)) for n in decision.match.nodes)
        for node in decision.match.nodes
    }
    reasons = dict.fromkeys(reusing_float, REUSES_FLOAT_REASON)
    reasons.update(
        dict.fromkeys(float_islands(nodes, annotations, reusing_float), FLOAT_ISLAND_REASON)
    )
    if reasons:
        decisions = [d for d in decisions if d.match.output not in reasons]
        for node, reason in reasons.items():
            entries[node.name] = replace(entries[node.name], status=Status.FLOAT, reason=reason)
    _explain_float_inputs(after_float, tensor_nodes, entries)
    return annotations, decisions, entries


def _explain_float_inputs(
    candidates: list[Node], tensor_nodes: set[Node], entries: dict[str, Entry]
) -> None:
    """An op the backend quantizes only fused into the op before it (``torch.relu``
    after an add) has no pattern of its own: when that op runs in float, the reason
    is its float input, not a missing pattern. ``candidates`` in graph order, so a
    chain of them names the first float layer's reason."""
    for node in candidates:
        inputs = [arg for _, arg in _flat_node_args(node) if arg in tensor_nodes]
        producer = entries.get(inputs[0].name) if len(inputs) == 1 else None
        if producer is None or producer.status is not Status.FLOAT:
            continue
        if not inputs[0].op.startswith("call"):
            continue  # a graph input: quantized where it enters, had the op a pattern
        reason = float_input_reason(producer.node, producer.reason)
        entries[node.name] = replace(entries[node.name], reason=reason)


def _behind_a_float_root(
    match: Match, qconfigs: Mapping[Node, Any], modules: Mapping
) -> dict[Node, str]:
    """When a pattern's root has no QConfig but ops fused after it do (``F.linear`` set
    to None, then ``F.relu``), each runs in float because its input does: they
    would have run in the root's int8 kernel. Empty unless that is so."""
    root = match.root
    if qconfigs.get(root) is not None or all(qconfigs.get(n) is None for n in match.nodes):
        return {}
    reasons = {root: f"no QConfig for {op_name(root, modules)} in the QConfigMapping"}
    for member in reversed(match.nodes):  # forward order: producers first
        if member is root:
            continue
        if qconfigs.get(member) is None:
            reasons[member] = f"no QConfig for {op_name(member, modules)} in the QConfigMapping"
            continue
        producer = next((arg for _, arg in _flat_node_args(member) if arg in reasons), root)
        reasons[member] = float_input_reason(producer.name, reasons[producer])
    return reasons


def _quantizes(annotation: QuantizationAnnotation | None) -> bool:
    return annotation is not None and (
        annotation.output_qspec is not None
        or any(spec is not None for spec in annotation.input_qspec_map.values())
    )


def _quantizes_weights(match: Match | None) -> bool:
    """A match of a module with weights to quantize (a dynamic LSTM). A function's
    config may list weighted dtype configs too (x86's ``add`` shares its list with
    the weighted ops): a tuple sum, ``(out,) + outputs[1:]``, has no weights."""
    return (
        match is not None
        and any(node.op == "call_module" for node in match.nodes)
        and any(config.weight_dtype is not None for config in match.config.dtype_configs)
    )


def _takes_a_container(node: Node) -> bool:
    return any(isinstance(arg, Node) and returns_container(arg) for arg in node.args)


def returns_container(node: Node) -> bool:
    """A tuple, list or dict of values (TensorMetadata is a NamedTuple: one tensor)."""
    meta = node.meta.get("tensor_meta")
    return isinstance(meta, (tuple, list, dict)) and not isinstance(meta, TensorMetadata)


def _spec_at(point: Any, annotations: dict[Node, QuantizationAnnotation]) -> Any:
    """The spec annotated at a point: an edge's input spec, a node's output spec."""
    if isinstance(point, tuple):
        annotation = annotations.get(point[1])
        return annotation.input_qspec_map.get(point[0]) if annotation else None
    annotation = annotations.get(point)
    return annotation.output_qspec if annotation else None


def _root_point(point: Any, annotations: dict[Node, QuantizationAnnotation]) -> Any:
    """The point (node or edge) whose spec ``point``'s SharedQuantizationSpecs end at."""
    seen = set()
    while point not in seen:
        seen.add(point)
        spec = _spec_at(point, annotations)
        if not isinstance(spec, SharedQuantizationSpec):
            return point
        point = spec.edge_or_node
    return point  # shared specs in a cycle


def _resolved(point: Any, annotations: dict[Node, QuantizationAnnotation]) -> Any:
    """The spec a point ends at after following SharedQuantizationSpecs (None if
    unset, or if they go round in a cycle)."""
    if point is None:
        return None
    spec = _spec_at(_root_point(point, annotations), annotations)
    return None if isinstance(spec, SharedQuantizationSpec) else spec


def reuse_observed_inputs(annotations: dict[Node, QuantizationAnnotation]) -> None:
    """torch.ao FX observes an input only when its producer's output is not already
    quantized to the same dtype: the consumer then reads the producer's observer.

    Without this a fixed-qparams op after a conv (conv -> sigmoid) would quantize
    the conv's output with the op's fixed *output* qparams, clipping it to [0, 1),
    and ``x * sigmoid(g)`` would re-observe sigmoid's output for the mul.
    """
    for annotation in annotations.values():
        for producer, spec in list(annotation.input_qspec_map.items()):
            if isinstance(spec, SharedQuantizationSpec) or getattr(spec, "is_dynamic", False):
                continue
            produced = _resolved(producer, annotations)
            if produced is None or getattr(produced, "is_dynamic", False):
                continue
            if getattr(produced, "dtype", None) == getattr(spec, "dtype", None):
                annotation.input_qspec_map[producer] = SharedQuantizationSpec(producer)


def share_inputs_of_cat(annotations: dict[Node, QuantizationAnnotation]) -> None:
    """An op whose output shares its first input's observer and that takes more
    inputs (``torch.cat``): every input shares that observer too, as torch.ao FX
    (which points each input's observer at the first's) and torchao's PT2E (which
    unites an input edge with its producer's output) do.

    An input no quantized op produces (a float op's output, a graph input) had an
    observer of its own: rounded to its scale, then again to the output's (cat of
    two ``cumsum``s: 31.1 dB against float, torch.ao 32.2). One a quantized op
    produces kept that op's: requantized in the cat (two convs: 0.4-1.0 dB below
    torch.ao). Such a producer's observer joins the cat's, unless its spec is not an
    observer's (fixed qparams: sigmoid's 1/256; derived) or of another dtype.
    """
    for node, annotation in annotations.items():
        output = annotation.output_qspec
        if not isinstance(output, SharedQuantizationSpec) or len(annotation.input_qspec_map) < 2:
            continue
        first = output.edge_or_node
        if not (isinstance(first, tuple) and first[1] is node):
            continue
        for producer, spec in list(annotation.input_qspec_map.items()):
            if (producer, node) == first or getattr(spec, "is_dynamic", False):
                continue
            if not isinstance(spec, SharedQuantizationSpec):
                if _resolved(producer, annotations) is None:  # nothing quantized it
                    annotation.input_qspec_map[producer] = SharedQuantizationSpec(first)
                continue
            _join(producer, first, annotations)


def _join(point: Any, first: Any, annotations: dict[Node, QuantizationAnnotation]) -> None:
    """Make ``point``'s observer ``first``'s where both end at plain observers alike.

    The point's own spec changes, not the one it shares: torch.ao FX swaps the
    observer after the cat's producer and leaves the ones before it. A relu6
    sharing its conv's observer then reads the cat's; the conv keeps observing its
    own pre-activation range (joining that, 0.4 dB below torch.ao on a MobileNet's
    two-branch block)."""
    target = _root_point(first, annotations)
    if _root_point(point, annotations) == target:
        return
    mine, theirs = _resolved(point, annotations), _spec_at(target, annotations)
    if type(mine) is not QuantizationSpec or type(theirs) is not QuantizationSpec:
        return  # fixed qparams, derived, or nothing: not an observer to share

    def kind(spec: QuantizationSpec) -> tuple:
        return spec.dtype, spec.qscheme, spec.quant_min, spec.quant_max, spec.is_dynamic

    if mine.is_dynamic or kind(mine) != kind(theirs):
        return
    if isinstance(point, tuple):
        annotations[point[1]].input_qspec_map[point[0]] = SharedQuantizationSpec(target)
    else:
        annotations[point].output_qspec = SharedQuantizationSpec(target)


def _annotate_custom_call(
    node: Node,
    qconfig: Any,
    tensor_nodes: set[Node],
    annotations: dict[Node, QuantizationAnnotation],
    cache: dict[int, QuantizationSpec],
) -> None:
    if _holds_dict(node.meta.get("tensor_meta")):
        raise UnsupportedSetting(
            f"custom module {node.target!r}: its output holds a dict; qcore swaps custom "
            "module classes whose forward returns a tensor or a (nested) tuple or list of "
            "them: leave it float with non_traceable_module_class instead"
        )
    spec = spec_from_ctr(qconfig.activation, cache)
    annotation = annotations.setdefault(node, QuantizationAnnotation(_annotated=True))
    for _, arg in _flat_node_args(node):
        if arg in tensor_nodes:
            annotation.input_qspec_map[arg] = spec
    # A tuple output (torch.ao's LSTM: (out, (h, c))) is not observed here: the
    # quantized module gives each element its own qparams (convert reads them).
    meta = node.meta.get("tensor_meta")
    if isinstance(meta, TensorMetadata) or (meta is None and node in tensor_nodes):
        annotation.output_qspec = spec


def _holds_dict(meta: Any) -> bool:
    if isinstance(meta, dict):
        return True
    is_container = isinstance(meta, (tuple, list)) and not isinstance(meta, TensorMetadata)
    return is_container and any(_holds_dict(item) for item in meta)


def _match_qconfig(match: Match, qconfigs: Mapping[Node, Any]) -> tuple[Any, str | None]:
    found = [qconfigs.get(node) for node in match.nodes]
    if all(other is None for other in found):
        return None, "no QConfig for this pattern in the QConfigMapping"
    others = [qconfigs.get(node) for node in match.nodes if node is not match.root]
    qconfig = pattern_qconfig(qconfigs.get(match.root), others)
    if qconfig is None:
        return None, (
            f"the nodes of pattern {match.config.describe_pattern()} have different QConfigs; "
            "give them the same one"
        )
    return qconfig, None


def _reuses_input(spec: QuantizationSpec) -> bool:
    """torch.ao's ReuseInputObserver: the op keeps its input's quantization."""
    ctr = spec.observer_or_fake_quant_ctr
    inner = getattr(getattr(ctr, "p", ctr), "func", ctr)
    return getattr(inner, "__name__", "") == "ReuseInputObserver"


def _share_with_producer(
    match: Match, tensor_nodes: set[Node], annotations: dict[Node, QuantizationAnnotation]
) -> None:
    inputs = [arg for _, arg in _flat_node_args(match.root) if arg in tensor_nodes]
    producer = annotations.get(inputs[0]) if inputs else None
    if producer is not None and producer.output_qspec is not None:
        output = annotations.setdefault(match.output, QuantizationAnnotation(_annotated=True))
        output.output_qspec = SharedQuantizationSpec(inputs[0])


def _observation_type(config: BackendPatternConfig, root: Node, tensor_nodes: set) -> Any:
    by_count = config._num_tensor_args_to_observation_type
    if by_count:
        count = sum(1 for _, arg in _flat_node_args(root) if arg in tensor_nodes)
        return by_count.get(count, config.observation_type)
    return config.observation_type


_SCALAR_PRODUCTS = {operator.mul, torch.mul, "mul"}
_SCALAR_SUMS = {operator.add, torch.add, "add"}


def _fake_quantizes(spec: QuantizationSpec) -> bool:
    return hasattr(spec.observer_or_fake_quant_ctr(), "fake_quant_enabled")


def _has_fixed_qparams(node: Node, annotations: dict[Node, QuantizationAnnotation]) -> bool:
    """Whether ``node``'s output is quantized with fixed qparams (tanh, sigmoid)."""
    return _is_fixed(_resolved(node, annotations))


def _is_fixed(spec: Any) -> bool:
    if isinstance(spec, FixedQParamsQuantizationSpec):
        return True
    ctr = getattr(spec, "observer_or_fake_quant_ctr", None)
    inner = getattr(getattr(ctr, "p", ctr), "func", ctr)
    return "FixedQParams" in getattr(inner, "__name__", "")


def _input_spec(act_spec: QuantizationSpec, cache: dict[int, QuantizationSpec]) -> Any:
    """The spec of a pattern's activation input: its QConfig's, except for an op with
    fixed qparams (sigmoid, tanh, hardsigmoid, softmax). Those are its *output's*:
    an input nothing quantized feeds (``sigmoid(x.cumsum(1))``, a standalone
    module's float output) quantized with them was clipped to [0, 1) (10.8 dB, as
    torch.ao). It is observed from its values instead, in the same dtype and range
    (an input already quantized reads its producer's observer, as before)."""
    if not _is_fixed(act_spec):
        return act_spec
    fixed = act_spec.observer_or_fake_quant_ctr()
    key = (_fake_quantizes(act_spec), act_spec.dtype, fixed.quant_min, fixed.quant_max)
    if key not in _OBSERVED_INPUTS:
        observer = MinMaxObserver.with_args(
            dtype=act_spec.dtype, quant_min=fixed.quant_min, quant_max=fixed.quant_max
        )
        if key[0]:
            observer = FakeQuantize.with_args(
                observer=MovingAverageMinMaxObserver,
                dtype=act_spec.dtype,
                quant_min=fixed.quant_min,
                quant_max=fixed.quant_max,
            )
        _OBSERVED_INPUTS[key] = observer
    return spec_from_ctr(_OBSERVED_INPUTS[key], cache)


# Observer constructors for fixed-qparams ops' inputs, one per kind (specs are cached
# by constructor identity).
_OBSERVED_INPUTS: dict[tuple, Any] = {}


def _scalar_qparams(
    root: Node,
    tensor_nodes: set[Node],
    dtype: torch.dtype,
    annotations: dict[Node, QuantizationAnnotation],
) -> Any:
    """How ``x * c`` (a tensor times a Python number) derives its output qparams from
    ``x``'s, else None.

    ``x + c`` keeps sharing ``x``'s observer, as torch.ao does: one observer sees
    both tensors, so neither is clipped. Deriving a shifted zero point instead
    (torch's add_scalar) moves every value by the same fraction of a step, a bias
    that a following linear layer sums coherently (measured: up to 15 dB worse).
    Only an ``x`` whose observer cannot widen gets the shift: fixed qparams (tanh),
    or derived ones (``x * 0.5 + 3``). Sharing a product's derived qparams, which
    observe nothing, clipped the sum (15.7 dB against torch.ao's 43.8). On 80
    generated chains with such a sum, shifting and observing the sum anew scored
    the same on average (39.1 and 38.9 dB, lowered); the shift stays on x's grid,
    where a sum of values already on it rounds the same for every element, and
    it is what torch's add_scalar kernel computes, so the kernel needs no requantize.
    """
    operands = _scalar_operands(root, tensor_nodes)
    if operands is None:
        return None
    number, tensor = operands
    info = torch.iinfo(storage_dtype(dtype))
    if root.target in _SCALAR_PRODUCTS:  # exact from x's qparams, observed or derived
        return ScaledQParams(number, info.min, info.max)
    if root.target in _SCALAR_SUMS and _cannot_widen(tensor, annotations):
        return ShiftedQParams(number, info.min, info.max)
    return None


def _scalar_operands(root: Node, tensor_nodes: set[Node]) -> tuple[float, Node] | None:
    """(c, x) of ``x + c``, ``x * c`` and kin (a tensor and a nonzero Python number),
    else None."""
    if root.target not in _SCALAR_PRODUCTS and root.target not in _SCALAR_SUMS:
        return None
    if len(root.args) != 2 or root.kwargs:
        return None
    numbers_ = [a for a in root.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    tensors = [a for a in root.args if isinstance(a, Node) and a in tensor_nodes]
    if len(numbers_) != 1 or len(tensors) != 1 or numbers_[0] == 0:
        return None
    return float(numbers_[0]), tensors[0]


def _cannot_widen(node: Node, annotations: dict[Node, QuantizationAnnotation]) -> bool:
    """``node``'s qparams come from no observer that sees its values: fixed ones
    (tanh, sigmoid), or derived from another's (``x * 0.5``)."""
    if isinstance(_resolved(node, annotations), DerivedQuantizationSpec):
        return True
    return _has_fixed_qparams(node, annotations)


@dataclass(frozen=True)
class ScaledQParams:
    """The qparams of ``x * factor``, as torch's mul_scalar kernel computes them from
    ``x``'s: exact, nothing requantized.

    torch.ao shares ``x``'s qparams with ``x * 0.5``, which wastes a bit of the
    output's range in its reference form; its mul_scalar kernel then scales
    exactly. Deriving the output's qparams makes the reference exact as well.
    The range is the dtype's, as the kernel's: for a positive factor the integers
    are ``x``'s own, so they stay in whatever narrower range ``x`` was given.
    """

    factor: float
    quant_min: int
    quant_max: int

    def __call__(self, observers: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        scale, zero_point = observed_qparams(observers[0])
        scale = scale * abs(self.factor)
        if self.factor < 0:  # the integer grid flips around the dtype's range
            zero_point = self.quant_min + self.quant_max - zero_point
        return scale, zero_point


@dataclass(frozen=True)
class ShiftedQParams:
    """The qparams of ``x + offset``, as torch's add_scalar kernel computes them: the
    zero point moves by ``round(offset / scale)``; where it would leave the dtype's
    range, the range is widened to keep zero representable.

    Used where ``x`` has fixed qparams (tanh, sigmoid): sharing its observer, which
    cannot widen to the sum's values, would clip ``tanh(x) + 3`` to [-1, 1).
    """

    offset: float
    quant_min: int
    quant_max: int

    def __call__(self, observers: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        scale, zero_point = observed_qparams(observers[0])
        quant_min, quant_max = self.quant_min, self.quant_max
        shifted = zero_point - torch.round(self.offset / scale)
        span = quant_max - quant_min
        below, above = shifted < quant_min, shifted > quant_max
        scale = torch.where(below, (quant_max - shifted) / span * scale, scale)
        scale = torch.where(above, (shifted - quant_min) / span * scale, scale)
        zero_point = torch.clamp(shifted, quant_min, quant_max)
        return scale, zero_point.to(torch.int64)


# A bias rounded to float16, with torch.ao's observer class for torch.ao's QConfigs
# (module constants: specs are cached by constructor identity).
_AO_FLOAT16_BIAS = torch.ao.quantization.observer.PlaceholderObserver.with_args(dtype=torch.float16)
_FLOAT16_BIAS = PlaceholderObserver.with_args(dtype=torch.float16)


def _float16_bias_spec(
    act_spec: QuantizationSpec | None,
    qconfig: Any,
    dtype_config: DTypeConfig,
    cache: dict[int, QuantizationSpec],
) -> QuantizationSpec | None:
    """The spec of a bias argument (F.linear's, F.conv's), or None to leave it float.

    torch.ao FX rounds the bias to float16 where the op's activation and weight are
    static float16 (its prepare's ``bias_obs_or_fq_ctr``); qcore does so where the
    accepted DTypeConfig also says ``bias_dtype=torch.float16``. Every other bias
    stays float: int8 kernels quantize it themselves."""
    if act_spec is None or act_spec.dtype != torch.float16 or act_spec.is_dynamic:
        return None
    if dtype_config.bias_dtype != torch.float16 or qconfig.weight is None:
        return None
    if spec_from_ctr(qconfig.weight, cache).dtype != torch.float16:
        return None
    from_torch_ao = type(qconfig.weight()).__module__.startswith("torch.ao.")
    return spec_from_ctr(_AO_FLOAT16_BIAS if from_torch_ao else _FLOAT16_BIAS, cache)


def _annotate(
    match: Match,
    qconfig: Any,
    dtype_config: DTypeConfig,
    tensor_nodes: set[Node],
    annotations: dict[Node, QuantizationAnnotation],
    cache: dict[int, QuantizationSpec],
    input_type_to_index: Mapping[str, int],
) -> None:
    config = match.config
    observation = _observation_type(config, match.root, tensor_nodes)
    if observation is ObservationType.INPUT_OUTPUT_NOT_OBSERVED:
        return
    members = match.node_set
    weight_index = input_type_to_index.get("weight")
    bias_index = input_type_to_index.get("bias")
    act_spec = None
    if is_quantized_dtype(dtype_config.input_dtype) and qconfig.activation is not None:
        act_spec = spec_from_ctr(qconfig.activation, cache)
    if act_spec is not None and _reuses_input(act_spec):
        _share_with_producer(match, tensor_nodes, annotations)
        return
    first_edge = None
    for node in reversed(match.nodes):  # forward order: the root first
        annotation = annotations.setdefault(node, QuantizationAnnotation(_annotated=True))
        for index, arg in _flat_node_args(node):
            if arg in members or arg not in tensor_nodes:
                continue
            if node is match.root and index == bias_index:
                bias_spec = _float16_bias_spec(act_spec, qconfig, dtype_config, cache)
                if bias_spec is not None:
                    annotation.input_qspec_map[arg] = bias_spec
                continue
            if node is match.root and index == weight_index:
                if is_quantized_dtype(dtype_config.weight_dtype) and qconfig.weight is not None:
                    annotation.input_qspec_map[arg] = spec_from_ctr(qconfig.weight, cache)
                continue
            if act_spec is not None:
                if getattr(act_spec, "is_dynamic", False) and (node, index) != (match.root, 0):
                    # torch.ao FX quantizes a dynamic pattern's first input alone (its
                    # is_zeroth_arg): a recurrent layer's hidden state enters float.
                    continue
                annotation.input_qspec_map[arg] = _input_spec(act_spec, cache)
                first_edge = first_edge or (arg, node)
    output = annotations.setdefault(match.output, QuantizationAnnotation(_annotated=True))
    if observation is ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT:
        # A derived observer only computes qparams: QAT must fake-quantize in training.
        derivable = act_spec is not None and not _fake_quantizes(act_spec)
        derive = (
            _scalar_qparams(match.root, tensor_nodes, act_spec.dtype, annotations)
            if derivable
            else None
        )
        if (
            first_edge is not None
            and not derivable
            and act_spec is not None
            and _scalar_operands(match.root, tensor_nodes) is not None
        ):
            # QAT: one fake quant shared by x and x + 3 (or x * 0.5) tracks neither
            # range, and training would learn against the clipped one: the result
            # gets a fake quant of its own, which the kernel requantizes to.
            output.output_qspec = act_spec
        elif first_edge is not None and derive is not None:
            output.output_qspec = DerivedQuantizationSpec(
                derived_from=[first_edge],
                derive_qparams_fn=derive,
                dtype=act_spec.dtype,
                quant_min=derive.quant_min,
                quant_max=derive.quant_max,
            )
        elif first_edge is not None:
            output.output_qspec = SharedQuantizationSpec(first_edge)
    elif observation is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT:
        if is_quantized_dtype(dtype_config.output_dtype) and qconfig.activation is not None:
            output.output_qspec = spec_from_ctr(qconfig.activation, cache)
