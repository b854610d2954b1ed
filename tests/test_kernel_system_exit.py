"""A kernel raising SystemExit in ``lower`` or in its trial run at convert ended
the user's process (lowering caught Exception only); the plugin guide promises a
plugin never does. Now it is refused like any failing kernel (the op stays in
reference form, explain says why); KeyboardInterrupt still stops convert."""

import warnings

import pytest
import torch
from linear_chip import fresh_registry, linear_chip

import qcore
from qcore import DTypeConfig
from qcore.config.qconfig import get_default_qconfig

INT8 = DTypeConfig(torch.quint8, torch.quint8, torch.qint8, torch.float)
DEVICE_NOT_FOUND = "vendor runtime: device not found"


class ExitsWhenRun(torch.nn.Module):
    def forward(self, x):
        raise SystemExit(DEVICE_NOT_FOUND)


def exits_in_lower(match):
    raise SystemExit(DEVICE_NOT_FOUND)


def interrupted_in_lower(match):
    raise KeyboardInterrupt


LOWERINGS = {
    "lower": exits_in_lower,
    "trial run": lambda match: ExitsWhenRun(),
    "interrupt": interrupted_in_lower,
}


def chip(lower):
    return linear_chip(lower)


@pytest.fixture
def registry(monkeypatch):
    return fresh_registry(monkeypatch)


def prepared(registry, where):
    registry.register(chip(LOWERINGS[where]), name="chip")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    mapping = qcore.QConfigMapping().set_global(get_default_qconfig("x86"))
    result = qcore.prepare_fx(model, mapping, (x,), backend="chip")
    result(x)
    return result, x


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        ("lower", f"kernel chip.linear: SystemExit: {DEVICE_NOT_FOUND}"),
        (
            "trial run",
            f"kernel chip.linear: it raised SystemExit on inputs of the recorded shapes: "
            f"{DEVICE_NOT_FOUND}",
        ),
    ],
)
def test_a_kernel_raising_system_exit_is_refused(registry, where, reason):
    model, x = prepared(registry, where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        converted = qcore.convert_fx(model)  # before: SystemExit, the process ended
    entry = qcore.explain(converted)["_0"]
    assert entry.status.value == "reference"
    assert entry.reason.startswith(reason)
    assert converted(x).shape == (3, 4)


def test_keyboard_interrupt_still_stops_convert(registry):
    model, _ = prepared(registry, "interrupt")
    with pytest.raises(KeyboardInterrupt):
        qcore.convert_fx(model)


def test_qcore_check_reports_a_kernel_raising_system_exit(registry, monkeypatch):
    """A kernel that skips the trial run (qcore's own, here pretended) and raises
    SystemExit when check runs it ended `qcore check` (it caught Exception only)."""
    import qcore.engine.lower
    from qcore.conformance import run_checks

    registry.register(chip(LOWERINGS["trial run"]), name="chip")
    monkeypatch.setattr(qcore.engine.lower, "is_tested", lambda kernel: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks("chip")
    failed = [result for result in results if not result.passed]
    assert any("SystemExit" in r.detail and DEVICE_NOT_FOUND in r.detail for r in failed), failed
