"""qcore.quantize_dynamic: the one-liner torch.ao users expect (issue 16 §2).

It quantizes nn.Linear and the functional F.linear, each with the relu after it
fused into one dynamic kernel, and the dynamic recipe of the user guide
(``set_object_type(nn.Linear, default_dynamic_qconfig)``) no longer leaves
``F.relu(linear(x))`` in float.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params
from torch import nn
from zoo.baseline import quantized_engine, sqnr

import qcore
from qcore.config.qconfig import QConfigMapping, default_dynamic_qconfig

BACKENDS = backend_params(("fbgemm", "qnnpack", "x86", "native"))


class LinearsAndConv(nn.Module):
    """nn.Linear + F.relu, F.linear + F.relu, a conv (not dynamic) and a plain linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(32, 32)
        self.weight = nn.Parameter(torch.randn(16, 32) * 0.2)
        self.bias = nn.Parameter(torch.randn(16) * 0.1)
        self.conv = nn.Conv1d(1, 1, 1)
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc(x))
        x = F.relu(F.linear(x, self.weight, self.bias))
        x = self.conv(x.unsqueeze(1)).squeeze(1)
        return self.head(x)


def _kernels(model) -> dict[str, tuple[str, str]]:
    return {e.node: (e.status.value, e.kernel) for e in qcore.explain(model).ops}


def _on(kernel: tuple[str, str], backend: str, family: str) -> bool:
    """Quantized on ``family``'s kernel of ``backend`` (native: of any installed backend)."""
    status, name = kernel
    owner, _, kind = name.partition(".")
    return status == "quantized" and kind == family and backend in ("native", owner)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_and_functional_linear_with_relu_run_on_dynamic_kernels(backend):
    model = LinearsAndConv().eval()
    before = copy.deepcopy(model.state_dict())
    quantized = qcore.quantize_dynamic(model, backend=backend)
    kernels = _kernels(quantized)
    assert _on(kernels["fc"], backend, "linear_relu_dynamic")  # nn.Linear + F.relu, fused
    assert _on(kernels["linear"], backend, "linear_relu_dynamic")  # F.linear + F.relu
    assert kernels["relu_1"] == kernels["linear"]
    assert _on(kernels["head"], backend, "linear_dynamic")
    assert kernels["conv"][0] == "float"  # not a dynamic op: left alone
    # No relu is left in the graph after the linears: the kernels apply it.
    targets = [n.target for n in quantized.graph.nodes if n.op == "call_function"]
    assert F.relu not in targets and torch.relu not in targets
    x = torch.randn(16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = quantized(x)
    assert sqnr(model(x), out) > 25
    for name, tensor in model.state_dict().items():  # the user's model is untouched
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_example_inputs_and_float16_weights(backend):
    model = LinearsAndConv().eval()
    x = torch.randn(4, 32)
    with_inputs = qcore.quantize_dynamic(model, backend=backend, example_inputs=(x,))
    int8 = _kernels(with_inputs)
    assert int8 == _kernels(qcore.quantize_dynamic(model, backend=backend))
    fp16 = qcore.quantize_dynamic(model, {nn.Linear}, torch.float16, backend=backend)
    kernels = _kernels(fp16)
    # qnnpack has no fp16 packed linear: reference form there (explain says so)
    on_qnnpack = int8["head"][1].startswith("qnnpack.")
    assert kernels["fc"][0] == kernels["head"][0] == ("reference" if on_qnnpack else "quantized")
    assert kernels["linear"][0] == "float"  # F.linear is not in the set asked for
    assert sqnr(model(x), fp16(x)) > 50  # float16 weights: close to float


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86")))
def test_float16_weights_leave_the_input_in_float32_as_torch_ao(backend):
    """The reference form rounds a float16-weight layer's input to float16 too; the
    kernels take float32, and lowering used to keep that rounding before them:
    three linears 63.8 dB against float, torch.ao's 67.4. Now torch.ao's numbers."""
    from torch.ao.quantization import quantize_dynamic

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)).eval()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    ours = qcore.quantize_dynamic(model, {nn.Linear}, torch.float16, backend=backend)
    assert "float16" not in ours.code
    with quantized_engine(backend), torch.no_grad():
        theirs = quantize_dynamic(model, {nn.Linear}, dtype=torch.float16)
        assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("backend", backend_params(("x86",)))
def test_qconfig_spec_by_module_name_and_dict(backend):
    model = LinearsAndConv().eval()
    by_name = _kernels(qcore.quantize_dynamic(model, {"head"}, backend=backend))
    assert by_name["head"][0] == "quantized"
    assert by_name["fc"][0] == by_name["linear"][0] == "float"
    by_dict = _kernels(
        qcore.quantize_dynamic(model, {F.linear: default_dynamic_qconfig}, backend=backend)
    )
    assert by_dict["linear"] == ("quantized", "x86.linear_relu_dynamic")
    assert by_dict["fc"][0] == "float"


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86")))
def test_guide_recipe_fuses_relu_after_a_dynamic_linear(backend):
    """Only nn.Linear is mapped: its relu needs no QConfig of its own (it was float)."""
    model = LinearsAndConv().eval()
    mapping = QConfigMapping().set_object_type(nn.Linear, default_dynamic_qconfig)
    x = torch.randn(4, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing with a QConfig stays float
        prepared = qcore.prepare_fx(model, mapping, (x,), backend=backend)
    kernels = _kernels(qcore.convert_fx(prepared))
    assert kernels["fc"] == ("quantized", f"{backend}.linear_relu_dynamic")
    assert kernels["linear"][0] == kernels["relu_1"][0] == "float"  # F.linear not mapped


def test_bad_arguments_name_the_field():
    model = LinearsAndConv().eval()
    with pytest.raises(ValueError, match=r"dtype: got torch\.quint4x2.*expected torch\.qint8"):
        qcore.quantize_dynamic(model, dtype=torch.quint4x2)
    with pytest.raises(TypeError, match=r"qconfig_spec: got 3 \(int\); expected None"):
        qcore.quantize_dynamic(model, 3)
    with pytest.raises(TypeError, match=r"qconfig_spec: key 3 \(int\); expected a module class"):
        qcore.quantize_dynamic(model, {3})
