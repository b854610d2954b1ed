"""Calibration on several processes: merge every observer's statistics over torch.distributed.

Each rank calibrates its shard of the data on its own copy of the prepared
model; :func:`sync_observers` then merges the statistics of every observer
(and of every fake quant's ``activation_post_process``) across the process
group, so that every rank holds the same statistics and ``convert_fx`` gives
the same model everywhere::

    >>> import torch.distributed as dist, qcore
    >>> dist.init_process_group("gloo")              # torchrun sets the rendezvous
    >>> prepared = qcore.prepare_fx(model, mapping, example_inputs, backend="fbgemm")
    >>> for batch in my_shard_of(calibration_data):
    ...     prepared(batch)
    >>> qcore.sync_observers(prepared, timeout=timedelta(seconds=60))
    >>> quantized = qcore.convert_fx(prepared)       # the same on every rank

How each kind of statistic is merged:

- **min/max** (``MinMaxObserver``, ``PerChannelMinMaxObserver``): the minimum
  of the minima and the maximum of the maxima, elementwise per channel; exactly
  what one process calibrating on all the data records.
- **moving averages** (``MovingAverage*MinMaxObserver``): the mean of the ranks'
  averages weighted by the batches each rank observed (qcore's observers count
  them in ``batches_observed``; an observer without a counter, torch.ao's, or
  one restored from a state_dict counts as one batch once it has observed).
- **histograms** (``HistogramObserver``): every rank's histogram and range are
  gathered and merged into the union range with ``HistogramObserver.merge``, in
  rank order, as successive batches are; within one bin width of one process
  calibrating on all the data.
- **fake quants** (QAT): their ``activation_post_process`` is merged as above,
  then their ``scale`` and ``zero_point`` are recomputed from it.

Observers are found by walking the module (any ``nn.Module``: FX or PT2E
prepared models, torch.ao's observers too), by their attributes and buffers.

Faults are errors, on every rank, within ``timeout`` at each step: a rank that
does not join is named (``RankTimeoutError``), and so are, to a rank arriving
after the others gave up, the ranks that timed out (they closed their
connections); ranks whose observers differ (another model, another backend or
QConfigMapping, another ``eps``) are named with the first differing observer
and the values that differ (``ObserverMismatchError``); an observer holding NaN
statistics (torch.ao's propagate a NaN from calibration) is named with its rank
(``ObserverSyncError``). The NaN and infinite values qcore's observers skipped
are summed over the ranks, so every rank's convert warns about all of them.
Statistics are merged into copies and written back only when everything
succeeded: on failure the model is left as it was. After a failure the process
group should not be used again: ``torch.distributed.destroy_process_group()``
returns at once (the collectives carry ``timeout``, so the backend gives up when
the sync does), or end the job.

Cost: a presence check (one message to each peer), two small all_gathers to
compare the observer sets, one all_reduce for all min/max observers, one for
all moving averages, and two all_gathers for all histograms (each rank merges
its share of them). See ``benchmarks/distributed_merge.py``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions

from qcore.observers.nonfinite import skipped_count

__all__ = [
    "ObserverMismatchError",
    "ObserverSyncError",
    "RankTimeoutError",
    "SyncResult",
    "sync_observers",
]

DEFAULT_TIMEOUT = timedelta(minutes=5)

MINMAX = "min/max"
MOVING_AVERAGE = "moving average"
HISTOGRAM = "histogram"
FAKE_QUANT = "fake quant"
NO_STATISTICS = "no statistics"
_MERGED = (MINMAX, MOVING_AVERAGE, HISTOGRAM)

_OBSERVER_PREFIX = "activation_post_process"  # qcore.engine.observe.OBSERVER_PREFIX, sans index
_PRESENCE_TAG = 0x5153  # "QS": the p2p tag of the presence check
# buffers that carry settings or switches, not statistics
_SETTINGS_BUFFERS = {
    "eps",
    "scale",
    "zero_point",
    "fake_quant_enabled",
    "observer_enabled",
    "batches_observed",
}
_STATISTICS_BUFFERS = {
    MINMAX: ("min_val", "max_val"),
    MOVING_AVERAGE: ("min_val", "max_val"),
    HISTOGRAM: ("histogram", "min_val", "max_val"),
}
_SETTINGS = (
    "dtype",
    "qscheme",
    "quant_min",
    "quant_max",
    "reduce_range",
    "ch_axis",
    "bins",
    "averaging_constant",
    "is_dynamic",
)


class ObserverSyncError(RuntimeError):
    """sync_observers could not merge the observers; the model is unchanged."""


class ObserverMismatchError(ObserverSyncError):
    """A rank's observers differ from rank 0's. ``rank`` and ``observer`` name them."""

    def __init__(self, message: str, rank: int, observer: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.observer = observer

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.rank, self.observer)


class RankTimeoutError(ObserverSyncError):
    """Ranks did not join within the timeout. ``ranks`` lists them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.ranks)


@dataclass
class SyncResult:
    """What :func:`sync_observers` merged: ``kinds`` maps each observer's module name
    to how it was merged (``"min/max"``, ``"moving average"``, ``"histogram"``,
    ``"fake quant"``, ``"no statistics"``)."""

    world_size: int
    kinds: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for kind in self.kinds.values():
            counts[kind] = counts.get(kind, 0) + 1
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        return f"SyncResult(world_size={self.world_size}, {summary}, {self.seconds:.3f} s)"


@dataclass
class _Observer:
    name: str
    module: nn.Module
    kind: str
    settings: list[list[str]]
    shapes: list[list[int]]

    def fingerprint(self) -> list:
        cls = type(self.module)
        return [self.name, f"{cls.__module__}.{cls.__qualname__}", self.kind, self.settings]

    @property
    def numel(self) -> int:
        return math.prod(self.shapes[0])


def _describe(entry: list) -> str:
    name, cls, kind, settings, shapes = entry
    return (
        f"{name!r}: {cls.rsplit('.', 1)[-1]}({_show_settings(settings)}), {kind}, "
        f"buffer shapes {shapes}"
    )


# -- finding the observers ------------------------------------------------------------


# Attribute lookups go through the instance and class dicts: nn.Module.__getattr__
# raising AttributeError for each absent attribute costs more than the merge itself
# on models with thousands of modules.


def _is_fake_quant(module: nn.Module) -> bool:
    return (
        module._modules.get("activation_post_process") is not None
        and "scale" in module._buffers
        and "zero_point" in module._buffers
    )


def _is_observer(name: str, module: nn.Module) -> bool:
    return hasattr(type(module), "calculate_qparams") or name.rsplit(".", 1)[-1].startswith(
        _OBSERVER_PREFIX
    )


def _settings(module: nn.Module, kind: str) -> list[list[str]]:
    """``[name, value]`` of each setting ``module`` has: its attributes in _SETTINGS,
    ``eps`` (the smallest scale: ranks with different ones convert to different
    models) and, for an observer without statistics, its fixed ``scale`` and
    ``zero_point``."""
    attrs = vars(module)
    found = [[attr, str(attrs[attr])] for attr in _SETTINGS if attr in attrs]
    buffers = ["eps"] + (["scale", "zero_point"] if kind == NO_STATISTICS else [])
    for name in buffers:
        value = module._buffers.get(name)
        if isinstance(value, torch.Tensor) and 0 < value.numel() <= 8:
            found.append([name, ", ".join(repr(v) for v in value.reshape(-1).tolist())])
    return found


def _show_settings(settings: list[list[str]]) -> str:
    return ", ".join(f"{name}={value}" for name, value in settings)


def _nan_statistics(module: nn.Module, kind: str) -> str | None:
    """``"min_val=nan"``-like text when a statistic of ``module`` holds a NaN."""
    found = []
    for name in _STATISTICS_BUFFERS.get(kind, ()):
        value = module._buffers.get(name)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if bool(torch.isnan(value).any()):
                shown = value.tolist() if value.numel() <= 4 else "NaN among its values"
                found.append(f"{name}={shown}")
    return ", ".join(found) or None


def _collect(model: nn.Module) -> tuple[list[_Observer], str | None]:
    """The observers and fake quants of ``model`` in module order, and the first
    problem that prevents merging them (reported on every rank)."""
    found: list[_Observer] = []
    for name, module in model.named_modules():
        buffers = {n: b for n, b in module._buffers.items() if b is not None}
        if _is_fake_quant(module):
            kind = FAKE_QUANT
        elif _is_observer(name, module):
            if {"histogram", "min_val", "max_val"} <= buffers.keys():
                kind = HISTOGRAM
            elif {"min_val", "max_val"} <= buffers.keys():
                kind = MOVING_AVERAGE if "averaging_constant" in vars(module) else MINMAX
            else:
                kind = NO_STATISTICS
        else:
            continue
        stats = _STATISTICS_BUFFERS.get(kind, ())
        unknown = set(buffers) - _SETTINGS_BUFFERS - set(stats)
        if unknown:
            return found, (
                f"cannot merge observer {name!r} ({type(module).__name__}): it keeps "
                f"buffers {sorted(unknown)} that sync_observers does not know how to merge "
                "(it merges min_val/max_val, and histogram with min_val/max_val)"
            )
        nan = _nan_statistics(module, kind)
        if nan is not None:
            # merged, a NaN becomes every rank's: each would convert to NaN scales
            return found, (
                f"observer {name!r} ({type(module).__name__}) holds {nan}; expected the "
                "finite range of its calibration values. It propagated a NaN from "
                "calibration (torch.ao's observers do; qcore's skip NaN and ±inf and "
                "count them) or was loaded with NaN statistics"
            )
        shapes = [list(buffers[b].shape) for b in stats]
        found.append(_Observer(name or "<model>", module, kind, _settings(module, kind), shapes))
    return found, None


# -- communication ----------------------------------------------------------------------


def _ranks(ranks: Any) -> str:
    return f"rank(s) {', '.join(map(str, sorted(ranks)))}"


class _Comm:
    def __init__(self, group: Any, timeout: timedelta) -> None:
        self.group = group
        # Collectives are called on the process group itself, with ``timeout`` in
        # their options: torch.distributed's functions leave the group's own timeout
        # (30 min by default) to the backend, whose worker thread then stays blocked
        # on a collective a rank never joined, and destroy_process_group() waits for
        # it. With the sync's timeout the backend gives up when the sync does.
        self.process_group = group if group is not None else dist.group.WORLD
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def wait(self, start: Any, step: str) -> None:
        """Start an operation (``start()`` returns its work) and wait for it; a
        failure at either point is an ObserverSyncError saying which step."""
        try:
            start().wait(timeout=self.timeout)
        except RuntimeError as error:
            raise ObserverSyncError(
                f"rank {self.rank}: sync_observers failed while {step} (timeout "
                f"{self.timeout.total_seconds():g} s): a rank that joined did not get "
                f"there in time (stuck or dead) or gave up: {error}"
            ) from error

    def check_presence(self) -> None:
        """Every rank exchanges a message with every other; those not heard from
        within the timeout are named. A rank whose own timeout passed has closed its
        connections: a rank arriving after that finds them closed, and names it too."""
        peers = [r for r in range(self.world) if r != self.rank]
        mine = torch.tensor([self.rank], dtype=torch.int64, device=self.device)
        received = {r: torch.full_like(mine, -1) for r in peers}
        closed: dict[int, str] = {}  # rank -> gloo's error: its connection is gone
        sends, recvs = {}, {}
        for r in peers:
            peer = self.global_rank(r)
            try:
                sends[r] = dist.isend(mine, peer, group=self.group, tag=_PRESENCE_TAG)
                recvs[r] = dist.irecv(received[r], peer, group=self.group, tag=_PRESENCE_TAG)
            except RuntimeError as error:
                closed[r] = str(error)
        deadline = time.monotonic() + self.timeout.total_seconds()
        timed_out: list[int] = []
        for r, work in [*recvs.items(), *sends.items()]:
            if r in closed or r in timed_out:
                continue
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                work.wait(timeout=timedelta(seconds=remaining))
            except RuntimeError as error:
                if "timed out" in str(error).lower():
                    timed_out.append(r)
                else:
                    closed[r] = str(error)
        if closed or timed_out:
            missing = sorted([*closed, *timed_out])
            parts = []
            if timed_out:
                parts.append(
                    f"{_ranks(timed_out)} not heard from within "
                    f"{self.timeout.total_seconds():g} s (they did not call it, or are "
                    "stuck or dead)"
                )
            if closed:
                parts.append(
                    f"{_ranks(closed)} closed the connection before this rank joined "
                    "(their own sync_observers timed out, or they exited; "
                    f"{next(iter(closed.values()))})"
                )
            raise RankTimeoutError(
                f"rank {self.rank}: {_ranks(missing)} of {self.world} did not join "
                f"sync_observers: {'; '.join(parts)}; the model's observers are unchanged",
                missing,
            )

    def all_gather(self, tensor: torch.Tensor, step: str) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        options = AllgatherOptions()
        options.timeout = self.timeout
        options.asyncOp = True
        self.wait(lambda: self.process_group.allgather([out], [tensor], options), step)
        return out

    def all_reduce(self, tensor: torch.Tensor, op: Any, step: str) -> torch.Tensor:
        options = AllreduceOptions()
        options.reduceOp = op
        options.timeout = self.timeout
        options.asyncOp = True
        self.wait(lambda: self.process_group.allreduce([tensor], options), step)
        return tensor

    def all_gather_json(self, value: Any, step: str) -> list[Any]:
        data = json.dumps(value).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [int(s) for s in self.all_gather(size, step)]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = self.all_gather(padded.to(self.device), step)
        return [
            json.loads(bytes(t[:n].cpu().tolist()).decode())
            for t, n in zip(gathered, sizes, strict=True)
        ]


# -- comparing the ranks' observers -------------------------------------------------------


def _shapes_match(a: list[list[int]], b: list[list[int]]) -> bool:
    # an unobserved per-channel observer has empty buffers: it matches any size
    return len(a) == len(b) and all(
        x == y or math.prod(x) == 0 or math.prod(y) == 0 for x, y in zip(a, b, strict=True)
    )


def _check_same(payloads: list[dict]) -> None:
    for rank, payload in enumerate(payloads):
        if payload["error"]:
            raise ObserverSyncError(f"rank {rank}: {payload['error']}")
    reference = payloads[0]["observers"]
    hint = (
        "; every rank must prepare the same model with the same backend and QConfigMapping "
        "before sync_observers"
    )
    for rank, payload in enumerate(payloads[1:], start=1):
        theirs = payload["observers"]
        for ours, other in zip(reference, theirs, strict=False):
            if ours[:3] == other[:3] and ours[3] != other[3]:
                # the same observer, set up differently: say which settings differ
                mine, their = dict(ours[3]), dict(other[3])
                differing = "; ".join(
                    f"{name}={mine.get(name, '(none)')} on rank 0, "
                    f"{name}={their.get(name, '(none)')} on rank {rank}"
                    for name in sorted(mine.keys() | their.keys())
                    if mine.get(name) != their.get(name)
                )
                raise ObserverMismatchError(
                    f"observer {ours[0]!r} ({ours[1].rsplit('.', 1)[-1]}) of rank {rank} is "
                    f"set up differently from rank 0's: {differing}. Merged, the ranks would "
                    f"still convert to different models{hint}",
                    rank,
                    ours[0],
                )
            if ours[:4] != other[:4] or not _shapes_match(ours[4], other[4]):
                raise ObserverMismatchError(
                    f"the observers of rank {rank} differ from rank 0's at observer "
                    f"{ours[0]!r}: rank 0 has {_describe(ours)}; rank {rank} has "
                    f"{_describe(other)}{hint}",
                    rank,
                    ours[0],
                )
        if len(theirs) != len(reference):
            longer = reference if len(reference) > len(theirs) else theirs
            first = longer[min(len(reference), len(theirs))]
            who = f"rank 0 has {len(reference)}, rank {rank} has {len(theirs)}"
            raise ObserverMismatchError(
                f"the observers of rank {rank} differ from rank 0's at observer "
                f"{first[0]!r}: {who} observers (the first without a counterpart: "
                f"{_describe(first)}){hint}",
                rank,
                first[0],
            )


# -- merging -----------------------------------------------------------------------------


def _is_observed(min_val: torch.Tensor, max_val: torch.Tensor) -> bool:
    if min_val.numel() == 0:
        return False
    return not bool((min_val == math.inf).all() and (max_val == -math.inf).all())


def _agreed_sizes(payloads: list[dict]) -> dict[str, int]:
    """Each observer's statistics size: the first non-empty one among the ranks (an
    unobserved per-channel observer has empty buffers); 0 if empty everywhere."""
    sizes: dict[str, int] = {}
    for payload in payloads:
        for entry in payload["observers"]:
            if entry[4] and not sizes.get(entry[0]):
                sizes[entry[0]] = math.prod(entry[4][0])
    return sizes


def _merge_min_max(
    observers: list[_Observer], sizes: dict[str, int], comm: _Comm
) -> dict[str, tuple]:
    """One all_reduce(MIN) over [minima, -maxima] of every min/max observer."""
    parts, layout = [], []
    for obs in observers:
        numel = sizes.get(obs.name, 0)
        if numel == 0:
            continue  # observed nowhere
        lo, hi = obs.module.min_val.detach(), obs.module.max_val.detach()
        if lo.numel() == 0:
            lo = torch.full((numel,), math.inf)
            hi = torch.full((numel,), -math.inf)
        parts.append(lo.reshape(-1))
        parts.append(-hi.reshape(-1))
        layout.append((obs, numel))
    if not layout:
        return {}
    packed = torch.cat([p.to(torch.float64) for p in parts]).to(comm.device)
    packed = comm.all_reduce(packed, dist.ReduceOp.MIN, "reducing min/max").cpu()
    merged, offset = {}, 0
    for obs, numel in layout:
        shape = obs.shapes[0] if obs.numel else [numel]
        lo = packed[offset : offset + numel].reshape(shape)
        hi = -packed[offset + numel : offset + 2 * numel].reshape(shape)
        offset += 2 * numel
        merged[obs.name] = (lo, hi)
    return merged


def _batches(module: nn.Module, observed: bool) -> float:
    if not observed:
        return 0.0
    counter = getattr(module, "batches_observed", None)
    count = int(counter) if counter is not None else 0
    return float(max(count, 1))


def _merge_moving_averages(
    observers: list[_Observer], sizes: dict[str, int], comm: _Comm
) -> dict[str, tuple]:
    """One all_reduce(SUM) over [n * min, n * max, n] of every moving average."""
    parts, layout = [], []
    for obs in observers:
        numel = sizes.get(obs.name, 0)
        if numel == 0:
            continue
        lo, hi = obs.module.min_val.detach(), obs.module.max_val.detach()
        observed = _is_observed(lo, hi)
        n = _batches(obs.module, observed)
        if observed:
            parts += [n * lo.reshape(-1).double(), n * hi.reshape(-1).double()]
        else:
            parts += [torch.zeros(numel, dtype=torch.float64)] * 2
        parts.append(torch.tensor([n], dtype=torch.float64))
        layout.append((obs, numel))
    if not layout:
        return {}
    packed = torch.cat([p.to(comm.device) for p in parts])
    packed = comm.all_reduce(packed, dist.ReduceOp.SUM, "averaging moving averages").cpu()
    merged, offset = {}, 0
    for obs, numel in layout:
        shape = obs.shapes[0] if obs.numel else [numel]
        total = float(packed[offset + 2 * numel])
        if total > 0:
            lo = (packed[offset : offset + numel] / total).reshape(shape)
            hi = (packed[offset + numel : offset + 2 * numel] / total).reshape(shape)
            merged[obs.name] = (lo, hi, int(total))
        offset += 2 * numel + 1
    return merged


def _merge_histograms(observers: list[_Observer], comm: _Comm) -> dict[str, tuple]:
    """One all_gather of every rank's [min, max, histogram...] for all histogram
    observers; rank ``i % world`` merges observer ``i`` (as HistogramObserver.merge, in
    rank order, all its observers of one size at once); one all_gather of the results."""
    if not observers:
        return {}
    from qcore.observers.histogram_merge import UPSAMPLE_RATE, merge_rows

    dtype = torch.float32
    for obs in observers:
        dtype = torch.promote_types(dtype, obs.module.histogram.dtype)
    parts = []
    for obs in observers:
        module = obs.module
        parts += [module.min_val.detach().reshape(1), module.max_val.detach().reshape(1)]
        parts.append(module.histogram.detach().reshape(-1))
    local = torch.cat([p.to(dtype) for p in parts]).to(comm.device)
    gathered = torch.stack([t.cpu() for t in comm.all_gather(local, "gathering histograms")])

    sizes = [obs.numel + 2 for obs in observers]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    mine = list(range(comm.rank, len(observers), comm.world))
    # This rank's observers by (bins, upsampling rate): each group merges as one batch.
    groups: dict[tuple[int, int], list[int]] = {}
    for index in mine:
        module = observers[index].module
        rate = getattr(module, "upsample_rate", None) or UPSAMPLE_RATE
        groups.setdefault((observers[index].numel, rate), []).append(index)
    merged_rows: dict[int, torch.Tensor] = {}
    for (bins, rate), indices in groups.items():
        starts = torch.tensor([offsets[i] for i in indices])
        columns = starts[:, None] + torch.arange(bins + 2)
        rows = gathered[:, columns]  # (world, observers, 2 + bins)
        hist, lo, hi = rows[0, :, 2:], rows[0, :, 0], rows[0, :, 1]
        for rank in range(1, comm.world):
            other = rows[rank]
            hist, lo, hi = merge_rows(hist, lo, hi, other[:, 2:], other[:, 0], other[:, 1], rate)
        together = torch.cat([lo[:, None], hi[:, None], hist], dim=1)
        merged_rows.update(zip(indices, together, strict=True))
    share_size = max(
        sum(sizes[i] for i in range(r, len(observers), comm.world)) for r in range(comm.world)
    )
    share = torch.zeros(share_size, dtype=dtype)  # this rank's merged histograms
    if mine:
        filled = torch.cat([merged_rows[index] for index in mine])
        share[: filled.numel()] = filled
    results = [t.cpu() for t in comm.all_gather(share.to(comm.device), "sharing merged histograms")]

    merged = {}
    position = [0] * comm.world
    for index, obs in enumerate(observers):
        owner = index % comm.world
        row = results[owner][position[owner] : position[owner] + sizes[index]]
        position[owner] += sizes[index]
        merged[obs.name] = (row[0], row[1], row[2:])  # views of a fresh gather
    return merged


# -- the API ---------------------------------------------------------------------------------


def _write(buffer: torch.Tensor, value: torch.Tensor) -> None:
    if buffer.shape != value.shape:
        buffer.detach_().resize_(value.shape)
    buffer.copy_(value)


def sync_observers(
    model: nn.Module, group: Any = None, timeout: timedelta = DEFAULT_TIMEOUT
) -> SyncResult:
    """Merge the statistics of every observer of ``model`` across the ranks of ``group``.

    Call it on every rank of the process group (default: the world) after each
    rank calibrated its shard of the data; afterwards every rank's observers
    hold the same statistics (and QAT fake quants the same scale and zero
    point), so ``convert_fx``/``convert_pt2e`` give the same model everywhere.
    The module docstring says how each kind of observer is merged.

    Args:
        model: a prepared model (FX, PT2E, QAT, or any module holding qcore's or
            torch.ao's observers and fake quants), prepared the same way on every rank.
        group: the ``torch.distributed`` process group; ``None`` for the default one.
        timeout: how long to wait for the other ranks at each step.

    Returns:
        a :class:`SyncResult` naming each observer and how it was merged.

    Raises:
        RankTimeoutError: a rank did not join within ``timeout``, or had given up
            (timed out) before this rank joined (names them).
        ObserverMismatchError: a rank's observers differ from rank 0's (names the
            rank, the first differing observer and, for settings such as ``eps``,
            both values), raised on every rank.
        ObserverSyncError: torch.distributed is not initialized, a collective
            failed or timed out, an observer holds NaN statistics, or keeps
            statistics this function cannot merge.
        On any error, the model is left unchanged; ``destroy_process_group()``
        returns promptly.

    Example::

        >>> # torchrun --nproc_per_node=2 calibrate.py
        >>> dist.init_process_group("gloo")
        >>> prepared = qcore.prepare_fx(model, mapping, example_inputs)
        >>> for x in data[dist.get_rank() :: dist.get_world_size()]:
        ...     prepared(x)
        >>> qcore.sync_observers(prepared, timeout=timedelta(seconds=30))
        SyncResult(world_size=2, 3 histogram, 1 no statistics, 0.012 s)
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ObserverSyncError(
            "sync_observers needs torch.distributed: call "
            "torch.distributed.init_process_group() first (torchrun sets RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT for it)"
        )
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, not {type(timeout).__name__}")
    started = time.perf_counter()
    comm = _Comm(group, timeout)
    observers, problem = _collect(model)
    payload = {
        "observers": [obs.fingerprint() + [obs.shapes] for obs in observers],
        "error": problem,
    }
    comm.check_presence()
    # Ranks agree in the common case: compare digests first, whole lists only if they
    # differ (to name the first differing observer) or a rank reports a problem. The
    # non-finite values each observer skipped travel along: summed, every rank's
    # convert warns about all of them, as one process calibrating on all the data.
    encoded = json.dumps(payload, sort_keys=True).encode()
    skipped = {obs.name: n for obs in observers if (n := skipped_count(obs.module))}
    digest = [hashlib.sha256(encoded).hexdigest(), problem is not None, skipped]
    digests = comm.all_gather_json(digest, "comparing the ranks' observers")
    skipped_total: dict[str, int] = {}
    for _, _, counts in digests:
        for name, count in counts.items():
            skipped_total[name] = skipped_total.get(name, 0) + count
    if all(d[:2] == [digest[0], False] for d in digests):
        payloads = [payload] * comm.world
    else:
        payloads = comm.all_gather_json(payload, "comparing the ranks' observers")
    _check_same(payloads)

    by_kind: dict[str, list[_Observer]] = {kind: [] for kind in _MERGED}
    for obs in observers:
        if obs.kind in by_kind:
            by_kind[obs.kind].append(obs)
    sizes = _agreed_sizes(payloads)
    min_max = _merge_min_max(by_kind[MINMAX], sizes, comm)
    moving = _merge_moving_averages(by_kind[MOVING_AVERAGE], sizes, comm)
    histograms = _merge_histograms(by_kind[HISTOGRAM], comm)

    # fake quants' new qparams, from copies of their merged observers
    qparams = {}
    observer_of = {id(obs.module): obs for obs in observers}
    for obs in observers:
        if obs.kind != FAKE_QUANT:
            continue
        inner = observer_of.get(id(obs.module.activation_post_process))
        state = None
        if inner is not None:
            state = min_max.get(inner.name) or moving.get(inner.name)
            if inner.name in histograms:
                state = histograms[inner.name][:2]
        if state is None or not _is_observed(state[0], state[1]):
            continue
        probe = copy.deepcopy(inner.module)
        _write(probe.min_val, state[0])
        _write(probe.max_val, state[1])
        if inner.name in histograms:
            _write(probe.histogram, histograms[inner.name][2])
        qparams[obs.name] = probe.calculate_qparams()

    # commit, all at once
    for obs in observers:
        module = obs.module
        if obs.name in skipped_total or skipped_count(module):
            module.nonfinite_skipped = skipped_total.get(obs.name, 0)
        if obs.name in min_max:
            _write(module.min_val, min_max[obs.name][0])
            _write(module.max_val, min_max[obs.name][1])
        elif obs.name in moving:
            lo, hi, total = moving[obs.name]
            _write(module.min_val, lo)
            _write(module.max_val, hi)
            if isinstance(getattr(module, "batches_observed", None), torch.Tensor):
                module.batches_observed.fill_(total)
        elif obs.name in histograms:
            lo, hi, hist = histograms[obs.name]
            _write(module.histogram, hist)
            _write(module.min_val, lo)
            _write(module.max_val, hi)
        elif obs.name in qparams:
            scale, zero_point = qparams[obs.name]
            _write(module.scale, scale)
            _write(module.zero_point, zero_point)
    return SyncResult(
        comm.world, {obs.name: obs.kind for obs in observers}, time.perf_counter() - started
    )
