"""In-place writes on the FX path, and the traced graph checked against the model.

torch.fx keeps ``y.mul_(2)`` as a node nothing reads and treats it as pure: convert's
dead-code pass dropped it, on qcore as on torch.ao (1.14 off on a range of 2.5), as
it dropped an ``nn.ReLU(inplace=True)`` whose result was ignored; and a view taken
before ``a.add_(b)`` read a quantized copy from before the write (1.91 off on 1.99).
``a += b`` is traced as ``a + b``, so the traced float graph itself differs from the
model: prepare says so.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from backends import FIRST_PARTY, backend_params, installed

import qcore
from qcore.engine.aliasing import AliasedWriteError
from qcore.engine.custom_config import as_custom_config
from qcore.engine.in_place import make_traced_writes_visible
from qcore.engine.trace import trace
from qcore.examples import ZOO

BACKENDS = backend_params(("fbgemm", "qnnpack", "x86"))
UNFAITHFUL = "prepare: the traced graph does not compute"


@pytest.fixture
def backend() -> str:
    """Any installed first-party backend: what these tests check is the traced graph."""
    for name in FIRST_PARTY:
        if installed(name):
            return name
    pytest.skip("no first-party backend installed")


class _Convs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2, self.c3 = (torch.nn.Conv2d(4, 4, 1) for _ in range(3))


class MethodWriteNothingReads(_Convs):
    def __init__(self) -> None:
        super().__init__()
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(x)
        y.mul_(2.0)  # its result is never read: y is
        z = self.c2(y)
        self.relu(z)  # likewise
        return self.c3(z)


class FunctionalWriteNothingReads(_Convs):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(x)
        F.relu(y, inplace=True)
        torch.sigmoid_(y)
        return self.c2(y)


class ViewBeforeMethodWrite(_Convs):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.c1(x)
        flat = a.view(2, 4, 16).transpose(1, 2)  # two views, made before the write
        a.add_(self.c2(x))
        return self.c3(torch.relu(a)) + flat.transpose(1, 2).view(2, 4, 4, 4)


class ViewBeforeAugmentedAssignment(_Convs):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.c1(x)
        flat = a.view(2, 4, 16)
        a += self.c2(x)  # traced as a + c2(x): flat misses the write
        return self.c3(torch.relu(a)) + flat.view(2, 4, 4, 4)


def _quantized(model: torch.nn.Module, backend: str, x: torch.Tensor) -> torch.nn.Module:
    prepared = qcore.prepare_fx(model, None, (x,), backend=backend)
    with torch.no_grad():
        prepared(x)
    return qcore.convert_fx(prepared)


def _relative_error(model: torch.nn.Module, quantized: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        expected = model(x.clone())
        return float((quantized(x) - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "model_class", [MethodWriteNothingReads, FunctionalWriteNothingReads, ViewBeforeMethodWrite]
)
def test_an_in_place_write_reaches_every_later_read(model_class: type, backend: str) -> None:
    model, x = model_class().eval(), torch.randn(2, 4, 4, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", UNFAITHFUL, qcore.QCoreWarning)
        quantized = _quantized(model, backend, x)
    # quantization error; without the pass it was 45-96% of the output's range
    assert _relative_error(model, quantized, x) < 0.05


def test_a_model_writing_into_its_input_leaves_the_callers_tensor_alone(backend: str) -> None:
    class ScalesItsInput(_Convs):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(0.5)
            return self.c1(x)

    model, x = ScalesItsInput().eval(), torch.randn(2, 4, 4, 4)
    before = x.clone()
    prepared = qcore.prepare_fx(model, None, (x,), backend=backend)
    assert torch.equal(x, before)
    with torch.no_grad():
        prepared(x.clone())
    quantized = qcore.convert_fx(prepared)
    with torch.no_grad():
        expected = model(x.clone())
        assert float((quantized(x.clone()) - expected).abs().max()) < 0.05 * float(
            expected.abs().max()
        )


class RunningState(torch.nn.Module):
    """A running sum the output reads back through a second attribute read, and a
    running maximum nothing reads: forward's writes into the model's own state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("total", torch.zeros(8))
        self.register_buffer("peak", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.total.add_(y.detach().mean(0))
        torch.maximum(self.peak, y.detach().amax(0), out=self.peak)
        return y - self.total


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_into_the_models_state_survive_convert(backend: str) -> None:
    """Convert's dead-code pass dropped both writes (torch.fx takes call_method for
    pure): the int8 model's total never moved, 8.5 -> 4.0 -> 2.3 dB over three
    calls; prepare's probe ran the traced graph on state the eager run had moved,
    and warned that the graph differs from the model."""
    model, x = RunningState().eval(), torch.randn(4, 8)
    float_model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", UNFAITHFUL, qcore.QCoreWarning)
        prepared = qcore.prepare_fx(model, None, (x,), backend=backend)
    with torch.no_grad():
        prepared(x)
        float_model(x)  # the same state as the calibrated model
        quantized = qcore.convert_fx(prepared)
        for _ in range(3):
            expected, actual = float_model(x), quantized(x)
            assert float((actual - expected).abs().max()) < 0.05 * float(expected.abs().max())
    torch.testing.assert_close(quantized.peak, float_model.peak, atol=0.05, rtol=0.05)
    torch.testing.assert_close(quantized.total, float_model.total, atol=0.05, rtol=0.05)


def test_an_augmented_assignment_a_view_misses_is_warned_about_at_prepare(backend: str) -> None:
    model, x = ViewBeforeAugmentedAssignment().eval(), torch.randn(2, 4, 4, 4)
    with pytest.warns(
        qcore.QCoreWarning, match=r"traced graph does not compute .* output 0 differs by up to"
    ) as caught:
        qcore.prepare_fx(model, None, (x,), backend=backend)
    assert "a += b" in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the user's prepare_fx call


def test_the_warning_names_the_first_module_whose_output_differs(backend: str) -> None:
    class DriftsBeforeC2(_Convs):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.c1(x)
            kept = a.view(-1)
            a += 1.0
            return self.c3(self.c2(kept.view(2, 4, 4, 4)))

    x = torch.randn(2, 4, 4, 4)
    with pytest.warns(qcore.QCoreWarning, match=r"first module whose output differs is 'c2'"):
        qcore.prepare_fx(DriftsBeforeC2().eval(), None, (x,), backend=backend)


def test_a_write_through_a_view_read_elsewhere_is_refused_with_the_way_out(backend: str) -> None:
    class Inner(torch.nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            a[:, :2].mul_(0.5)  # writes into a through a view
            return a

    class Outer(_Convs):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.c1(x)
            self.inner(a)
            return self.c2(a)

    x = torch.randn(2, 4, 4, 4)
    with pytest.raises(AliasedWriteError, match=r"mul_.*'non_traceable_module_name': \['inner'\]"):
        qcore.prepare_fx(Outer().eval(), None, (x,), backend=backend)

    # the way out it names works, and is exact for the float part it keeps
    settings = {"non_traceable_module_name": ["inner"]}
    prepared = qcore.prepare_fx(
        Outer().eval(), None, (x,), backend=backend, prepare_custom_config=settings
    )
    with torch.no_grad():
        prepared(x)
    quantized = qcore.convert_fx(prepared)
    assert _relative_error(Outer().eval(), quantized, x) < 0.05


def test_without_example_inputs_the_ops_that_always_view_count() -> None:
    gm = trace(ViewBeforeMethodWrite(), as_custom_config(None))  # no probe run
    code_before = gm.code
    # the pass already ran in trace; run it on a fresh trace of the raw graph
    raw = torch.fx.symbolic_trace(ViewBeforeMethodWrite())
    assert make_traced_writes_visible(raw) == 2  # relu's read of a, the views' late read
    assert raw.code == gm.code and code_before == gm.code
    x = torch.randn(2, 4, 4, 4)
    with torch.no_grad():
        assert torch.equal(raw(x.clone()), ViewBeforeMethodWrite()(x.clone()))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_the_example_models_trace_faithfully(name: str) -> None:
    entry = ZOO[name]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", UNFAITHFUL, qcore.QCoreWarning)
        gm = trace(entry.make_model().eval(), as_custom_config(None), entry.example_inputs())
    assert gm.graph.find_nodes(op="output")
