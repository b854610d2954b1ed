"""Fast bias correction (issue 17 §1): the rounding of a layer's weights shifts
its output mean; correct_bias adds the shift back to the float bias, on FX and
PT2E prepared models, changing nothing else."""

from __future__ import annotations

import pytest
import torch
from backends import backend_params, installed

import qcore
from qcore.algorithms import corrected_biases


class RoundsDown(torch.nn.Module):
    """A linear whose weights all sit 0.45 of a step above a grid point (the step
    its symmetric observer picks): rounding takes 0.45 step off every product, and
    its inputs are positive, so the output shifts by the same sign everywhere."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.fc1 = torch.nn.Linear(64, 64, bias=bias)
        self.fc2 = torch.nn.Linear(64, 8)
        step = 0.001
        integers = torch.randint(-100, 100, (64, 64), generator=generator).float()
        weight = (integers + 0.45) * step
        weight[:, 0] = 127.5 * step  # pins each channel's scale at step
        with torch.no_grad():
            self.fc1.weight.copy_(weight)
            if bias:
                self.fc1.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _data(count: int = 4) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.rand(16, 64, generator=generator) + 0.5,) for _ in range(count)]


def _calibrated(model, path: str, backend: str):
    data = _data()
    if path == "pt2e":
        prepared = qcore.prepare_pt2e(torch.export.export(model, data[0]).module(), backend)
    else:
        prepared = qcore.prepare_fx(model, None, data[0], backend=backend)
    with torch.no_grad():
        for batch in data:
            prepared(*batch)
    return prepared


def _convert(prepared, path: str):
    return qcore.convert_pt2e(prepared) if path == "pt2e" else qcore.convert_fx(prepared)


def _sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (expected - actual).pow(2).mean()
    return (10 * torch.log10(expected.pow(2).mean() / noise)).item()


def _backend() -> str:
    for name in ("qnnpack", "fbgemm", "x86"):
        if installed(name):
            return name
    pytest.skip("needs a first-party backend")


METHODS = ["fast", "empirical"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_correction_lifts_sqnr_where_rounding_is_biased(path, backend, method):
    model = RoundsDown().eval()
    prepared = _calibrated(model, path, backend)
    corrected = qcore.correct_bias(prepared, _data(), method=method)
    (x,) = _data(1)[0]
    with torch.no_grad():
        plain_db = _sqnr(model(x), _convert(prepared, path)(x))
        corrected_db = _sqnr(model(x), _convert(corrected, path)(x))
    assert corrected_db >= plain_db + 5.0, (plain_db, corrected_db)
    changed = {c.layer: c for c in corrected_biases(corrected)}
    assert len(changed) == 2  # fc1 and fc2
    assert max(c.largest_change for c in changed.values()) > 0.01


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_only_biases_change(path, method):
    prepared = _calibrated(RoundsDown().eval(), path, _backend())
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    corrected = qcore.correct_bias(prepared, _data(), method=method)
    after = corrected.state_dict()
    assert all(torch.equal(v, prepared.state_dict()[k]) for k, v in before.items())
    differ = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert differ and all("bias" in k for k in differ), differ
    assert corrected_biases(prepared) == ()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_a_layer_without_a_bias_gets_one(path, method):
    model = RoundsDown(bias=False).eval()
    prepared = _calibrated(model, path, _backend())
    corrected = qcore.correct_bias(prepared, _data(), method=method)
    (x,) = _data(1)[0]
    with torch.no_grad():
        plain_db = _sqnr(model(x), _convert(prepared, path)(x))
        corrected_db = _sqnr(model(x), _convert(corrected, path)(x))
    assert corrected_db >= plain_db + 5.0, (plain_db, corrected_db)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"prepared: got .*Linear.*expected a model from qcore"):
        qcore.correct_bias(torch.nn.Linear(2, 2), [])
    prepared = _calibrated(RoundsDown().eval(), "fx", _backend())
    for method in METHODS:
        with pytest.raises(ValueError, match=r"calibration_data: got .*which gave no batches"):
            qcore.correct_bias(prepared, [], method=method)
    with pytest.raises(ValueError, match=r"method: got 'exact'; expected 'fast' or 'empirical'"):
        qcore.correct_bias(prepared, _data(), method="exact")


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu_(self.conv(x))  # in place: it rewrites the conv's output tensor
        y = torch.relu(self.depthwise(y)) + y
        return self.fc(y.mean((2, 3)))


@pytest.mark.parametrize("backend", backend_params())
def test_empirical_correction_runs_the_graph_as_convert_computes_it(backend):
    """The empirical method measures each layer on the model as convert computes it:
    the simulation it walks gives the reference form's outputs (PT2E, where both
    run the same float ops on the same fake-quantized values)."""
    from qcore.algorithms.simulated import _Run
    from qcore.pt2e.prepare import PT2E_STATE_KEY

    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    model = ConvNet().eval()
    prepared = qcore.prepare_pt2e(torch.export.export(model, (x,)).module(), backend)
    with torch.no_grad():
        prepared(x)
        reference = qcore.convert_pt2e(prepared, lower=False)(x)
        before = {k: v.clone() for k, v in prepared.state_dict().items()}
        simulated = _Run(prepared, True, prepared.meta[PT2E_STATE_KEY].full_range).run(x * 3)
        after = prepared.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # observers only read
        simulated = _Run(prepared, True, prepared.meta[PT2E_STATE_KEY].full_range).run(x)
    torch.testing.assert_close(simulated, reference, rtol=0, atol=1e-6)
    corrected = qcore.correct_bias(prepared, [(x,)], method="empirical")
    with torch.no_grad():
        before = _sqnr(model(x), qcore.convert_pt2e(prepared)(x))
        after = _sqnr(model(x), qcore.convert_pt2e(corrected)(x))
    # on the data it was corrected on; measuring the conv's output after relu_ had
    # rewritten it moved biases by the ReLU's cut: 28.5 -> 18.3 dB on resnet18_like
    assert after >= before - 0.1, (before, after)


class CalledTwice(torch.nn.Module):
    """fc1 runs twice: both calls' roundings shift the one bias they share."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = RoundsDown()
        self.fc2 = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1 = self.inner.fc1
        return self.fc2(torch.relu(fc1(torch.relu(fc1(x)))))


@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_fast_correction_of_a_layer_called_twice_shifts_its_bias_once(path):
    """Each call's shift was added to the shared bias in turn: twice the shift the
    layer's inputs, pooled over both calls, call for (16.2 against 24.1 dB)."""
    backend = _backend()
    model = CalledTwice().eval()
    fc1 = model.inner.fc1
    prepared = _calibrated(model, path, backend)
    corrected = qcore.correct_bias(prepared, _data())
    inputs = []
    handle = fc1.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    with torch.no_grad():
        for batch in _data():
            model(*batch)
    handle.remove()
    pooled_mean = torch.cat(inputs).mean(0)
    rounding = torch.full_like(fc1.weight, 0.45 * 0.001)  # RoundsDown's weights
    rounding[:, 0] = 0.5 * 0.001  # 127.5 steps, clamped to 127
    expected = rounding @ pooled_mean
    (shared_bias,) = [
        value for name, value in corrected.state_dict().items() if name.endswith("fc1.bias")
    ]
    torch.testing.assert_close(shared_bias - fc1.bias, expected, rtol=1e-4, atol=1e-6)
    assert len(corrected_biases(corrected)) == 2  # fc1 (once) and fc2
