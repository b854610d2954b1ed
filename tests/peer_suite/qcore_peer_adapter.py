"""A pytest plugin that runs the peers' own suites against qcore.

Loaded with ``-p qcore_peer_adapter`` (``tests/peer_suite`` on ``PYTHONPATH``) by
``tox -e peersuite``. It swaps the peers' prepare/convert/fuse entry points for
qcore's, wherever the suites and their helpers bound them, and nothing else:
the tests' own arguments reach qcore unchanged.

``expected_failures.txt`` beside this file lists, one line each, the tests that
fail on the peer itself (not counted) and the tests qcore fails today, each
with its kind and reason. Listed tests run as strict xfails: one that starts to
pass fails the run until its line is removed, so the list only shrinks.
The last lines of the run are the counts the issue tracks.
``QCORE_PEERSUITE_RUN_LISTED=1`` runs the listed tests as plain tests (for
``refresh_expected.py``, which rewrites the list from such a run).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

import qcore

FX_ENTRY_POINTS = (
    "prepare_fx",
    "prepare_qat_fx",
    "convert_fx",
    "convert_to_reference_fx",
    "fuse_fx",
)
# The peer's entry points that are qcore's under another name: torch.ao's decomposed
# reference form is qcore's reference form (both quantized_decomposed ops).
ALIASES = {"_convert_to_reference_decomposed_fx": "convert_to_reference_fx"}
PT2E_ENTRY_POINTS = ("prepare_pt2e", "prepare_qat_pt2e", "convert_pt2e")

# Where the peers and their test helpers bind the entry points.
FX_HOMES = (
    "torch.ao.quantization.quantize_fx",
    "torch.testing._internal.common_quantization",
)
PT2E_HOMES = (
    "torchao.quantization.pt2e.quantize_pt2e",
    "torchao.quantization.pt2e",
    "torchao.testing.pt2e.utils",
)

EXPECTED_FAILURES = Path(__file__).with_name("expected_failures.txt")

# Kinds of line in expected_failures.txt.
PEER_FAILS = "peer-fails"  # fails on the peer itself: not counted
PEER_NAMES = "peer-names"  # asserts the peer's own class, op or attribute names
OPEN = "open"  # a qcore gap still to fix: counts against the target
KINDS = (PEER_FAILS, PEER_NAMES, OPEN)


@dataclass(frozen=True)
class Expected:
    test: str
    kind: str
    reason: str


def read_expected(path: Path = EXPECTED_FAILURES) -> dict[str, Expected]:
    """``suite::Class::test | kind | reason`` lines; ``#`` starts a comment."""
    found: dict[str, Expected] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip() if line.lstrip().startswith("#") else line.strip()
        if not line:
            continue
        parts = [part.strip() for part in line.split("|", 2)]
        if len(parts) != 3 or parts[1] not in KINDS or not parts[2]:
            raise ValueError(
                f"{path.name}:{number}: got {line!r}; expected 'suite::Class::test | kind | "
                f"reason' with kind one of {', '.join(KINDS)}"
            )
        if parts[0] in found:
            raise ValueError(f"{path.name}:{number}: {parts[0]} is listed twice")
        found[parts[0]] = Expected(*parts)
    return found


def _suite_id(item: pytest.Item) -> str:
    """``fx::TestQuantizeFx::test_x`` from the item's path and name."""
    suite = Path(str(item.fspath)).parent.name
    return f"{suite}::{item.nodeid.split('::', 1)[1]}"


def _swap(module, names) -> None:
    for name in (*names, *ALIASES):
        if hasattr(module, name):
            setattr(module, name, getattr(qcore, ALIASES.get(name, name)))


def _swap_homes(module_names: tuple[str, ...], names: tuple[str, ...]) -> None:
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        _swap(module, names)


def pytest_configure(config: pytest.Config) -> None:
    _swap_homes(FX_HOMES, FX_ENTRY_POINTS)
    _swap_homes(PT2E_HOMES, PT2E_ENTRY_POINTS)
    config._qcore_expected = read_expected()
    config._qcore_outcomes = {}


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    for module in {item.module for item in items if getattr(item, "module", None)}:
        _swap(module, FX_ENTRY_POINTS + PT2E_ENTRY_POINTS)
    expected = config._qcore_expected
    for item in items:
        listed = expected.get(_suite_id(item))
        if listed is None:
            continue
        if listed.kind == PEER_FAILS:
            item.add_marker(pytest.mark.skip(reason=f"fails on the peer itself: {listed.reason}"))
        elif not os.environ.get("QCORE_PEERSUITE_RUN_LISTED"):
            item.add_marker(
                pytest.mark.xfail(reason=f"{listed.kind}: {listed.reason}", strict=True)
            )


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    expected = config._qcore_expected
    per_suite: dict[str, dict[str, int]] = {}
    for outcome in ("passed", "failed", "xfailed", "xpassed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", "call") not in ("call", "setup"):
                continue
            if outcome == "passed" and report.when != "call":
                continue
            nodeid = report.nodeid
            suite = Path(nodeid.split("::", 1)[0]).parent.name
            test_id = f"{suite}::{nodeid.split('::', 1)[1]}"
            counts = per_suite.setdefault(suite, {})
            kind = expected[test_id].kind if test_id in expected else None
            key = f"{outcome}:{kind}" if outcome in ("xfailed", "xpassed") else outcome
            if outcome == "skipped" and kind == PEER_FAILS:
                key = "peer-fails"
            counts[key] = counts.get(key, 0) + 1
    config._qcore_counts = per_suite


def pytest_unconfigure(config: pytest.Config) -> None:
    """The counts, as the run's last lines."""
    per_suite = getattr(config, "_qcore_counts", None)
    if per_suite is None:
        return
    writer = config.get_terminal_writer()
    writer.sep("=", "qcore against the peers' suites")
    for suite, counts in sorted(per_suite.items()):
        passed = counts.get("passed", 0)
        names = counts.get(f"xfailed:{PEER_NAMES}", 0)
        still_open = counts.get(f"xfailed:{OPEN}", 0)
        failed = counts.get("failed", 0) + counts.get("error", 0)
        xpassed = sum(v for k, v in counts.items() if k.startswith("xpassed"))
        ran_on_peer = passed + names + still_open + failed + xpassed
        writer.line(
            f"peersuite {suite}: {passed} of {ran_on_peer} that pass on the peer pass on qcore; "
            f"{names} expected (the peer's own names), {still_open} open, {failed} unlisted "
            f"failures, {xpassed} listed but passing; {counts.get('peer-fails', 0)} fail on "
            f"the peer (not counted), {counts.get('skipped', 0)} skipped"
        )
