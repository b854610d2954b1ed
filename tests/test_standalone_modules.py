"""Standalone modules (issue 13, item 2): prepared and converted as models of their
own, with their own QConfigMapping, and an int8 or float interface to the parent."""

from __future__ import annotations

import copy

import pytest
import torch
from backends import requires_fbgemm
from torch import nn
from torch.ao.quantization import MinMaxObserver, default_qconfig, get_default_qconfig, quantize_fx
from torch.ao.quantization.fx.custom_config import PrepareCustomConfig

import qcore
from qcore.engine.custom_config import UnsupportedSetting
from qcore.plugin import UnknownBackendError

pytestmark = requires_fbgemm

FLOAT = {"input_quantized_idxs": [], "output_quantized_idxs": []}
INT8 = {"input_quantized_idxs": [0], "output_quantized_idxs": [0]}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x))


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.block = Block()
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.block(self.conv(x)))


def _flat(model: Parent) -> nn.Module:
    """The same layers in one model, quantized in one piece: what a standalone
    module with an int8 interface must compute."""
    return nn.Sequential(
        copy.deepcopy(model.conv),
        copy.deepcopy(model.block.conv),
        copy.deepcopy(model.block.relu),
        copy.deepcopy(model.head),
    ).eval()


def _count(gm: torch.fx.GraphModule, op: str, target) -> int:
    found = 0
    for node in gm.graph.nodes:
        if node.op != op:
            continue
        if op == "call_module":
            found += isinstance(gm.get_submodule(node.target), target)
        else:
            found += node.target == target
    return found


def _quantize(model, mapping, x, config=None, convert=qcore.convert_fx):
    prepared = qcore.prepare_fx(model, mapping, (x,), "fbgemm", config)
    prepared(x)
    return prepared, convert(prepared)


def _config(form: str, interface: dict, x: torch.Tensor):
    if form == "name":
        return {"standalone_module_name": [("block", None, (x,), interface, None)]}
    if form == "class":
        return {"standalone_module_class": [(Block, None, (x,), interface, None)]}
    return PrepareCustomConfig().set_standalone_module_name(
        "block", None, (x,), PrepareCustomConfig.from_dict(interface), None
    )


@pytest.mark.parametrize("form", ["name", "class", "object"])
def test_int8_interface_passes_the_parents_int8_tensor(form):
    torch.manual_seed(0)
    model, x = Parent().eval(), torch.randn(2, 3, 8, 8)
    mapping = {"": get_default_qconfig("fbgemm")}
    prepared, converted = _quantize(model, mapping, x, _config(form, INT8, x))
    # the parent observes the block's input; the block only its own output
    block = prepared.block
    observers = [type(m).__name__ for n, m in block.named_modules() if "post_process" in n]
    assert sorted(observers) == ["HistogramObserver", "ParentQParamsObserver"]
    # converted, the block neither quantizes its input nor dequantizes its output
    assert _count(converted.block, "call_function", torch.quantize_per_tensor) == 0
    assert _count(converted.block, "call_method", "dequantize") == 0
    assert qcore.explain(converted.block).float == []
    flat = _quantize(_flat(model), mapping, x)[1]
    assert torch.equal(converted(x), flat(x))
    assert not torch.equal(model(x), converted(x))  # it is quantized
    assert not hasattr(model.block, "qconfig")  # the user's model is left as is


def test_float_interface_quantizes_inside_the_standalone_module():
    torch.manual_seed(0)
    model, x = Parent().eval(), torch.randn(2, 3, 8, 8)
    prepared, converted = _quantize(model, {"": default_qconfig}, x, _config("name", FLOAT, x))
    assert _count(prepared.block, "call_module", MinMaxObserver) == 2  # its input and output
    assert _count(converted.block, "call_function", torch.quantize_per_tensor) == 1
    assert _count(converted.block, "call_method", "dequantize") == 1
    # against torch.ao's own standalone module, same observers: within one output step
    ao_prepared = quantize_fx.prepare_fx(
        copy.deepcopy(model), {"": default_qconfig}, (x,), _config("name", FLOAT, x)
    )
    ao_prepared(x)
    ao = quantize_fx.convert_fx(ao_prepared)
    scale = converted.head.scale if hasattr(converted.head, "scale") else 0.1
    assert (converted(x) - ao(x)).abs().max() <= scale + 1e-6


@pytest.mark.parametrize("convert", [qcore.convert_fx, qcore.convert_to_reference_fx])
def test_standalone_module_with_its_own_qconfig_mapping(convert):
    """The block's own mapping leaves its conv float; the parent's convs are quantized."""
    torch.manual_seed(0)
    model, x = Parent().eval(), torch.randn(2, 3, 8, 8)
    config = {"standalone_module_name": [("block", {"": None}, (x,), FLOAT, None)]}
    _, converted = _quantize(model, {"": default_qconfig}, x, config, convert)
    block, parent = qcore.explain(converted.block), qcore.explain(converted)
    assert block.quantized == [] and block.reference == []
    assert len(parent.quantized) + len(parent.reference) == 2  # conv and head
    torch.testing.assert_close(converted.block(x), model.block(x))


def test_int8_input_without_a_parent_qconfig_is_an_error_naming_it():
    model, x = Parent().eval(), torch.randn(2, 3, 8, 8)
    mapping = torch.ao.quantization.QConfigMapping().set_module_name("head", default_qconfig)
    config = {"standalone_module_name": [("block", {"": default_qconfig}, (x,), INT8, None)]}
    with pytest.raises(UnsupportedSetting, match="'block' takes quantized inputs \\[0\\]"):
        qcore.prepare_fx(model, mapping, (x,), "fbgemm", config)


def test_converting_an_int8_interface_standalone_module_alone_is_an_error():
    """Its quantized input's qparams are the parent's: alone it has none to use."""
    model, x = Parent().eval(), torch.randn(2, 3, 8, 8)
    prepared, _ = _quantize(model, {"": default_qconfig}, x, _config("name", INT8, x))
    with pytest.raises(ValueError, match="convert the parent"):
        qcore.convert_fx(prepared.block)


@pytest.mark.parametrize(
    ("form", "entry", "error", "message"),
    [
        (
            "name",
            ("block", 3, None, None),
            TypeError,
            "prepare_custom_config.standalone_module_name['block']: qconfig_mapping: got 3 (int)",
        ),
        (
            "name",
            ("block", None, None, None, "x68"),
            UnknownBackendError,
            "prepare_custom_config.standalone_module_name['block']: unknown backend 'x68'",
        ),
        (
            "class",
            (Block, None, "bad", None),
            TypeError,
            f"prepare_custom_config.standalone_module_class[{__name__}.Block] (module 'block'): "
            "example_inputs: got 'bad' (str)",
        ),
    ],
)
def test_an_error_in_a_standalone_entry_names_the_entry(form, entry, error, message):
    """The entry's own settings failed with the message of a top-level prepare_fx call."""
    model, x = Parent().eval(), torch.randn(2, 3, 8, 8)
    config = {f"standalone_module_{form}": [entry]}
    with pytest.raises(error) as refused:
        qcore.prepare_fx(model, {"": default_qconfig}, (x,), "fbgemm", config)
    assert str(refused.value).startswith(message)
