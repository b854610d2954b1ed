"""AdaRound (Nagel et al., "Up or Down? Adaptive Rounding", 2020).

Rounding each weight to its nearest grid point minimizes each weight's error, not
the layer's: the errors of a row add up in its outputs. AdaRound learns, per
weight, whether to round down or up: ``W~ = s * (floor(W / s) + h(V) - z)``, with
``h(V) = clamp(sigmoid(V) * 1.2 - 0.1, 0, 1)`` the rectified sigmoid, ``V``
trained to reconstruct the layer's output on calibration inputs while a
regularizer ``sum(1 - |2h - 1|^beta)``, ``beta`` annealed from 20 to 2, pushes each
``h`` to 0 or 1. Each layer is learned alone (layer-wise reconstruction), its input
as the quantized model sees it (fake-quantized with the input's calibrated
qparams) against the float output.

Runs after calibration, so that each weight's qparams are the ones convert will
use (the QConfig's weight observer on FX, the graph's on PT2E). The result keeps
them exactly: the weight is written as the dequantized learned integers, except
the elements that set each channel's minimum and maximum, which keep their float
value (convert rounds them to nearest, as before), and no learned integer leaves
that range. The observer's min/max, and so its scale and zero point (power of two
or not), are those of the original weight; this is checked for every layer, as is
that quantizing the written weight gives back the learned integers.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from qcore.algorithms.layers import (
    InputRecorder,
    Layer,
    first_observed,
    is_observer,
    layer_name,
    record_inputs,
    single_use_layers,
    weight_qparams,
    weighted_module,
)
from qcore.config.errors import describe
from qcore.engine.reference import QParams, fake_quantize, qparams_of

__all__ = ["AdaroundedLayer", "adaround", "adarounded_layers"]

_KEY = "qcore_adarounded_layers"
_ZETA, _GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch (the paper's values)
_WARMUP = 0.2  # the first fifth of the iterations reconstructs without the regularizer
_BETA = (20.0, 2.0)
_ROWS = 256  # linear input rows per iteration
_SAMPLES = 32  # conv input samples per iteration


@dataclass(frozen=True)
class AdaroundedLayer:
    """One layer's result: ``error_nearest``/``error_learned``, the mean squared
    output error of nearest and of learned rounding on the calibration inputs;
    ``flipped``, the fraction of weights rounded the other way than nearest;
    ``kept``, ``"learned"`` or why the nearest rounding stayed; ``integers``, the
    weight's integers convert produces."""

    layer: str
    iterations: int
    seconds: float
    error_nearest: float
    error_learned: float
    flipped: float
    kept: str
    integers: torch.Tensor = field(repr=False, compare=False)


def _axis_shape(qparams: QParams, weight: torch.Tensor) -> list[int]:
    shape = [1] * weight.dim()
    if qparams.per_channel:
        shape[qparams.axis] = -1
    return shape


def _range_mask(weight: torch.Tensor, qparams: QParams) -> torch.Tensor:
    """The elements holding each channel's (or the tensor's) minimum or maximum."""
    if not qparams.per_channel:
        return (weight == weight.min()) | (weight == weight.max())
    moved = weight.movedim(qparams.axis, 0).flatten(1)
    low, high = moved.amin(1, keepdim=True), moved.amax(1, keepdim=True)
    mask = (moved == low) | (moved == high)
    return mask.reshape(weight.movedim(qparams.axis, 0).shape).movedim(0, qparams.axis)


def _channel_limits(weight: torch.Tensor, qparams: QParams, scale, zero_point):
    """The integers whose dequantized value stays inside each channel's [min, max]."""
    if qparams.per_channel:
        moved = weight.movedim(qparams.axis, 0).flatten(1)
        shape = _axis_shape(qparams, weight)
        low, high = moved.amin(1).reshape(shape), moved.amax(1).reshape(shape)
    else:
        low, high = weight.min(), weight.max()
    lowest = torch.ceil(low / scale + zero_point).clamp(min=qparams.quant_min)
    highest = torch.floor(high / scale + zero_point).clamp(max=qparams.quant_max)
    return lowest, highest


def _op(gm: GraphModule, node: Node, layer: Layer) -> Callable[[Any, Any], Any]:
    """The layer's operation on (input, weight), without its bias (which cancels in
    the reconstruction error) and without a fused activation."""
    if node.op == "call_module":
        module = weighted_module(gm.get_submodule(node.target))
        if layer.is_linear:
            return F.linear
        return lambda x, w: module._conv_forward(x, w, None)
    rest, kwargs = node.args[3:], {k: v for k, v in node.kwargs.items() if k != "bias"}
    return lambda x, w: node.target(x, w, None, *rest, **kwargs)


def _input_qparams(gm: GraphModule, node: Node) -> QParams | None:
    from qcore.pt2e.prepare import PT2E_STATE_KEY

    source = node.args[0]
    if not (isinstance(source, Node) and is_observer(gm, source)):
        return None
    observer = gm.get_submodule(source.target)
    if getattr(observer, "is_dynamic", False) or getattr(observer, "dtype", None) not in (
        torch.quint8,
        torch.qint8,
        torch.int8,
        torch.uint8,
    ):
        return None  # a float input, or one quantized per batch at run time
    full_range = PT2E_STATE_KEY not in gm.meta or gm.meta[PT2E_STATE_KEY].full_range
    return qparams_of(observer, full_range=full_range)


class _Inputs:
    """A layer's recorded float inputs, and how its kernel would see them."""

    def __init__(self, qparams: QParams | None) -> None:
        self.qparams, self.batches = qparams, []

    def __call__(self, x: torch.Tensor) -> None:
        self.batches.append(x.float().clone())

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.qparams is None else fake_quantize(x, self.qparams)[1]


class _Progress:
    """``\\r``-updated lines on stderr, written only when stderr is a terminal."""

    def __init__(self, enabled: bool | None) -> None:
        if enabled is None:
            try:
                enabled = sys.stderr.isatty()
            except (AttributeError, ValueError):  # replaced or closed stderr
                enabled = False
        self.enabled, self.last = enabled, 0.0

    def show(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.enabled and (force or now - self.last > 0.2):
            sys.stderr.write(f"\r  adaround {text}\033[K")
            sys.stderr.flush()
            self.last = now

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _learn(
    layer: Layer,
    qparams: QParams,
    op: Callable,
    inputs: _Inputs,
    iterations: int,
    deadline: float,
    regularization: float,
    learning_rate: float,
    progress: Callable[[int], None],
    generator: torch.Generator,
) -> tuple[torch.Tensor, int]:
    """(the learned integers, as floats; the iterations run). The elements holding a
    channel's minimum or maximum keep nearest rounding."""
    weight = layer.weight.detach().float()
    shape = _axis_shape(qparams, weight)
    scale = qparams.scale.float().reshape(shape)
    zero_point = qparams.zero_point.float().reshape(shape)
    nearest, dequantized = fake_quantize(weight, qparams)
    fixed = _range_mask(weight, qparams)
    lowest, highest = _channel_limits(weight, qparams, scale, zero_point)
    floor = torch.floor(weight / scale)
    rest = (weight / scale - floor).clamp(0.01, 0.99)  # h(V) starts at the fraction
    v = (-torch.log((_ZETA - _GAMMA) / (rest - _GAMMA) - 1)).requires_grad_(True)
    optimizer = torch.optim.Adam([v], lr=learning_rate)
    x_float = torch.cat(inputs.batches)
    if layer.is_linear:
        x_float = x_float.reshape(-1, x_float.shape[-1])
    per_step = _ROWS if layer.is_linear else _SAMPLES
    learned = ~fixed
    warmup = int(_WARMUP * iterations)
    done = 0
    for step in range(iterations):
        if time.monotonic() > deadline:
            break
        pick = torch.randint(
            0, x_float.shape[0], (min(per_step, x_float.shape[0]),), generator=generator
        )
        with torch.no_grad():
            target = op(x_float[pick], weight)
            x_quant = inputs.quantized(x_float[pick])
        h = ((torch.sigmoid(v) * (_ZETA - _GAMMA)) + _GAMMA).clamp(0, 1)
        integer = torch.clamp(floor + h + zero_point, lowest, highest)
        soft = torch.where(learned, scale * (integer - zero_point), dequantized.float())
        error = (op(x_quant, soft) - target).pow(2).flatten(1).sum(1).mean()
        loss = error
        if step >= warmup:
            beta = _BETA[0] + (_BETA[1] - _BETA[0]) * (step - warmup) / max(1, iterations - warmup)
            loss = loss + regularization * (1 - (2 * h[learned] - 1).abs().pow(beta)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done = step + 1
        progress(done)
    with torch.no_grad():
        integer = torch.clamp(floor + (v >= 0).float() + zero_point, lowest, highest)
        integer = torch.where(learned, integer, nearest.float())
    return integer, done


def _error(op: Callable, inputs: _Inputs, weight: torch.Tensor, dequantized: torch.Tensor) -> float:
    """Mean squared output error over every recorded input."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x in inputs.batches:
            difference = op(inputs.quantized(x), dequantized) - op(x, weight)
            total += float(difference.pow(2).sum())
            count += difference.numel()
    return total / max(1, count)


def _check_number(name: str, value: Any, kind: type, low: float, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (kind, int)) or not value >= low:
        raise ValueError(f"{name}: got {describe(value)}; expected {what}")


def adaround(
    prepared: GraphModule,
    calibration_data: Iterable[Any],
    *,
    iterations: int = 500,
    time_budget_s: float | None = None,
    regularization: float = 0.01,
    learning_rate: float = 0.01,
    progress: bool | None = None,
    seed: int = 0,
    input_fn: Callable[[Any], Any] | None = None,
) -> GraphModule:
    """AdaRound of a calibrated prepared model's conv and linear weights (FX or PT2E).

    Returns a copy (the model passed in is not changed) whose quantized weights
    round up or down as learned on ``calibration_data`` (batches as
    ``qcore.quantize`` takes them): convert it as usual; the weights' qparams are
    the ones calibration gave. ``qcore.algorithms.adarounded_layers(model)`` lists
    each layer's error before and after, and the integers convert will produce.

    ``iterations``: optimizer steps per layer (the paper uses 10,000; a few hundred
    already gain most on small layers). ``time_budget_s``: seconds for the whole
    pass, shared among the layers still to learn (each stops when its share is
    spent, keeping what it learned; a layer given no time keeps nearest rounding);
    None for no limit. ``regularization``: the weight of the rounding regularizer
    (the paper's lambda). ``learning_rate``: Adam's, on ``V``. ``progress``: a
    progress line on stderr; None shows it when stderr is a terminal. ``seed``:
    the sampling of calibration rows per step. A layer keeps nearest rounding where
    the learned one does not lower its output error on the calibration inputs.

    Example::

        >>> for batch in calibration_data:
        ...     prepared(*batch)
        >>> prepared = qcore.adaround(prepared, calibration_data, time_budget_s=60)
        >>> quantized = qcore.convert_pt2e(prepared)
    """
    if not isinstance(prepared, GraphModule):
        raise TypeError(
            f"prepared: got {describe(prepared)}; expected a model from qcore.prepare_fx or "
            "qcore.prepare_pt2e, calibrated"
        )
    _check_number("iterations", iterations, int, 1, "an int >= 1")
    if time_budget_s is not None:
        _check_number("time_budget_s", time_budget_s, float, 0, "seconds >= 0, or None")
    _check_number("regularization", regularization, float, 0, "a float >= 0")
    _check_number("learning_rate", learning_rate, float, 1e-12, "a float > 0")
    _check_number("seed", seed, int, -(2**63), "an int")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress: got {describe(progress)}; expected True, False or None")
    static = any(isinstance(getattr(m, "min_val", None), torch.Tensor) for m in prepared.modules())
    if static and first_observed(prepared) is None:  # dynamic models have nothing to calibrate
        raise ValueError(
            "prepared: no observer has seen data; adaround learns against the weights' "
            "calibrated qparams: run the calibration batches through the prepared model first"
        )
    start = time.monotonic()
    gm = copy.deepcopy(prepared)
    layers: dict[Node, tuple[Layer, QParams]] = {}
    for node, layer in single_use_layers(gm).items():
        found = weight_qparams(gm, node, layer, fresh=True)
        if found is not None and found.dtype != torch.float16 and node.args[0] is not None:
            layers[node] = (layer, found)
    recorder = InputRecorder(copy.deepcopy(gm), {})
    twins = {n.name: n for n in recorder.module.graph.nodes}
    inputs = {node: _Inputs(_input_qparams(gm, node)) for node in layers}
    recorder.watched = {twins[node.name]: inputs[node] for node in layers}
    record_inputs(recorder, prepared, calibration_data, input_fn)
    shown = _Progress(progress)
    generator = torch.Generator().manual_seed(seed)
    results = []
    for index, (node, (layer, qparams)) in enumerate(layers.items()):
        if not inputs[node].batches:  # not reached on this data (a branch not taken)
            continue
        name = layer_name(gm, node)
        now = time.monotonic()
        if time_budget_s is None:
            deadline = math.inf
        else:
            deadline = now + (start + time_budget_s - now) / (len(layers) - index)
        label = f"[{index + 1}/{len(layers)}] {name}"
        shown.show(f"{label}: 0/{iterations}", force=True)
        op = _op(gm, node, layer)
        integer, done = _learn(
            layer,
            qparams,
            op,
            inputs[node],
            iterations,
            deadline,
            regularization,
            learning_rate,
            lambda step, label=label: shown.show(f"{label}: {step}/{iterations}"),
            generator,
        )
        results.append(_write(gm, node, layer, qparams, op, inputs[node], integer, done, now, name))
        inputs[node].batches.clear()  # memory: each layer's inputs go once it is done
    shown.close()
    gm.meta[_KEY] = tuple(results)
    return gm


def _write(
    gm: GraphModule,
    node: Node,
    layer: Layer,
    qparams: QParams,
    op: Callable,
    inputs: _Inputs,
    integer: torch.Tensor,
    done: int,
    started: float,
    name: str,
) -> AdaroundedLayer:
    """Writes the learned rounding into ``layer``'s weight where it lowers the error,
    checked to keep the weight's qparams and to quantize back to ``integer``."""
    weight = layer.weight.detach().clone()
    shape = _axis_shape(qparams, weight)
    scale, zero_point = qparams.scale.reshape(shape), qparams.zero_point.reshape(shape)
    nearest, dequantized = fake_quantize(weight, qparams)
    fixed = _range_mask(weight.float(), qparams)
    written = torch.where(fixed, weight, ((integer - zero_point) * scale).to(weight.dtype))
    before = _error(op, inputs, weight.float(), dequantized.float())
    after = _error(op, inputs, weight.float(), fake_quantize(written, qparams)[1].float())
    flipped = float((integer != nearest.float()).float().mean())
    kept = "learned"
    if not after < before:
        kept = "nearest: the learned rounding did not lower the output error"
    else:
        layer.weight.data.copy_(written)
        again = weight_qparams(gm, node, layer, fresh=True)
        same = (
            again is not None
            and torch.equal(again.scale, qparams.scale)
            and torch.equal(again.zero_point, qparams.zero_point)
        )
        if not same or not torch.equal(fake_quantize(written, qparams)[0].float(), integer):
            layer.weight.data.copy_(weight)  # an observer that reads more than min/max
            kept = "nearest: the weight observer would not keep its qparams"
    if kept != "learned":
        after, flipped, integer = before, 0.0, nearest.float()
    integers = integer.to(nearest.dtype)
    seconds = time.monotonic() - started
    return AdaroundedLayer(name, done, seconds, before, after, flipped, kept, integers)


def adarounded_layers(model: GraphModule) -> tuple[AdaroundedLayer, ...]:
    """What :func:`adaround` did to each of ``model``'s layers (empty if nothing)."""
    return tuple(getattr(model, "meta", {}).get(_KEY, ()))
