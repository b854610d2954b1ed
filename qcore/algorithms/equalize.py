"""Cross-layer equalization (Nagel et al., "Data-Free Quantization", 2019).

Two weighted layers in a chain, ``y = W2 · relu(W1 · x + b1) + b2``, compute the
same function when output channel ``c`` of the first is divided by ``s_c > 0``
and input channel ``c`` of the second multiplied by it (ReLU commutes with a
positive scale). Choosing ``s_c = sqrt(r1_c / r2_c)``, with ``r`` each channel's
largest absolute weight, gives both channels the range ``sqrt(r1_c * r2_c)``:
per-tensor weight quantization wastes no levels on one dominant channel, and the
activation between the layers has channels of similar range, which helps its
per-tensor quantization most (depthwise convolutions, MobileNet-style nets).

Runs on a prepared model, FX or PT2E, before calibration: it rescales weights
only, so observers see the equalized activations and no QConfig or backend
constraint is touched. Equalized: conv -> conv (a depthwise conv on either side)
and linear -> linear, with nothing between them but ReLU (or, when asked, ReLU6,
replaced by ReLU as AIMET does: that changes the float function where activations
exceed 6). A conv's channels are its output's dimension 1 and a linear reads the
last one, so a conv and a linear in a row never share a channel axis.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from qcore.algorithms.layers import (
    Layer,
    check_uncalibrated,
    is_observer,
    layer_of,
    single_use_layers,
)
from qcore.config.errors import describe

__all__ = ["EqualizedPair", "equalize", "equalized_pairs"]

aten = torch.ops.aten

_RELU = {torch.relu, torch.nn.functional.relu, aten.relu.default, aten.relu_.default, "relu"}
_RELU6 = {torch.nn.functional.relu6, aten.relu6.default, aten.hardtanh.default}


@dataclass(frozen=True)
class EqualizedPair:
    """Two layers equalized: the first's output channels scaled down, the second's
    input channels up. ``largest_before``/``largest_after``: the largest ratio of a
    channel's weight range to the smallest one's, in the first layer."""

    first: str
    second: str
    largest_before: float
    largest_after: float


def _passes_through(gm: GraphModule, node: Node, relu6_to_relu: bool) -> str | None:
    """ "observer", "relu", "relu6" for a node a chain may cross, else None."""
    if is_observer(gm, node):
        return "observer"
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, torch.nn.ReLU):
            return "relu"
        if isinstance(module, torch.nn.ReLU6) and relu6_to_relu:
            return "relu6"
        return None
    if node.op in ("call_function", "call_method") and node.target in _RELU:
        return "relu"
    if node.op == "call_function" and node.target in _RELU6 and relu6_to_relu:
        if node.target is aten.hardtanh.default and tuple(node.args[1:3]) != (0.0, 6.0):
            return None
        return "relu6"
    return None


def _next_layer(gm: GraphModule, node: Node, relu6_to_relu: bool) -> tuple[Node, list[Node]] | None:
    """The weighted op ``node``'s output reaches alone, and the ReLU6s on the way."""
    if node.op == "call_module" and len(node.args) + len(node.kwargs) > 1:
        # A fused conv + add (onednn's ConvAdd2d): its output is conv(x) + other, and
        # scaling the conv's output channels would leave ``other`` unscaled.
        return None
    relu6s: list[Node] = []
    current = node
    while True:
        users = list(current.users)
        if len(users) != 1:
            return None
        (user,) = users
        if layer_of(gm, user) is not None:
            return (user, relu6s) if user.args and user.args[0] is current else None
        kind = _passes_through(gm, user, relu6_to_relu)
        if kind is None or user.args[0] is not current:
            return None
        if kind == "relu6":
            relu6s.append(user)
        current = user


def _output_ranges(layer: Layer) -> torch.Tensor:
    return layer.weight.detach().abs().flatten(1).amax(1)


def _input_ranges(layer: Layer, channels: int) -> torch.Tensor | None:
    """Per input channel of ``layer``: its largest absolute weight."""
    weight = layer.weight.detach().abs()
    if layer.is_linear or layer.groups == 1:
        if weight.shape[1] != channels:
            return None
        return weight.transpose(0, 1).flatten(1).amax(1)
    if layer.groups == channels and weight.shape[0] == channels:  # depthwise
        return weight.flatten(1).amax(1)
    return None


def _scale_input_channels(layer: Layer, scale: torch.Tensor) -> None:
    weight = layer.weight.data
    shape = [1] * weight.dim()
    if layer.is_linear or layer.groups == 1:
        shape[1] = -1
    else:  # depthwise: input channel c is output channel c
        shape[0] = -1
    weight.mul_(scale.reshape(shape))


def _spread(ranges: torch.Tensor) -> float:
    positive = ranges[ranges > 0]
    return float(positive.max() / positive.min()) if positive.numel() else 1.0


_DEAD = 1e-3  # a channel's range below this fraction of its layer's largest


def _equalize_pair(first: Layer, second: Layer) -> EqualizedPair | None:
    r1 = _output_ranges(first)
    r2 = _input_ranges(second, r1.numel()) if first.is_linear == second.is_linear else None
    if r2 is None:
        return None
    before = _spread(r1)
    # A (nearly) dead channel is left as it is: its scale sqrt(r1 / r2) would be
    # tiny, and dividing the bias by it made one channel a huge constant that set
    # the next activation's scale (50.8 dB to 0 on a depthwise chain).
    usable = (r1 > _DEAD * r1.max()) & (r2 > _DEAD * r2.max())
    scale = torch.ones_like(r1)
    scale[usable] = torch.sqrt(r1[usable] / r2[usable])
    shape = [-1] + [1] * (first.weight.dim() - 1)
    first.weight.data.div_(scale.reshape(shape))
    if first.bias is not None:
        first.bias.data.div_(scale)
    _scale_input_channels(second, scale)
    return EqualizedPair(first.name, second.name, before, _spread(_output_ranges(first)))


def _replace_relu6(gm: GraphModule, nodes: list[Node]) -> None:
    for node in nodes:
        if node.op == "call_module":
            # a ReLU6 module called elsewhere too keeps clipping there: this call
            # gets a ReLU of its own
            calls = sum(n.op == "call_module" and n.target == node.target for n in gm.graph.nodes)
            if calls > 1:
                node.target = _free_name(gm, f"{node.target}_as_relu")
                gm.add_submodule(node.target, torch.nn.ReLU())
                continue
            parent, _, attr = node.target.rpartition(".")
            setattr(gm.get_submodule(parent) if parent else gm, attr, torch.nn.ReLU())
        elif node.op == "call_function" and node.target in _RELU6:
            node.target, node.args, node.kwargs = aten.relu.default, (node.args[0],), {}
        else:
            node.target, node.args, node.kwargs = torch.relu, (node.args[0],), {}
    gm.recompile()


def _free_name(gm: GraphModule, base: str) -> str:
    name, suffix = base, 0
    while True:
        try:
            gm.get_submodule(name)
        except AttributeError:
            return name
        suffix += 1
        name = f"{base}_{suffix}"


def equalize(
    prepared: GraphModule, *, iterations: int = 4, relu6_to_relu: bool = False
) -> GraphModule:
    """Cross-layer equalization of a prepared model (FX or PT2E), before calibration.

    Returns a copy whose weighted layer pairs are equalized (the model passed in is
    not changed); ``qcore.algorithms.equalized_pairs(model)`` lists them. Chains of
    more than two layers are equalized pair by pair, ``iterations`` times over (the
    scales converge in a few). ``relu6_to_relu=True`` also equalizes across ReLU6,
    which it replaces by ReLU (the float function changes where activations exceed 6).

    Example::

        >>> prepared = qcore.prepare_fx(model, None, example_inputs, backend="qnnpack")
        >>> prepared = qcore.equalize(prepared)
        >>> for batch in calibration_data:
        ...     prepared(*batch)
        >>> quantized = qcore.convert_fx(prepared)
    """
    if not isinstance(prepared, GraphModule):
        raise TypeError(
            f"prepared: got {describe(prepared)}; expected a model from qcore.prepare_fx or "
            "qcore.prepare_pt2e"
        )
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations: got {describe(iterations)}; expected an int >= 1")
    if not isinstance(relu6_to_relu, bool):
        raise TypeError(f"relu6_to_relu: got {describe(relu6_to_relu)}; expected True or False")
    check_uncalibrated(prepared, "equalize rescales the activations it observes")
    gm = copy.deepcopy(prepared)
    layers = {node: layer_of(gm, node) for node in gm.graph.nodes}
    layers = {node: layer for node, layer in layers.items() if layer is not None}
    # A weight another op reads too (a module called twice, a tied embedding) cannot
    # be rescaled for one of them.
    alone = single_use_layers(gm)
    chains: list[tuple[Node, Node, list[Node]]] = []
    for node in layers:
        found = _next_layer(gm, node, relu6_to_relu)
        if found is not None and node in alone and found[0] in alone:
            chains.append((node, found[0], found[1]))
    results: dict[tuple[str, str], EqualizedPair] = {}
    crossed: list[Node] = []
    with torch.no_grad():
        for _ in range(iterations):
            for first_node, second_node, relu6s in chains:
                done = _equalize_pair(layers[first_node], layers[second_node])
                if done is None:
                    continue
                key = (done.first, done.second)
                if key not in results:
                    crossed.extend(relu6s)
                    results[key] = done
                else:
                    results[key] = EqualizedPair(
                        done.first, done.second, results[key].largest_before, done.largest_after
                    )
    _replace_relu6(gm, crossed)
    gm.meta[_PAIRS_KEY] = tuple(results.values())
    return gm


_PAIRS_KEY = "qcore_equalized_pairs"


def equalized_pairs(model: GraphModule) -> tuple[EqualizedPair, ...]:
    """The pairs :func:`equalize` rescaled in ``model`` (empty if none)."""
    return tuple(getattr(model, "meta", {}).get(_PAIRS_KEY, ()))
