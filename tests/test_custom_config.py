"""What torch.ao's prepare_fx/convert_fx accept, qcore accepts (issue 13, item 2).

Legacy qconfig dicts, example inputs as a tensor or a list, torch.ao's argument
order, and every PrepareCustomConfig/ConvertCustomConfig setting: honoured, or
refused with an error naming it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from backends import requires_fbgemm
from torch import nn
from torch.ao.nn import quantized as nnq
from torch.ao.quantization import (
    QConfigMapping,
    default_dynamic_qconfig,
    default_qconfig,
    get_default_qconfig_mapping,
)
from torch.ao.quantization.fx.custom_config import ConvertCustomConfig, PrepareCustomConfig

import qcore
from qcore.config.errors import QCoreWarning, describe
from qcore.engine.custom_config import UnsupportedSetting

pytestmark = requires_fbgemm


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.attr = "kept"

    def forward(self, x):
        return self.second(self.first(x))


def _calibrated(prepared, x):
    with torch.no_grad():
        prepared(x)
    return prepared


def test_legacy_qconfig_dict_equals_the_mapping():
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    legacy = {"": default_qconfig, "module_name": [("second", None)]}
    mapping = QConfigMapping().set_global(default_qconfig).set_module_name("second", None)
    from_dict = qcore.convert_fx(_calibrated(qcore.prepare_fx(model, legacy, (x,), "fbgemm"), x))
    from_mapping = qcore.convert_fx(
        _calibrated(qcore.prepare_fx(model, mapping, (x,), "fbgemm"), x)
    )
    assert torch.equal(from_dict(x), from_mapping(x))
    statuses = {e.node: e.status.value for e in qcore.explain(from_dict).entries}
    assert statuses["first"] == "quantized" and statuses["second"] == "float"


@pytest.mark.parametrize("form", ["tensor", "list"])
def test_example_inputs_as_a_tensor_or_a_list(form):
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    example = x if form == "tensor" else [x]
    prepared = qcore.prepare_fx(model, get_default_qconfig_mapping("fbgemm"), example, "fbgemm")
    assert len(qcore.explain(prepared).quantized) == 2


def test_torch_ao_positional_order_prepare_custom_config_fourth():
    """torch.ao: prepare_fx(model, mapping, example_inputs, prepare_custom_config)."""
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    config = PrepareCustomConfig().set_non_traceable_module_names(["second"])
    prepared = qcore.prepare_fx(model, get_default_qconfig_mapping("fbgemm"), (x,), config)
    assert [n.target for n in prepared.graph.nodes if n.target == "second"] == ["second"]


def test_preserved_attributes_survive_prepare_and_convert():
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    prepared = qcore.prepare_fx(
        model, default_qconfig_mapping(), (x,), "fbgemm", {"preserved_attributes": ["attr"]}
    )
    assert prepared.attr == "kept"
    assert copy.deepcopy(prepared).attr == "kept"  # a GraphModule's deep copy drops it
    converted = qcore.convert_fx(
        _calibrated(prepared, x), ConvertCustomConfig().set_preserved_attributes(["attr"])
    )
    assert converted.attr == "kept"
    assert copy.deepcopy(converted).attr == "kept"


def default_qconfig_mapping():
    return get_default_qconfig_mapping("fbgemm")


# -- custom module classes -------------------------------------------------------------------


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


class ObservedCustom(Custom):
    @classmethod
    def from_float(cls, float_module):
        observed = cls()
        observed.linear = float_module.linear
        observed.qconfig = float_module.qconfig
        return observed


class QuantizedCustom(nn.Module):
    def __init__(self, linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x)

    @classmethod
    def from_observed(cls, observed):
        observed.linear.activation_post_process = observed.activation_post_process
        return cls(nnq.Linear.from_float(observed.linear))


class WithCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.custom = Custom()

    def forward(self, x):
        return self.custom(self.first(x))


CUSTOM_PREPARE = {"float_to_observed_custom_module_class": {"static": {Custom: ObservedCustom}}}
CUSTOM_CONVERT = {
    "observed_to_quantized_custom_module_class": {"static": {ObservedCustom: QuantizedCustom}}
}


def _two_linears_like(model: WithCustom) -> TwoLinears:
    reference = TwoLinears().eval()
    reference.first.load_state_dict(model.first.state_dict())
    reference.second.load_state_dict(model.custom.linear.state_dict())
    return reference


@pytest.mark.parametrize("convert", ["convert_fx", "convert_to_reference_fx"])
def test_custom_module_class_float_observed_quantized(convert):
    torch.manual_seed(0)
    model, x = WithCustom().eval(), torch.randn(8, 4)
    mapping = QConfigMapping().set_global(default_qconfig)
    prepared = qcore.prepare_fx(model, mapping, (x,), "fbgemm", CUSTOM_PREPARE)
    assert isinstance(prepared.custom, ObservedCustom)
    assert isinstance(model.custom, Custom) and not isinstance(model.custom, ObservedCustom)
    converted = getattr(qcore, convert)(_calibrated(prepared, x), CUSTOM_CONVERT)
    assert isinstance(converted.custom, QuantizedCustom)
    # The same numbers as the custom module's linear quantized as an ordinary one.
    plain = qcore.prepare_fx(_two_linears_like(model), mapping, (x,), "fbgemm")
    expected = qcore.convert_fx(_calibrated(plain, x))(x)
    assert torch.allclose(converted(x), expected, atol=1e-6)


def test_custom_module_without_a_quantized_class_is_refused_by_name():
    model, x = WithCustom().eval(), torch.randn(8, 4)
    mapping = QConfigMapping().set_global(default_qconfig)
    prepared = _calibrated(qcore.prepare_fx(model, mapping, (x,), "fbgemm", CUSTOM_PREPARE), x)
    with pytest.raises(UnsupportedSetting, match="observed_to_quantized_mapping.*ObservedCustom"):
        qcore.convert_fx(prepared)


class DynamicCustom(nn.Module):
    def __init__(self, linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x)

    @classmethod
    def from_observed(cls, module):
        from torch.ao.nn.quantized import dynamic as nnqd

        return cls(nnqd.Linear.from_float(module.linear))


def test_non_traceable_module_swapped_for_its_dynamic_class():
    model, x = WithCustom().eval(), torch.randn(8, 4)
    mapping = QConfigMapping().set_global(default_dynamic_qconfig)
    prepared = qcore.prepare_fx(
        model, mapping, (x,), "fbgemm", {"non_traceable_module_class": [Custom]}
    )
    converted = qcore.convert_fx(
        prepared,
        {"observed_to_quantized_custom_module_class": {"dynamic": {Custom: DynamicCustom}}},
    )
    assert isinstance(converted.custom, DynamicCustom)
    assert (converted(x) - model(x)).abs().max() < 0.05


# -- quantized inputs and outputs ----------------------------------------------------------


def _boundary_models(config):
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    plain = _calibrated(qcore.prepare_fx(model, default_qconfig_mapping(), (x,), "fbgemm"), x)
    edged = _calibrated(
        qcore.prepare_fx(model, default_qconfig_mapping(), (x,), "fbgemm", config), x
    )
    return plain, edged, x


@pytest.mark.parametrize("convert", [qcore.convert_fx, qcore.convert_to_reference_fx])
def test_output_quantized_indexes_return_the_int8_tensor(convert):
    plain, edged, x = _boundary_models({"output_quantized_idxs": [0]})
    expected, got = convert(plain)(x), convert(edged)(x)
    assert got.dtype == torch.quint8
    assert torch.equal(got.dequantize(), expected)


@pytest.mark.parametrize("convert", [qcore.convert_fx, qcore.convert_to_reference_fx])
def test_input_quantized_indexes_take_a_quantized_tensor(convert):
    plain, edged, x = _boundary_models({"input_quantized_idxs": [0]})
    scale, zero_point = plain.activation_post_process_0.calculate_qparams()
    quantized_x = torch.quantize_per_tensor(x, float(scale), int(zero_point), torch.quint8)
    model = convert(edged)
    assert torch.equal(model(quantized_x), convert(plain)(x))
    assert torch.equal(model(x), convert(plain)(x))  # a float input passes too


def test_an_output_after_a_float_op_is_observed_to_leave_as_int8():
    """torch.ao's rule: an output asked for as int8 is observed even when the op
    before it (Softplus here) stays float."""
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Softplus()).eval(), torch.randn(8, 4)
    config = {"output_quantized_idxs": [0]}
    prepared = _calibrated(
        qcore.prepare_fx(model, default_qconfig_mapping(), (x,), "fbgemm", config), x
    )
    got = qcore.convert_fx(prepared)(x)
    assert got.dtype == torch.quint8
    assert (got.dequantize() - model(x)).abs().max() < 0.05


def test_an_output_index_beyond_the_outputs_is_an_error_naming_it():
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    config = {"output_quantized_idxs": [1]}
    prepared = _calibrated(
        qcore.prepare_fx(model, default_qconfig_mapping(), (x,), "fbgemm", config), x
    )
    with pytest.raises(UnsupportedSetting, match="output_quantized_indexes: got 1; the model"):
        qcore.convert_fx(prepared)


# -- refused, by name ------------------------------------------------------------------------


def test_unknown_custom_config_key_is_refused():
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    with pytest.raises(UnsupportedSetting, match="'non_traceable_module'"):
        qcore.prepare_fx(
            model, default_qconfig_mapping(), (x,), "fbgemm", {"non_traceable_module": ["x"]}
        )


def test_a_qconfig_set_to_none_at_convert_leaves_that_op_float():
    """torch.ao's convert takes the prepare mapping with some QConfigs set to None:
    those ops stay float, as if the prepare mapping had said so."""
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    prepared = _calibrated(qcore.prepare_fx(model, default_qconfig_mapping(), (x,), "fbgemm"), x)
    changed = copy.deepcopy(default_qconfig_mapping()).set_module_name("second", None)
    converted = qcore.convert_fx(prepared, qconfig_mapping=changed)
    statuses = {e.node: e.status.value for e in qcore.explain(converted).entries}
    assert statuses["first"] == "quantized" and statuses["second"] == "float"
    assert type(converted.second) is nn.Linear
    at_prepare = qcore.prepare_fx(model, changed, (x,), "fbgemm")
    expected = qcore.convert_fx(_calibrated(at_prepare, x))(x)
    assert torch.equal(converted(x), expected)
    assert torch.equal(qcore.convert_fx(prepared)(x), qcore.convert_fx(prepared)(x))
    assert not torch.equal(qcore.convert_fx(prepared)(x), expected)  # prepared is left as is


def test_a_qat_module_set_to_none_at_convert_returns_to_float():
    model, x = TwoLinears().train(), torch.randn(8, 4)
    mapping = torch.ao.quantization.get_default_qat_qconfig_mapping("fbgemm")
    prepared = _calibrated(qcore.prepare_qat_fx(model, mapping, (x,), "fbgemm"), x)
    assert isinstance(prepared.second, torch.ao.nn.qat.Linear)
    changed = copy.deepcopy(mapping).set_object_type(nn.Linear, None)
    converted = qcore.convert_fx(prepared, qconfig_mapping=changed)
    assert type(converted.first) is nn.Linear and type(converted.second) is nn.Linear
    assert qcore.explain(converted).quantized == []
    torch.testing.assert_close(converted.eval()(x), model.eval()(x))


def test_another_qconfig_at_convert_is_refused_naming_the_op():
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    prepared = _calibrated(qcore.prepare_fx(model, default_qconfig_mapping(), (x,), "fbgemm"), x)
    changed = copy.deepcopy(default_qconfig_mapping()).set_module_name("second", default_qconfig)
    with pytest.raises(UnsupportedSetting, match="changing QConfigs.*'second'"):
        qcore.convert_fx(prepared, qconfig_mapping=changed)


def test_convert_takes_the_prepare_mapping_again():
    """torch.ao's QAT examples pass the prepare mapping to convert_fx again (a no-op
    there); qcore refused any mapping at convert. An equal one (a copy, torch.ao's
    dict form of the same QConfigs) now converts as without it."""
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    qconfig = torch.ao.quantization.get_default_qconfig("fbgemm")
    prepared = _calibrated(qcore.prepare_fx(model, {"": qconfig}, (x,), "fbgemm"), x)
    expected = qcore.convert_fx(prepared)(x)
    again = {"": torch.ao.quantization.get_default_qconfig("fbgemm")}  # new QConfig objects
    assert torch.equal(qcore.convert_fx(prepared, qconfig_mapping=again)(x), expected)
    copied = copy.deepcopy(again)
    assert torch.equal(qcore.convert_fx(prepared, qconfig_mapping=copied)(x), expected)
    other = {"": torch.ao.quantization.get_default_qconfig("qnnpack")}
    with pytest.raises(UnsupportedSetting, match="changing QConfigs"):
        qcore.convert_fx(prepared, qconfig_mapping=other)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        # a string was split into letters: names 'f' and 'c', attributes 't', 'r', ...
        ("non_traceable_module_name", "first", "a list of names"),
        ("preserved_attributes", "attr", "a list of names"),
        ("non_traceable_module_name", 3, "a list of names"),  # was "'int' is not iterable"
        ("input_quantized_idxs", 0, "a list of non-negative int indexes"),  # was dropped
        ("output_quantized_idxs", 1, "a list of non-negative int indexes"),
        ("non_traceable_module_class", nn.Linear, "a list of torch.nn.Module subclasses"),
    ],
)
def test_a_lone_name_or_index_is_refused_naming_the_key_written(key, value, expected):
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    with pytest.raises(TypeError) as refused:
        qcore.prepare_fx(model, default_qconfig_mapping(), (x,), "fbgemm", {key: value})
    assert str(refused.value) == (
        f"prepare_custom_config.{key}: got {describe(value)}; expected {expected}"
    )


def test_custom_module_classes_not_in_a_dict_are_refused_naming_the_quant_type():
    """{"static": [nn.Linear]} raised "cannot convert dictionary update sequence"."""
    config = {"float_to_observed_custom_module_class": {"static": [nn.Linear]}}
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    with pytest.raises(TypeError) as refused:
        qcore.prepare_fx(model, default_qconfig_mapping(), (x,), "fbgemm", config)
    assert str(refused.value) == (
        "prepare_custom_config.float_to_observed_custom_module_class['static']: got "
        f"{describe([nn.Linear])}; expected a dict of classes ({{float class: observed "
        "class} or {observed class: quantized class})"
    )


def test_custom_config_names_that_name_no_module_warn_once():
    """A typo there quietly traced and quantized the module meant to stay untraced or
    standalone; the same typo in a QConfigMapping warns."""
    model, x = TwoLinears().eval(), torch.randn(8, 4)
    config = {
        "non_traceable_module_name": ["frist", "second"],
        "standalone_module_name": [("secnod", None, None, None)],
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qcore.prepare_fx(model, default_qconfig_mapping(), (x,), "fbgemm", config)
    unmatched = [str(w.message) for w in caught if "names no module" in str(w.message)]
    assert [w.category for w in caught if "names no module" in str(w.message)] == [QCoreWarning]
    assert unmatched == [
        "prepare: prepare_custom_config sets non_traceable_module_names 'frist'; "
        "standalone_module_names 'secnod', which names no module of the model: no module "
        "is left untraced or prepared standalone by it. Module names are those of "
        "model.named_modules()."
    ]
