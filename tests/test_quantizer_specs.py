"""A user's own Quantizer, written with qcore's classes, prepares as its specs say.

Faults a port of torchao quantizers found (each test fails without its fix):
- a per-tensor weight spec naming a ``ch_axis`` (the PT2E tutorial's, and
  torchao's XNNPACK symmetric config's) lost its whole spec: MinMaxObserver
  refused ``ch_axis``, and the fallback built it with no settings (quint8
  0..255 affine weights where the spec says int8 -127..127 symmetric);
- annotating a graph input made the prepared model fail on its first call (the
  input guard was moved before the observer it was rewired to read);
- QAT put a plain FixedQParamsObserver where torchao puts a fake quant, so
  training never saw the sigmoid's output rounded;
- a fixed-qparams int8 spec with no range got 0..255 and failed at inference.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qcore
from qcore.observers import FixedQParamsFakeQuantize, MinMaxObserver, PerChannelMinMaxObserver
from qcore.quantizer import (
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
)

aten = torch.ops.aten
QD = torch.ops.quantized_decomposed

ACTIVATION = QuantizationSpec(
    dtype=torch.int8,
    quant_min=-128,
    quant_max=127,
    qscheme=torch.per_tensor_affine,
    observer_or_fake_quant_ctr=MinMaxObserver,
)
TUTORIAL_WEIGHT = QuantizationSpec(  # the PT2E tutorial's: per tensor, with a ch_axis
    dtype=torch.int8,
    quant_min=-127,
    quant_max=127,
    qscheme=torch.per_tensor_symmetric,
    ch_axis=0,
    observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12),
)


class LinearQuantizer(Quantizer):
    def __init__(self, weight: QuantizationSpec, inputs_too: bool = False) -> None:
        super().__init__()
        self.weight, self.inputs_too = weight, inputs_too

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for node in model.graph.nodes:
            if self.inputs_too and node.op == "placeholder":
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    output_qspec=ACTIVATION, _annotated=True
                )
            if node.target == aten.linear.default:
                x, weight = node.args[:2]
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={x: ACTIVATION, weight: self.weight},
                    output_qspec=ACTIVATION,
                    _annotated=True,
                )
        return model

    def validate(self, model: torch.fx.GraphModule) -> None:
        pass


def _exported(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(model.eval(), (x,)).module()


def _weight_dequantize(converted: torch.fx.GraphModule) -> tuple:
    for node in converted.graph.nodes:
        if node.target == QD.dequantize_per_tensor.default and node.args[0].op == "get_attr":
            return node.args[1:]  # scale, zero_point, quant_min, quant_max, dtype
    raise AssertionError("no weight dequantize in the converted graph")


def test_a_per_tensor_weight_spec_naming_a_ch_axis_keeps_its_settings():
    torch.manual_seed(0)
    model, x = nn.Linear(16, 8), torch.randn(4, 16)
    prepared = qcore.prepare_pt2e(_exported(model, x), LinearQuantizer(TUTORIAL_WEIGHT))
    prepared(x)
    weight_observers = [
        m for m in prepared.modules() if isinstance(m, MinMaxObserver) and m.dtype == torch.int8
    ]
    assert any(m.qscheme == torch.per_tensor_symmetric for m in weight_observers)
    converted = qcore.convert_pt2e(prepared, lower=False)
    _, zero_point, quant_min, quant_max, dtype = _weight_dequantize(converted)
    assert (zero_point, quant_min, quant_max, dtype) == (0, -127, 127, torch.int8)


def test_a_per_channel_spec_still_gets_its_axis():
    spec = QuantizationSpec(
        dtype=torch.int8,
        quant_min=-127,
        quant_max=127,
        qscheme=torch.per_channel_symmetric,
        ch_axis=1,
        observer_or_fake_quant_ctr=PerChannelMinMaxObserver,
    )
    model, x = nn.Linear(16, 8), torch.randn(4, 16)
    prepared = qcore.prepare_pt2e(_exported(model, x), LinearQuantizer(spec))
    (observer,) = [m for m in prepared.modules() if isinstance(m, PerChannelMinMaxObserver)]
    assert observer.ch_axis == 1


def test_a_constructor_that_drops_the_specs_settings_is_refused():
    class Stubborn(MinMaxObserver):  # takes no keywords: builds quint8 whatever the spec
        def __init__(self) -> None:
            super().__init__()

    spec = QuantizationSpec(
        dtype=torch.int8,
        quant_min=-127,
        quant_max=127,
        qscheme=torch.per_tensor_symmetric,
        observer_or_fake_quant_ctr=Stubborn,
    )
    model, x = nn.Linear(16, 8), torch.randn(4, 16)
    with pytest.raises(TypeError, match=r"QuantizationSpec.dtype is torch.int8.*built dtype="):
        qcore.prepare_pt2e(_exported(model, x), LinearQuantizer(spec))


def test_an_annotated_graph_input_runs_and_its_guard_names_the_argument():
    torch.manual_seed(0)
    model, x = nn.Linear(16, 8), torch.randn(4, 16)
    quantizer = LinearQuantizer(TUTORIAL_WEIGHT, inputs_too=True)
    prepared = qcore.prepare_pt2e(_exported(model, x), quantizer)
    prepared(x)  # raised UnboundLocalError in the guard
    with pytest.raises(AssertionError, match=r"input 'input': dimension 0 is 5"):
        prepared(torch.randn(5, 16))
    converted = qcore.convert_pt2e(prepared, lower=False)
    expected = model(x)
    sqnr = 10 * torch.log10(expected.pow(2).sum() / (expected - converted(x)).pow(2).sum())
    assert sqnr > 30


class SigmoidQuantizer(Quantizer):
    def __init__(self, fixed: FixedQParamsQuantizationSpec) -> None:
        super().__init__()
        self.fixed = fixed

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for node in model.graph.nodes:
            if node.target == aten.sigmoid.default:
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={node.args[0]: ACTIVATION},
                    output_qspec=self.fixed,
                    _annotated=True,
                )
        return model

    def validate(self, model: torch.fx.GraphModule) -> None:
        pass


class LinearSigmoid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(x))


SIGMOID_UINT8 = FixedQParamsQuantizationSpec(
    dtype=torch.uint8, scale=1 / 256, zero_point=0, quant_min=0, quant_max=255
)


def test_qat_fake_quantizes_a_fixed_qparams_output():
    model, x = LinearSigmoid(), torch.randn(4, 8)
    exported = torch.export.export(model.train(), (x,)).module()
    prepared = qcore.prepare_qat_pt2e(exported, SigmoidQuantizer(SIGMOID_UINT8))
    fake_quants = [m for m in prepared.modules() if isinstance(m, FixedQParamsFakeQuantize)]
    assert len(fake_quants) == 1
    out = prepared(x)
    assert torch.equal(out, torch.round(out * 256) / 256)  # the training output is rounded


def test_a_fixed_int8_spec_without_a_range_takes_the_dtypes():
    spec = FixedQParamsQuantizationSpec(dtype=torch.int8, scale=2 / 256, zero_point=0)
    model, x = LinearSigmoid(), torch.randn(4, 8)
    prepared = qcore.prepare_pt2e(_exported(model, x), SigmoidQuantizer(spec))
    prepared(x)
    converted = qcore.convert_pt2e(prepared, lower=False)
    quantize = next(
        n
        for n in converted.graph.nodes
        if n.target == QD.quantize_per_tensor.default and n.args[0].target == aten.sigmoid.default
    )
    assert quantize.args[3:] == (-128, 127, torch.int8)
    assert torch.allclose(converted(x), model(x), atol=2 / 256)
