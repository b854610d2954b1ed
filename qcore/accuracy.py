"""Keep the fewest layers float that bring the model within an accuracy budget.

``qcore.quantize(..., accuracy_budget=...)`` runs this module. The budget is
one of:

* :class:`MinSQNR`: the quantized model's outputs must have a signal-to-
  quantization-noise ratio of at least ``db`` dB against the float model's, on
  the calibration data or on ``eval_data``; a plain ``30.0`` means ``MinSQNR(db=30.0)``;
* :class:`MetricBudget`: the user's metric, called as NNCF calls its
  ``validation_fn``: ``metric(model, eval_data) -> float``; the quantized model
  may score at most ``max_drop`` worse than the float model does.

The search (NNCF's ``quantize_with_accuracy_control`` and Intel Neural
Compressor's accuracy-driven tuning work alike): measure the converted model;
rank each candidate (the conv/linear layers, and the quantized function calls
such as add, matmul and cat) by how much keeping it alone float improves the
measure (a metric's ties, common with top-1 accuracy, by how much it improves
the SQNR on the calibration data); keep candidates float in that order until
the budget is met; then try each kept one int8 again, least sensitive first,
and quantize it where the others already meet the budget, repeating until none
can go. Explain gives each kept one the measure with it float and with it int8.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule
from torch.utils._pytree import tree_leaves

from qcore.config.errors import QCoreWarning, describe
from qcore.keep_float import Build, mark_kept_float

__all__ = [
    "AccuracyBudgetNotMet",
    "MetricBudget",
    "MinSQNR",
    "as_budget",
    "gauge_for",
    "keep_float_for_budget",
    "sqnr",
]

_DROP_TYPES = ("absolute", "relative")


def _check_number(name: str, value: Any, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise TypeError(f"{name}: got {describe(value)}; expected {expected}")
    return float(value)


def _check_eval_data(owner: str, eval_data: Any) -> None:
    if eval_data is None:
        return
    if isinstance(eval_data, (torch.Tensor, dict, str, bytes)) or not isinstance(
        eval_data, Iterable
    ):
        raise TypeError(
            f"{owner}.eval_data: got {describe(eval_data)}; expected None (the calibration "
            "data) or an iterable of batches in the calibration data's form, e.g. [x1, x2]"
        )


@dataclass(frozen=True)
class MinSQNR:
    """Budget: the quantized model's outputs at least ``db`` dB SQNR against float.

    SQNR is 10·log10(Σ‖float‖² / Σ‖float − quantized‖²), summed over every batch of
    ``eval_data`` (default: the calibration data) and every floating-point tensor
    the model returns. ``eval_data`` batches take the calibration data's form.

    Example::

        >>> quantized = qcore.quantize(model, (x,), data, backend="x86",
        ...                            accuracy_budget=qcore.MinSQNR(db=30.0))
    """

    db: float
    eval_data: Iterable[Any] | None = None

    def __post_init__(self) -> None:
        db = _check_number("MinSQNR.db", self.db, "a number of decibels, e.g. 30.0")
        if math.isinf(db):
            raise ValueError(
                f"MinSQNR.db: got {describe(self.db)}; expected a finite number of decibels "
                "(an infinite SQNR means outputs equal to float's: quantize nothing instead)"
            )
        _check_eval_data("MinSQNR", self.eval_data)


@dataclass(frozen=True)
class MetricBudget:
    """Budget: the user's metric on the quantized model at most ``max_drop`` worse
    than on the float model.

    ``metric(model, eval_data)`` returns a number (NNCF's ``validation_fn``
    convention); it is called once on the float model and once per candidate
    model, with ``eval_data`` (default: the calibration data) as given.
    ``drop_type="absolute"`` allows ``float_score - max_drop`` (for
    ``higher_is_better``; ``+`` otherwise); ``"relative"`` allows a drop of
    ``max_drop * |float_score|``.

    Example::

        >>> def accuracy(model, loader):
        ...     return sum(float((model(x).argmax(1) == y).float().mean()) for x, y in loader)
        >>> budget = qcore.MetricBudget(accuracy, max_drop=0.01, eval_data=val_loader)
        >>> quantized = qcore.quantize(model, (x,), calib_loader, accuracy_budget=budget)
    """

    metric: Callable[[torch.nn.Module, Any], float]
    max_drop: float = 0.01
    drop_type: str = "absolute"
    higher_is_better: bool = True
    eval_data: Iterable[Any] | None = None

    def __post_init__(self) -> None:
        if not callable(self.metric):
            raise TypeError(
                f"MetricBudget.metric: got {describe(self.metric)}; expected a function "
                "metric(model, eval_data) -> float"
            )
        drop = _check_number("MetricBudget.max_drop", self.max_drop, "a number >= 0, e.g. 0.01")
        if not drop >= 0 or math.isinf(drop):
            raise ValueError(
                f"MetricBudget.max_drop: got {describe(self.max_drop)}; expected a finite "
                "number >= 0, the largest drop allowed, e.g. 0.01"
            )
        if self.drop_type not in _DROP_TYPES:
            raise ValueError(
                f"MetricBudget.drop_type: got {describe(self.drop_type)}; expected "
                "'absolute' or 'relative'"
            )
        if not isinstance(self.higher_is_better, bool):
            raise TypeError(
                f"MetricBudget.higher_is_better: got {describe(self.higher_is_better)}; "
                "expected True or False"
            )
        _check_eval_data("MetricBudget", self.eval_data)


Budget = MinSQNR | MetricBudget


class AccuracyBudgetNotMet(QCoreWarning):
    """No choice of layers kept float met the accuracy budget; the model returned
    is the one that came closest."""


def as_budget(value: Any) -> Budget | None:
    """``accuracy_budget``'s value as a budget: None, a budget, or a number (dB)."""
    if value is None or isinstance(value, (MinSQNR, MetricBudget)):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return MinSQNR(db=value)
    raise TypeError(
        f"accuracy_budget: got {describe(value)}; expected qcore.MinSQNR(db=...), "
        "qcore.MetricBudget(metric, max_drop=...), a number (minimum SQNR in dB) or None"
    )


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    reference, actual = reference.detach(), actual.detach()  # outputs of a model with grads
    noise = (reference - actual).norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(reference.norm() / noise))


def _float_leaves(output: Any) -> list[torch.Tensor]:
    return [
        leaf.detach().float()
        for leaf in tree_leaves(output)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    ]


class _Gauge:
    """One budget made concrete: a model's score (higher is better after
    ``sign``), whether it meets the budget, and how to say it."""

    def __init__(
        self,
        measure: Callable[[torch.nn.Module], float],
        threshold: float,
        sign: float,
        name: str,
        number: Callable[[float], str],
        budget: str,
    ) -> None:
        self.measure, self.threshold, self.sign = measure, threshold, sign
        self.name, self.number, self.budget = name, number, budget
        # Ranks layers whose measures tie: a metric such as top-1 accuracy often
        # moves only once several layers are float, and then every layer alone ties.
        self.tiebreak: Callable[[torch.nn.Module], float] | None = None

    def show(self, value: float) -> str:
        return f"{self.name} {self.number(value)}"

    def key(self, value: float) -> float:
        return self.sign * value

    def meets(self, value: float) -> bool:
        return self.key(value) >= self.key(self.threshold)


def sqnr_gauge(model: torch.nn.Module, calls: Sequence[tuple[tuple, dict]], db: float) -> _Gauge:
    """MinSQNR over ``calls`` (``(args, kwargs)`` per batch) against ``model``'s outputs."""
    with torch.no_grad():
        references = [_float_leaves(model(*args, **kwargs)) for args, kwargs in calls]
    signal = sum(float(t.pow(2).sum()) for ref in references for t in ref)

    def measure(candidate: torch.nn.Module) -> float:
        noise = 0.0
        with torch.no_grad():
            for (args, kwargs), ref in zip(calls, references, strict=True):
                out = _float_leaves(candidate(*args, **kwargs))
                noise += sum(float((r - o).pow(2).sum()) for r, o in zip(ref, out, strict=True))
        if noise == 0:
            return math.inf
        return 10 * math.log10(signal / noise) if signal > 0 else -math.inf

    return _Gauge(measure, db, 1.0, "SQNR", lambda v: f"{v:.1f} dB", f"{db:g} dB")


def metric_gauge(model: torch.nn.Module, budget: MetricBudget, eval_data: Any) -> _Gauge:
    """MetricBudget: the threshold from the float model's score."""

    def measure(candidate: torch.nn.Module) -> float:
        with torch.no_grad():
            score = budget.metric(candidate, eval_data)
        if isinstance(score, torch.Tensor) and score.numel() == 1:
            score = score.item()
        if isinstance(score, bool) or not isinstance(score, numbers.Real) or math.isnan(score):
            raise TypeError(
                f"MetricBudget.metric: returned {describe(score)}; expected a number "
                "(higher is better unless higher_is_better=False)"
            )
        return float(score)

    base = measure(model)
    sign = 1.0 if budget.higher_is_better else -1.0
    drop = budget.max_drop * (abs(base) if budget.drop_type == "relative" else 1.0)
    threshold = base - sign * drop

    bound = "at least" if budget.higher_is_better else "at most"
    text = (
        f"{bound} {threshold:.4g} (float {base:.4g}, max_drop {budget.max_drop:g} "
        f"{budget.drop_type})"
    )
    return _Gauge(measure, threshold, sign, "metric", lambda v: f"{v:.4g}", text)


def gauge_for(
    budget: Budget,
    model: torch.nn.Module,
    calibration_data: Sequence[Any],
    input_fn: Callable[[Any], Any] | None = None,
) -> _Gauge:
    """``budget`` measured against the float ``model`` on its ``eval_data``, else
    on ``calibration_data`` (batches read as ``qcore.quantize`` reads them)."""
    data = calibration_data if budget.eval_data is None else list(budget.eval_data)
    if isinstance(budget, MinSQNR):
        return sqnr_gauge(model, _calls(model, data, input_fn), float(budget.db))
    gauge = metric_gauge(model, budget, data)  # eval_data in the metric's own form
    gauge.tiebreak = sqnr_gauge(model, _calls(model, calibration_data, input_fn), 0.0).measure
    return gauge


def _calls(model: torch.nn.Module, data: Any, input_fn: Any) -> list[tuple[tuple, dict]]:
    from qcore.calibration import calibration_calls

    calls = list(calibration_calls(model, data, input_fn))
    if not calls:
        raise ValueError(
            "accuracy_budget: no batches to measure on (the calibration data, or "
            "MinSQNR.eval_data, is empty)"
        )
    return calls


def keep_float_for_budget(
    build: Build,
    candidates: Sequence[str],
    gauge: _Gauge,
    float_with: Mapping[str, Sequence[str]] | None = None,
    *,
    mark: Callable[[GraphModule, Mapping[str, str]], GraphModule] = mark_kept_float,
) -> GraphModule:
    """The model ``build`` gives with the fewest of ``candidates`` float that meets
    ``gauge``'s budget; explain gives each kept layer both measures.

    Then, where that kept k > 2, a greedy search (each step the candidate that
    helps most with those already kept) for at most k - 1 steps, so the answer
    never keeps more than greedy's; its answer pruned the same way.

    Builds: 1 (all int8) + N (each candidate float alone) + at most N - 1 (the
    ranked prefixes) + at most k(k+1)/2 (trying each of the k kept int8 again,
    once more after each one that could go) + at most (k - 2)(N - 1) (greedy's
    steps after the first, which is the ranking's) + its pruning: with N
    candidates, at most 2N + 1 when one suffices, else at most kN + k². Where no
    choice meets the budget it warns (:class:`AccuracyBudgetNotMet`) and returns
    the best model measured.
    ``float_with`` names what ``build`` keeps float along with a candidate (its
    activation: :func:`qcore.keep_float.followers`); explain gives them its reason.
    ``mark(model, reasons)`` records each kept candidate's reason for explain
    (:func:`qcore.keep_float.mark_kept_float`; the PT2E path's reads module paths).

    Example (``build(names)`` converts with those modules' QConfigs None)::

        >>> gauge = gauge_for(qcore.MinSQNR(db=30.0), model, batches)
        >>> chosen = keep_float_for_budget(build, ["conv1", "layer1.0.conv1", "fc"], gauge)
        >>> print(qcore.explain(chosen))
    """
    candidates = list(dict.fromkeys(candidates))  # a module called twice is one candidate
    values: dict[frozenset[str], float] = {}
    ties: dict[frozenset[str], float] = {}
    meeting: dict[frozenset[str], GraphModule] = {}
    best: list[Any] = [None, -math.inf, None]  # kept, key, model

    def measure(kept: frozenset[str], rank: bool = False) -> float:
        if kept not in values:
            model = build(kept)
            value = values[kept] = gauge.measure(model)
            if rank and gauge.tiebreak is not None:
                ties[kept] = gauge.tiebreak(model)
            if gauge.meets(value):
                meeting[kept] = model
            if best[2] is None or gauge.key(value) > best[1]:
                best[:] = [kept, gauge.key(value), model]
        return values[kept]

    if gauge.meets(measure(frozenset())):
        return best[2]
    gains = {name: gauge.key(measure(frozenset({name}), rank=True)) for name in candidates}
    ranked = sorted(  # stable: ties in graph order
        candidates, key=lambda name: (-gains[name], -ties.get(frozenset({name}), 0.0))
    )
    kept: list[str] = []
    for name in ranked:
        kept.append(name)
        if gauge.meets(measure(frozenset(kept))):
            break
    else:
        model = _not_met(best[2], best[0], values[best[0]], gauge, len(candidates))
        return mark(
            model, _with_followers(_not_met_reasons(best[0], values[best[0]], gauge), float_with)
        )

    def pruned(chosen: frozenset[str]) -> frozenset[str]:
        removed = True
        while removed:  # least sensitive first; again after each removal
            removed = False
            for name in reversed([n for n in ranked if n in chosen]):
                trial = chosen - {name}
                if gauge.meets(measure(trial)):
                    meeting.pop(chosen)  # never returned to: free its model
                    chosen, removed = trial, True
        return chosen

    chosen = pruned(frozenset(kept))
    # Ranking alone can pick layers that help alone but not together. A greedy search
    # (each step keeps float the candidate that helps most with those already kept)
    # runs while it could still need fewer: its first step is the ranking's builds.
    greedy: frozenset[str] = frozenset()
    for _ in range(len(chosen) - 1):
        steps = [greedy | {name} for name in ranked if name not in greedy]
        greedy = max(steps, key=lambda trial: gauge.key(measure(trial)))
        if gauge.meets(values[greedy]):
            meeting.pop(chosen)
            chosen = pruned(greedy)
            break
    reasons = {
        name: (
            f"kept float (accuracy budget): {gauge.show(values[chosen])} with it float, "
            f"{gauge.number(values[chosen - {name}])} int8; budget {gauge.budget}"
        )
        for name in chosen
    }
    return mark(meeting[chosen], _with_followers(reasons, float_with))


def _with_followers(
    reasons: dict[str, str], float_with: Mapping[str, Sequence[str]] | None
) -> dict[str, str]:
    """Each kept candidate's reason, also for what went float with it."""
    result = dict(reasons)
    for name, reason in reasons.items():
        for follower in (float_with or {}).get(name, ()):
            result.setdefault(follower, f"{reason} (with {name})")
    return result


def _not_met_reasons(kept: frozenset[str], value: float, gauge: _Gauge) -> dict[str, str]:
    reason = (
        f"kept float (accuracy budget not met): {gauge.show(value)} with these {len(kept)} "
        f"float, the best found; budget {gauge.budget}"
    )
    return dict.fromkeys(kept, reason)


def _not_met(
    model: GraphModule, kept: frozenset[str], value: float, gauge: _Gauge, candidates: int
) -> GraphModule:
    names = ", ".join(sorted(kept)) or "none"
    warnings.warn(
        f"accuracy_budget: {gauge.budget} not met: the best found is {gauge.show(value)} with "
        f"{len(kept)} of {candidates} candidates float ({names}). Returning that model. "
        "The quantized ops that are no candidates (modules other than conv/linear, method "
        "calls) still lose accuracy: set their QConfigs to None in qconfig_mapping, or "
        "lower the budget",
        AccuracyBudgetNotMet,
        stacklevel=4,  # the caller of qcore.quantize
    )
    return model
