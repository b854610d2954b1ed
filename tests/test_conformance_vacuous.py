"""``qcore check`` cannot pass vacuously (issue 16 §3).

tests/thirdparty/vacuous declares Linear and Conv2d patterns whose dtype configs
no default QConfig meets (every op stays float), a Linear kernel that refuses
every match, and a kernel of a module class no conformance model can be built
for. It is pip-installed into a temporary directory (as test_hostile_plugins
does) and checked in a fresh process: the kernel check and both model checks
fail, naming each kernel once and saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_hostile_plugins import _install


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> subprocess.CompletedProcess:
    site = _install(tmp_path_factory.mktemp("vacuous"), "vacuous")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QCORE_")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "qcore", "check", "vacuous"],
        capture_output=True,
        text=True,
        timeout=900,
        env=environ,
    )


def _line(result: subprocess.CompletedProcess, check: str) -> str:
    lines = [line for line in result.stdout.splitlines() if line[6:].startswith(check)]
    assert len(lines) == 1, result.stdout[-3000:]
    return lines[0]


def test_check_fails_the_vacuous_backend(checked):
    assert checked.returncode == 5, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert _line(checked, "loads").startswith("PASS")


def test_kernels_without_a_model_or_unused_fail_named_once(checked):
    line = _line(checked, "kernels match reference")
    assert line.startswith("FAIL")
    detail = checked.stdout[checked.stdout.index(line) :]
    detail = detail[: detail.index("\nPASS") if "\nPASS" in detail else None]
    # the kernel with no model and no declared reason, named once with its pattern
    assert (
        "no generated model and no declared reason (Kernel.no_model_reason) for 1 kernel pattern:"
        in detail
    )
    assert detail.count("vacuous.block") == 1 and "VacuousBlock" in detail
    # the kernel that refuses every match of its own pattern
    assert "vacuous.linear: nn.Linear: not used" in detail
    assert "power_of_two_scale=True" in detail  # why: its own config leaves Linear float


def test_models_that_stay_float_fail(checked):
    fx = _line(checked, "models quantize (FX)")
    assert fx.startswith("FAIL")
    assert "declares patterns for" in fx and "yet quantized none" in fx
    assert "power_of_two_scale=True" in fx  # why, and what to change
