"""A kernel qcore does not test is tried once at convert: a wrong output shape or
kind leaves its op in reference form, with a warning, instead of reaching the
user's forward (qcore.engine.kernel_check)."""

import warnings

import pytest
import torch
from linear_chip import fresh_registry, linear_chip

import qcore
from qcore import DTypeConfig
from qcore.config.qconfig import get_default_qconfig
from qcore.plugin.kernels import Kernel

INT8 = DTypeConfig(torch.quint8, torch.quint8, torch.qint8, torch.float)


class Requantized(torch.nn.Module):
    """The reference linear on the dequantized input, quantized to the output's qparams."""

    def __init__(self, match, reshape=None, float_output=False):
        super().__init__()
        self.reference, self.output = match.module, match.output
        self.reshape, self.float_output = reshape, float_output

    def forward(self, x):
        y = self.reference(x.dequantize())
        if self.reshape is not None:
            y = y.reshape(self.reshape(y))
        if self.float_output:
            return y
        return torch.quantize_per_tensor(y, self.output.scale, self.output.zero_point, torch.quint8)


BEHAVIOURS = {
    "right": lambda match: Requantized(match),
    "wrong_shape": lambda match: Requantized(match, reshape=lambda y: (-1,)),
    "float_output": lambda match: Requantized(match, float_output=True),
}


def chip(behaviour):
    return linear_chip(BEHAVIOURS[behaviour])


@pytest.fixture
def registry(monkeypatch):
    return fresh_registry(monkeypatch)


def converted(registry, behaviour):
    registry.register(chip(behaviour), name="chip")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    mapping = qcore.QConfigMapping().set_global(get_default_qconfig("x86"))
    prepared = qcore.prepare_fx(model, mapping, (x,), backend="chip")
    prepared(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = qcore.convert_fx(prepared)
    return result, x, [str(w.message) for w in caught if issubclass(w.category, qcore.QCoreWarning)]


def test_a_right_kernel_is_used_without_a_warning(registry):
    model, x, warned = converted(registry, "right")
    assert warned == []
    assert qcore.explain(model)["_0"].kernel == "chip.linear"
    assert model(x).shape == (3, 4)


@pytest.mark.parametrize(
    ("behaviour", "problem"),
    [
        ("wrong_shape", "it returned shape (12,) where the reference gives (3, 4)"),
        ("float_output", "it returned a float32 tensor where its class promises an int8"),
    ],
)
def test_a_wrong_kernel_is_refused_and_named(registry, behaviour, problem):
    model, x, warned = converted(registry, behaviour)
    (message,) = warned
    assert "1 op(s) left in reference form" in message and "chip.linear" in message
    assert problem in message and "qcore check" in message
    entry = qcore.explain(model)["_0"]
    assert entry.status.value == "reference" and problem in entry.reason
    assert model(x).shape == (3, 4)


def test_qcores_own_kernels_are_not_tried():
    from qcore.engine.kernel_check import is_tested
    from qcore.kernels.library import kernels_for

    assert all(is_tested(kernel) for kernel in kernels_for("fbgemm"))
    assert not is_tested(Kernel("chip.linear", torch.nn.Linear, "chip", BEHAVIOURS["right"]))


@pytest.mark.parametrize("dynamic_batch", [False, True], ids=["static", "dynamic batch"])
def test_pt2e_tries_the_kernel_too(registry, dynamic_batch):
    """With a dynamic batch the kernel was not tried (no recorded size): it ran,
    explained as quantized, and gave (3, 1) for (3, 4). It is tried at the batch
    export saw."""
    registry.register(chip("wrong_shape"), name="chip")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    shapes = {"input": {0: torch.export.Dim("batch")}} if dynamic_batch else None
    exported = torch.export.export(model, (x,), dynamic_shapes=shapes).module()
    prepared = qcore.prepare_pt2e(exported, "chip")
    prepared(x)
    with pytest.warns(qcore.QCoreWarning, match=r"chip\.linear\): it returned shape \(12,\)"):
        lowered = qcore.convert_pt2e(prepared)
    assert lowered(x).shape == (3, 4)
