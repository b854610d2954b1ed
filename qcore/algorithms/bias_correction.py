"""Bias correction (Nagel et al., 2019; NNCF's fast bias correction).

Rounding a layer's weights shifts the mean of its outputs: ``E[Q(W) x]`` differs
from ``E[W x]`` by ``(W - Q(W)) E[x]``, a bias no later layer undoes, largest on
depthwise convolutions (few weights per output, each error weighs). Correction
adds that shift back to the layer's bias, from the per-channel mean of its input
over calibration data. The weights' quantization is the one convert will apply
(the QConfig's weight observer on FX, the graph's weight observer on PT2E), so
the integer weights and every constraint of the backend stay as they are; only
the float bias, which kernels take in float, changes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node

from qcore.algorithms.layers import (
    Layer,
    layer_of,
    parameter_reads,
    positional_batches,
    record_inputs,
    single_use_layers,
    weight_qparams,
    weighted_module,
)
from qcore.algorithms.simulated import float_pre_activations, sample_means, simulated_steps
from qcore.config.errors import describe
from qcore.engine.reference import QParams, fake_quantize

__all__ = ["CorrectedBias", "correct_bias", "corrected_biases"]

_KEY = "qcore_corrected_biases"
_METHODS = ("fast", "empirical")


@dataclass(frozen=True)
class CorrectedBias:
    """A layer whose bias was corrected: the largest change, relative to the
    largest absolute bias before (0 when it had none)."""

    layer: str
    largest_change: float
    relative_change: float


class _InputMeans(Interpreter):
    """Runs the graph, summing each watched node's first input per channel."""

    def __init__(self, gm: GraphModule, watched: dict[Node, bool]) -> None:
        super().__init__(gm)
        self.watched = watched  # node -> is_linear
        self.sums: dict[Node, torch.Tensor] = {}
        self.counts: dict[Node, int] = {}

    def run_node(self, node: Node) -> Any:
        if node in self.watched:
            x = self.env[node.args[0]].detach().float()
            if self.watched[node]:  # linear: channels last
                flat = x.reshape(-1, x.shape[-1])
            else:  # conv: channels at dim 1
                flat = x.transpose(0, 1).reshape(x.shape[1], -1).t()
            self.sums[node] = self.sums.get(node, 0) + flat.sum(0)
            self.counts[node] = self.counts.get(node, 0) + flat.shape[0]
        return super().run_node(node)


def _shift(delta: torch.Tensor, mean: torch.Tensor, groups: int, is_linear: bool) -> torch.Tensor:
    """``(W - Q(W)) E[x]`` per output channel."""
    if is_linear:
        return delta @ mean
    out_channels, in_per_group = delta.shape[0], delta.shape[1]
    per_output = delta.flatten(2).sum(2)  # the input's mean taken as spatially constant
    group_of = torch.arange(out_channels) // (out_channels // groups)
    index = group_of[:, None] * in_per_group + torch.arange(in_per_group)[None, :]
    return (per_output * mean[index]).sum(1)


def correct_bias(
    prepared: GraphModule,
    calibration_data: Iterable[Any],
    *,
    input_fn: Callable[[Any], Any] | None = None,
    method: str = "fast",
) -> GraphModule:
    """Bias correction of a calibrated prepared model (FX or PT2E).

    Returns a copy whose conv/linear biases absorb the shift quantization makes
    in the mean of their outputs; a layer without a bias gets one. Observers are
    not touched: convert the result as usual. ``qcore.algorithms.corrected_biases(model)``
    lists what changed. ``method``:

    - ``"fast"`` (NNCF's fast bias correction): each layer's own weight rounding,
      ``(W - Q(W)) E[x]``, with ``E[x]`` the per-channel mean of its float input
      over ``calibration_data`` (batches as ``qcore.quantize`` takes them).
    - ``"empirical"`` (Nagel et al., 2019; NNCF's bias correction): the shift each
      layer's output mean actually has when the model runs quantized, weights and
      activations, with every earlier layer already corrected. It also takes out
      what the layers before gave it (clipping, activation rounding), which on
      depthwise nets is most of it. It holds every calibration batch's
      activations at once, layer by layer.

    Example::

        >>> for batch in calibration_data:
        ...     prepared(*batch)
        >>> prepared = qcore.correct_bias(prepared, calibration_data)
        >>> quantized = qcore.convert_fx(prepared)
    """
    if not isinstance(prepared, GraphModule):
        raise TypeError(
            f"prepared: got {describe(prepared)}; expected a model from qcore.prepare_fx or "
            "qcore.prepare_pt2e, calibrated"
        )
    if method not in _METHODS:
        expected = " or ".join(map(repr, _METHODS))
        raise ValueError(f"method: got {method!r}; expected {expected}")
    gm = copy.deepcopy(prepared)
    layers: dict[Node, Layer] = {}
    qparams: dict[Node, QParams] = {}
    candidates = single_use_layers(gm) if method == "empirical" else _all_layers(gm)
    for node, layer in candidates.items():
        if node.args[0] is None:
            continue
        found = weight_qparams(gm, node, layer)
        if found is not None:
            layers[node], qparams[node] = layer, found
    if not layers:
        gm.meta[_KEY] = ()
        return gm
    if method == "empirical":
        changes = _empirical(gm, layers, qparams, prepared, calibration_data, input_fn)
    else:
        changes = _fast(gm, layers, qparams, prepared, calibration_data, input_fn)
    gm.meta[_KEY] = tuple(changes)
    return gm


def _all_layers(gm: GraphModule) -> dict[Node, Layer]:
    found = {node: layer_of(gm, node) for node in gm.graph.nodes}
    return {node: layer for node, layer in found.items() if layer is not None}


def _calls_by_bias(gm: GraphModule, layers: dict[Node, Layer]) -> dict[Any, list[Node]]:
    """The layers' calls grouped by the bias a correction changes (a bias tensor,
    or for a module without one, the module; else the call's own new one), leaving
    out a bias that layers of different weights share or another op reads: one
    shift cannot correct two roundings."""
    calls: dict[Any, list[Node]] = {}
    for node, layer in layers.items():
        if layer.bias is not None:
            home: Any = ("tensor", id(layer.bias))
        elif node.op == "call_module":
            home = ("module", node.target)
        else:
            home = ("call", node.name)
        calls.setdefault(home, []).append(node)
    reads = parameter_reads(gm)

    def one_layer(group: list[Node]) -> bool:
        bias = layers[group[0]].bias
        same_weight = len({id(layers[node].weight) for node in group}) == 1
        return same_weight and (bias is None or reads.get(id(bias), 0) == len(group))

    return {home: group for home, group in calls.items() if one_layer(group)}


def _change(node: Node, shift: torch.Tensor, bias_before: torch.Tensor | None) -> CorrectedBias:
    before = 0.0 if bias_before is None else float(bias_before.abs().max())
    largest = float(shift.abs().max())
    return CorrectedBias(node.name, largest, largest / before if before else 0.0)


def _fast(gm, layers, qparams, prepared, calibration_data, input_fn) -> list[CorrectedBias]:
    recorder = _InputMeans(copy.deepcopy(gm), {})
    by_name = {n.name: n for n in recorder.module.graph.nodes}
    recorder.watched = {by_name[n.name]: layer.is_linear for n, layer in layers.items()}
    record_inputs(recorder, prepared, calibration_data, input_fn)
    changes = []
    with torch.no_grad():
        for calls in _calls_by_bias(gm, layers).values():
            # one bias for several calls (a module called twice): one shift, from
            # the mean of every call's input, not each call's shift added in turn
            node, layer = calls[0], layers[calls[0]]
            twins = [by_name[call.name] for call in calls]
            total = sum(recorder.counts.get(twin, 0) for twin in twins)
            if not total:  # not reached on this data
                continue
            mean = sum(recorder.sums[twin] for twin in twins if twin in recorder.sums) / total
            _, dequantized = fake_quantize(layer.weight, qparams[node])
            delta = (layer.weight.detach() - dequantized).float()
            shift = _shift(delta, mean, layer.groups, layer.is_linear).to(layer.weight.dtype)
            changes.append(_change(node, shift, layer.bias))
            if layer.bias is None:
                _add_bias(gm, node, shift)
            else:
                layer.bias.data.add_(shift)
    return changes


def _empirical(gm, layers, qparams, prepared, calibration_data, input_fn) -> list[CorrectedBias]:
    from qcore.pt2e.prepare import PT2E_STATE_KEY

    batches = list(positional_batches(prepared, calibration_data, input_fn))
    had_bias = {node: layer.bias is not None for node, layer in layers.items()}
    for node, layer in list(layers.items()):
        if layer.bias is None:  # a zero bias to correct, read where the layer reads it
            _add_bias(gm, node, torch.zeros(layer.weight.shape[0], dtype=layer.weight.dtype))
            layers[node] = layer_of(gm, node)
    full_range = PT2E_STATE_KEY not in gm.meta or gm.meta[PT2E_STATE_KEY].full_range
    changes = []
    with torch.no_grad():
        float_means = float_pre_activations(gm, layers, batches)

        def adjust(node: Node, outputs: list[torch.Tensor]) -> torch.Tensor:
            layer = layers[node]
            shift = _shrunk(float_means[node] - sample_means(outputs, layer.is_linear))
            shift = shift.to(layer.bias.dtype)
            before = layer.bias.detach().clone() if had_bias[node] else None
            changes.append(_change(node, shift, before))
            layer.bias.data.add_(shift)
            return shift

        simulated_steps(gm, layers, qparams, batches, full_range, adjust)
    return changes


def _shrunk(differences: torch.Tensor) -> torch.Tensor:
    """The mean of per-sample output differences (samples, channels), each channel's
    shrunk toward 0 by how well the calibration data pins it down: by
    ``1 - (standard error / mean)**2``, and to 0 where the mean is within one
    standard error (James-Stein's positive part). A few calibration batches
    otherwise move biases by noise: held-out SQNR fell where the shift was small."""
    mean = differences.mean(0)
    if differences.shape[0] < 2:
        return mean
    error = differences.std(0) / differences.shape[0] ** 0.5
    keep = (1 - (error / mean.abs().clamp_min(1e-12)) ** 2).clamp_min(0)
    return mean * keep


def _add_bias(gm: GraphModule, node: Node, bias: torch.Tensor) -> None:
    if node.op == "call_module":
        module = weighted_module(gm.get_submodule(node.target))
        module.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
        return
    name = f"{node.name}_corrected_bias"
    gm.register_buffer(name, bias.clone())
    with gm.graph.inserting_before(node):
        attr = gm.graph.get_attr(name)
    args = list(node.args) + [None] * max(0, 3 - len(node.args))
    args[2] = attr
    node.args = tuple(args)
    gm.recompile()


def corrected_biases(model: GraphModule) -> tuple[CorrectedBias, ...]:
    """The layers :func:`correct_bias` changed in ``model`` (empty if none)."""
    return tuple(getattr(model, "meta", {}).get(_KEY, ()))
