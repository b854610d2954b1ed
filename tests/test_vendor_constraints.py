"""Constraints NPUs and DSPs need: symmetric (``zero_point_exact_match`` alone) and
power-of-two scales (``scale_power_of_two``): validated, enforced at prepare,
explained when unmet, serialised in JSON. No backend plugin needed."""

import json
import math

import pytest
import torch
import torch.ao.nn.quantized.reference as nnqr
from torch import nn
from torch.ao.quantization import FixedQParamsObserver
from torch.ao.quantization import MinMaxObserver as TorchMinMaxObserver

import qcore
from qcore import (
    BackendConfig,
    BackendPatternConfig,
    ConfigError,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
)
from qcore.config.compat import observer_facts, reasons_rejected
from qcore.config.json import from_json, to_json
from qcore.config.qconfig import QConfig, QConfigMapping, default_qconfig_mapping
from qcore.observers import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver

SYMMETRIC_INT8 = DTypeWithConstraints(dtype=torch.qint8, zero_point_exact_match=0)
POW2_ACT = DTypeWithConstraints(dtype=torch.quint8, scale_power_of_two=True)
POW2_WEIGHT = DTypeWithConstraints(
    dtype=torch.qint8, zero_point_exact_match=0, scale_power_of_two=True
)
POW2_INT8 = DTypeConfig(
    input_dtype=POW2_ACT, output_dtype=POW2_ACT, weight_dtype=POW2_WEIGHT, bias_dtype=torch.float
)
POW2_QCONFIG = QConfig(
    activation=HistogramObserver.with_args(power_of_two_scale=True),
    weight=PerChannelMinMaxObserver.with_args(
        dtype=torch.qint8, qscheme=torch.per_channel_symmetric, power_of_two_scale=True
    ),
)


def is_power_of_two(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


def pow2_backend() -> BackendConfig:
    different = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    weighted = [
        (nn.Linear, nnqr.Linear),
        (nn.Conv2d, nnqr.Conv2d),
    ]
    return BackendConfig("pow2chip").set_backend_pattern_configs(
        [
            BackendPatternConfig(float_module)
            .set_observation_type(different)
            .add_dtype_config(POW2_INT8)
            .set_root_module(float_module)
            .set_reference_quantized_module(reference)
            for float_module, reference in weighted
        ]
    )


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.linear = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        return self.linear(torch.flatten(torch.relu(self.conv(x)), 1))


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise))


# -- the constraint fields ----------------------------------------------------------


def test_scale_power_of_two_is_validated_naming_the_field():
    with pytest.raises(ConfigError, match=r"scale_power_of_two.*'yes'.*True, False or None"):
        DTypeWithConstraints(dtype=torch.quint8, scale_power_of_two="yes")
    with pytest.raises(ConfigError, match=r"scale_exact_match.*0\.01.*power of two"):
        DTypeWithConstraints(dtype=torch.quint8, scale_exact_match=0.01, scale_power_of_two=True)
    with pytest.raises(ConfigError, match=r"scale_max_upper_bound.*0\.0009"):
        DTypeWithConstraints(
            scale_min_lower_bound=0.0005, scale_max_upper_bound=0.0009, scale_power_of_two=True
        )
    # False is no constraint at all: equal to leaving it unset
    assert DTypeWithConstraints(dtype=torch.quint8, scale_power_of_two=False) == (
        DTypeWithConstraints(dtype=torch.quint8)
    )
    # torch.ao's positional order is kept: the new field comes last
    assert (
        DTypeWithConstraints(torch.quint8, 0, 255, None, None, None, 0).zero_point_exact_match == 0
    )


def test_zero_point_alone_means_symmetric_not_fixed_qparams():
    config = DTypeConfig(
        input_dtype=torch.quint8,
        output_dtype=torch.quint8,
        weight_dtype=SYMMETRIC_INT8,
        bias_dtype=torch.float,
    )
    symmetric = QConfig(
        activation=MinMaxObserver,
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
    per_channel = QConfig(
        activation=MinMaxObserver,
        weight=PerChannelMinMaxObserver.with_args(
            dtype=torch.qint8, qscheme=torch.per_channel_symmetric
        ),
    )
    assert reasons_rejected(config, symmetric) == []
    assert reasons_rejected(config, per_channel) == []
    affine = QConfig(activation=MinMaxObserver, weight=MinMaxObserver.with_args(dtype=torch.qint8))
    (reason,) = reasons_rejected(config, affine)
    assert "weight observer computes its zero point from the data" in reason
    assert "zero_point_exact_match 0" in reason and "per_tensor_symmetric" in reason


def test_zero_point_alone_checks_the_symmetric_zero_point():
    unsigned = DTypeWithConstraints(dtype=torch.quint8, zero_point_exact_match=0)
    config = DTypeConfig(input_dtype=unsigned, output_dtype=unsigned)
    symmetric_quint8 = QConfig(
        activation=MinMaxObserver.with_args(qscheme=torch.per_tensor_symmetric), weight=None
    )
    (reason,) = reasons_rejected(config, symmetric_quint8)
    assert reason == (
        "activation symmetric torch.quint8 zero_point 128 does not match zero_point_exact_match 0"
    )
    # fixed qparams with that zero point meet it too (sigmoid's 1/256, 0)
    fixed = QConfig(
        activation=FixedQParamsObserver.with_args(scale=1 / 256, zero_point=0), weight=None
    )
    assert reasons_rejected(config, fixed) == []


def test_power_of_two_needs_an_observer_that_rounds():
    config = DTypeConfig(input_dtype=POW2_ACT, output_dtype=POW2_ACT)
    (reason,) = reasons_rejected(config, QConfig(activation=TorchMinMaxObserver, weight=None))
    assert "does not round its scales to powers of two" in reason
    assert "power_of_two_scale=True" in reason
    assert reasons_rejected(config, POW2_QCONFIG) == []
    fixed = QConfig(
        activation=FixedQParamsObserver.with_args(scale=1 / 256, zero_point=0), weight=None
    )
    assert reasons_rejected(config, fixed) == []
    not_pow2 = QConfig(
        activation=FixedQParamsObserver.with_args(scale=0.01, zero_point=0), weight=None
    )
    assert "is not a power of two" in reasons_rejected(config, not_pow2)[0]
    assert observer_facts(POW2_QCONFIG.activation()).power_of_two_scale


@pytest.mark.parametrize(
    "observer",
    [
        MinMaxObserver.with_args(power_of_two_scale=True),
        MinMaxObserver.with_args(
            dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, power_of_two_scale=True
        ),
        HistogramObserver.with_args(power_of_two_scale=True),
        PerChannelMinMaxObserver.with_args(
            dtype=torch.qint8, qscheme=torch.per_channel_symmetric, power_of_two_scale=True
        ),
    ],
)
def test_observers_round_scales_up_to_powers_of_two(observer):
    torch.manual_seed(0)
    plain = observer.p.func(**{**observer.p.keywords, "power_of_two_scale": False})
    rounded = observer()
    x = torch.randn(8, 16) * 3 + 1
    plain(x)
    rounded(x)
    scales, zero_points = rounded.calculate_qparams()
    before, _ = plain.calculate_qparams()
    assert all(is_power_of_two(float(s)) for s in scales.flatten())
    # rounded up, never by a factor of two or more: the observed range stays covered
    assert bool((scales >= before).all()) and bool((scales < 2 * before).all())
    low = (rounded.quant_min - zero_points) * scales
    high = (rounded.quant_max - zero_points) * scales
    if scales.numel() == 1:
        assert float(low) <= float(x.min()) + float(scales) / 2
        assert float(high) >= float(x.max()) - float(scales) / 2


# -- enforced at prepare, explained, serialised ------------------------------------


_INPUT = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _quantize(mapping: QConfigMapping) -> tuple[dict, torch.Tensor]:
    """{"lowered": convert_fx, "reference": convert_to_reference_fx} and the float output."""
    torch.manual_seed(0)
    model = Net().eval()
    x = _INPUT
    prepared = qcore.prepare_fx(model, mapping, (x,), pow2_backend())
    with torch.no_grad():
        for _ in range(8):
            prepared(torch.randn(4, 3, 8, 8))
        converted = {
            "lowered": qcore.convert_fx(prepared),
            "reference": qcore.convert_to_reference_fx(prepared),
        }
        return converted, model(x)


def _scales(converted: torch.fx.GraphModule) -> list[float]:
    """Every scale in a converted model: quantize ops' (literal or buffer), kernels'
    buffers (``scale``, ``weight_scale``), reference modules' weight qparams."""
    scales = []
    for name, buffer in converted.named_buffers():
        if name.endswith("scale"):
            scales += [float(s) for s in buffer.flatten()]
    for node in converted.graph.nodes:
        if node.op == "call_function" and "quantize_per_tensor" in str(node.target):
            if isinstance(node.args[1], float):
                scales.append(node.args[1])
    for module in converted.modules():
        for qparams in getattr(module, "weight_qparams", {}).values():
            scales += [float(s) for s in torch.as_tensor(qparams.scale).flatten()]
    return scales


@pytest.mark.parametrize("form", ["lowered", "reference"])
def test_quantized_model_has_power_of_two_scales_and_sane_numbers(form):
    converted, expected = _quantize(QConfigMapping().set_global(POW2_QCONFIG))
    model = converted[form]
    report = qcore.explain(model)
    assert {entry.op for entry in report.reference + report.quantized} == {"Conv2d", "Linear"}
    scales = _scales(model)
    # the two inputs, the two outputs, one weight scale per output channel (8 + 10)
    assert len(scales) >= 2 + 8 + 10, scales
    assert all(is_power_of_two(scale) for scale in scales), scales
    with torch.no_grad():
        got = model(_INPUT)
    # rounding each scale up costs at most one bit: still far from noise
    assert sqnr(expected, got) > 25


def test_unmet_power_of_two_is_explained_and_stays_float():
    mapping = default_qconfig_mapping("x86")  # torch.ao's recipe: no power-of-two scales
    converted, expected = _quantize(mapping)
    report = qcore.explain(converted["lowered"])
    assert not report.quantized and not report.reference
    linear = next(entry for entry in report.float if entry.op == "Linear")
    assert "scale_power_of_two" in linear.reason
    assert "power_of_two_scale=True" in linear.reason
    with torch.no_grad():  # nothing quantized: the float model's numbers
        assert torch.equal(expected, converted["lowered"](_INPUT))


def test_constraints_round_trip_through_json_and_refuse_torch_ao():
    config = pow2_backend()
    text = to_json(config)
    document = json.loads(text)
    weight = document["configs"][0]["dtype_configs"][0]["weight_dtype"]
    assert weight == {
        "dtype": "qint8",
        "zero_point_exact_match": 0,
        "scale_power_of_two": True,
    }
    assert from_json(text) == config
    assert BackendConfig.from_dict(config.to_dict()) == config
    bad = text.replace('"scale_power_of_two": true', '"scale_power_of_two": 1', 1)
    with pytest.raises(ConfigError, match=r"scale_power_of_two: got 1.*true or false"):
        from_json(bad)
    from qcore.config.torch_ao import to_torch_ao

    with pytest.raises(ConfigError, match=r"scale_power_of_two: got True; expected None"):
        to_torch_ao(config)


def test_pt2e_enforces_power_of_two_too():
    """The PT2E path compiles the same constraints into its Quantizer."""
    from qcore.pt2e import BackendQuantizer, convert_pt2e, prepare_pt2e

    torch.manual_seed(0)
    model = Net().eval()
    exported = torch.export.export(model, (_INPUT,)).module()
    results = {}
    for label, mapping in (
        ("pow2", QConfigMapping().set_global(POW2_QCONFIG)),
        ("default", default_qconfig_mapping("x86")),
    ):
        quantizer = BackendQuantizer(pow2_backend(), mapping)
        prepared = prepare_pt2e(exported, quantizer)
        with torch.no_grad():
            for _ in range(8):
                prepared(torch.randn(4, 3, 8, 8))
            results[label] = convert_pt2e(prepared, lower=False)
    converted, scales, channels = results["pow2"], [], 0
    for node in converted.graph.nodes:
        if "quantize_per_tensor" in str(node.target) and isinstance(node.args[1], float):
            scales.append(node.args[1])
        if "quantize_per_channel" in str(node.target):  # the weights
            per_channel = getattr(converted, node.args[1].target).flatten().tolist()
            scales += per_channel
            channels += len(per_channel)
    assert channels >= 8 + 10 and len(scales) > channels, scales
    assert all(is_power_of_two(s) for s in scales), scales
    with torch.no_grad():
        assert sqnr(model(_INPUT), results["pow2"](_INPUT)) > 25
    report = qcore.explain(results["default"])
    assert not report.quantized and not report.reference
    assert any("power_of_two_scale=True" in entry.reason for entry in report.float)
