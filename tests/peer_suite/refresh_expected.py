"""Rewrite expected_failures.txt from a run of the peers' suites (a maintainer's tool).

    cd ../shared/peer-tests
    QCORE_PEERSUITE_RUN_LISTED=1 pytest -p qcore_peer_adapter --rootdir . \
        fx/test_quantize_fx.py --junitxml=/tmp/fx.xml
    python <qcore>/tests/peer_suite/refresh_expected.py fx /tmp/fx.xml

Lines of other suites and ``peer-fails`` lines are kept as they are. A listed test
that passes now loses its line; a ``peer-names`` line that still fails keeps its
hand-written reason; every other failure becomes an ``open`` line whose reason is
the error it raised, so the file says what is still wrong. Reclassifying a line as
``peer-names`` is a judgement made by hand: only assertions on the peer's own
class, op or attribute names qualify.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from qcore_peer_adapter import EXPECTED_FAILURES, OPEN, PEER_FAILS, read_expected

REASON_LENGTH = 200


def failures(junit_xml: Path, suite: str) -> dict[str, str]:
    """``suite::Class::test`` -> a one-line reason, for each failed or erroring test."""
    found = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is None:
            continue
        owner = case.get("classname", "").rsplit(".", 1)[-1]
        test = "::".join([suite, *([owner] if owner.startswith("Test") else []), case.get("name")])
        message = " ".join((problem.get("message") or problem.text or "").split())
        message = re.sub(r"0x[0-9a-f]+", "0x..", message)  # object addresses change per run
        found[test] = message[:REASON_LENGTH].replace("|", "/").replace("#", "no.") or "failed"
    return found


def refresh(suite: str, junit_xml: Path, path: Path = EXPECTED_FAILURES) -> str:
    expected = read_expected(path)
    failing = failures(junit_xml, suite)
    lines = []
    for test, entry in expected.items():
        if not test.startswith(f"{suite}::") or entry.kind == PEER_FAILS:
            lines.append(f"{test} | {entry.kind} | {entry.reason}")
        elif test in failing:
            reason = entry.reason if entry.kind != OPEN else failing[test]
            lines.append(f"{test} | {entry.kind} | {reason}")
    listed = set(expected)
    new = {test: why for test, why in failing.items() if test not in listed}
    lines += [f"{test} | {OPEN} | {why}" for test, why in new.items()]
    text = path.read_text()
    header = text[: text.index("\n\n")].splitlines() if "\n\n" in text else []
    body = sorted(lines, key=lambda line: line.split(" | ")[0])
    return "\n".join([*header, "", *body]) + "\n"


if __name__ == "__main__":
    suite_name, xml_path = sys.argv[1], Path(sys.argv[2])
    EXPECTED_FAILURES.write_text(refresh(suite_name, xml_path))
