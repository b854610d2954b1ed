"""AdaRound (issue 17 §1): learned weight rounding on a calibrated prepared model,
FX or PT2E. Convert produces exactly the learned integers with the qparams the
backend's config gives; SQNR rises where nearest rounding loses; time is bounded."""

from __future__ import annotations

import time

import pytest
import torch
from backends import backend_params, installed
from test_vendor_constraints import POW2_QCONFIG, is_power_of_two, pow2_backend, sqnr

import qcore
from qcore.algorithms import adarounded_layers
from qcore.config.qconfig import QConfigMapping


class Coarse(torch.nn.Module):
    """A conv and a linear whose every output channel has one weight 50x the rest:
    the grid is coarse for the others, and their inputs are all positive (after a
    ReLU, or shifted), so rounding errors of a row add up instead of cancelling."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 16, 3)
        self.fc = torch.nn.Linear(16 * 3 * 3, 10)
        with torch.no_grad():
            for layer in (self.conv, self.fc):
                weight = torch.randn(layer.weight.shape, generator=generator) * 0.01
                weight.view(weight.shape[0], -1)[:, 0] = 0.5
                layer.weight.copy_(weight)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.avg_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc(torch.flatten(pooled, 1))


def _data(count: int = 8, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(32, 4, 8, 8, generator=generator) + 0.5 for _ in range(count)]


_X = _data(1, seed=2)[0]  # not among the calibration batches


def _calibrated(model, path: str, backend):
    data = _data()
    if path == "pt2e":
        exported = torch.export.export(model, (data[0],)).module()
        if isinstance(backend, str):
            prepared = qcore.prepare_pt2e(exported, backend)
        else:
            from qcore.pt2e import BackendQuantizer

            mapping = QConfigMapping().set_global(POW2_QCONFIG)
            prepared = qcore.prepare_pt2e(exported, BackendQuantizer(backend, mapping))
    elif isinstance(backend, str):
        prepared = qcore.prepare_fx(model, None, (data[0],), backend=backend)
    else:
        mapping = QConfigMapping().set_global(POW2_QCONFIG)
        prepared = qcore.prepare_fx(model, mapping, (data[0],), backend)
    with torch.no_grad():
        for batch in data:
            prepared(batch)
    return prepared


def _convert(prepared, path: str, *, reference: bool = False):
    if path == "pt2e":
        return qcore.convert_pt2e(prepared, lower=not reference)
    return qcore.convert_to_reference_fx(prepared) if reference else qcore.convert_fx(prepared)


def _integer_weights(converted, path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (integer weight, its scales)} as convert's reference form holds them."""
    found = {}
    if path == "fx":
        for name in ("conv", "fc"):
            module = converted.get_submodule(name)
            qparams = module.weight_qparams["weight"]
            found[name] = (module.integer_weight("weight"), qparams.scale)
        return found
    layers = {torch.ops.aten.conv2d.default: "conv", torch.ops.aten.linear.default: "fc"}
    for node in converted.graph.nodes:
        if node.op == "call_function" and node.target in layers:
            dequantize = node.args[1]  # the weight: dequantize(integers, scale, zero point, ...)
            integers, scale = dequantize.args[:2]  # a per-tensor scale is a literal
            scale = getattr(converted, scale.target) if hasattr(scale, "target") else scale
            found[layers[node.target]] = (getattr(converted, integers.target), torch.tensor(scale))
    return found


def _backend() -> str:
    for name in ("qnnpack", "x86", "fbgemm"):
        if installed(name):
            return name
    pytest.skip("needs a first-party backend")


@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_adaround_lifts_sqnr_and_convert_gives_the_learned_integers(path, backend):
    model = Coarse().eval()
    prepared = _calibrated(model, path, backend)
    started = time.monotonic()
    rounded = qcore.adaround(prepared, _data(), iterations=200)
    seconds = time.monotonic() - started
    with torch.no_grad():
        expected = model(_X)
        plain_db = sqnr(expected, _convert(prepared, path)(_X))
        rounded_db = sqnr(expected, _convert(rounded, path)(_X))
    assert rounded_db >= plain_db + 2.0, (plain_db, rounded_db, seconds)
    results = {r.layer: r for r in adarounded_layers(rounded)}
    assert set(results) == {"conv", "fc"}
    plain = _integer_weights(_convert(prepared, path, reference=True), path)
    learned = _integer_weights(_convert(rounded, path, reference=True), path)
    for name, result in results.items():
        assert result.kept == "learned" and result.iterations == 200
        assert result.error_learned < result.error_nearest
        assert 0 < result.flipped < 0.5
        integers, scale = learned[name]
        assert torch.equal(integers, result.integers), name
        assert torch.equal(scale, plain[name][1]), name  # the qparams did not move
        assert not torch.equal(integers, plain[name][0])  # and some weights rounded otherwise
        # learned rounding moves each weight by at most one step from nearest
        assert (integers.int() - plain[name][0].int()).abs().max() == 1


@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_power_of_two_scales_stay_as_the_backend_requires(path):
    model = Coarse().eval()
    prepared = _calibrated(model, path, pow2_backend())
    rounded = qcore.adaround(prepared, _data(), iterations=100)
    plain = _integer_weights(_convert(prepared, path, reference=True), path)
    learned = _integer_weights(_convert(rounded, path, reference=True), path)
    for name, result in ((r.layer, r) for r in adarounded_layers(rounded)):
        integers, scale = learned[name]
        assert all(is_power_of_two(float(s)) for s in scale.flatten()), scale
        assert torch.equal(scale, plain[name][1])
        assert torch.equal(integers, result.integers)
    with torch.no_grad():
        expected = model(_X)
        assert sqnr(expected, _convert(rounded, path)(_X)) > sqnr(
            expected, _convert(prepared, path)(_X)
        )


def test_time_budget_bounds_the_run_and_zero_keeps_nearest_rounding():
    prepared = _calibrated(Coarse().eval(), "fx", _backend())
    started = time.monotonic()
    bounded = qcore.adaround(prepared, _data(), iterations=10**7, time_budget_s=1.0)
    elapsed = time.monotonic() - started
    assert elapsed < 6.0, elapsed  # the budget plus recording and checking, on a loaded machine
    # How many iterations fit depends on the machine: on a loaded one recording the
    # inputs can use the whole budget, leaving a layer none. Only the bound is certain.
    assert all(r.iterations < 10**7 for r in adarounded_layers(bounded))
    none = qcore.adaround(prepared, _data(), time_budget_s=0)
    results = adarounded_layers(none)
    assert [r.iterations for r in results] == [0, 0]
    assert all(r.flipped == 0 for r in results)
    with torch.no_grad():
        assert torch.equal(_convert(none, "fx")(_X), _convert(prepared, "fx")(_X))


def test_progress_only_on_a_terminal(capsys):
    prepared = _calibrated(Coarse().eval(), "fx", _backend())
    qcore.adaround(prepared, _data(), iterations=5)  # stderr is captured: not a terminal
    assert capsys.readouterr().err == ""
    qcore.adaround(prepared, _data(), iterations=5, progress=True)
    err = capsys.readouterr().err
    assert "\r  adaround [1/2] conv: 0/5" in err and "[2/2] fc" in err and err.endswith("\n")


def test_the_prepared_model_is_not_changed():
    prepared = _calibrated(Coarse().eval(), "pt2e", _backend())
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    rounded = qcore.adaround(prepared, _data(), iterations=200)
    assert all(torch.equal(v, prepared.state_dict()[k]) for k, v in before.items())
    assert adarounded_layers(prepared) == ()
    changed = [k for k, v in rounded.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and all(k.endswith("weight") for k in changed), changed


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"prepared: got .*Linear.*expected a model from qcore"):
        qcore.adaround(torch.nn.Linear(2, 2), [])
    model = Coarse().eval()
    uncalibrated = qcore.prepare_fx(model, None, (_X,), backend=_backend())
    with pytest.raises(ValueError, match=r"prepared: no observer has seen data.*calibration"):
        qcore.adaround(uncalibrated, _data())
    prepared = _calibrated(model, "fx", _backend())
    for name, value, expected in (
        ("iterations", 0, "an int >= 1"),
        ("iterations", 2.5, "an int >= 1"),
        ("time_budget_s", -1.0, "seconds >= 0, or None"),
        ("time_budget_s", float("nan"), "seconds >= 0, or None"),
        ("regularization", "high", "a float >= 0"),
        ("learning_rate", 0, "a float > 0"),
    ):
        with pytest.raises(ValueError, match=rf"{name}: got .*; expected {expected}"):
            qcore.adaround(prepared, _data(), **{name: value})
    with pytest.raises(TypeError, match=r"progress: got 'yes'.*True, False or None"):
        qcore.adaround(prepared, _data(), progress="yes")
    with pytest.raises(ValueError, match=r"calibration_data: got .*which gave no batches"):
        qcore.adaround(prepared, [])


def test_dynamic_linears_need_no_calibration():
    from qcore.config.qconfig import default_dynamic_qconfig

    model = Coarse().eval()
    mapping = QConfigMapping().set_object_type(torch.nn.Linear, default_dynamic_qconfig)
    prepared = qcore.prepare_fx(model, mapping, (_X,), backend=_backend())
    rounded = qcore.adaround(prepared, _data(), iterations=100)
    (result,) = adarounded_layers(rounded)  # the conv stays float
    assert result.layer == "fc" and result.kept == "learned"
    converted = qcore.convert_to_reference_fx(rounded)
    assert torch.equal(converted.fc.integer_weight("weight"), result.integers)
