"""SmoothQuant (Xiao et al., 2023) for linear layers.

A linear's input often has a few channels far larger than the rest (transformer
activations after a LayerNorm): per-tensor activation quantization spends its
levels on them and the other channels drown in rounding. Per input channel ``j``,
``s_j = max|X_j|^alpha / max|W[:, j]|^(1 - alpha)`` moves that range from the
activation into the weights, ``X' = X / s`` and ``W' = W * s``, which the weights'
per-channel (or wider) quantization takes better. ``alpha`` sets how much moves.

The division of ``X`` is folded into the op producing it, where that is exact: a
LayerNorm's weight and bias, or a preceding linear's output rows and bias (a ReLU
or an eval-mode dropout between them commutes with the positive ``s``). Elsewhere
the linear is left as it is and reported: an explicit ``X * (1 / s)`` would run in
float between the producer's quantized output and the linear's, a dequantize/quantize
round trip and an observer that no backend config placed. Linears reading one input (q/k/v
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
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Interpreter, Node

from qcore.algorithms.layers import (
    InputRecorder,
    Layer,
    check_uncalibrated,
    is_observer,
    is_observer_module,
    layer_name,
    layer_of,
    parameter_reads,
    positional_batches,
    single_use_layers,
    tensor_of,
    unobserved,
    weight_qparams,
)
from qcore.algorithms.simulated import simulated_outputs
from qcore.config.errors import describe

__all__ = ["SEARCH_ALPHAS", "SmoothedLayers", "smooth_quant", "smoothed_layers"]

aten = torch.ops.aten

SEARCH_ALPHAS = tuple(round(0.1 * step, 1) for step in range(11))
"""The grid ``alpha="search"`` tries per group of linears, against leaving it as it is
(alpha 0 is not that: ``s = 1 / max|W|``, the weights' range moved into the input)."""

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


#: Dropout calls and the positions and defaults of (p, train, inplace): aten's and
#: torch.dropout(input, p, train), F.dropout(input, p=0.5, training=True, inplace=False).
_DROPOUT = {
    aten.dropout.default: (("p", "train"), (None, None)),
    torch.dropout: (("p", "train"), (None, None)),
    torch.nn.functional.dropout: (("p", "training", "inplace"), (0.5, True, False)),
}


def _is_eval_dropout(gm: GraphModule, node: Node) -> bool:
    """A dropout that is the identity: aten's ``dropout(x, p, train=False)`` (what
    torch.export records for an eval-mode ``nn.Dropout``), a ``nn.Dropout`` module not
    in training mode, ``F.dropout(x, training=False)``; or any of them with ``p == 0``.
    In-place ones are not (they write their input)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return (
            isinstance(module, torch.nn.Dropout)
            and not module.inplace
            and (not module.training or module.p == 0)
        )
    if node.op != "call_function" or node.target not in _DROPOUT:
        return False
    names, defaults = _DROPOUT[node.target]
    values = dict(zip(names, defaults, strict=True))
    values.update(zip(names, node.args[1:], strict=False))
    values.update((key, value) for key, value in node.kwargs.items() if key in values)
    if values.get("inplace"):
        return False
    return values[names[1]] is False or values["p"] == 0


def _passes_s(gm: GraphModule, node: Node) -> bool:
    """``node`` commutes with a positive per-channel ``s``: a ReLU, or a dropout that
    is the identity (eval mode)."""
    return _is_relu(gm, node) or _is_eval_dropout(gm, node)


def _producer(gm: GraphModule, node: Node) -> Node:
    """The op making ``node``'s value, past observers, ReLUs and eval-mode dropouts
    (which commute with s > 0)."""
    current = unobserved(gm, node)
    while isinstance(current, Node) and _passes_s(gm, current):
        current = unobserved(gm, current.args[0])
    return current


def _readers(gm: GraphModule, producer: Node) -> list[Node]:
    """The ops reading ``producer``'s value, past observers, ReLUs and eval-mode dropouts."""
    found, stack = [], [producer]
    while stack:
        node = stack.pop()
        for user in node.users:
            if is_observer(gm, user) or _passes_s(gm, user):
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
    """Per group: each input channel's largest magnitude, overall and per batch."""

    def __init__(self) -> None:
        self.absmax: torch.Tensor | None = None
        self.per_batch: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor) -> None:
        largest = x.float().reshape(-1, x.shape[-1]).abs().amax(0)
        self.per_batch.append(largest)
        self.absmax = largest if self.absmax is None else torch.maximum(self.absmax, largest)


def _scales(absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    wmax = torch.stack([w.detach().abs().amax(0) for w in weights]).amax(0).float()
    scale = torch.ones_like(absmax)
    usable = (absmax > 0) & (wmax > 0)
    scale[usable] = absmax[usable].pow(alpha) / wmax[usable].pow(1 - alpha)
    return scale.clamp(1e-5, 1e5)  # an all-but-zero channel must not blow up the other side


def _rescale(
    weights: list[torch.Tensor],
    absorber: tuple[torch.Tensor, torch.Tensor | None],
    scale: torch.Tensor,
) -> None:
    """``W * s`` for the group's linears, ``/ s`` for the op producing their input."""
    for weight in weights:
        weight.data.mul_(scale.to(weight.dtype))
    weight, bias = absorber
    shape = (-1,) + (1,) * (weight.dim() - 1)  # LayerNorm: (C,); linear: rows (C, in)
    weight.data.div_(scale.reshape(shape).to(weight.dtype))
    if bias is not None:
        bias.data.div_(scale.to(bias.dtype))


class _Fold:
    """One fold of the search: a copy of the model whose weights take the
    candidates, calibrated on the ``fit`` batches and run as converted on ``held``."""

    def __init__(self, gm: GraphModule, fit: list[tuple], held: list[int]) -> None:
        from qcore.pt2e.prepare import PT2E_STATE_KEY

        self.memo: dict[int, Any] = {}
        self.model = copy.deepcopy(gm, self.memo)
        self.fit, self.held = fit, held
        self.full_range = PT2E_STATE_KEY not in gm.meta or gm.meta[PT2E_STATE_KEY].full_range
        # each observer as it was before calibration, with every name it has (an
        # observer shared by several nodes is one module, and stays one)
        self.observers: dict[int, tuple[list[str], torch.nn.Module]] = {}
        for name, module in self.model.named_modules(remove_duplicate=False):
            if is_observer_module(module):
                entry = self.observers.setdefault(id(module), ([], copy.deepcopy(module)))
                entry[0].append(name)

    def twin(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """The fold's copy of one of the original model's tensors."""
        return None if tensor is None else self.memo[id(tensor)]

    def outputs(self, batches: list[tuple]) -> list[Any]:
        """The held-out batches' outputs, as converted after calibration on ``fit``."""
        for names, pristine in self.observers.values():
            fresh = copy.deepcopy(pristine)
            for name in names:
                owner, _, attribute = name.rpartition(".")
                setattr(self.model.get_submodule(owner) if owner else self.model, attribute, fresh)
        with torch.no_grad():
            for args in self.fit:
                Interpreter(self.model).run(*args)
        qparams = {}
        for node in self.model.graph.nodes:
            layer = layer_of(self.model, node) if node.op == "call_module" else None
            if layer is not None:  # FX: quantized at convert (PT2E: observed in the graph)
                qparams[node] = weight_qparams(self.model, node, layer)
        held = [batches[i] for i in self.held]
        return simulated_outputs(self.model, qparams, held, self.full_range)


def _search(
    gm: GraphModule,
    plans: dict[Node, tuple[Any, Any]],
    groups: dict[Node, list[Node]],
    layers: dict[Node, Layer],
    stats: dict[Node, _Statistics],
    batches: list[tuple],
) -> dict[Node, float | None]:
    """Each group's alpha, greedily in graph order: the one of SEARCH_ALPHAS whose
    model output, quantized as convert computes it, is closest to the float one,
    the groups before it smoothed as chosen and those after it as they are; None
    (the group left as it is) unless that alpha's error is lower by more than its
    standard error (paired, per output row).

    A group's own output is not the measure: smoothing one linear's input changes
    the rows of the linear producing it (their per-tensor weight range) and the
    quantization noise every later layer receives; the example MLP's groups, each
    picked by its own output, gave 36.3 dB where leaving them all gave 39.5.

    Two folds: each candidate's s and the observers' calibration come from every
    other batch and the error from the rest, then the other way round, so every
    batch is scored once by a model that did not see it. Smoothing brings every
    channel to the range's edge, and an alpha whose range fits only the batches it
    was computed on clips unseen ones (the deployed model's inputs), which s and
    qparams from the scored batches would hide. A lone batch is both."""
    searched = [p for p in plans if stats[p].absmax is not None]
    if not searched:
        return {}
    indices = list(range(len(batches)))
    splits = [(indices[::2], indices[1::2]), (indices[1::2], indices[::2])]
    if len(batches) < 2:
        splits = [(indices, indices)]
    folds = [_Fold(gm, [batches[i] for i in fit], held) for fit, held in splits]
    expected = simulated_outputs(gm, {}, batches, folds[0].full_range, quantized=False)
    signal = _signal(expected)

    def errors(changes: list[tuple[list[torch.Tensor], Any, torch.Tensor] | None]):
        """Each scored output row's squared error, each fold with its own s."""
        found = []
        for fold, change in zip(folds, changes, strict=True):
            if change is None:
                got = fold.outputs(batches)
            else:
                weights, absorber, scale = change
                tensors = [t for t in (*weights, *absorber) if t is not None]
                originals = [t.detach().clone() for t in tensors]
                _rescale(weights, absorber, scale)
                try:
                    got = fold.outputs(batches)
                finally:
                    for tensor, original in zip(tensors, originals, strict=True):
                        tensor.data.copy_(original)
            found.append(_row_errors([expected[i] for i in fold.held], got, signal))
        return torch.cat(found)

    current = errors([None] * len(folds))
    chosen: dict[Node, float | None] = {}
    for producer in searched:
        _, (weight, bias) = plans[producer]
        per_batch = stats[producer].per_batch
        changes = []
        for fold, (fit, _) in zip(folds, splits, strict=True):
            weights = [fold.twin(layers[node].weight) for node in groups[producer]]
            absmax = torch.stack([per_batch[i] for i in fit]).amax(0)
            changes.append((weights, (fold.twin(weight), fold.twin(bias)), absmax))
        by_alpha = {}
        for alpha in SEARCH_ALPHAS:
            trial = [(w, a, _scales(absmax, w, alpha)) for w, a, absmax in changes]
            by_alpha[alpha] = (trial, errors(trial))
        alpha = min(by_alpha, key=lambda a: float(by_alpha[a][1].sum()))
        trial, candidate = by_alpha[alpha]
        gain = current - candidate
        chosen[producer] = None
        if float(gain.sum()) > _SIGNIFICANCE * _standard_error(gain):
            chosen[producer], current = alpha, candidate
            for weights, absorber, scale in trial:
                _rescale(weights, absorber, scale)
    return chosen


_SIGNIFICANCE = 1.0  # standard errors a candidate's gain must exceed to be kept


def _standard_error(gains: torch.Tensor) -> float:
    """The standard error of the sum of per-row gains (0 for a single row)."""
    return float(gains.std()) * gains.numel() ** 0.5 if gains.numel() > 1 else 0.0


def _leaves(output: Any) -> list[torch.Tensor | None]:
    return [
        leaf if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else None
        for leaf in pytree.tree_leaves(output)
    ]


def _signal(outputs: list[Any]) -> list[float]:
    """Per output (a leaf of the output's pytree), its squared magnitude over every batch."""
    totals: list[float] = []
    for output in outputs:
        for index, leaf in enumerate(_leaves(output)):
            if index == len(totals):
                totals.append(0.0)
            if leaf is not None:
                totals[index] += float(leaf.double().pow(2).sum())
    return [max(total, 1e-30) for total in totals]


def _row_errors(expected: list[Any], got: list[Any], signal: list[float]) -> torch.Tensor:
    """Each output row's squared error (over its last dimension) divided by that
    output's squared magnitude: their sum over every batch is 1 / SQNR, scale-free
    and summed over the outputs."""
    rows = [torch.zeros(0, dtype=torch.float64)]
    for want_batch, have_batch in zip(expected, got, strict=True):
        pairs = zip(_leaves(want_batch), _leaves(have_batch), strict=True)
        for index, (want, have) in enumerate(pairs):
            if want is None or have is None:
                continue
            squared = (have.double() - want.double()).pow(2)
            width = squared.shape[-1] if squared.dim() else 1
            rows.append(squared.reshape(-1, max(width, 1)).sum(1) / signal[index])
    return torch.cat(rows)


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
    tries ``SEARCH_ALPHAS`` per group of linears sharing an input, in graph order,
    and keeps the one whose model output, quantized as convert computes it, is
    closest to the float one on calibration batches its s and qparams did not come
    from, or leaves the group as it is unless that alpha is better by more than the
    noise of the estimate. It runs the model about 2 x 11 times over the
    calibration data per group.
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
    stats = {p: _Statistics() for p in plans}
    recorder.watched = {twins[groups[p][0].name]: stats[p] for p in plans}
    batches = list(positional_batches(prepared, calibration_data, input_fn))
    with torch.no_grad():
        for args in batches:
            recorder.run(*args)
    searched = _search(gm, plans, groups, layers, stats, batches) if alpha == "search" else {}
    with torch.no_grad():
        for producer, (wanted, absorber) in plans.items():
            group, found = groups[producer], stats[producer]
            if found.absmax is None:  # not reached on this data (a branch not taken)
                continue
            label = tuple(names[node] for node in group)
            if wanted == "search":
                wanted = searched[producer]
                if wanted is None:
                    reason = "alpha='search': the model's quantized output is closest unsmoothed"
                    results.append(SmoothedLayers(label, _label(producer), None, skipped=reason))
                    continue
            scale = _scales(found.absmax, [layers[n].weight for n in group], float(wanted))
            _rescale([layers[n].weight for n in group], absorber, scale)
            before, after = _spread(found.absmax), _spread(found.absmax / scale)
            results.append(SmoothedLayers(label, _label(producer), float(wanted), before, after))
    gm.meta[_KEY] = tuple(results)
    return gm


def smoothed_layers(model: GraphModule) -> tuple[SmoothedLayers, ...]:
    """What :func:`smooth_quant` did to ``model``'s linears (empty if nothing)."""
    return tuple(getattr(model, "meta", {}).get(_KEY, ()))
