"""Non-finite and huge calibration values: what observers do with them, and the checks
convert runs before it reads any observer.

**NaN and ±inf are skipped.** Every qcore observer records the finite values of a
tensor only and counts the others in ``nonfinite_skipped``; ``convert_fx``,
``convert_to_reference_fx`` and ``convert_pt2e`` then emit one
:class:`NonFiniteValuesWarning` naming each observer that skipped values and how
many. torch.ao's MinMaxObserver propagates a NaN instead (every later scale is
NaN), and its HistogramObserver fails on it. Skipping is the choice here because
a calibration set of real data with an occasional bad sample (a corrupt image, a
padded batch, a division by zero in preprocessing) still describes the range
well; failing would throw the whole calibration away, and a NaN range quantizes
nothing. An infinite value cannot be represented either way: at run time it
saturates to the end of the range the finite values gave. Who wants an error
instead turns the warning into one::

    warnings.filterwarnings("error", category=qcore.observers.NonFiniteValuesWarning)

**Huge values are clamped.** Observers record magnitudes up to :data:`RANGE_LIMIT`
(half float32's largest value), so a range is at most float32's largest value
wide: its scale, and every value dequantized with it, stays finite. Larger values
saturate, as they would at the end of any range.

**Statistics that are NaN anyway** (a torch.ao observer that propagated one, a
state_dict holding them) are an error at convert naming the node and the observer
(:func:`check_observers`): no scale can be computed from them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from qcore.config.errors import QCoreWarning, caller_stacklevel
from qcore.observers.base import RANGE_LIMIT, UniformQuantizationObserverBase

__all__ = [
    "RANGE_LIMIT",
    "NonFiniteStatisticsError",
    "NonFiniteValuesWarning",
    "check_observers",
    "constants_observed",
    "finite_aminmax",
    "finite_aminmax_rows",
    "skipped_count",
    "warn_of_nonfinite_weights",
]

_STATISTICS = ("min_val", "max_val", "histogram")
_LISTED = 8  # observers named in the warning; a NaN input reaches every later one


class NonFiniteValuesWarning(QCoreWarning):
    """Observers skipped NaN or infinite calibration values (one warning per convert)."""


class NonFiniteStatisticsError(ValueError):
    """An observer's statistics are NaN: no scale can be computed from them."""


def skipped_count(observer: Any) -> int:
    """How many non-finite values ``observer`` skipped (0 for observers that do not count)."""
    return int(getattr(observer, "nonfinite_skipped", 0) or 0)


def _count_skipped(observer: nn.Module, count: int) -> None:
    # A plain attribute, not a buffer: state_dicts keep torch.ao's keys, and the
    # count is only read on the host (convert's warning, sync_observers).
    observer.nonfinite_skipped = skipped_count(observer) + count


def finite_aminmax(
    observer: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(min, max)`` of the finite values of ``x``, clamped to ±RANGE_LIMIT; ``None``
    when there are none. Skipped values are counted on ``observer``.

    The common case costs one ``aminmax`` and reading its two results (a NaN or an
    infinity fails the comparisons); only a tensor holding one is masked.
    """
    x_min, x_max = torch.aminmax(x)
    if -RANGE_LIMIT <= x_min.item() and x_max.item() <= RANGE_LIMIT:
        return x_min, x_max
    finite = torch.isfinite(x)
    kept = int(finite.sum())
    if kept < x.numel():
        _count_skipped(observer, x.numel() - kept)
        if kept == 0:
            return None
        x_min = torch.where(finite, x, math.inf).amin()
        x_max = torch.where(finite, x, -math.inf).amax()
    return x_min.clamp(-RANGE_LIMIT, RANGE_LIMIT), x_max.clamp(-RANGE_LIMIT, RANGE_LIMIT)


def finite_aminmax_rows(
    observer: nn.Module, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of ``rows`` (channels x values): ``(min, max)`` of its finite values,
    clamped to ±RANGE_LIMIT. A row without any is ``(inf, -inf)``, what an observer
    that saw nothing holds; ``None`` when no row has any. Skipped values are counted
    on ``observer``."""
    mins, maxs = torch.aminmax(rows, dim=1)
    # torch.min/max propagate NaN, which fails the comparisons as ±inf do
    if -RANGE_LIMIT <= mins.min().item() and maxs.max().item() <= RANGE_LIMIT:
        return mins, maxs
    finite = torch.isfinite(rows)
    skipped = int(rows.numel() - finite.sum())
    if skipped:
        _count_skipped(observer, skipped)
        mins = torch.where(finite, rows, math.inf).amin(dim=1)
        maxs = torch.where(finite, rows, -math.inf).amax(dim=1)
    seen = torch.isfinite(mins)  # a row with a finite value has both ends finite
    if not bool(seen.any()):
        return None
    return (
        torch.where(seen, mins.clamp(-RANGE_LIMIT, RANGE_LIMIT), mins),
        torch.where(seen, maxs.clamp(-RANGE_LIMIT, RANGE_LIMIT), maxs),
    )


def _nan_statistics(observer: nn.Module) -> str | None:
    """``"min_val=nan, max_val=nan"``-like text if a statistic buffer holds a NaN."""
    found = []
    for name in _STATISTICS:
        value = observer._buffers.get(name)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if bool(torch.isnan(value).any()):
                many = f"{value.numel()} values, NaN among them"
                found.append(f"{name}={value.tolist() if value.numel() <= 4 else many}")
    return ", ".join(found) or None


def _out_of_range(observer: nn.Module) -> str | None:
    """For observers other than qcore's (which clamp on their own): text naming a
    min_val/max_val beyond ±RANGE_LIMIT, infinities included, whose scale would not
    be finite. A never-observed (inf, -inf) pair is not one."""
    lo, hi = observer._buffers.get("min_val"), observer._buffers.get("max_val")
    if not isinstance(lo, torch.Tensor) or not isinstance(hi, torch.Tensor):
        return None
    if lo.numel() == 0 or lo.shape != hi.shape or not lo.is_floating_point():
        return None
    unobserved = (lo == math.inf) & (hi == -math.inf)
    beyond = ~unobserved & ((lo.abs() > RANGE_LIMIT) | (hi.abs() > RANGE_LIMIT))
    if not bool(beyond.any()):
        return None
    if lo.numel() == 1:
        return f"min_val={lo.item()}, max_val={hi.item()}"
    channel = int(beyond.reshape(-1).nonzero()[0])
    return (
        f"min_val={lo.reshape(-1)[channel].item()}, max_val={hi.reshape(-1)[channel].item()} "
        f"in channel {channel}"
    )


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    # torch.ao's classes have qcore's names: say whose
    if cls.__module__.startswith("qcore."):
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


def _statistics_holder(module: nn.Module) -> nn.Module:
    # a fake quant keeps its statistics in its observer
    inner = module._modules.get("activation_post_process")
    return inner if inner is not None else module


def _observed_nodes(
    graphs: Iterable[tuple[str, torch.fx.GraphModule, Iterable[str]]],
) -> dict[str, tuple[nn.Module, list[str]]]:
    """Each observer (by its name, prefixed with its graph's) -> (module, the names
    of the nodes whose values it saw)."""
    observed: dict[str, tuple[nn.Module, list[str]]] = {}
    for prefix, gm, observer_names in graphs:
        for key, node in _observer_calls(prefix, gm, observer_names):
            if key not in observed:
                observed[key] = (gm.get_submodule(node.target), [])
            source = node.args[0]
            observed[key][1].append(getattr(source, "name", str(source)))
    return observed


def _weight_observers(graphs: Iterable[tuple]) -> set[str]:
    """The observers that read constants only (weights: named by their own warning)."""
    reads_other: set[str] = set()
    reads_constant: set[str] = set()
    for prefix, gm, observer_names in graphs:
        for key, node in _observer_calls(prefix, gm, observer_names):
            constant = getattr(node.args[0], "op", None) == "get_attr"
            (reads_constant if constant else reads_other).add(key)
    return reads_constant - reads_other


def _observer_calls(
    prefix: str, gm: torch.fx.GraphModule, observer_names: Iterable[str]
) -> Iterator[tuple[str, torch.fx.Node]]:
    """(prefixed observer name, the call) for each call of an observer of ``gm``."""
    names = set(observer_names)
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in names and node.args:
            yield (f"{prefix}.{node.target}" if prefix else node.target), node


def warn_of_nonfinite_weights(weights: Iterable[tuple[str, torch.Tensor]], stage: str) -> None:
    """One warning naming each weight to be quantized (``(name, tensor)``) that
    holds NaN or inf: its integers are garbage while the float model gives NaN."""
    found = []
    for name, weight in weights:
        bad = int((~torch.isfinite(weight.detach())).sum())
        if bad:
            found.append(f"{name} ({bad} of {weight.numel()})")
    if found:
        warnings.warn(
            f"{stage}: weights hold NaN or inf values: {'; '.join(dict.fromkeys(found))}. "
            "Their int8 values are meaningless (the float model's outputs are NaN or inf "
            "too); fix the float model's weights before quantizing.",
            NonFiniteValuesWarning,
            stacklevel=caller_stacklevel(),
        )


def constants_observed(
    *graphs: tuple[str, torch.fx.GraphModule, Iterable[str]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each constant (a weight) an observer of the graphs reads."""
    from qcore.engine.constants import attribute  # the engine imports the observers

    for prefix, gm, observer_names in graphs:
        for _, node in _observer_calls(prefix, gm, observer_names):
            source = node.args[0]
            if getattr(source, "op", None) == "get_attr":
                value = attribute(gm, source.target)
                if isinstance(value, torch.Tensor):
                    yield (f"{prefix}.{source.target}" if prefix else source.target), value


def check_observers(
    *graphs: tuple[str, torch.fx.GraphModule, Iterable[str]], stage: str = "convert"
) -> None:
    """Before converting: every observer each graph calls (``(prefix, graph module,
    observer module names)``, the prefix naming a subgraph, or ``""``) must hold
    numbers; then one :class:`NonFiniteValuesWarning` for all the observers that
    skipped values.

    Raises:
        NonFiniteStatisticsError: an observer's statistics are NaN, or, for an
            observer other than qcore's, beyond ±RANGE_LIMIT; the message names the
            node it observes, the observer, its class and values.
    """
    skipped: list[tuple[str, list[str], int]] = []
    weights = _weight_observers(graphs)
    for target, (observer, sources) in _observed_nodes(graphs).items():
        module = _statistics_holder(observer)
        where = " and ".join(repr(s) for s in sources)
        problem = _nan_statistics(module)
        if problem is not None:
            raise NonFiniteStatisticsError(
                f"{stage}: observer {target!r} ({_class_name(module)}) of node {where} "
                f"holds {problem}; expected the finite range of the calibration values. "
                "It propagated a NaN from calibration (torch.ao's observers do; qcore's "
                "skip NaN and ±inf) or was loaded with NaN statistics: calibrate again "
                "with qcore's observers, or with data free of NaN"
            )
        if not isinstance(module, UniformQuantizationObserverBase):
            problem = _out_of_range(module)
            if problem is not None:
                raise NonFiniteStatisticsError(
                    f"{stage}: observer {target!r} ({_class_name(module)}) of node {where} "
                    f"holds {problem}; expected magnitudes up to {RANGE_LIMIT:.4g}, beyond "
                    "which its scale, or the values dequantized with it, are not finite. "
                    "qcore's observers skip infinities and clamp larger values: calibrate "
                    "with them"
                )
        count = skipped_count(module)
        if count and target not in weights:
            skipped.append((target, sources, count))
    if skipped:
        total = sum(count for *_, count in skipped)
        listed = "; ".join(
            f"{target} (of {', '.join(repr(s) for s in sources)}): {count}"
            for target, sources, count in skipped[:_LISTED]
        )
        if len(skipped) > _LISTED:
            listed += f"; and {len(skipped) - _LISTED} more"
        warnings.warn(
            f"{stage}: calibration gave {total} NaN or infinite value(s), skipped by "
            f"{len(skipped)} observer(s): {listed}. Their scales come from the finite "
            "values; an infinite value saturates at run time. If non-finite values are "
            "not expected, check the calibration data and the model; to make this an "
            "error: warnings.filterwarnings('error', "
            "category=qcore.observers.NonFiniteValuesWarning)",
            NonFiniteValuesWarning,
            stacklevel=caller_stacklevel(),
        )
