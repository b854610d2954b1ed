"""A prepared graph run as its converted model computes, batch by batch in step.

Each observer's output is fake-quantized with the qparams it calibrated (on PT2E
that includes the weights' observers), and an FX layer runs on its fake-quantized
weights. Observers only read here: running the graph changes no statistics.
Empirical bias correction (``correct_bias(..., method="empirical")``) walks the
graph in this form, one layer at a time, across all calibration batches at once:
each layer's bias is set before anything after it runs. ``smooth_quant``'s search
scores its candidates on the outputs of whole runs (:func:`simulated_outputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node

from qcore.algorithms.layers import Layer, is_observer_module, weighted_module
from qcore.engine.reference import QParams, fake_quantize, qparams_of
from qcore.observers import MinMaxObserver

__all__ = ["float_pre_activations", "sample_means", "simulated_outputs", "simulated_steps"]

_INTEGER_DTYPES = (torch.quint8, torch.qint8, torch.int8, torch.uint8)


def sample_means(outputs: list[torch.Tensor], is_linear: bool) -> torch.Tensor:
    """Each sample's per-channel output mean, over every batch: (samples, channels).
    A sample is one entry of a batch (channels last for a linear, at dim 1 for a
    conv); its positions (pixels, tokens) are averaged, as they are not independent."""
    rows = []
    for out in outputs:
        out = out.detach().float()
        if out.dim() < 2:
            out = out.reshape(1, -1)
        if is_linear:
            rows.append(out.reshape(out.shape[0], -1, out.shape[-1]).mean(1))
        else:
            rows.append(out.flatten(2).mean(2))
    return torch.cat(rows)


def _channel_shaped(values: torch.Tensor, like: torch.Tensor, is_linear: bool) -> torch.Tensor:
    if is_linear:
        return values
    return values.reshape([1, -1] + [1] * (like.dim() - 2))


class _Run(Interpreter):
    """One batch; observers pass values through (``quantized=False``) or
    fake-quantize them, without observing."""

    def __init__(self, gm: GraphModule, quantized: bool, full_range: bool) -> None:
        super().__init__(gm)
        self.quantized, self.full_range = quantized, full_range
        self.weights: dict[str, torch.Tensor] = {}  # FX layer target -> dequantized weight

    def call_module(self, target: str, args: Any, kwargs: Any) -> Any:
        module = self.module.get_submodule(target)
        if not is_observer_module(module):
            return super().call_module(target, args, kwargs)
        (x,) = args
        if not self.quantized or not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        if getattr(module, "is_dynamic", False) or getattr(module, "dtype", None) not in (
            _INTEGER_DTYPES
        ):
            return x
        return fake_quantize(x, qparams_of(module, full_range=self.full_range))[1].to(x.dtype)

    def pre_activation(self, node: Node) -> torch.Tensor:
        """The layer's output before a fused activation (FX ConvReLU2d and kin)."""
        if node.op != "call_module":
            return self.run_node(node)
        module = self.module.get_submodule(node.target)
        layer = weighted_module(module)
        x = self.env[node.args[0]]
        weight = self.weights.get(node.target, layer.weight)
        if isinstance(layer, torch.nn.Linear):
            return torch.nn.functional.linear(x, weight, layer.bias)
        return layer._conv_forward(x, weight, layer.bias)

    def finish(self, node: Node, pre: torch.Tensor) -> torch.Tensor:
        """A layer's output from its pre-activation."""
        module = self.module.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, torch.nn.Sequential):
            for child in list(module)[1:]:
                pre = child(pre)
        return pre

    def start(self, args: tuple) -> None:
        self.env, self.args_iter = {}, iter(args)

    def step(self, node: Node, value: Any = None, computed: bool = False) -> None:
        self.env[node] = value if computed else self.run_node(node)
        for done in self.user_to_last_uses.get(node, ()):
            del self.env[done]


def float_pre_activations(
    gm: GraphModule, layers: dict[Node, Layer], batches: list[tuple]
) -> dict[Node, torch.Tensor]:
    """Each layer's :func:`sample_means` in float (observers pass values through)."""
    means: dict[Node, list[torch.Tensor]] = {node: [] for node in layers}
    for args in batches:
        run = _Run(gm, quantized=False, full_range=True)
        run.start(args)
        for node in gm.graph.nodes:
            if node.op == "output":
                break
            if node in layers:
                pre = run.pre_activation(node)
                # now: an in-place op after the layer (``relu_``) rewrites this tensor
                means[node].append(sample_means([pre], layers[node].is_linear))
                run.step(node, run.finish(node, pre), computed=True)
            else:
                run.step(node)
    return {node: torch.cat(found) for node, found in means.items()}


def simulated_steps(
    gm: GraphModule,
    layers: dict[Node, Layer],
    weight_qparams: dict[Node, QParams],
    batches: list[tuple],
    full_range: bool,
    adjust: Callable[[Node, list[torch.Tensor]], torch.Tensor | None],
) -> None:
    """Runs every batch through ``gm`` as converted, in step, node by node. At each
    layer, ``adjust(node, pre_activations)`` may return a per-channel shift: it is
    added to those outputs before the rest of the graph sees them (the caller has
    added it to the layer's bias). ``weight_qparams``: each layer's, as convert
    quantizes its weight."""
    runs = [_Run(gm, quantized=True, full_range=full_range) for _ in batches]
    for node, layer in layers.items():
        qparams = weight_qparams.get(node) if node.op == "call_module" else None
        if qparams is not None:  # FX: the module's weight (PT2E: its observer node)
            dequantized = fake_quantize(layer.weight, qparams)[1].to(layer.weight.dtype)
            for run in runs:
                run.weights[node.target] = dequantized
    for run, args in zip(runs, batches, strict=True):
        run.start(args)
    for node in gm.graph.nodes:
        if node.op == "output":
            break
        if node not in layers:
            for run in runs:
                run.step(node)
            continue
        pres = [run.pre_activation(node) for run in runs]
        shift = adjust(node, pres)
        for run, pre in zip(runs, pres, strict=True):
            if shift is not None:
                pre = pre + _channel_shaped(shift, pre, layers[node].is_linear).to(pre.dtype)
            run.step(node, run.finish(node, pre), computed=True)


class _Converted(_Run):
    """Whole batches as converted: FX layers on their dequantized weights (by module
    target), a dynamic observer's input quantized by its own range, as the dynamic
    kernel quantizes each batch at run time. ``qparams``: each static observer's,
    by target, computed once for every batch."""

    def __init__(
        self,
        gm: GraphModule,
        full_range: bool,
        weights: dict[str, torch.Tensor],
        quantized: bool,
        qparams: dict[str, QParams],
    ) -> None:
        super().__init__(gm, quantized=quantized, full_range=full_range)
        self.weights, self.qparams = weights, qparams

    def run_node(self, node: Node) -> Any:
        if node.op == "call_module" and node.target in self.weights:
            return self.finish(node, self.pre_activation(node))
        return super().run_node(node)

    def call_module(self, target: str, args: Any, kwargs: Any) -> Any:
        module = self.module.get_submodule(target)
        if not self.quantized or not is_observer_module(module):
            return super().call_module(target, args, kwargs)
        (x,) = args
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        if getattr(module, "dtype", None) not in _INTEGER_DTYPES:
            return x
        if getattr(module, "is_dynamic", False):
            observer = MinMaxObserver(dtype=module.dtype)
            observer(x.detach())
            qparams = qparams_of(observer, full_range=self.full_range)
        else:
            if target not in self.qparams:
                self.qparams[target] = qparams_of(module, full_range=self.full_range)
            qparams = self.qparams[target]
        return fake_quantize(x, qparams)[1].to(x.dtype)


def simulated_outputs(
    gm: GraphModule,
    weight_qparams: Mapping[Node, QParams | None],
    batches: list[tuple],
    full_range: bool,
    *,
    quantized: bool = True,
) -> list[Any]:
    """``gm``'s output on each batch as its converted model computes it, from the
    qparams its observers calibrated (observers only read); with ``quantized``
    False, the float model's (observers pass values through). ``weight_qparams``:
    FX layers' (a module call -> the qparams convert quantizes its weight with;
    PT2E weights have observers in the graph)."""
    weights = {}
    for node, qparams in weight_qparams.items():
        if node.op == "call_module" and qparams is not None:
            weight = weighted_module(gm.get_submodule(node.target)).weight
            weights[node.target] = fake_quantize(weight, qparams)[1].to(weight.dtype)
    observed: dict[str, QParams] = {}
    with torch.no_grad():
        return [
            _Converted(gm, full_range, weights, quantized, observed).run(*args) for args in batches
        ]
