"""Explain's reason for an op that runs in float because the layer feeding it does.

``torch.relu`` has no pattern of its own in torch.ao's backends (they quantize it
only fused into an add or a mul); a backend may likewise quantize ``relu`` only
fused into a linear; ``F.linear -> F.relu`` is one pattern. After a layer kept
float, such an op's float input is why it runs in float: explain says so, naming
that layer and its reason, and prepare does not warn about it (nothing is lost).
On an int8 input it keeps the reason that it matches no pattern, and the warning.
"""

import warnings

import pytest
import torch
from backends import backend_params
from torch.ao.quantization import QConfigMapping, get_default_qconfig

import qcore
from qcore import BackendConfig, BackendPatternConfig, DTypeConfig
from qcore.api import get_default_qconfig_mapping
from qcore.engine.explain import Status
from qcore.keep_float import mark_kept_float

NO_QCONFIG = "no QConfig for this pattern in the QConfigMapping"


class TorchRelu(torch.nn.Module):
    """Linear -> torch.relu -> Linear: nothing fuses the relu into the first linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class ReluOnInput(TorchRelu):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(torch.relu(x)))


def _quantize(model, backend, mapping):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = qcore.quantize(model.eval(), (x,), [x], backend, mapping)
    found = [str(w.message) for w in caught if issubclass(w.category, qcore.QCoreWarning)]
    return qcore.explain(converted), converted, found


@pytest.mark.parametrize("backend", backend_params())
def test_relu_after_a_float_linear_names_the_linear_and_does_not_warn(backend):
    mapping = get_default_qconfig_mapping(backend).set_module_name("fc1", None)
    report, _, warned = _quantize(TorchRelu(), backend, mapping)

    assert report["fc1"].status is Status.FLOAT
    assert report["fc1"].reason == NO_QCONFIG
    assert report["relu"].status is Status.FLOAT
    assert report["relu"].reason == f"its input is float: fc1 runs in float ({NO_QCONFIG})"
    assert [e.node for e in report.quantized] == ["fc2"]
    assert warned == []


@pytest.mark.parametrize("backend", backend_params())
def test_relu_on_an_int8_input_still_matches_no_pattern_and_warns(backend):
    report, _, warned = _quantize(TorchRelu(), backend, get_default_qconfig_mapping(backend))

    assert [e.node for e in report.quantized] == ["fc1", "fc2"]
    assert report["relu"].reason == f"no pattern in backend {backend!r} matches relu"
    assert len(warned) == 1 and "(relu)" in warned[0]


@pytest.mark.parametrize("backend", backend_params())
def test_relu_on_the_graph_input_still_matches_no_pattern(backend):
    # the model's input is no layer kept float: it would be quantized where it enters
    report, _, warned = _quantize(ReluOnInput(), backend, get_default_qconfig_mapping(backend))

    assert report["relu"].reason == f"no pattern in backend {backend!r} matches relu"
    assert len(warned) == 1 and "(relu)" in warned[0]


@pytest.mark.parametrize("backend", backend_params())
def test_a_layer_the_search_keeps_float_is_named_with_its_new_reason(backend):
    # keep_float_if_slower and accuracy_budget convert with the layer's QConfig None,
    # then give it their own reason (mark_kept_float): the relu's follows
    mapping = get_default_qconfig_mapping(backend).set_module_name("fc1", None)
    _, converted, _ = _quantize(TorchRelu(), backend, mapping)
    kept = "kept float (keep_float_if_slower): 9 us int8, 5 us float"

    report = qcore.explain(mark_kept_float(converted, {"fc1": kept}))

    assert report["fc1"].reason == kept
    assert report["relu"].reason == f"its input is float: fc1 runs in float ({kept})"
    assert report["fc2"].status is Status.QUANTIZED


class ModuleRelu(TorchRelu):
    def __init__(self) -> None:
        super().__init__()
        self.relu = torch.nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


@pytest.mark.parametrize("backend", backend_params())
def test_a_relu_fused_into_a_linear_set_to_none_goes_float_with_it(backend):
    # torch.ao fuses fc1 and relu into one LinearReLU, which takes fc1's QConfig:
    # the entry was "the fused modules (fc1, relu) have different QConfigs; give them
    # the same one", though the user set fc1's None on purpose
    mapping = get_default_qconfig_mapping(backend).set_module_name("fc1", None)
    report, _, warned = _quantize(ModuleRelu(), backend, mapping)

    assert [(e.node, e.op, e.status) for e in report.ops] == [
        ("fc1", "LinearReLU", Status.FLOAT),
        ("fc2", "Linear", Status.QUANTIZED),
    ]
    assert report["fc1"].reason == (
        "no QConfig for fc1 in the QConfigMapping (relu, fused into it, runs in float with it)"
    )
    assert warned == []


class FunctionalLinear(TorchRelu):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.linear(x, self.fc1.weight, self.fc1.bias)
        return self.fc2(torch.nn.functional.relu(hidden))


class FunctionalLinearModuleRelu(ModuleRelu):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(torch.nn.functional.linear(x, self.fc1.weight, self.fc1.bias)))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("model", [FunctionalLinear, FunctionalLinearModuleRelu])
def test_a_pattern_whose_linear_has_no_qconfig_names_the_linear(model, backend):
    # (linear, relu) matches as one pattern, its parts' QConfigs differ: the relu
    # was "give them the same one" (and warned about), though the user set the
    # linear's None on purpose
    mapping = get_default_qconfig_mapping(backend)
    report, _, warned = _quantize(model(), backend, mapping)
    assert [e.node for e in report.quantized] == ["linear", "relu", "fc2"]

    mapping.set_object_type(torch.nn.functional.linear, None)
    report, _, warned = _quantize(model(), backend, mapping)

    linear = "no QConfig for linear in the QConfigMapping"
    assert report["linear"].reason == linear
    assert report["relu"].status is Status.FLOAT
    assert report["relu"].reason == f"its input is float: linear runs in float ({linear})"
    assert warned == []


# A backend with no plugin that quantizes relu only fused into a linear (as many
# vendor backends do): the PT2E path gives the same reason.
_INT8 = DTypeConfig(torch.quint8, torch.quint8, torch.qint8, torch.float)
CHIP = BackendConfig("chip").set_backend_pattern_configs(
    [
        BackendPatternConfig(torch.nn.Linear).add_dtype_config(_INT8),
        BackendPatternConfig((torch.nn.Linear, torch.nn.ReLU)).add_dtype_config(_INT8),
    ]
)


class ReluAndHidden(ModuleRelu):
    """fc1's output is read twice, so no (linear, relu) pattern can take the relu."""

    def forward(self, x: torch.Tensor):
        hidden = self.fc1(x)
        return self.fc2(self.relu(hidden)), hidden


def _pt2e_report(model, mapping):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    exported = torch.export.export(model.eval(), (x,)).module()
    prepared = qcore.prepare_pt2e(exported, qcore.pt2e.BackendQuantizer(CHIP, mapping))
    prepared(x)
    return qcore.explain(qcore.convert_pt2e(prepared))


def _mapping():
    return QConfigMapping().set_global(get_default_qconfig("fbgemm"))


def test_pt2e_relu_after_a_float_linear_names_the_linear():
    report = _pt2e_report(ModuleRelu(), _mapping().set_module_name("fc1", None))

    linear = "no QConfig for aten.linear in the QConfigMapping"
    assert report["linear"].reason == linear
    assert report["relu"].status is Status.FLOAT
    assert report["relu"].reason == f"its input is float: linear runs in float ({linear})"


def test_pt2e_relu_on_an_int8_input_still_matches_no_pattern():
    report = _pt2e_report(ReluAndHidden(), _mapping())

    # int8 in reference form: the chip has no plugin, so no kernels
    assert report["linear_reference"].status is Status.REFERENCE
    assert report["relu"].reason == "no pattern in backend 'chip' matches aten.relu"


class AttentionReshape(torch.nn.Module):
    """Linear -> scaled_dot_product_attention (float: no backend quantizes it) ->
    reshape -> Linear: transformers' attention output. The reshape's output is
    quantized for the linear; the reshape itself reads the float attention."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(2, 4, 2, 4).transpose(1, 2)
        attention = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return self.out(attention.reshape(2, -1, 8))


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "qnnpack")))
def test_pt2e_reshape_of_the_float_attention_says_it_runs_in_float(backend):
    x = torch.randn(2, 4, 8)
    exported = torch.export.export(AttentionReshape().eval(), (x,)).module()
    prepared = qcore.prepare_pt2e(exported, backend)
    prepared(x)
    report = qcore.explain(qcore.convert_pt2e(prepared))

    attention = f"no pattern in backend {backend!r} matches aten.scaled_dot_product_attention"
    assert report["scaled_dot_product_attention"].reason == attention
    assert report["reshape"].status is Status.FLOAT
    assert report["reshape"].reason == (
        f"its input is float: scaled_dot_product_attention runs in float ({attention})"
    )
    assert report["linear_1_reference"].kernel == f"{backend}.linear"  # takes it as int8
