"""A model converted on one CPU and loaded on another (issue 13, silent accuracy).

Lowering chooses each kernel's engine for the CPU that converts: where fbgemm's and
oneDNN's 16-bit pair sums would saturate (no VNNI), or oneDNN's int8 conv computes a
geometry wrong (qcore.kernels.onednn_probe), the kernel runs on qnnpack's instead, and
a dynamic input is quantized to 7 bits. A model saved on a CPU with VNNI and loaded
on one without kept the first CPU's choice and saturated silently. Loading (torch.load,
qcore.load, deepcopy, load_state_dict) now asks the loading CPU again. The "other CPU" is made here
by answering the CPU questions differently before and after saving, so these tests run
the same on any machine.
"""

from __future__ import annotations

import io
import os
import tempfile
import warnings

import pytest
import torch
from backends import installed
from test_kernels_saturation import SigmoidSoftmax
from torch import nn

import qcore
from qcore.config.qconfig import default_dynamic_qconfig
from qcore.kernels import dynamic, onednn_probe, runtime

SATURATING = "sums pairs of int8 products in 16 bits"


def _pretend_cpu(monkeypatch: pytest.MonkeyPatch, saturates: bool) -> None:
    monkeypatch.setattr(runtime, "int8_products_saturate", lambda: saturates)
    monkeypatch.setattr(dynamic, "int8_products_saturate", lambda: saturates)


def _pickled(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _through_qcore_save(model: nn.Module) -> nn.Module:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.qcore")
        qcore.save(model, path)
        return qcore.load(path)


def _loaded_with_warnings(load, model: nn.Module) -> tuple[nn.Module, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a user sees: each text once per place
        loaded = load(model)
    return loaded, [str(w.message) for w in caught if issubclass(w.category, qcore.QCoreWarning)]


def _saturating_model(monkeypatch, backend: str):
    torch.manual_seed(0)
    model = SigmoidSoftmax().eval()
    batches = [torch.randn(4, 3, 8, 8) * 2 for _ in range(3)]
    _pretend_cpu(monkeypatch, saturates=False)  # converted on a CPU with VNNI
    prepared = qcore.prepare_fx(model, None, (batches[0],), backend)
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    return qcore.convert_fx(prepared), qcore.convert_to_reference_fx(prepared), batches


@pytest.mark.skipif(not installed("fbgemm"), reason="the fbgemm plugin is not installed")
@pytest.mark.parametrize("route", ["torch.load", "qcore.load", "load_state_dict"])
def test_kernels_whose_sums_saturate_on_the_loading_cpu_move_to_the_exact_engine(
    monkeypatch, route
) -> None:
    lowered, reference, batches = _saturating_model(monkeypatch, "fbgemm")
    assert lowered.conv2.engine == lowered.fc2.engine == "fbgemm"
    copy = _pickled(lowered)  # made on the converting CPU, for load_state_dict
    _pretend_cpu(monkeypatch, saturates=True)  # loaded on a CPU without VNNI

    def into_copy(model: nn.Module) -> nn.Module:
        copy.load_state_dict(model.state_dict())
        return copy

    loads = {"torch.load": _pickled, "qcore.load": _through_qcore_save}
    loaded, messages = _loaded_with_warnings(loads.get(route, into_copy), lowered)

    assert loaded.conv2.engine == loaded.fc2.engine == runtime.EXACT_ENGINE
    assert loaded.conv1.engine == "fbgemm"  # its graph input keeps to 7 bits
    assert len(messages) == 1 and "converted on a CPU" in messages[0]
    report = qcore.explain(loaded)
    for node in ("conv2", "fc2"):
        assert "runs on qnnpack's kernel on this CPU" in report[node].reason
        assert SATURATING in report[node].reason
    assert SATURATING not in report["conv1"].reason
    with torch.no_grad():
        for batch in batches:
            expected = reference(batch)
            assert (loaded(batch) - expected).abs().max() <= 2.01 * loaded.fc2.scale


@pytest.mark.skipif(not installed("fbgemm"), reason="the fbgemm plugin is not installed")
def test_a_model_loaded_on_the_cpu_that_converted_it_keeps_its_kernels_quietly(
    monkeypatch,
) -> None:
    lowered, _, batches = _saturating_model(monkeypatch, "fbgemm")
    loaded, messages = _loaded_with_warnings(_pickled, lowered)
    assert messages == []
    assert loaded.conv2.engine == "fbgemm"
    assert qcore.explain(loaded) == qcore.explain(lowered)
    with torch.no_grad():
        assert torch.equal(loaded(batches[0]), lowered(batches[0]))


@pytest.mark.skipif(not installed("x86"), reason="the x86 plugin is not installed")
def test_a_conv_geometry_onednn_gets_wrong_on_the_loading_cpu_moves_to_the_exact_engine(
    monkeypatch,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.ReLU()).eval()
    batches = [torch.randn(2, 4, 10) for _ in range(3)]
    prepared = qcore.prepare_fx(model, None, (batches[0],), "x86")
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    onednn_probe.onednn_conv_wrong_here.cache_clear()
    lowered = qcore.convert_fx(prepared)
    if lowered.get_submodule("0").engine != "x86":
        pytest.skip("this CPU's oneDNN already computes this geometry wrong")

    def garbage(x, packed, scale, zero_point):  # the loading CPU's oneDNN, made wrong
        return torch.quantize_per_tensor(torch.rand(1, 8, 10) * 9, 0.05, 64, torch.quint8)

    monkeypatch.setitem(onednn_probe._QUANTIZED_CONVS, 1, garbage)
    monkeypatch.setattr(onednn_probe, "cpu_fingerprint", lambda: "another kind of CPU")
    onednn_probe.onednn_conv_wrong_here.cache_clear()
    try:
        loaded, messages = _loaded_with_warnings(_pickled, lowered)
    finally:
        onednn_probe.onednn_conv_wrong_here.cache_clear()
    assert loaded.get_submodule("0").engine == runtime.EXACT_ENGINE
    assert len(messages) == 1
    reason = qcore.explain(loaded)["_0"].reason
    assert "runs on qnnpack's kernel on this CPU" in reason
    assert "steps off the reference on this CPU" in reason
    reference = qcore.convert_to_reference_fx(prepared)
    with torch.no_grad():
        for batch in batches:
            expected = reference(batch)
            step = loaded.get_submodule("0").scale
            assert (loaded(batch) - expected).abs().max() <= 2.01 * step


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 16)
        self.lstm = nn.LSTM(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.fc(x))[0]


@pytest.mark.skipif(not installed("fbgemm"), reason="the fbgemm plugin is not installed")
def test_dynamic_kernels_take_7_bit_inputs_on_a_loading_cpu_whose_sums_saturate(
    monkeypatch,
) -> None:
    torch.manual_seed(0)
    model = Mlp().eval()
    x = torch.randn(5, 3, 32)
    mapping = qcore.QConfigMapping().set_global(default_dynamic_qconfig)
    _pretend_cpu(monkeypatch, saturates=False)
    prepared = qcore.prepare_fx(model, mapping, (x,), "fbgemm")
    lowered = qcore.convert_fx(prepared)
    assert not lowered.fc.reduce_range and not lowered.lstm.reduce_range

    _pretend_cpu(monkeypatch, saturates=True)
    loaded, messages = _loaded_with_warnings(_pickled, lowered)
    assert loaded.fc.reduce_range and loaded.lstm.reduce_range
    assert len(messages) == 1
    assert "7 bits on this CPU" in qcore.explain(loaded)["fc"].reason
    # What lowering on such a CPU gives: the same kernels, the same numbers.
    on_this_cpu = qcore.convert_fx(qcore.prepare_fx(model, mapping, (x,), "fbgemm"))
    with torch.no_grad():
        assert torch.equal(loaded(x), on_this_cpu(x))


@pytest.mark.skipif(not installed("x86"), reason="the x86 plugin is not installed")
def test_a_model_loaded_on_the_kind_of_cpu_that_converted_it_is_not_probed_again(
    monkeypatch,
) -> None:
    """The probe (a few to tens of milliseconds a geometry) ran at lowering on this
    kind of CPU: loading here skips it; on another kind it runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.ReLU()).eval()
    prepared = qcore.prepare_fx(model, None, (torch.randn(2, 4, 10),), "x86")
    prepared(torch.randn(2, 4, 10))
    lowered = qcore.convert_fx(prepared)
    if lowered.get_submodule("0").engine != "x86":
        pytest.skip("this CPU's oneDNN computes this geometry wrong")
    asked = []
    probe = onednn_probe.onednn_conv_wrong_here.__wrapped__
    monkeypatch.setattr(
        onednn_probe, "onednn_conv_wrong_here", lambda *a: asked.append(a) or probe(*a)
    )
    _pickled(lowered)
    assert asked == []
    monkeypatch.setattr(onednn_probe, "cpu_fingerprint", lambda: "another kind of CPU")
    _pickled(lowered)
    assert len(asked) == 1
