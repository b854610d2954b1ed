"""Misbehaving plugins, installed for real: issue 14's isolation items end to end.

tests/thirdparty/hostile (distribution ``QCore_Hostile``: backends hostile,
twin-a, twin-b, and an extension of x86) and tests/thirdparty/acme are
pip-installed into a temporary directory put on PYTHONPATH of a fresh Python
process, next to whatever this environment installed. The hostile plugin
misbehaves as QCORE_HOSTILE says (HOSTILE_BEHAVIOURS), its x86 extension as
QCORE_HOSTILE_X86 says (X86_BEHAVIOURS). For each, PROBE loads every backend
and "native", asks for the hostile backend's defaults, and quantizes a model
with "native": the process survives, the other backends load, and every error
names the plugin.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qcore

THIRDPARTY = Path(__file__).parent / "thirdparty"
OURS = {"hostile", "twin-a", "twin-b", "acme"}  # the backends the temporary install adds
# What this environment installed, broken ones aside (tox -e thirdparty has some).
OTHERS = {
    name
    for name in qcore.list_backends()
    if name != "native" and name not in OURS and not name.startswith("broken-")
}

# QCORE_HOSTILE: what the ``hostile`` backend's plugin does.
HOSTILE_BEHAVIOURS = {
    "exit-import": "raises SystemExit(3) at import",
    "base-exception-import": "raises a BaseException subclass at import",
    "import-error": "fails to import (a missing dependency)",
    "old-api": "declares plugin API 0",
    "misspelled-hook": "implements qcore_backend_kernel, which is no hook",
    "exit-hook": "raises SystemExit(3) in qcore_backend_pattern_configs",
    "base-exception-hook": "raises a BaseException subclass in a hook",
    "hook-error": "raises RuntimeError in a hook",
    "no-pattern": "returns a BackendPatternConfig without a pattern",
    "not-a-list": "returns 42 for its pattern configs",
    "wrong-item": "returns a str among its pattern configs",
    "bad-kernel": "builds Kernel(pattern=42)",
    "mapping-str": "returns a str as its default QConfigMapping",
    "mapping-dict": "returns a dict as its default QConfigMapping",
    "quantizer-str": "returns a str as its PT2E Quantizer",
}
# QCORE_HOSTILE_X86: what its extension of x86, a backend it does not own, does.
X86_BEHAVIOURS = {
    "exit-import": "raises SystemExit(3) at import",
    "hook-error": "raises RuntimeError in a hook",
}

# One process tries each case in turn (a case: environment variables to set), each
# with a fresh registry and a fresh import of the hostile package, and prints one
# line per case; a case that ends the process leaves the lines after it missing.
PROBE = r"""
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
import qcore
import qcore.plugin

BASELINE = {key: os.environ.get(key) for key in ("QCORE_BLOCK_PLUGINS",)}
for case in json.loads(os.environ["QCORE_PROBE_CASES"]):
    for key in ("QCORE_HOSTILE", "QCORE_HOSTILE_X86"):
        os.environ.pop(key, None)
    for key, value in BASELINE.items():
        os.environ[key] = value or ""
    os.environ.update(case)
    for module in [m for m in sys.modules if m.startswith("qcore_hostile")]:
        del sys.modules[module]
    qcore.plugin._default_registry = qcore.plugin.BackendRegistry()
    report = {"case": case, "backends": {}, "hostile": {}}
    for name in qcore.list_backends():
        if name == "native":
            continue
        try:
            qcore.get_backend(name)
            report["backends"][name] = "ok"
        except Exception as error:
            report["backends"][name] = f"{type(error).__name__}: {error}"
    report["imported"] = "qcore_hostile.plugin" in sys.modules
    try:
        native = qcore.get_backend("native")
        report["native"] = sorted({plugin.spec.backend for plugin in native.plugins})
        report["left_out"] = [name for name, _ in getattr(native, "left_out", ())]
    except Exception as error:
        report["native"] = f"{type(error).__name__}: {error}"
    asks = {
        "mapping": lambda: type(qcore.get_default_qconfig_mapping("hostile")).__name__,
        "quantizer": lambda: repr(qcore.get_backend("hostile").quantizer()),
    }
    for what, ask in asks.items():
        try:
            report["hostile"][what] = "ok: " + ask()
        except Exception as error:
            report["hostile"][what] = f"{type(error).__name__}: {error}"
    if report["backends"].get("fbgemm") == "ok" or report["backends"].get("x86") == "ok":
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
        x = torch.randn(4, 8)
        try:
            prepared = qcore.prepare_fx(model, None, (x,), backend="native")
            prepared(x)
            converted = qcore.convert_fx(prepared)
            report["native_quantize"] = "ok" if converted(x).shape == (4, 8) else "wrong shape"
        except Exception as error:
            report["native_quantize"] = f"{type(error).__name__}: {error}"
    print("PROBE " + json.dumps(report), flush=True)
"""

BLOCKED = "qcore-acme,qcore-broken"
BLOCKED_SPELLINGS = ("qcore-hostile", "QCORE.HOSTILE", "qcore_hostile:hostile")
CASES = (
    [{}]
    + [{"QCORE_HOSTILE": behaviour} for behaviour in sorted(HOSTILE_BEHAVIOURS)]
    + [{"QCORE_HOSTILE_X86": behaviour} for behaviour in sorted(X86_BEHAVIOURS)]
    + [
        # The advice a broken extension's error gives, followed.
        {"QCORE_HOSTILE_X86": behaviour, "QCORE_BLOCK_PLUGINS": f"{BLOCKED},QCore_Hostile:x86"}
        for behaviour in sorted(X86_BEHAVIOURS)
    ]
    + [
        {"QCORE_HOSTILE": "exit-import", "QCORE_BLOCK_PLUGINS": f"{BLOCKED},{blocked}"}
        for blocked in BLOCKED_SPELLINGS
    ]
)


def _install(root: Path, *names: str) -> Path:
    """pip-install tests/thirdparty/<name> (copied: the build writes next to the sources)."""
    sources = []
    for name in names:
        sources.append(root / "src" / name)
        ignore = shutil.ignore_patterns("build", "*.egg-info")
        shutil.copytree(THIRDPARTY / name, sources[-1], ignore=ignore)
    site = root / "site"
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
    try:
        import setuptools  # noqa: F401

        command.append("--no-build-isolation")  # no index needed
    except ImportError:
        pass
    result = subprocess.run(
        [*command, *map(str, sources)], capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        pytest.skip(f"could not pip-install the test plugins: {result.stderr[-500:]}")
    return site


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return _install(tmp_path_factory.mktemp("hostile"), "hostile", "acme")


def run(site: Path, *args: str, code: str | None = None, timeout: float = 300, **env: str):
    """A fresh Python with the test plugins installed, running ``code`` or ``qcore args``."""
    environ = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("QCORE_HOSTILE", "QCORE_BLOCK", "QCORE_DISABLE"))
    }
    environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(site), os.environ.get("PYTHONPATH", "")])
    )
    # Each misbehaviour is tried alone: acme (a vendor of its own) only where asked
    # for, and tests/thirdparty/broken (installed by tox -e thirdparty) never.
    environ["QCORE_BLOCK_PLUGINS"] = BLOCKED
    environ.update(env)
    argv = ["-c", code] if code is not None else ["-m", "qcore", *args]
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=environ
    )


def probe(site: Path, cases: list[dict]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run PROBE over ``cases``: the process and one report per case it reached."""
    result = run(site, code=PROBE, QCORE_PROBE_CASES=json.dumps(cases))
    lines = [line[6:] for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    return result, [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def reports(site) -> dict[str, dict]:
    result, found = probe(site, CASES)
    by_case = {json.dumps(report["case"], sort_keys=True): report for report in found}
    by_case["<process>"] = {"returncode": result.returncode, "stderr": result.stderr[-3000:]}
    return by_case


def report_of(reports: dict, **case: str) -> dict:
    found = reports.get(json.dumps(case, sort_keys=True))
    process = reports["<process>"]
    assert found is not None, (
        f"the probe process ended (exit {process['returncode']}) before case {case}: "
        f"{process['stderr']}"
    )
    return found


def assert_others_survive(report: dict, lost: set[str] = frozenset()) -> None:
    """Every backend this environment installed still loads (but ``lost``), and is in native."""
    for name in OTHERS - lost:
        assert report["backends"][name] == "ok", (name, report["backends"][name])
    assert set(report["native"]) >= OTHERS - lost, report["native"]
    if "native_quantize" in report:
        assert report["native_quantize"] == "ok", report["native_quantize"]


def test_the_probe_process_survives_every_case(reports):
    assert reports["<process>"]["returncode"] == 0, reports["<process>"]["stderr"]
    assert len(reports) == len(CASES) + 1


def test_well_behaved_the_hostile_package_loads(reports):
    report = report_of(reports)
    assert_others_survive(report)
    for name in ("hostile", "twin-a", "twin-b"):
        assert report["backends"][name] == "ok", report["backends"][name]
    assert report["left_out"] == []


@pytest.mark.parametrize("behaviour", sorted(HOSTILE_BEHAVIOURS))
def test_a_hostile_plugin_fails_alone_and_is_named(reports, behaviour):
    report = report_of(reports, QCORE_HOSTILE=behaviour)
    assert_others_survive(report)
    # One module serving two entry points (twin-a, twin-b) is unaffected.
    assert report["backends"]["twin-a"] == report["backends"]["twin-b"] == "ok"
    status = report["backends"]["hostile"]
    hooks = report["hostile"]
    if behaviour.startswith(("mapping-", "quantizer-")):
        # Loads; the hook's answer is refused when asked for, naming the plugin.
        assert status == "ok"
        what = "mapping" if behaviour.startswith("mapping") else "quantizer"
        assert hooks[what].startswith("BackendLoadError"), hooks[what]
        assert "plugin QCore_Hostile:hostile" in hooks[what]
        assert "expected a" in hooks[what]
        assert report["left_out"] == []
        return
    assert status.startswith(("BackendLoadError", "PluginAPIVersionError")), status
    assert "plugin QCore_Hostile:hostile" in status
    assert "QCORE_BLOCK_PLUGINS=QCore_Hostile:hostile" in status
    assert "hostile" not in report["native"] and report["left_out"] == ["hostile"]
    for answer in hooks.values():  # asking again gives the same error, not a crash
        assert answer.startswith(("BackendLoadError", "PluginAPIVersionError")), answer


@pytest.mark.parametrize("behaviour", sorted(X86_BEHAVIOURS))
def test_a_broken_extension_of_x86_says_how_to_block_it(reports, behaviour):
    if "x86" not in OTHERS:
        pytest.skip("needs the x86 plugin")
    report = report_of(reports, QCORE_HOSTILE_X86=behaviour)
    assert_others_survive(report, lost={"x86"})
    error = report["backends"]["x86"]
    assert error.startswith("BackendLoadError") and "plugin QCore_Hostile:x86" in error
    assert "To load 'x86' without it, set QCORE_BLOCK_PLUGINS=QCore_Hostile:x86" in error
    # native reports the backend it lost.
    assert "x86" not in report["native"] and report["left_out"] == ["x86"]
    # Following the advice brings x86 back.
    blocked = f"{BLOCKED},QCore_Hostile:x86"
    report = report_of(reports, QCORE_HOSTILE_X86=behaviour, QCORE_BLOCK_PLUGINS=blocked)
    assert report["backends"]["x86"] == "ok" and report["left_out"] == []


@pytest.mark.parametrize("blocked", BLOCKED_SPELLINGS)
def test_blocking_matches_normalized_names(reports, blocked):
    report = report_of(
        reports, QCORE_HOSTILE="exit-import", QCORE_BLOCK_PLUGINS=f"{BLOCKED},{blocked}"
    )
    assert "blocked by QCORE_BLOCK_PLUGINS" in report["backends"]["hostile"]
    assert not report["imported"]


def test_qcore_backends_survives_and_reports(site):
    env = {"QCORE_HOSTILE": "exit-hook"}
    if "x86" in OTHERS:
        env["QCORE_HOSTILE_X86"] = "exit-import"
    result = run(site, "backends", "--load", **env)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[2:] if line.strip()}
    assert rows["hostile"].split()[-3:-1] == ["failed:", "SystemExit:"], rows["hostile"]
    for name in OTHERS - {"x86"}:
        assert rows[name].rstrip().endswith("ok"), rows[name]
    lost = "hostile, x86" if "x86" in OTHERS else "hostile"
    assert f"leaves out {lost} (failed)" in rows["native"]
    culprits = (
        "QCore_Hostile:hostile,QCore_Hostile:x86" if "x86" in OTHERS else "QCore_Hostile:hostile"
    )
    assert f"QCORE_BLOCK_PLUGINS={culprits}" in result.stdout


def test_qcore_backends_imports_no_plugin(site):
    start = time.perf_counter()
    result = run(site, "backends", QCORE_HOSTILE="slow-import", QCORE_HOSTILE_SLEEP="60")
    assert result.returncode == 0, result.stderr
    assert time.perf_counter() - start < 50
    assert "not loaded" in result.stdout and "No plugin was imported" in result.stdout


def test_a_blocked_plugin_is_not_broken(site):
    result = run(site, "backends", "--load", QCORE_BLOCK_PLUGINS=f"{BLOCKED},qcore-hostile")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if "QCore_Hostile" in line]
    assert rows and all(line.rstrip().endswith("blocked") for line in rows)


def test_a_plugin_slow_to_import_blocks_no_other_backend(site):
    other = sorted(OTHERS)[0] if OTHERS else None
    if other is None:
        pytest.skip("needs a backend plugin")
    code = (
        "import threading, time, qcore\n"
        f"qcore.get_backend({other!r})\n"
        "slow = threading.Thread(target=qcore.get_backend, args=('hostile',), daemon=True)\n"
        "slow.start(); time.sleep(0.5)\n"
        f"start = time.perf_counter(); qcore.get_backend({other!r})\n"
        "print(f'{time.perf_counter() - start:.3f}', slow.is_alive())\n"
    )
    result = run(site, code=code, QCORE_HOSTILE="slow-import", QCORE_HOSTILE_SLEEP="20")
    assert result.returncode == 0, result.stderr
    seconds, still_importing = result.stdout.split()
    assert still_importing == "True" and float(seconds) < 1.0


# -- issue 14 section 4: a vendor's plugin must not change others' behaviour --------

# Quantizes two models with "native" (FX and PT2E) and with "x86" (PT2E), with or
# without the vendors (a fresh registry per case), and prints what explain says.
VENDOR_PROBE = r"""
import json, os, warnings
warnings.simplefilter("ignore")
import torch
import qcore
import qcore.plugin
from qcore.pt2e.extended import quantizer_for_backend


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.relu = torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.linear(self.relu(self.conv(x)).mean((2, 3)))


class GeluNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.gelu = torch.nn.GELU()

    def forward(self, x):
        fused = self.gelu(self.a(x))           # x86's recipe fuses linear + gelu
        alone = self.gelu(torch.relu(self.a(x)) + 1)  # x86 leaves this gelu float
        return self.b(fused + alone)


def explain(model):
    return [[e.node, e.op, e.status.value, e.kernel, e.reason] for e in qcore.explain(model).ops]


def fx(model, x, backend):
    prepared = qcore.prepare_fx(model, None, (x,), backend=backend)
    prepared(x)
    converted = qcore.convert_fx(prepared)
    return {"explain": explain(converted), "output": converted(x).tolist()}


def pt2e(model, x, backend):
    exported = torch.export.export(model, (x,)).module()
    prepared = qcore.prepare_pt2e(exported, backend)
    prepared_explain = explain(prepared)
    prepared(x)
    converted = qcore.convert_pt2e(prepared)
    return {
        "prepared": prepared_explain,
        "explain": explain(converted),
        "output": converted(x).tolist(),
    }


torch.manual_seed(0)
conv_net, conv_x = ConvNet().eval(), torch.randn(2, 3, 8, 8)
gelu_net, gelu_x = GeluNet().eval(), torch.randn(8, 16)
for blocked in json.loads(os.environ["QCORE_VENDOR_CASES"]):
    os.environ["QCORE_BLOCK_PLUGINS"] = blocked
    qcore.plugin._default_registry = qcore.plugin.BackendRegistry()
    native = qcore.get_backend("native")
    report = {
        "blocked": blocked,
        "native_quantizer": type(quantizer_for_backend(native)).__name__,
        "x86_quantizer": type(quantizer_for_backend(qcore.get_backend("x86"))).__name__,
        "native_mapping": repr(qcore.get_default_qconfig_mapping("native").global_qconfig),
        "conflicts": [str(conflict) for conflict in native.conflicts],
        "native_fx": fx(conv_net, conv_x, "native"),
        "native_pt2e": pt2e(conv_net, conv_x, "native"),
        "gelu_fx_x86": fx(gelu_net, gelu_x, "x86"),
        "gelu_pt2e_x86": pt2e(gelu_net, gelu_x, "x86"),
        "gelu_pt2e_native": pt2e(gelu_net, gelu_x, "native"),
    }
    print("VENDOR " + json.dumps(report), flush=True)
"""

# tox -e thirdparty also installs qcore-mychip, which extends x86: kept out of both.
WITH_VENDORS = "qcore-broken,qcore-mychip:x86"
WITHOUT_VENDORS = f"{WITH_VENDORS},qcore-acme,qcore-hostile"


@pytest.fixture(scope="module")
def vendors(site) -> dict[str, dict]:
    if "x86" not in OTHERS:
        pytest.skip("needs the x86 plugin")
    cases = [WITHOUT_VENDORS, WITH_VENDORS]
    result = run(site, code=VENDOR_PROBE, QCORE_VENDOR_CASES=json.dumps(cases))
    lines = [line[7:] for line in result.stdout.splitlines() if line.startswith("VENDOR ")]
    assert len(lines) == len(cases), result.stderr[-3000:]
    return {report["blocked"]: report for report in map(json.loads, lines)}


def test_a_vendor_ignoring_backend_does_not_change_native(vendors):
    """qcore-acme answers every hook whatever `backend` says (its fuser makes its own
    fused module, its default QConfigMapping is qint8) and its name sorts first.
    QCore_Hostile, installed too, adds GELU to x86: the model has none."""
    alone, with_acme = vendors[WITHOUT_VENDORS], vendors[WITH_VENDORS]
    assert with_acme["native_mapping"] == alone["native_mapping"]
    for path in ("native_fx", "native_pt2e"):
        assert with_acme[path]["explain"] == alone[path]["explain"], path
        assert with_acme[path]["output"] == alone[path]["output"], path
    statuses = {entry[0]: entry[2:4] for entry in with_acme["native_fx"]["explain"]}
    assert statuses["conv"][0] == "quantized" and "AcmeConvReLU2d" not in str(statuses)
    # acme's fuser is reported as a conflict, not silently dropped.
    assert any("fuser_method" in c and "acme" in c for c in with_acme["conflicts"])


def test_pt2e_native_is_the_union(vendors):
    """ "native" on PT2E is compiled from the union, as on FX: the same kernels."""
    for report in vendors.values():
        assert report["native_quantizer"] == "BackendQuantizer"
        # (PT2E lists the relu a conv takes in as a post-op too; FX fused it at prepare)
        kernels = [
            entry[3]
            for entry in report["native_pt2e"]["explain"]
            if not entry[4].startswith("a post-op in")
        ]
        assert kernels == [entry[3] for entry in report["native_fx"]["explain"]]
    # The GELU pattern and kernel QCore_Hostile adds to x86 reach native on PT2E too.
    entries = {e[0]: e for e in vendors[WITH_VENDORS]["gelu_pt2e_native"]["explain"]}
    assert [e[2:4] for e in entries.values() if e[1] == "aten.gelu"] == [
        ["quantized", "hostile.gelu"]
    ] * 2


def test_pt2e_x86_uses_what_its_extension_adds(vendors):
    alone, extended = vendors[WITHOUT_VENDORS], vendors[WITH_VENDORS]
    assert alone["x86_quantizer"] == "X86Quantizer"
    assert extended["x86_quantizer"] == "ExtendedQuantizer"
    # FX: the vendor's GELU pattern and kernel are used.
    fx_kernels = {e[0]: e[3] for e in extended["gelu_fx_x86"]["explain"]}
    assert fx_kernels["gelu"] == fx_kernels.get("gelu_1", "hostile.gelu") == "hostile.gelu"
    # PT2E: the gelu x86's recipe leaves float is the vendor's ...
    prepared = {e[0]: e for e in extended["gelu_pt2e_x86"]["prepared"]}
    converted = {e[0]: e for e in extended["gelu_pt2e_x86"]["explain"]}
    alone_prepared = {e[0]: e for e in alone["gelu_pt2e_x86"]["prepared"]}
    assert alone_prepared["gelu_1"][2] == "float"
    assert prepared["gelu_1"][2] == "quantized"
    assert converted["gelu_1"][2:4] == ["quantized", "hostile.gelu"]
    # ... and where x86's recipe takes the gelu (fused into the linear), explain says
    # why the vendor's pattern is not used.
    assert prepared["gelu"][2] == "quantized"
    assert "QCore_Hostile's pattern GELU for x86 is not used here" in prepared["gelu"][4]
    assert "X86Quantizer (qcore-x86)" in prepared["gelu"][4]
    # What x86's own recipe decides is unchanged by the extension.
    for node, entry in alone_prepared.items():
        if node != "gelu_1":
            assert prepared[node][:3] == entry[:3], node
