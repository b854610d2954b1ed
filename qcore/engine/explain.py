"""Explain: for every node, whether it was quantized and, if not, why.

The engine writes an :class:`Entry` for each node while it prepares, converts
and lowers; :func:`qcore.explain` returns them as a :class:`Report`, which
prints as a table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["Entry", "Report", "Status", "attach_report", "report_of"]

# Kept twice because each copy survives a different way of copying a
# GraphModule: deepcopy keeps ``meta`` but drops plain attributes; torch.load
# rebuilds the module with empty ``meta`` but restores the attributes.
_REPORT_KEY = _REPORT_ATTRIBUTE = "_qcore_report"


class Status(enum.Enum):
    QUANTIZED = "quantized"
    """Runs on a backend kernel (converted), or will be quantized (prepared)."""
    REFERENCE = "reference"
    """Quantized, but no kernel of the backend takes it: reference form, correct and slower."""
    FLOAT = "float"
    """Left in floating point; the reason says why."""
    NOT_AN_OP = "-"
    """Graph inputs, outputs and constants; observers and quantize ops qcore inserted."""


@dataclass(frozen=True)
class Entry:
    node: str
    op: str
    status: Status
    reason: str = ""
    pattern: str = ""
    kernel: str = ""

    def with_status(self, status: Status, reason: str = "", kernel: str = "") -> Entry:
        return replace(self, status=status, reason=reason or self.reason, kernel=kernel)


class Report:
    """What happened to each node of a prepared or converted model.

    Example::

        >>> report = qcore.explain(converted)
        >>> [e.node for e in report.float]
        ['sigmoid']
        >>> print(report)
    """

    def __init__(self, backend: str, entries: list[Entry]) -> None:
        self.backend = backend
        self.entries = entries

    def __iter__(self):
        return iter(self.entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Report):
            return NotImplemented
        return (self.backend, self.entries) == (other.backend, other.entries)

    __hash__ = None  # mutable, like a list

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, node_name: str) -> Entry:
        for entry in self.entries:
            if entry.node == node_name:
                return entry
        raise KeyError(f"no node named {node_name!r}; nodes: {[e.node for e in self.entries]}")

    def with_status(self, status: Status) -> list[Entry]:
        return [entry for entry in self.entries if entry.status is status]

    @property
    def quantized(self) -> list[Entry]:
        return self.with_status(Status.QUANTIZED)

    @property
    def reference(self) -> list[Entry]:
        return self.with_status(Status.REFERENCE)

    @property
    def float(self) -> list[Entry]:
        return self.with_status(Status.FLOAT)

    @property
    def ops(self) -> list[Entry]:
        return [entry for entry in self.entries if entry.status is not Status.NOT_AN_OP]

    def summary(self) -> str:
        ops = self.ops
        return (
            f"backend {self.backend}: {len(self.quantized)} of {len(ops)} operators quantized, "
            f"{len(self.reference)} in reference form, {len(self.float)} in float"
        )

    def __str__(self) -> str:
        rows = [["NODE", "OP", "STATUS", "DETAIL"]]
        for entry in self.ops:
            detail = entry.kernel or entry.reason
            if entry.status is Status.QUANTIZED and entry.kernel:
                detail = f"kernel {entry.kernel}"
            rows.append([entry.node, entry.op, entry.status.value, detail])
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True))
            + "  "
            + row[3]
            for row in rows
        ]
        lines.insert(1, "-" * (sum(widths) + 6 + 6))
        return self.summary() + "\n" + "\n".join(line.rstrip() for line in lines)

    __repr__ = summary


def op_name(node: Any, modules: dict[str, torch.nn.Module]) -> str:
    """A readable name of what a node runs."""
    if node.op == "call_module":
        return type(modules[node.target]).__name__
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}()"
    return node.op


def attach_report(gm: torch.fx.GraphModule, report: Report) -> Report:
    """Record ``report`` as what :func:`qcore.explain` returns for ``gm``."""
    gm.meta[_REPORT_KEY] = report
    setattr(gm, _REPORT_ATTRIBUTE, report)
    return report


def report_of(model: Any) -> Report | None:
    """The report the engine attached to ``model``, or None."""
    for report in (
        getattr(model, "meta", {}).get(_REPORT_KEY),
        getattr(model, _REPORT_ATTRIBUTE, None),
    ):
        if isinstance(report, Report):
            return report
    return None
