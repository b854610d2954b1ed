"""Custom modules whose forward returns a tuple (issue 13, item 2): torch.ao's static
LSTM, float nn.LSTM -> observed quantizable.LSTM -> quantized.LSTM, (out, (h, c))."""

from __future__ import annotations

import copy

import pytest
import torch
from backends import requires_fbgemm
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping, quantize_fx
from torch.ao.quantization.fx.custom_config import ConvertCustomConfig, PrepareCustomConfig
from torch.utils._pytree import tree_leaves

import qcore

pytestmark = requires_fbgemm

PREPARE = PrepareCustomConfig().set_float_to_observed_mapping(nn.LSTM, torch.ao.nn.quantizable.LSTM)
CONVERT = ConvertCustomConfig().set_observed_to_quantized_mapping(
    torch.ao.nn.quantizable.LSTM, torch.ao.nn.quantized.LSTM
)


class Heads(nn.Module):
    """Each element of the LSTM's output feeds a quantized linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, 1)
        self.out = nn.Linear(8, 4)
        self.h = nn.Linear(8, 4)
        self.c = nn.Linear(8, 4)

    def forward(self, x, h0, c0):
        out, (h, c) = self.lstm(x, (h0, c0))
        return self.out(out), (self.h(h), self.c(c))


class WholeTuple(nn.Module):
    """The output tuple is returned as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, 1)

    def forward(self, x, h0, c0):
        return self.lstm(x, (h0, c0))


def _inputs() -> tuple:
    generator = torch.Generator().manual_seed(0)
    return (
        torch.rand(5, 3, 8, generator=generator),
        torch.rand(1, 3, 8, generator=generator),
        torch.randn(1, 3, 8, generator=generator),
    )


def _quantize(prepare_fx, convert, model, inputs):
    mapping = get_default_qconfig_mapping("fbgemm")
    prepared = prepare_fx(copy.deepcopy(model), mapping, inputs, prepare_custom_config=PREPARE)
    prepared(*inputs)
    return prepared, convert(prepared, convert_custom_config=CONVERT)


def _count(gm, target) -> int:
    return sum(node.target is target for node in gm.graph.nodes)


@pytest.mark.parametrize("model_class", [Heads, WholeTuple])
def test_static_lstm_equals_torch_ao(model_class):
    torch.manual_seed(0)
    model, inputs = model_class().eval(), _inputs()
    prepared, converted = _quantize(qcore.prepare_fx, qcore.convert_fx, model, inputs)
    assert isinstance(prepared.lstm, torch.ao.nn.quantizable.LSTM)
    assert isinstance(converted.lstm, torch.ao.nn.quantized.LSTM)
    _, ao = _quantize(quantize_fx.prepare_fx, quantize_fx.convert_fx, model, inputs)
    got, expected = converted(*inputs), ao(*inputs)
    assert torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(expected)
    for value, reference in zip(tree_leaves(got), tree_leaves(expected), strict=True):
        assert not value.is_quantized
        torch.testing.assert_close(value, reference, rtol=0, atol=0)
    assert not isinstance(model.lstm, torch.ao.nn.quantizable.LSTM)  # the user's model


def test_consumers_take_the_lstm_int8_outputs_as_they_are():
    """Only the three LSTM inputs are quantized: each linear reads its element's int8
    tensor with the qparams the quantized LSTM gave it (no dequantize, no requantize)."""
    model, inputs = Heads().eval(), _inputs()
    _, converted = _quantize(qcore.prepare_fx, qcore.convert_fx, model, inputs)
    assert _count(converted, torch.quantize_per_tensor) == 3
    dequantized = [n.args[0].target for n in converted.graph.nodes if n.target == "dequantize"]
    assert dequantized == ["out", "h", "c"]


def test_reference_form_of_a_tuple_output_runs_on_int8():
    torch.manual_seed(0)
    model, inputs = Heads().eval(), _inputs()
    prepared, lowered = _quantize(qcore.prepare_fx, qcore.convert_fx, model, inputs)
    reference = qcore.convert_to_reference_fx(prepared, convert_custom_config=CONVERT)
    assert isinstance(reference.lstm, torch.ao.nn.quantized.LSTM)
    pairs = zip(tree_leaves(reference(*inputs)), tree_leaves(lowered(*inputs)), strict=True)
    for value, expected in pairs:
        # same int8 inputs; the reference linears round once in float: a step at most
        torch.testing.assert_close(value, expected, rtol=0, atol=0.05)


class Split(nn.Module):
    """A float custom module returning two tensors."""

    def forward(self, x):
        return torch.relu(x), torch.sigmoid(x)


class ObservedSplit(Split):
    @classmethod
    def from_float(cls, float_module):
        return cls()


class QuantizedSplit(nn.Module):
    """Runs on int8: relu keeps its input's qparams, sigmoid gives torch's fixed ones."""

    def forward(self, x):
        return torch.relu(x), torch.sigmoid(x)

    @classmethod
    def from_observed(cls, observed):
        return cls()


class WithSplit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.split = Split()
        self.head = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        a, b = self.split(self.conv(x))
        return self.head(a) + b


def test_any_custom_module_with_a_tuple_output():
    torch.manual_seed(0)
    model, x = WithSplit().eval(), torch.randn(2, 3, 4, 4)
    prepare = PrepareCustomConfig().set_float_to_observed_mapping(Split, ObservedSplit)
    convert = ConvertCustomConfig().set_observed_to_quantized_mapping(ObservedSplit, QuantizedSplit)
    mapping = get_default_qconfig_mapping("fbgemm")
    prepared = qcore.prepare_fx(model, mapping, (x,), prepare_custom_config=prepare)
    prepared(x)
    converted = qcore.convert_fx(prepared, convert_custom_config=convert)
    assert isinstance(converted.split, QuantizedSplit)
    # the head takes relu's int8 output as is: no quantize between split and head
    quantizes = [n for n in converted.graph.nodes if n.target is torch.quantize_per_tensor]
    assert len(quantizes) == 1  # the model's input
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=0.1)


class DictOut(nn.Module):
    def forward(self, x):
        return {"y": x + 1}


class ObservedDictOut(DictOut):
    @classmethod
    def from_float(cls, float_module):
        return cls()


def test_a_custom_module_returning_a_dict_is_refused_by_name():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = DictOut()

        def forward(self, x):
            return self.inner(x)["y"]

    prepare = PrepareCustomConfig().set_float_to_observed_mapping(DictOut, ObservedDictOut)
    with pytest.raises(qcore.engine.custom_config.UnsupportedSetting, match="'inner'.*dict"):
        qcore.prepare_fx(
            Model().eval(),
            get_default_qconfig_mapping("fbgemm"),
            (torch.randn(2, 3),),
            prepare_custom_config=prepare,
        )
