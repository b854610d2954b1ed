"""Explain: for every node, whether it was quantized and, if not, why.

The engine writes an :class:`Entry` for each node while it prepares, converts
and lowers; :func:`qcore.explain` returns them as a :class:`Report`, which
prints as a table.
"""

from __future__ import annotations

import enum
import re
import textwrap
from dataclasses import dataclass, replace
from typing import Any

import torch

from qcore.config.errors import describe

__all__ = [
    "WIDTH",
    "Entry",
    "Report",
    "Status",
    "attach_report",
    "brief",
    "report_of",
    "with_load_notes",
]

# Kept twice because each copy survives a different way of copying a
# GraphModule: deepcopy keeps ``meta`` but drops plain attributes; torch.load
# rebuilds the module with empty ``meta`` but restores the attributes.
_REPORT_KEY = _REPORT_ATTRIBUTE = "_qcore_report"

#: The columns ``print(report)`` keeps each line within.
WIDTH = 100
_INNERMOST = re.compile(r"\(([^()]*)\)")


class Status(enum.Enum):
    QUANTIZED = "quantized"
    """Runs on a backend kernel (converted), or will be quantized (prepared)."""
    REFERENCE = "reference"
    """Quantized, but no kernel of the backend takes it: reference form, correct and slower."""
    FLOAT = "float"
    """Left in floating point; the reason says why."""
    NOT_AN_OP = "-"
    """Graph inputs, outputs and constants; observers and quantize ops qcore inserted."""


#: A node's meta: the names of ops a kernel's module took in as post-ops (PT2E's
#: ``linear -> gelu``): their entries follow that node's and take its kernel.
POST_OPS_KEY = "qcore_post_ops"

#: A node's meta: why no kernel could be tried on it, where lowering never gets
#: to ask one (PT2E's weighted op read both quantized and in float).
UNLOWERABLE_KEY = "qcore_unlowerable"


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

    def __init__(
        self, backend: str, entries: list[Entry], algorithms: tuple[str, ...] = ()
    ) -> None:
        self.backend = backend
        self.entries = entries
        # What qcore.quantize(algorithms=...) ran, each as qcore.algorithms describes it.
        self.algorithms = algorithms

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

    def format(self, width: int | None = WIDTH, verbose: bool = False) -> str:
        """The table ``print(report)`` shows: one line per operator, each within
        ``width`` columns (None: no limit). A reason too long for its line is cut,
        its long parenthesised parts (a DTypeConfig's fields, a hint) shown as
        ``(…)``; ``verbose=True`` wraps every reason in full over as many lines as
        it takes, and :meth:`details` gives one node's.

        Example::

            >>> print(report.format(width=80))
            >>> print(report.format(verbose=True))    # nothing cut
        """
        _check_width(width)
        rows = [["NODE", "OP", "STATUS", "DETAIL"]]
        for entry in self.ops:
            detail = entry.kernel or entry.reason
            if entry.status is Status.QUANTIZED and entry.kernel:
                detail = f"kernel {entry.kernel}"
            rows.append([entry.node, entry.op, entry.status.value, detail])
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines, cut = [], False
        for row in rows:
            head = "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True))
            if width is None:
                lines.append(f"{head}  {row[3]}".rstrip())
            elif verbose:
                lines.extend(_wrapped(head + "  ", row[3], width))
            else:
                short = brief(row[3])
                line = f"{head}  {short}".rstrip()
                if len(line) > width:  # the reason on a line of its own, cut to fit
                    line = head.rstrip() + "\n" + fit("    " + short, width)
                cut = cut or short != row[3] or line.endswith("…")
                lines.append(line)
        lines.insert(1, "-" * min(sum(widths) + 12, width or sum(widths) + 12))
        if cut:
            lines.append(
                "(cut to fit: report.details(node) shows one in full; "
                "report.format(verbose=True), all)"
            )
        head = [fit(self.summary(), width)]
        if self.algorithms:
            head.append(fit("algorithms: " + "; ".join(self.algorithms), width))
        return "\n".join([*head, *lines])

    def __str__(self) -> str:
        return self.format()

    def details(self, node_name: str, width: int | None = WIDTH) -> str:
        """Everything explain knows of one node, nothing cut: its op, status,
        pattern, kernel and reason, each reason of a list (kernels that refused,
        ``"; "``-separated) on lines of its own, wrapped to ``width`` columns.

        Example::

            >>> print(qcore.explain(converted).details("softmax"))
        """
        _check_width(width)
        entry = self[node_name]
        fields = [("node", entry.node), ("op", entry.op), ("status", entry.status.value)]
        fields += [
            (name, value)
            for name, value in (("pattern", entry.pattern), ("kernel", entry.kernel))
            if value
        ]
        lines = [f"{name}: {value}" for name, value in fields]
        parts = entry.reason.split("; ") if entry.reason else []
        for index, part in enumerate(parts):
            lines.extend(_wrapped("reason: " if index == 0 else " " * 8, part, width))
        return "\n".join(lines)

    __repr__ = summary


def brief(reason: str, limit: int = 40) -> str:
    """``reason`` with each parenthesised part longer than ``limit`` characters
    shown as ``(…)``: ``QConfig rejected by pattern Softmax: DTypeConfig(…): ...``."""
    text, previous = reason, None
    while text != previous:  # innermost parts first, so an enclosing one counts them folded
        previous = text
        text = _INNERMOST.sub(
            lambda m: "(…)" if len(m.group(0)) > limit else f"\x01{m.group(1)}\x02", text
        )
    return text.replace("\x01", "(").replace("\x02", ")")


def _check_width(width: Any) -> None:
    expected = "a number of columns (an int >= 1) or None for no limit"
    if width is None:
        return
    if not isinstance(width, int) or isinstance(width, bool):
        raise TypeError(f"width: got {describe(width)}; expected {expected}")
    if width < 1:
        raise ValueError(f"width: got {describe(width)}; expected {expected}")


def fit(line: str, width: int | None) -> str:
    """``line`` cut to ``width`` columns, ending in "…" where it was cut."""
    return line if width is None or len(line) <= width else line[: width - 1] + "…"


def _wrapped(head: str, text: str, width: int | None) -> list[str]:
    """``head`` + ``text`` on one line if it fits ``width``; else ``text`` wrapped under
    its first line where ``head`` leaves it 60 columns, or below ``head``, indented 4."""
    line = (head + text).rstrip()
    if width is None or len(line) <= width:
        return [line]
    if width - len(head) >= 60:
        indent = " " * len(head)
        return textwrap.wrap(text, width, initial_indent=head, subsequent_indent=indent)
    return [
        head.rstrip(),
        *textwrap.wrap(text, width, initial_indent="    ", subsequent_indent="    "),
    ]


def op_name(node: Any, modules: dict[str, torch.nn.Module]) -> str:
    """A readable name of what a node runs."""
    if node.op == "call_module":
        return type(modules[node.target]).__name__
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}()"
    return node.op


def attach_report(gm: torch.nn.Module, report: Report) -> Report:
    """Record ``report`` as what :func:`qcore.explain` returns for ``gm`` (a
    GraphModule, or the user's own module that ``keep_float_if_slower`` returned)."""
    if isinstance(getattr(gm, "meta", None), dict):
        gm.meta[_REPORT_KEY] = report
    setattr(gm, _REPORT_ATTRIBUTE, report)
    return report


def with_load_notes(model: Any, report: Report) -> Report:
    """``report`` with what a kernel decided again on the CPU that loaded ``model``
    (``load_note``: :meth:`qcore.kernels.packed.PackedWeights.check_on_load`)."""
    notes = {}
    for node in getattr(getattr(model, "graph", None), "nodes", ()):
        if node.op == "call_module":
            note = getattr(_submodule(model, node.target), "load_note", "")
            if note:
                notes[node.name] = note
    if not notes:
        return report
    entries = [replace(e, reason=notes[e.node]) if e.node in notes else e for e in report]
    return Report(report.backend, entries, report.algorithms)


def _submodule(model: Any, target: str) -> Any:
    try:
        return model.get_submodule(target)
    except AttributeError:
        return None


def report_of(model: Any) -> Report | None:
    """The report the engine attached to ``model``, or None."""
    for report in (
        getattr(model, "meta", {}).get(_REPORT_KEY),
        getattr(model, _REPORT_ATTRIBUTE, None),
    ):
        if isinstance(report, Report):
            return report
    return None
