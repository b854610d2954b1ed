"""SmoothQuant (Xiao et al., 2023) for linear layers.

A linear's input often has a few channels far larger than the rest (transformer
activations after a LayerNorm): per-tensor activation quantization spends its
levels on them and the other channels drown in rounding. Per input channel ``j``,
``s_j = max|X_j|^alpha / max|W[:, j]|^(1 - alpha)`` moves that range from the
activation into the weights, ``X' = X / s`` and ``W' = W * s``, which the weights'
per-channel (or wider) quantization takes better. ``alpha`` sets how much moves.

The division of ``X`` is folded into the op producing it, where that is exact: a
LayerNorm's weight and bias, or a preceding linear's output rows and bias (a ReLU
between them commutes with the positive ``s``). Elsewhere the linear is left as it
is and reported: an explicit ``X * (1 / s)`` would run in float between the
producer's quantized output and the linear's, a dequantize/quantize round trip and
an observer that no backend config placed. Linears reading one input (q/k/v
projections) share one ``s``.

Runs on a prepared model, FX or PT2E, before calibration: only float weights
change, so observers see the smoothed tensors and the backend's QConfigs (and so
every constraint of its config, such as power-of-two scales) decide the qparams.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.algorithms.layers import (
    InputRecorder,
    Layer,
    check_uncalibrated,
    is_observer,
    layer_name,
    layer_of,
    parameter_reads,
    record_inputs,
    single_use_layers,
    tensor_of,
    unobserved,
    weight_qparams,
)
from qcore.config.errors import describe
from qcore.engine.reference import fake_quantize, qparams_of
from qcore.observers import MinMaxObserver

__all__ = ["SEARCH_ALPHAS", "SmoothedLayers", "smooth_quant", "smoothed_layers"]

aten = torch.ops.aten

SEARCH_ALPHAS = tuple(round(0.1 * step, 1) for step in range(11))
"""The grid ``alpha="search"`` tries per group of linears, after leaving it as it is."""

_SEARCH_ROWS = 4096  # input rows kept per group to score the search's candidates
_RELU = {torch.relu, torch.nn.functional.relu, aten.relu.default, aten.relu_.default, "relu"}
_KEY = "qcore_smoothed_layers"


@dataclass(frozen=True)
class SmoothedLayers:
    """Linears smoothed together (one input, one ``s``) and the op that absorbed
    ``1 / s`` (``source``), or, with ``alpha`` None, linears left as they were and
    why (``skipped``). ``spread_before``/``spread_after``: the largest over the
    smallest per-channel range of their input, before and after."""

    layers: tuple[str, ...]
    source: str
    alpha: float | None
    spread_before: float = 1.0
    spread_after: float = 1.0
    skipped: str = ""


def _is_relu(gm: GraphModule, node: Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), torch.nn.ReLU)
    return node.op in ("call_function", "call_method") and node.target in _RELU


def _producer(gm: GraphModule, node: Node) -> Node:
    """The op making ``node``'s value, past observers and ReLUs (which commute with s > 0)."""
    current = unobserved(gm, node)
    while isinstance(current, Node) and _is_relu(gm, current):
        current = unobserved(gm, current.args[0])
    return current


def _readers(gm: GraphModule, producer: Node) -> list[Node]:
    """The ops reading ``producer``'s value, past observers and ReLUs."""
    found, stack = [], [producer]
    while stack:
        node = stack.pop()
        for user in node.users:
            if is_observer(gm, user) or _is_relu(gm, user):
                stack.append(user)
            else:
                found.append(user)
    return found


def _absorber(gm: GraphModule, node: Node, layers: dict[Node, Layer], channels: int):
    """(weight, bias) ``X / s`` folds into, as rows (linear) or elements (LayerNorm);
    or a reason it cannot. ``layers``: those whose weight and bias no other op reads."""
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), torch.nn.LayerNorm):
        norm = gm.get_submodule(node.target)
        if norm.weight is None or tuple(norm.normalized_shape) != (channels,):
            return f"LayerNorm {node.target!r} has no affine weight over the {channels} channels"
        return _read_once(gm, norm.weight, norm.bias) or "its LayerNorm's weight is read twice"
    if node.op == "call_function" and node.target is aten.layer_norm.default:
        weight = tensor_of(gm, node.args[2] if len(node.args) > 2 else None)
        bias_arg = node.args[3] if len(node.args) > 3 else None
        bias = tensor_of(gm, bias_arg)
        if weight is None or weight.shape != (channels,) or (bias_arg is not None and bias is None):
            return "its layer_norm has no affine weight over the channels"
        return _read_once(gm, weight, bias) or "its layer_norm's weight is read twice"
    layer = layers.get(node)
    if layer is not None and layer.is_linear and layer.weight.shape[0] == channels:
        return layer.weight, layer.bias
    found = layer_of(gm, node)
    if found is not None and found.is_linear and found.weight.shape[0] == channels:
        return f"its producer {_label(node)!r} runs twice, or shares its weight or bias"
    kind = "a model input" if node.op == "placeholder" else repr(_label(node))
    return f"its input comes from {kind}: only a LayerNorm or a linear absorbs 1/s exactly"


def _read_once(gm: GraphModule, weight: torch.Tensor, bias: torch.Tensor | None):
    """(weight, bias) where no other op reads either (a module called twice, a
    LayerNorm whose affine tensors another shares), else None."""
    reads = parameter_reads(gm)
    alone = reads.get(id(weight), 0) == 1 and (bias is None or reads.get(id(bias), 0) == 1)
    return (weight, bias) if alone else None


def _check_alpha(alpha: Any) -> None:
    def fraction(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1

    if alpha == "search" or fraction(alpha):
        return
    if isinstance(alpha, Mapping) and all(
        isinstance(key, str) and fraction(value) for key, value in alpha.items()
    ):
        return
    raise ValueError(
        f"alpha: got {describe(alpha)}; expected a float from 0 to 1, a dict of layer names "
        'to such floats, or "search"'
    )


class _Statistics:
    """Per group: each input channel's largest magnitude, and rows kept for the search."""

    def __init__(self, keep_rows: bool) -> None:
        self.keep_rows = keep_rows
        self.absmax: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []
        self.kept = 0

    def __call__(self, x: torch.Tensor) -> None:
        flat = x.float().reshape(-1, x.shape[-1])
        largest = flat.abs().amax(0)
        self.absmax = largest if self.absmax is None else torch.maximum(self.absmax, largest)
        if self.keep_rows and self.kept < _SEARCH_ROWS:
            self.rows.append(flat[: _SEARCH_ROWS - self.kept].clone())
            self.kept += self.rows[-1].shape[0]


def _scales(absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    wmax = torch.stack([w.detach().abs().amax(0) for w in weights]).amax(0).float()
    scale = torch.ones_like(absmax)
    usable = (absmax > 0) & (wmax > 0)
    scale[usable] = absmax[usable].pow(alpha) / wmax[usable].pow(1 - alpha)
    return scale.clamp(1e-5, 1e5)  # an all-but-zero channel must not blow up the other side


def _search(
    gm: GraphModule,
    scratch: GraphModule,
    group: list[Node],
    layers: dict[Node, Layer],
    stats: _Statistics,
) -> float | None:
    """The alpha of SEARCH_ALPHAS whose quantized outputs best match the float ones,
    or None where the group unsmoothed does better than any."""
    from qcore.pt2e.prepare import PT2E_STATE_KEY

    full_range = PT2E_STATE_KEY not in gm.meta or gm.meta[PT2E_STATE_KEY].full_range
    # Each candidate's s and the input's qparams come from half the batches and the
    # error from the other half: smoothing brings every channel to the range's edge,
    # and an alpha whose range fits only the rows it was computed on clips unseen
    # ones (the deployed model's inputs), which an s from every row would hide.
    fit, x = _halves(stats.rows)
    fit_absmax = fit.abs().amax(0)
    weights = [layers[node].weight.detach().float() for node in group]
    expected = [x @ w.t() for w in weights]
    errors = []
    candidates = (None, *SEARCH_ALPHAS)
    for alpha in candidates:
        scale = (
            torch.ones_like(fit_absmax) if alpha is None else _scales(fit_absmax, weights, alpha)
        )
        smoothed = x / scale
        observer = gm.get_submodule(group[0].args[0].target)
        if getattr(observer, "is_dynamic", False):  # quantized per batch at run time
            observer = MinMaxObserver(dtype=observer.dtype)
        else:
            observer = copy.deepcopy(observer)
        observer(fit / scale)
        _, x_q = fake_quantize(smoothed, qparams_of(observer, full_range=full_range))
        error = 0.0
        for node, weight, target in zip(group, weights, expected, strict=True):
            twin = next(n for n in scratch.graph.nodes if n.name == node.name)
            layer = layer_of(scratch, twin)
            layer.weight.data.copy_(weight * scale)
            _, w_q = fake_quantize(layer.weight, weight_qparams(scratch, twin, layer, fresh=True))
            error += float((x_q @ w_q.float().t() - target).pow(2).mean())
        errors.append(error)
    return candidates[min(range(len(errors)), key=errors.__getitem__)]


def _halves(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Alternate batches, or the two halves of a lone batch's rows."""
    if len(rows) > 1:
        return torch.cat(rows[::2]), torch.cat(rows[1::2])
    middle = max(1, rows[0].shape[0] // 2)
    return rows[0][:middle], rows[0][middle:] if rows[0].shape[0] > 1 else rows[0]


def _label(node: Node) -> str:
    """A module's path (FX), else the node's name (``layer_norm``, ``add``)."""
    return str(node.target) if node.op == "call_module" else node.name


def _spread(ranges: torch.Tensor) -> float:
    positive = ranges[ranges > 0]
    return float(positive.max() / positive.min()) if positive.numel() else 1.0


def smooth_quant(
    prepared: GraphModule,
    calibration_data: Iterable[Any],
    *,
    alpha: float | Mapping[str, float] | str = 0.5,
    input_fn: Callable[[Any], Any] | None = None,
) -> GraphModule:
    """SmoothQuant of a prepared model's linears (FX or PT2E), before calibration.

    Returns a copy (the model passed in is not changed) in which each quantized
    linear whose input a LayerNorm or another linear produces has that input's
    per-channel range divided by ``s`` and its weight's input channels multiplied
    by it: the float function is the same. Statistics come from running the model
    on ``calibration_data`` (batches as ``qcore.quantize`` takes them), without
    touching its observers; calibrate the result as usual.

    ``alpha``: how much of the activations' range moves to the weights, from 0 to 1
    (0.5, the paper's default; more for larger outliers); a dict ``{layer: alpha}``
    by module name (``"blocks.0.attn.q"``) smooths those layers alone; ``"search"``
    tries ``SEARCH_ALPHAS`` per group of linears sharing an input and keeps the one
    whose quantized output is closest to the float one on the calibration data, or
    leaves the group as it is where that is closer still.
    ``qcore.algorithms.smoothed_layers(model)`` lists what was smoothed, with which
    alpha, and the linears left as they were with the reason.

    Example::

        >>> prepared = qcore.prepare_pt2e(exported, "x86")
        >>> prepared = qcore.smooth_quant(prepared, calibration_data, alpha="search")
        >>> for batch in calibration_data:
        ...     prepared(*batch)
        >>> quantized = qcore.convert_pt2e(prepared)
    """
    if not isinstance(prepared, GraphModule):
        raise TypeError(
            f"prepared: got {describe(prepared)}; expected a model from qcore.prepare_fx or "
            "qcore.prepare_pt2e, not yet calibrated"
        )
    _check_alpha(alpha)
    check_uncalibrated(prepared, "smooth_quant rescales the activations it observes")
    gm = copy.deepcopy(prepared)
    layers = single_use_layers(gm)
    candidates = [
        node
        for node, layer in layers.items()
        if layer.is_linear
        and isinstance(node.args[0], Node)
        and is_observer(gm, node.args[0])  # the input is quantized
        and weight_qparams(gm, node, layer, fresh=True) is not None
    ]
    names = {node: layer_name(gm, node) for node in candidates}
    if isinstance(alpha, Mapping):
        unknown = sorted(set(alpha) - set(names.values()))
        if unknown:
            raise ValueError(
                f"alpha: names no quantized linear of this model: {', '.join(map(repr, unknown))}"
                f"; its linears are {sorted(names.values())}"
            )
    groups: dict[Node, list[Node]] = {}
    for node in candidates:
        groups.setdefault(_producer(gm, node.args[0]), []).append(node)
    results: list[SmoothedLayers] = []
    plans: dict[Node, tuple[Any, Any]] = {}
    for producer, group in groups.items():
        label = tuple(names[node] for node in group)
        wanted = alpha if not isinstance(alpha, Mapping) else {alpha.get(n) for n in label}
        if isinstance(wanted, set):
            wanted.discard(None)
            if len(wanted) > 1:
                raise ValueError(
                    f"alpha: linears {list(label)} share one input and so one s; got different "
                    f"alphas {sorted(wanted)} for them"
                )
            if not wanted:
                continue  # not asked for
            (wanted,) = wanted
        others = [user for user in _readers(gm, producer) if user not in group]
        absorber = _absorber(gm, producer, layers, layers[group[0]].weight.shape[1])
        if others and not isinstance(absorber, str):
            absorber = f"its input also feeds {others[0].name}, which would see X / s"
        if isinstance(absorber, str):
            results.append(SmoothedLayers(label, _label(producer), None, skipped=absorber))
            continue
        plans[producer] = (wanted, absorber)
    recorder = InputRecorder(copy.deepcopy(gm), {})
    twins = {n.name: n for n in recorder.module.graph.nodes}
    stats = {p: _Statistics(plans[p][0] == "search") for p in plans}
    recorder.watched = {twins[groups[p][0].name]: stats[p] for p in plans}
    record_inputs(recorder, prepared, calibration_data, input_fn)
    # the search's candidates go into a copy's weights, never the model's
    scratch = copy.deepcopy(gm) if any(w == "search" for w, _ in plans.values()) else gm
    with torch.no_grad():
        for producer, (wanted, (weight, bias)) in plans.items():
            group, found = groups[producer], stats[producer]
            if found.absmax is None:  # not reached on this data (a branch not taken)
                continue
            label = tuple(names[node] for node in group)
            if wanted == "search":
                wanted = _search(gm, scratch, group, layers, found)
                if wanted is None:
                    reason = "alpha='search': its quantized output is closest unsmoothed"
                    results.append(SmoothedLayers(label, _label(producer), None, skipped=reason))
                    continue
            scale = _scales(found.absmax, [layers[n].weight for n in group], float(wanted))
            for node in group:
                layers[node].weight.data.mul_(scale.to(layers[node].weight.dtype))
            shape = (-1,) + (1,) * (weight.dim() - 1)  # LayerNorm: (C,); linear: rows (C, in)
            weight.data.div_(scale.reshape(shape).to(weight.dtype))
            if bias is not None:
                bias.data.div_(scale.to(bias.dtype))
            before, after = _spread(found.absmax), _spread(found.absmax / scale)
            results.append(SmoothedLayers(label, _label(producer), float(wanted), before, after))
    gm.meta[_KEY] = tuple(results)
    return gm


def smoothed_layers(model: GraphModule) -> tuple[SmoothedLayers, ...]:
    """What :func:`smooth_quant` did to ``model``'s linears (empty if nothing)."""
    return tuple(getattr(model, "meta", {}).get(_KEY, ()))
