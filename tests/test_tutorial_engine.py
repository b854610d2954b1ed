"""The BackendConfig tutorial (seed 002), steps 1-7, on qcore's engine.

The tutorial's code is below with only its import lines changed. Lowering
needs an installed backend's kernels; without one the model stays in
reference form, which explain reports.
"""

import warnings

import pytest
import torch

import qcore

# -- the tutorial's imports, pointed at qcore ---------------------------------
from qcore import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    MinMaxObserver,
    ObservationType,
    QConfig,
    QConfigMapping,
    convert_fx,
    default_weight_observer,
    get_default_qconfig_mapping,
    prepare_fx,
)
from qcore.kernels import QuantizedConv, QuantizedLinear

quint8_with_constraints = DTypeWithConstraints(
    dtype=torch.quint8,
    quant_min_lower_bound=0,
    quant_max_upper_bound=255,
    scale_min_lower_bound=2**-12,
)

weighted_int8_dtype_config = DTypeConfig(
    input_dtype=quint8_with_constraints,
    output_dtype=quint8_with_constraints,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
)


def fuse_conv2d_relu(is_qat, conv, relu):
    """Return a fused ConvReLU2d from individual conv and relu modules."""
    return torch.ao.nn.intrinsic.ConvReLU2d(conv, relu)


linear_config = (
    BackendPatternConfig()
    .set_pattern(torch.nn.Linear)
    .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
    .add_dtype_config(weighted_int8_dtype_config)
    .set_root_module(torch.nn.Linear)
    .set_qat_module(torch.nn.qat.Linear)
    .set_reference_quantized_module(torch.ao.nn.quantized.reference.Linear)
)

conv_relu_config = (
    BackendPatternConfig()
    .set_pattern((torch.nn.Conv2d, torch.nn.ReLU))
    .set_fused_module(torch.ao.nn.intrinsic.ConvReLU2d)
    .set_fuser_method(fuse_conv2d_relu)
)

fused_conv_relu_config = (
    BackendPatternConfig()
    .set_pattern(torch.ao.nn.intrinsic.ConvReLU2d)
    .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
    .add_dtype_config(weighted_int8_dtype_config)
    .set_root_module(torch.nn.Conv2d)
    .set_qat_module(torch.ao.nn.intrinsic.qat.ConvReLU2d)
    .set_reference_quantized_module(torch.ao.nn.quantized.reference.Conv2d)
)

backend_config = (
    BackendConfig("my_backend")
    .set_backend_pattern_config(linear_config)
    .set_backend_pattern_config(conv_relu_config)
    .set_backend_pattern_config(fused_conv_relu_config)
)

activation_observer = MinMaxObserver.with_args(quant_min=0, quant_max=127, eps=2**-12)
qconfig = QConfig(activation=activation_observer, weight=default_weight_observer)

qconfig_mapping = (
    QConfigMapping()
    .set_object_type(torch.nn.Linear, qconfig)
    .set_object_type(torch.nn.Conv2d, qconfig)
    .set_object_type(torch.nn.BatchNorm2d, qconfig)
    .set_object_type(torch.nn.ReLU, qconfig)
)


class MyModel(torch.nn.Module):
    def __init__(self, use_bn: bool):
        super().__init__()
        self.linear = torch.nn.Linear(10, 3)
        self.conv = torch.nn.Conv2d(3, 3, 3)
        self.bn = torch.nn.BatchNorm2d(3)
        self.relu = torch.nn.ReLU()
        self.sigmoid = torch.nn.Sigmoid()
        self.use_bn = use_bn

    def forward(self, x):
        x = self.linear(x)
        x = self.conv(x)
        if self.use_bn:
            x = self.bn(x)
        x = self.relu(x)
        x = self.sigmoid(x)
        return x


# -- end of the tutorial's code -------------------------------------------------

HAS_KERNELS = bool(qcore.get_backend("native").kernels)
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason="needs an installed backend's kernels")


def run_tutorial(use_bn, mapping):
    torch.manual_seed(0)
    example_inputs = (torch.rand(1, 3, 10, 10, dtype=torch.float),)
    model = MyModel(use_bn=use_bn).eval()
    prepared = prepare_fx(model, mapping, example_inputs, backend_config=backend_config)
    prepared(*example_inputs)  # calibrate
    converted = convert_fx(prepared, backend_config=backend_config)
    return model, prepared, converted, example_inputs


def test_step6_linear_and_fused_conv_relu_are_quantized():
    model, prepared, converted, example_inputs = run_tutorial(False, qconfig_mapping)
    report = qcore.explain(converted)
    assert report["sigmoid"].status.value == "float"
    quantized = {e.node for e in report.ops if e.status.value in ("quantized", "reference")}
    assert {"linear", "conv"} <= quantized
    if HAS_KERNELS:
        assert isinstance(converted.linear, QuantizedLinear)
        assert isinstance(converted.conv, QuantizedConv) and converted.conv.relu
        assert report["linear"].kernel and report["conv"].kernel
    out = converted(*example_inputs)
    expected = model(*example_inputs)
    step = converted.conv.scale if HAS_KERNELS else 1 / 128
    # One output quantization step of conv-relu, through a sigmoid (slope <= 1/4).
    assert torch.allclose(out, expected, atol=2 * step)


@needs_kernels
def test_step6_runs_on_int8_kernels_whatever_the_global_engine():
    previous = torch.backends.quantized.engine
    try:
        outs = []
        for engine in ("qnnpack", "fbgemm"):
            torch.backends.quantized.engine = engine
            _, _, converted, example_inputs = run_tutorial(False, qconfig_mapping)
            outs.append(converted(*example_inputs))
    finally:
        torch.backends.quantized.engine = previous
    torch.testing.assert_close(outs[0], outs[1])


def test_step7_conv_bn_relu_is_not_fused_and_explain_names_the_rule():
    with pytest.warns(qcore.QCoreWarning, match="qcore.explain"):
        _, prepared, converted, _ = run_tutorial(True, qconfig_mapping)
    report = qcore.explain(converted)
    assert report["linear"].status.value in ("quantized", "reference")
    for node in ("conv", "bn", "relu"):
        assert report[node].status.value == "float"
    assert "no fusion rule for (Conv2d, BatchNorm2d, ReLU)" in report["conv"].reason
    assert type(converted.conv) is torch.nn.Conv2d and type(converted.bn) is torch.nn.BatchNorm2d


def test_step7_default_qconfig_mapping_quantizes_nothing_and_says_why():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, prepared, converted, example_inputs = run_tutorial(True, get_default_qconfig_mapping())
    ours = [w for w in caught if issubclass(w.category, qcore.QCoreWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    report = qcore.explain(prepared)
    assert report.quantized == []
    reason = report["linear"].reason
    assert "eps" in reason and "scale_min_lower_bound" in reason
    assert type(converted.linear) is torch.nn.Linear
    assert str(qcore.explain(converted)).count("float") >= 5


def test_prepare_does_not_touch_the_users_model():
    model = MyModel(use_bn=False).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules_before = [type(m) for m in model.modules()]
    prepared = prepare_fx(
        model, qconfig_mapping, (torch.rand(1, 3, 10, 10),), backend_config=backend_config
    )
    prepared(torch.rand(1, 3, 10, 10))
    convert_fx(prepared)
    assert [type(m) for m in model.modules()] == modules_before
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_converted_forward_prints_no_warnings():
    _, _, converted, example_inputs = run_tutorial(False, qconfig_mapping)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted(*example_inputs)
    assert caught == []


def test_explain_table_prints_every_op():
    _, _, converted, _ = run_tutorial(False, qconfig_mapping)
    text = str(qcore.explain(converted))
    assert text.splitlines()[1].split() == ["NODE", "OP", "STATUS", "DETAIL"]
    assert "sigmoid" in text and "no QConfig" in text
