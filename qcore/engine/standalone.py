"""Standalone modules: torch.ao's submodules quantized as models of their own.

A submodule named in ``prepare_custom_config``'s ``standalone_module_names`` (or
of a class in ``standalone_module_classes``) is traced as a leaf of its parent,
and prepared with its own QConfigMapping, example inputs, custom config and
backend (each defaulting to the parent's). Its custom config's
``input_quantized_idxs``/``output_quantized_idxs`` are its interface:

- a quantized input is observed in the parent, with the parent's QConfig for the
  call, and the standalone module takes the parent's int8 tensor as is: inside
  it, that input carries a :class:`ParentQParamsObserver`, given the parent's
  qparams at convert (no second observer, no requantize);
- a quantized output is observed inside the standalone module and leaves it as
  int8; the parent dequantizes it for its float users.

At convert the standalone module is converted with its own state, and the
parent hands it int8 tensors at its quantized inputs.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore import ops
from qcore.config.errors import raise_prefixed
from qcore.engine.backend_annotator import reuse_observed_inputs, spec_from_ctr
from qcore.engine.boundaries import as_quantized, skip_requantize
from qcore.engine.custom_config import CustomConfig, Standalone, UnsupportedSetting
from qcore.engine.explain import Entry, Status
from qcore.engine.observe import OBSERVER_PREFIX
from qcore.observers import FixedQParamsObserver
from qcore.quantizer.spec import QuantizationAnnotation

__all__ = [
    "ParentQParamsObserver",
    "StandaloneCall",
    "annotate_standalone_inputs",
    "convert_standalone_modules",
    "input_qparams",
    "swap_standalone",
]

# (scale, zero_point, quant_min, quant_max, dtype) of a quantized input
InputQParams = tuple[float, int, int, int, torch.dtype]
PrepareOne = Callable[[torch.nn.Module, Standalone, Any], GraphModule]
ConvertOne = Callable[[GraphModule], GraphModule]


class ParentQParamsObserver(FixedQParamsObserver):
    """A standalone module's quantized input: the qparams of the int8 tensor its
    parent passes in, set at the parent's convert; it observes nothing itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given = False

    def give(self, scale: float, zero_point: int) -> None:
        self.scale.fill_(scale)
        self.zero_point.fill_(zero_point)
        self.given = True

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.given:
            raise ValueError(
                "a standalone module's quantized input takes its qparams from its parent "
                "model: convert the parent (convert_fx(parent)), not the standalone module alone"
            )
        return super().calculate_qparams()


@dataclass(frozen=True)
class StandaloneCall:
    """A call of a prepared standalone module, by node name, with its interface."""

    node: str
    target: str
    input_indexes: tuple[int, ...]
    output_indexes: tuple[int, ...]


def _state(prepared: GraphModule) -> Any:
    from qcore.engine.prepare import STATE_KEY

    return prepared.meta[STATE_KEY]


def swap_standalone(
    gm: GraphModule, qconfigs: dict[Node, Any], settings: CustomConfig, prepare_one: PrepareOne
) -> dict[Node, StandaloneCall]:
    """Prepare each standalone submodule called in ``gm`` and put it in place."""
    calls: dict[Node, StandaloneCall] = {}
    prepared: dict[str, GraphModule] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        entry = settings.standalone_for(node.target, module)
        if entry is None and node.target not in prepared:
            continue
        if node.target not in prepared:
            try:
                prepared[node.target] = prepare_one(module, entry, qconfigs.get(node))
            except Exception as error:
                raise_prefixed(error, _entry_name(settings, node.target, module))
            _take_parent_qparams(prepared[node.target])
            _set_module(gm, node.target, prepared[node.target])
        state = _state(prepared[node.target])
        calls[node] = StandaloneCall(
            node.name, node.target, state.quantized_inputs, state.quantized_outputs
        )
    return calls


def _entry_name(settings: CustomConfig, name: str, module: torch.nn.Module) -> str:
    """The custom-config entry that made ``name`` standalone, as torch.ao's dict keys it."""
    if name in settings.standalone_names:
        return f"prepare_custom_config.standalone_module_name[{name!r}]"
    cls = type(module)
    return (
        f"prepare_custom_config.standalone_module_class[{cls.__module__}.{cls.__qualname__}] "
        f"(module {name!r})"
    )


def _set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


def _take_parent_qparams(prepared: GraphModule) -> None:
    """The observers of the quantized inputs become ParentQParamsObservers."""
    placeholders = [node for node in prepared.graph.nodes if node.op == "placeholder"]
    for index in _state(prepared).quantized_inputs:
        if index >= len(placeholders):
            continue  # convert names the index in its error
        for user in placeholders[index].users:
            if user.op != "call_module" or not str(user.target).startswith(OBSERVER_PREFIX):
                continue
            observer = prepared.get_submodule(user.target)
            given = ParentQParamsObserver(
                1.0,
                0,
                dtype=observer.dtype,
                qscheme=getattr(observer, "qscheme", torch.per_tensor_affine),
                quant_min=getattr(observer, "quant_min", None) or 0,
                quant_max=getattr(observer, "quant_max", None) or 255,
            )
            _set_module(prepared, user.target, given)


def annotate_standalone_inputs(
    calls: dict[Node, StandaloneCall],
    qconfigs: dict[Node, Any],
    annotations: dict[Node, QuantizationAnnotation],
    entries: dict[str, Entry],
) -> None:
    """The parent observes a standalone module's quantized inputs with its QConfig
    for the call (the producer's observer, where it has one, serves)."""
    cache: dict = {}
    for node, call in calls.items():
        # its operators are in its own report, not the parent's
        entries[node.name] = Entry(
            node.name,
            "standalone module",
            Status.NOT_AN_OP,
            f"a standalone module: qcore.explain(model.{call.target}) reports its operators",
        )
        if not call.input_indexes:
            continue
        qconfig = qconfigs.get(node)
        if qconfig is None or qconfig.activation is None:
            raise UnsupportedSetting(
                f"prepare_custom_config.standalone_module: {call.target!r} takes quantized "
                f"inputs {list(call.input_indexes)} (input_quantized_idxs) but has no QConfig in "
                "the parent's QConfigMapping to observe them with; give it one"
            )
        spec = spec_from_ctr(qconfig.activation, cache)
        annotation = annotations.setdefault(node, QuantizationAnnotation(_annotated=True))
        for index in call.input_indexes:
            arg = node.args[index] if index < len(node.args) else None
            if isinstance(arg, Node):
                annotation.input_qspec_map[arg] = spec
    reuse_observed_inputs(annotations)


def input_qparams(
    reference: GraphModule, calls: tuple[StandaloneCall, ...]
) -> dict[str, dict[int, InputQParams]]:
    """In the parent's reference form, the qparams of each quantized input."""
    nodes = {node.name: node for node in reference.graph.nodes}
    found: dict[str, dict[int, InputQParams]] = {}
    for call in calls:
        node = nodes.get(call.node)
        if node is None:
            continue
        found[call.node] = {}
        for index in call.input_indexes:
            arg = node.args[index] if index < len(node.args) else None
            is_dequantize = (
                isinstance(arg, Node)
                and arg.op == "call_function"
                and arg.target is ops.dequantize_per_tensor
            )
            if not is_dequantize:
                raise UnsupportedSetting(
                    f"prepare_custom_config.standalone_module: input {index} of {call.target!r} "
                    "is quantized (input_quantized_idxs) but reaches it in float in the parent "
                    f"(from {getattr(arg, 'name', arg)!r}); its QConfig there must quantize it "
                    "per tensor, or drop the index"
                )
            _, scale, zero_point, quant_min, quant_max, dtype = arg.args
            found[call.node][index] = (scale, zero_point, quant_min, quant_max, dtype)
    return found


def convert_standalone_modules(
    prepared: GraphModule,
    converted: GraphModule,
    calls: tuple[StandaloneCall, ...],
    qparams: dict[str, dict[int, InputQParams]],
    convert_one: ConvertOne,
) -> None:
    """Convert each standalone module of ``converted`` and wire its int8 interface."""
    if not calls:
        return  # most models: no pass over the graph, no recompile
    nodes = {node.name: node for node in converted.graph.nodes}
    done: dict[str, GraphModule] = {}
    for call in calls:
        node = nodes.get(call.node)
        if node is None:
            continue
        given = qparams.get(call.node, {})
        if call.target not in done:
            done[call.target] = _convert_with(
                prepared.get_submodule(call.target), given, convert_one
            )
            _set_module(converted, call.target, done[call.target])
        args = list(node.args)
        for index in call.input_indexes:
            args[index] = as_quantized(
                converted, args[index], f"standalone module {call.target!r} input {index}"
            )
        node.args = tuple(args)
        _dequantize_outputs(converted, node, call.output_indexes)
    converted.graph.eliminate_dead_code()
    converted.recompile()


def _convert_with(
    prepared: GraphModule, given: dict[int, InputQParams], convert_one: ConvertOne
) -> GraphModule:
    """Convert a copy whose ParentQParamsObservers hold the parent's qparams; the
    lowered form then takes the parent's int8 tensor without requantizing it."""
    prepared = copy.deepcopy(prepared)
    placeholders = [node for node in prepared.graph.nodes if node.op == "placeholder"]
    for index, (scale, zero_point, *_) in given.items():
        for user in placeholders[index].users:
            if user.op == "call_module":
                observer = prepared.get_submodule(user.target)
                if isinstance(observer, ParentQParamsObserver):
                    observer.give(scale, zero_point)
    converted = convert_one(prepared)
    _skip_requantize(converted, given)
    return converted


def _skip_requantize(converted: GraphModule, given: dict[int, InputQParams]) -> None:
    """The inputs arrive with exactly the given qparams: no requantize after them."""
    placeholders = [node for node in converted.graph.nodes if node.op == "placeholder"]
    for index, (scale, zero_point, _, _, dtype) in given.items():
        skip_requantize(converted, placeholders[index], scale, zero_point, dtype)
    converted.graph.eliminate_dead_code()
    converted.recompile()


def _dequantize_outputs(gm: GraphModule, node: Node, indexes: tuple[int, ...]) -> None:
    """The parent's users get float: a dequantize after each quantized output."""
    if not indexes:
        return
    users = list(node.users)
    picks = [u for u in users if u.op == "call_function" and u.target is operator.getitem]
    if users and len(picks) == len(users):  # a tuple output, taken apart
        points = [u for u in picks if u.args[1] in indexes]
    else:
        points = [node] if 0 in indexes else []
    for point in points:
        point_users = list(point.users)
        with gm.graph.inserting_after(point):
            dequantized = gm.graph.call_method("dequantize", (point,))
        for user in point_users:
            user.replace_input_with(point, dequantized)
