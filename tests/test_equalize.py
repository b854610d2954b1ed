"""Cross-layer equalization (issue 17 §1): it keeps the float function, lifts the
SQNR of a model whose channels have very different ranges, and touches nothing
but weights, on FX and PT2E prepared models."""

from __future__ import annotations

import pytest
import torch
from backends import backend_params, installed

import qcore
from qcore.algorithms import equalized_pairs


class Imbalanced(torch.nn.Module):
    """conv -> relu -> depthwise conv -> relu -> conv -> linear, whose first conv's
    output channels alternate between ranges 1000 times apart (the depthwise conv
    undoes it): per-tensor quantization of the activation between them loses the
    small channels."""

    def __init__(self, relu6: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.conv2 = torch.nn.Conv2d(8, 8, 1)
        self.fc = torch.nn.Linear(8, 4)
        self.act = torch.nn.ReLU6() if relu6 else torch.nn.ReLU()
        factors = torch.tensor([30.0, 0.03] * 4)
        with torch.no_grad():
            self.conv1.weight.mul_(factors.reshape(-1, 1, 1, 1))
            self.conv1.bias.mul_(factors)
            self.depthwise.weight.div_(factors.reshape(-1, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.conv1(x))
        y = torch.relu(self.depthwise(y))
        y = self.conv2(y)
        return self.fc(y.mean((2, 3)))


def _data(count: int = 8) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 10, 10, generator=generator),) for _ in range(count)]


def _prepare(model: torch.nn.Module, path: str, backend: str) -> torch.fx.GraphModule:
    example = _data(1)[0]
    if path == "pt2e":
        return qcore.prepare_pt2e(torch.export.export(model, example).module(), backend)
    return qcore.prepare_fx(model, None, example, backend=backend)


def _sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (expected - actual).pow(2).mean()
    return (10 * torch.log10(expected.pow(2).mean() / noise)).item()


def _any_backend() -> str:
    for name in ("qnnpack", "fbgemm", "x86"):
        if installed(name):
            return name
    pytest.skip("needs a first-party backend")


@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_equalization_keeps_the_float_function(path):
    model = Imbalanced().eval()
    prepared = _prepare(model, path, _any_backend())
    equalized = qcore.equalize(prepared)
    (x,) = _data(1)[0]
    with torch.no_grad():
        before, after = prepared(x), equalized(x)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    pairs = equalized_pairs(equalized)
    # conv1 -> depthwise -> conv2; the mean between conv2 and fc ends the chain
    assert len(pairs) == 2 and pairs[0].second == pairs[1].first
    first = next(p for p in pairs if p.largest_before > 1000)
    assert first.largest_after < first.largest_before / 10


@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_equalization_lifts_sqnr_where_channel_ranges_differ(path, backend):
    model = Imbalanced().eval()
    results = {}
    for name, transform in (("plain", lambda p: p), ("equalized", qcore.equalize)):
        prepared = transform(_prepare(model, path, backend))
        with torch.no_grad():
            for batch in _data():
                prepared(*batch)
        converted = qcore.convert_pt2e(prepared) if path == "pt2e" else qcore.convert_fx(prepared)
        (x,) = _data(1)[0]
        with torch.no_grad():
            results[name] = _sqnr(model(x), converted(x))
    assert results["equalized"] >= results["plain"] + 2.0, results


def test_the_model_passed_in_is_not_changed():
    prepared = _prepare(Imbalanced().eval(), "fx", _any_backend())
    state = {k: v.clone() for k, v in prepared.state_dict().items()}
    qcore.equalize(prepared)
    assert all(torch.equal(v, prepared.state_dict()[k]) for k, v in state.items())
    assert equalized_pairs(prepared) == ()


def test_a_calibrated_model_is_refused():
    prepared = _prepare(Imbalanced().eval(), "fx", _any_backend())
    prepared(*_data(1)[0])
    with pytest.raises(ValueError, match=r"observer .* has already seen data.*before calibration"):
        qcore.equalize(prepared)


@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_relu6_is_crossed_only_when_asked(path):
    model = Imbalanced(relu6=True).eval()
    prepared = _prepare(model, path, _any_backend())
    plain = equalized_pairs(qcore.equalize(prepared))
    crossed = qcore.equalize(prepared, relu6_to_relu=True)
    assert len(equalized_pairs(crossed)) == len(plain) + 1
    (x,) = _data(1)[0]
    with torch.no_grad():
        expected = torch.relu(model.conv1(x))  # what ReLU in place of ReLU6 computes
        reference = model.fc(model.conv2(torch.relu(model.depthwise(expected))).mean((2, 3)))
        torch.testing.assert_close(crossed(x), reference, rtol=1e-4, atol=1e-5)


class CalledTwice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.shared = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.relu(self.shared(torch.relu(self.first(x)))))


def test_a_layer_called_twice_is_left_alone():
    example = (torch.randn(2, 4),)
    prepared = qcore.prepare_fx(CalledTwice().eval(), None, example, backend=_any_backend())
    equalized = qcore.equalize(prepared)
    assert equalized_pairs(equalized) == ()
    torch.testing.assert_close(equalized(*example), prepared(*example))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"iterations": 0}, ValueError, r"iterations: got 0 \(int\); expected an int >= 1"),
        ({"relu6_to_relu": "yes"}, TypeError, r"relu6_to_relu: got 'yes' \(str\); expected"),
    ],
)
def test_arguments_are_checked_by_name(kwargs, error, words):
    prepared = _prepare(Imbalanced().eval(), "fx", _any_backend())
    with pytest.raises(error, match=words):
        qcore.equalize(prepared, **kwargs)


def test_a_float_model_is_refused():
    with pytest.raises(TypeError, match=r"prepared: got .*Linear.*expected a model from qcore"):
        qcore.equalize(torch.nn.Linear(2, 2))


def test_a_conv_fused_with_an_add_is_not_a_first_layer():
    """onednn's FX fuses a conv with the residual add after it (ConvAdd2d, output
    conv(x) + other): scaling the conv's output channels would leave ``other``
    unscaled. Before: three such pairs on mobilenetv2_like, the equalized prepared
    model -2.4 dB against the one it came from."""
    if not installed("onednn"):
        pytest.skip("needs the onednn plugin")
    from qcore.accuracy import sqnr
    from qcore.examples import ZOO

    entry = ZOO["mobilenetv2_like"]
    model, data = entry.make_model(), entry.calibration_data(1)
    prepared = qcore.prepare_fx(model, None, data[0], backend="onednn")
    fused = {n.name for n in prepared.graph.nodes if n.op == "call_module" and len(n.args) > 1}
    assert fused, "expected onednn to fuse a conv with its residual add"
    equalized = qcore.equalize(prepared)
    assert not {pair.first for pair in equalized_pairs(equalized)} & fused
    with torch.no_grad():
        assert sqnr(prepared(*data[0]), equalized(*data[0])) > 60.0


class DepthwiseChain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.c3 = torch.nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c3(torch.relu(self.c2(torch.relu(self.c1(x)))))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("factor", [1e-4, 1e-8, 1e-20])
def test_a_nearly_dead_channel_costs_nothing(factor, backend):
    """A channel with tiny weights got a tiny scale; the depthwise conv's bias,
    divided by it, made one huge constant channel that set the next activation's
    scale: 50.8 dB to 20 (1e-8) and 0 (1e-20) on qnnpack, and qnnpack's
    recommended recipe runs equalize."""
    model = DepthwiseChain().eval()
    with torch.no_grad():
        model.c1.weight[2].mul_(factor)
        model.c1.bias[2] = 0.0
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=generator),) for _ in range(4)]
    x = torch.randn(4, 3, 8, 8, generator=generator)
    plain = qcore.quantize(model, batches[0], batches, backend=backend)
    equalized = qcore.quantize(model, batches[0], batches, backend=backend, algorithms=["equalize"])
    with torch.no_grad():
        expected = model(x)
        assert _sqnr(expected, equalized(x)) >= _sqnr(expected, plain(x)) - 1.5


def test_the_guides_qcore_algorithms_calls_work_after_a_bare_import():
    """qcore.algorithms.equalized_pairs(...) raised AttributeError unless the user
    had imported qcore.algorithms first."""
    import subprocess
    import sys

    code = (
        "import qcore; "
        "print(qcore.algorithms.equalized_pairs.__name__, qcore.accuracy.sqnr.__name__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["equalized_pairs", "sqnr"]


class ConvThenLinear(torch.nn.Module):
    """A linear reading a conv's output mixes its last dimension (the width), not
    the conv's channels: equalizing them as a pair changed the float function
    (3.6 dB against the original model) when width and channels had one size."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)))


@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_a_conv_and_the_linear_after_it_are_not_a_pair(path):
    model = ConvThenLinear().eval()
    x = torch.randn(2, 3, 8, 8)
    if path == "pt2e":
        exported = torch.export.export(model, (x,)).module()
        prepared = qcore.prepare_pt2e(exported, _any_backend())
    else:
        prepared = qcore.prepare_fx(model, None, (x,), backend=_any_backend())
    equalized = qcore.equalize(prepared)
    assert equalized_pairs(equalized) == ()
    with torch.no_grad():
        torch.testing.assert_close(equalized(x), model(x))


class SharedReLU6(torch.nn.Module):
    """One ReLU6 module between a and b, and again on the output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.act = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.b(self.act(self.a(x))) * 3)


def test_relu6_to_relu_replaces_the_crossed_call_alone():
    """The ReLU6 module was swapped for ReLU at every call: the output's clip at 6,
    which no pair crossed, went too (float output 17.7 dB against the original)."""
    model = SharedReLU6().eval()
    x = torch.randn(64, 8) * 3
    prepared = qcore.prepare_fx(model, None, (x,), backend=_any_backend())
    crossed = qcore.equalize(prepared, relu6_to_relu=True)
    assert [(p.first, p.second) for p in equalized_pairs(crossed)] == [("a", "b")]
    with torch.no_grad():
        inside = torch.relu(model.a(x))  # what the crossed call computes now
        expected = model.act(model.b(inside) * 3)
        assert (model.b(inside) * 3 > 6).any()  # the output's clip matters
        torch.testing.assert_close(crossed(x), expected, rtol=1e-4, atol=1e-5)
    assert isinstance(crossed.act, torch.nn.ReLU6)
