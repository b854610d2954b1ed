"""A kernel's int8 output must have the dtype and qparams lowering recorded for it
(``KernelMatch.output``): the next kernel reads its integers at those. A vendor
linear requantizing at 16x the recorded scale scored 1.15 dB (31.6 dB right), one
returning qint8 where quint8 was recorded -2.8 dB, and both passed the trial run
at convert and ``qcore check``. Now the trial run refuses them (the op stays in
reference form, explain says why) and ``qcore check`` fails naming the kernel,
what it returned and what was recorded; check's two-step tolerance is the
recorded step, not one the kernel claims."""

import re
import warnings

import pytest
import torch
from linear_chip import fresh_registry, linear_chip

import qcore
from qcore import DTypeConfig
from qcore.conformance import ConformanceFailure, check_kernels_match_reference

INT8 = DTypeConfig(torch.quint8, torch.quint8, torch.qint8, torch.float)


class Requantized(torch.nn.Module):
    """The reference linear on the dequantized input, quantized at the given qparams
    (the recorded ones unless told otherwise), ``steps_high`` steps off."""

    def __init__(self, match, scale_factor=1.0, dtype=None, zero_point_shift=0, steps_high=0):
        super().__init__()
        self.reference, output = match.module, match.output
        self.scale = output.scale * scale_factor  # what a kernel may claim as its step
        self.zero_point = output.zero_point + zero_point_shift
        self.dtype = dtype or output.dtype
        self.steps_high = steps_high

    def forward(self, x):
        y = self.reference(x.dequantize()) + self.steps_high * self.scale
        zero_point = 0 if self.dtype == torch.qint8 else self.zero_point
        return torch.quantize_per_tensor(y, self.scale, zero_point, self.dtype)


class ClaimsCoarseStep(torch.nn.Module):
    """The recorded qparams, values four steps high, with a 16x step as ``scale``."""

    def __init__(self, match):
        super().__init__()
        self.reference, self.output = match.module, match.output
        self.scale = match.output.scale * 16

    def forward(self, x):
        output = self.output
        y = self.reference(x.dequantize()) + 4 * output.scale
        return torch.quantize_per_tensor(y, output.scale, output.zero_point, output.dtype)


BEHAVIOURS = {
    "right": lambda match: Requantized(match),
    "coarse_scale": lambda match: Requantized(match, scale_factor=16.0),
    "wrong_dtype": lambda match: Requantized(match, dtype=torch.qint8),
    "shifted_zero_point": lambda match: Requantized(match, zero_point_shift=3),
}

PROBLEMS = {
    "coarse_scale": r"it returned quint8, scale [\d.e-]+, zero point \d+; lowering recorded "
    r"quint8, scale [\d.e-]+, zero point \d+",
    "wrong_dtype": r"it returned qint8, scale [\d.e-]+, zero point 0; lowering recorded quint8",
    "shifted_zero_point": r"it returned quint8, scale [\d.e-]+, zero point \d+; lowering "
    r"recorded quint8",
}


def chip(lower):
    return linear_chip(lower, default_mapping=True)


@pytest.fixture
def registry(monkeypatch):
    return fresh_registry(monkeypatch)


def converted(registry, behaviour):
    registry.register(chip(BEHAVIOURS[behaviour]), name="chip")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(3, 8)
    prepared = qcore.prepare_fx(model, qcore.get_default_qconfig_mapping("chip"), (x,), "chip")
    prepared(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = qcore.convert_fx(prepared)
    return result, [str(w.message) for w in caught if issubclass(w.category, qcore.QCoreWarning)]


def test_a_kernel_at_the_recorded_qparams_is_used(registry):
    model, warned = converted(registry, "right")
    assert warned == []
    assert qcore.explain(model)["_0"].kernel == "chip.linear"


@pytest.mark.parametrize("behaviour", ["coarse_scale", "wrong_dtype", "shifted_zero_point"])
def test_the_trial_run_refuses_other_output_qparams(registry, behaviour):
    model, warned = converted(registry, behaviour)
    (message,) = warned
    assert "2 op(s) left in reference form" in message and "chip.linear" in message
    for node in ("_0", "_1"):
        entry = qcore.explain(model)[node]
        assert entry.status.value == "reference"
        assert entry.reason.startswith("kernel chip.linear: ")
        assert re.search(PROBLEMS[behaviour], entry.reason), entry.reason


@pytest.mark.parametrize("behaviour", ["coarse_scale", "wrong_dtype"])
def test_check_fails_a_kernel_refused_for_its_qparams(registry, behaviour):
    registry.register(chip(BEHAVIOURS[behaviour]), name="chip")
    with pytest.raises(ConformanceFailure, match=PROBLEMS[behaviour]) as failure:
        check_kernels_match_reference("chip")
    assert "chip.linear" in str(failure.value)


@pytest.mark.parametrize("behaviour", ["coarse_scale", "wrong_dtype"])
def test_check_holds_a_tested_kernel_to_the_recorded_qparams(registry, monkeypatch, behaviour):
    """A first-party kernel is not tried at convert: check itself compares."""
    monkeypatch.setattr("qcore.engine.lower.is_tested", lambda kernel: True)
    registry.register(chip(BEHAVIOURS[behaviour]), name="chip")
    with pytest.raises(ConformanceFailure, match="kernel chip.linear: " + PROBLEMS[behaviour]):
        check_kernels_match_reference("chip")


def test_checks_tolerance_is_the_recorded_step(registry):
    """Four steps high at the recorded qparams, with a 16x ``scale`` attribute: the
    tolerance was read from that attribute (32 steps) and the kernel passed."""
    registry.register(chip(ClaimsCoarseStep), name="chip")
    with pytest.raises(ConformanceFailure, match="exceeds two output quantization steps"):
        check_kernels_match_reference("chip")
