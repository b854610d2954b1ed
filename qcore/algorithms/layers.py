"""Where a prepared graph keeps a conv's or linear's tensors, FX or PT2E.

FX calls a module (or a fused one, whose child "0" holds the weights); PT2E calls
an aten op whose weight and bias are (observed) get_attr nodes. The passes of
``qcore.algorithms`` read and rescale them through :func:`layer_of`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node

from qcore.engine.reference import QParams, qparams_of

__all__ = [
    "InputRecorder",
    "Layer",
    "check_uncalibrated",
    "first_observed",
    "is_observer",
    "is_observer_module",
    "layer_name",
    "layer_of",
    "parameter_reads",
    "positional_batches",
    "record_inputs",
    "single_use_layers",
    "tensor_of",
    "unobserved",
    "weight_qparams",
    "weighted_module",
]

aten = torch.ops.aten

_WEIGHTED_MODULES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear)
_WEIGHTED_FUNCTIONS = {
    aten.conv1d.default: "conv",
    aten.conv2d.default: "conv",
    aten.conv3d.default: "conv",
    aten.linear.default: "linear",
}


@dataclass
class Layer:
    """A weighted op's tensors, wherever the graph keeps them."""

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    groups: int
    is_linear: bool


def weighted_module(module: torch.nn.Module) -> torch.nn.Module | None:
    """The conv/linear a module runs: itself, or a fused module's child "0"."""
    if isinstance(module, _WEIGHTED_MODULES):
        return module
    # fused modules (ConvReLU2d, LinearReLU): the weighted op is their child "0"
    if (
        isinstance(module, torch.nn.Sequential)
        and len(module)
        and isinstance(module[0], _WEIGHTED_MODULES)
    ):
        if all(isinstance(m, torch.nn.ReLU) for m in list(module)[1:]):
            return module[0]
    return None


def is_observer(gm: GraphModule, node: Node) -> bool:
    """``node`` calls an observer or fake-quant module."""
    return node.op == "call_module" and is_observer_module(gm.get_submodule(node.target))


def is_observer_module(module: torch.nn.Module) -> bool:
    """``module`` is an observer or fake-quant module."""
    return hasattr(module, "calculate_qparams") or type(module).__name__.endswith("Observer")


def tensor_of(gm: GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a (possibly observed) get_attr node reads, or None."""
    node = unobserved(gm, node)
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    value: Any = gm
    for part in node.target.split("."):
        value = getattr(value, part)
    return value if isinstance(value, torch.Tensor) else None


def layer_of(gm: GraphModule, node: Node) -> Layer | None:
    """The conv/linear ``node`` runs (an FX module call or a PT2E aten op), or None."""
    if node.op == "call_module":
        module = weighted_module(gm.get_submodule(node.target))
        if module is None or module.weight is None:
            return None
        groups, is_linear = getattr(module, "groups", 1), isinstance(module, torch.nn.Linear)
        return Layer(node.name, module.weight, module.bias, groups, is_linear)
    kind = _WEIGHTED_FUNCTIONS.get(node.target) if node.op == "call_function" else None
    if kind is None or len(node.args) < 2:
        return None
    weight = tensor_of(gm, node.args[1])
    bias_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    bias = tensor_of(gm, bias_arg) if bias_arg is not None else None
    if weight is None or (bias_arg is not None and bias is None):
        return None
    groups = 1
    if kind == "conv":
        groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    return Layer(node.name, weight, bias, int(groups), kind == "linear")


def unobserved(gm: GraphModule, node: Any) -> Any:
    """``node`` with the observers in front of it skipped: the op producing the value."""
    while isinstance(node, Node) and is_observer(gm, node):
        node = node.args[0]
    return node


def layer_name(gm: GraphModule, node: Node) -> str:
    """The name a user knows a layer by: its module's path (FX: the module called;
    PT2E: the module its weight came from, as in ``model.state_dict()``)."""
    if node.op == "call_module":
        return str(node.target)
    weight = unobserved(gm, node.args[1])
    if isinstance(weight, Node) and weight.op == "get_attr":
        return str(weight.target).removesuffix(".weight")
    return node.name


def weight_qparams(
    gm: GraphModule, node: Node, layer: Layer, *, fresh: bool = False
) -> QParams | None:
    """The qparams convert will quantize ``node``'s weight with: the QConfig's weight
    observer run on the weight (FX), the graph's weight observer (PT2E; it observes
    the weight here, unless ``fresh``: then a copy of it does, and the graph's stays
    as it was). None where convert keeps the weight float, or for QAT modules
    (training already adapts to their fake-quantized weights)."""
    from qcore.engine.prepare import STATE_KEY
    from qcore.pt2e.prepare import PT2E_STATE_KEY

    if STATE_KEY in gm.meta and node.op == "call_module":
        state = gm.meta[STATE_KEY]
        if hasattr(gm.get_submodule(node.target), "weight_fake_quant"):
            return None
        for accepted in state.accepted:
            if accepted.root_name == node.name and accepted.qconfig.weight is not None:
                observer = accepted.qconfig.weight()
                observer(layer.weight.detach())
                return qparams_of(observer, full_range=True)
        return None
    if PT2E_STATE_KEY in gm.meta and node.op == "call_function":
        weight = node.args[1]
        if isinstance(weight, Node) and is_observer(gm, weight):
            observer = gm.get_submodule(weight.target)
            if fresh:
                observer = copy.deepcopy(observer)
            if getattr(observer, "dtype", None) not in (torch.qint8, torch.quint8, torch.int8):
                return None
            observer(layer.weight.detach())  # a weight observer sees its constant
            return qparams_of(observer, full_range=gm.meta[PT2E_STATE_KEY].full_range)
    return None


def first_observed(gm: GraphModule) -> str | None:
    """The name of the first observer of ``gm`` that has seen data, or None."""
    for name, module in gm.named_modules():
        min_val = getattr(module, "min_val", None)
        if isinstance(min_val, torch.Tensor) and min_val.numel() and torch.isfinite(min_val).any():
            return name
    return None


def check_uncalibrated(gm: GraphModule, what: str) -> None:
    """Refuse a model whose observers have seen data: ``what`` changes what they observe."""
    name = first_observed(gm)
    if name is not None:
        raise ValueError(
            f"model: observer {name!r} has already seen data; {what}: call it on the "
            "prepared model before calibration"
        )


class InputRecorder(Interpreter):
    """Runs a graph, handing each watched node's first input to its callback."""

    def __init__(self, gm: GraphModule, watched: dict[Node, Callable[[torch.Tensor], None]]):
        super().__init__(gm)
        self.watched = watched

    def run_node(self, node: Node) -> Any:
        if node in self.watched:
            self.watched[node](self.env[node.args[0]].detach())
        return super().run_node(node)


def single_use_layers(gm: GraphModule) -> dict[Node, Layer]:
    """Every conv/linear of ``gm`` whose weight and bias no other op reads: a module
    called twice cannot be changed for one of its calls, nor a weight tied to
    another module's (an embedding's, read by the output head) or a bias another
    layer shares or a function reads."""
    reads = parameter_reads(gm)
    layers = {node: layer_of(gm, node) for node in gm.graph.nodes}
    return {
        node: layer
        for node, layer in layers.items()
        if layer is not None
        and reads.get(id(layer.weight), 0) == 1
        and (layer.bias is None or reads.get(id(layer.bias), 0) == 1)
    }


def parameter_reads(gm: GraphModule) -> dict[int, int]:
    """How many ops read each tensor of ``gm`` (by ``id``): each call of a module
    holding it, and each user of a ``get_attr`` node fetching it."""
    reads: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and not is_observer(gm, node):
            module = gm.get_submodule(node.target)
            for key in {id(t) for t in (*module.parameters(), *module.buffers())}:
                reads[key] = reads.get(key, 0) + 1
        elif node.op == "get_attr":
            value = _attribute(gm, node.target)
            if isinstance(value, torch.Tensor):
                reads[id(value)] = reads.get(id(value), 0) + _readers_past_observers(gm, node)
    return reads


def _readers_past_observers(gm: GraphModule, node: Node) -> int:
    """The ops reading ``node``'s value, an observer counted as those reading its own."""
    return sum(
        _readers_past_observers(gm, user) if is_observer(gm, user) else 1 for user in node.users
    )


def _attribute(gm: GraphModule, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    try:
        return getattr(gm.get_submodule(owner) if owner else gm, name)
    except AttributeError:
        return None


def positional_batches(
    prepared: GraphModule, calibration_data: Any, input_fn: Callable[[Any], Any] | None
) -> Iterator[tuple]:
    """Each calibration batch (the forms ``qcore.quantize`` takes) as the positional
    inputs of ``prepared``'s graph, in its placeholders' order: a dict batch's
    keyword arguments (``input_ids=..., attention_mask=...``) go to the parameters
    of those names. The passes run the graph with an Interpreter, which takes
    positional inputs only."""
    from qcore.calibration import calibration_calls

    signature = inspect.signature(prepared.forward)
    for args, kwargs in calibration_calls(prepared, calibration_data, input_fn):
        if not kwargs:
            yield args
            continue
        bound = signature.bind(*args, **kwargs)  # calibration_calls checked the names
        bound.apply_defaults()
        yield bound.args


def record_inputs(
    recorder: Interpreter,
    prepared: GraphModule,
    calibration_data: Any,
    input_fn: Callable[[Any], Any] | None,
) -> None:
    """Runs ``recorder`` on each calibration batch (the forms ``qcore.quantize`` takes)."""
    with torch.no_grad():
        for args in positional_batches(prepared, calibration_data, input_fn):
            recorder.run(*args)
