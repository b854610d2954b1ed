"""The config data model: every setter and property of seed 001 and the
tutorial, pattern formats, validation errors, duplicates, dict round trip."""

import dataclasses
import operator

import pytest
import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.intrinsic.qat as nniqat
import torch.ao.nn.qat as nnqat
import torch.ao.nn.quantized.reference as nnqr
import torch.nn.functional as F

from qcore import (
    BackendConfig,
    BackendPatternConfig,
    ConfigError,
    DTypeConfig,
    DTypeWithConstraints,
    DuplicatePatternError,
    ObservationType,
)
from qcore.config.pattern import format_pattern, to_complex_format

QUINT8_CONSTRAINED = DTypeWithConstraints(
    dtype=torch.quint8,
    quant_min_lower_bound=0,
    quant_max_upper_bound=255,
    scale_min_lower_bound=2**-12,
)
WEIGHTED_INT8 = DTypeConfig(
    input_dtype=torch.quint8,
    output_dtype=torch.quint8,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
)


def fuse_conv2d_relu(is_qat, conv, relu):
    return nni.ConvReLU2d(conv, relu)


def root_node_getter(pattern):
    return pattern[-1]


def extra_inputs_getter(pattern):
    return []


def seed_001_backend_config():
    """The example of seed 001, with its import line changed to qcore."""
    linear_config = (
        BackendPatternConfig(torch.nn.Linear)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(WEIGHTED_INT8)
        .set_root_module(torch.nn.Linear)
        .set_qat_module(torch.ao.nn.qat.Linear)
        .set_reference_quantized_module(torch.ao.nn.quantized.reference.Linear)
    )
    conv_relu_config = (
        BackendPatternConfig((torch.nn.Conv2d, torch.nn.ReLU))
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(WEIGHTED_INT8)
        .set_fused_module(torch.ao.nn.intrinsic.ConvReLU2d)
        .set_fuser_method(fuse_conv2d_relu)
    )
    fused_conv_relu_config = (
        BackendPatternConfig(torch.ao.nn.intrinsic.ConvReLU2d)
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        .add_dtype_config(WEIGHTED_INT8)
        .set_root_module(torch.nn.Conv2d)
        .set_qat_module(torch.ao.nn.intrinsic.qat.ConvReLU2d)
        .set_reference_quantized_module(torch.ao.nn.quantized.reference.Conv2d)
    )
    return (
        BackendConfig("my_backend")
        .set_backend_pattern_config(linear_config)
        .set_backend_pattern_config(conv_relu_config)
        .set_backend_pattern_config(fused_conv_relu_config)
    )


def assert_config_error(excinfo, *parts):
    text = str(excinfo.value)
    for part in parts:
        assert part in text, f"{part!r} not in {text!r}"


# -- ObservationType, DTypeWithConstraints, DTypeConfig ------------------------


def test_observation_type_values_match_torch_ao():
    from torch.ao.quantization.backend_config import ObservationType as AO

    for member in ObservationType:
        assert AO[member.name].value == member.value


def test_dtype_with_constraints_fields_and_has_constraints():
    plain = DTypeWithConstraints(dtype=torch.qint8)
    assert plain.dtype is torch.qint8 and not plain.has_constraints
    assert QUINT8_CONSTRAINED.quant_min_lower_bound == 0
    assert QUINT8_CONSTRAINED.quant_max_upper_bound == 255
    assert QUINT8_CONSTRAINED.scale_min_lower_bound == 2**-12
    assert QUINT8_CONSTRAINED.scale_max_upper_bound is None
    assert QUINT8_CONSTRAINED.has_constraints
    fixed = DTypeWithConstraints(
        dtype=torch.quint8, scale_exact_match=1 / 256, zero_point_exact_match=0
    )
    assert fixed.scale_exact_match == 1 / 256 and fixed.zero_point_exact_match == 0
    assert fixed == DTypeWithConstraints(
        dtype=torch.quint8, scale_exact_match=1 / 256, zero_point_exact_match=0
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        fixed.dtype = torch.qint8


@pytest.mark.parametrize(
    "kwargs, parts",
    [
        ({"dtype": "quint8"}, ["DTypeWithConstraints.dtype", "'quint8'", "a torch.dtype"]),
        ({"quant_min_lower_bound": "0"}, ["quant_min_lower_bound", "'0'", "an int, a float"]),
        ({"quant_max_upper_bound": True}, ["quant_max_upper_bound", "True", "an int, a float"]),
        ({"scale_min_lower_bound": float("nan")}, ["scale_min_lower_bound", "nan"]),
        (
            {"quant_min_lower_bound": 10, "quant_max_upper_bound": 5},
            ["quant_min_lower_bound", "10", "no greater than quant_max_upper_bound=5"],
        ),
        (
            {"scale_min_lower_bound": 0.5, "scale_max_upper_bound": 0.25},
            ["scale_min_lower_bound", "0.5", "no greater than scale_max_upper_bound=0.25"],
        ),
        ({"scale_min_lower_bound": 0}, ["scale_min_lower_bound", "0", "greater than 0"]),
        ({"scale_exact_match": -1.0}, ["scale_exact_match", "-1.0", "greater than 0"]),
    ],
)
def test_dtype_with_constraints_validation(kwargs, parts):
    with pytest.raises(ConfigError) as excinfo:
        DTypeWithConstraints(**kwargs)
    assert_config_error(excinfo, *parts)


def test_dtype_config_properties():
    config = DTypeConfig(
        input_dtype=QUINT8_CONSTRAINED,
        output_dtype=QUINT8_CONSTRAINED,
        weight_dtype=torch.qint8,
        bias_dtype=torch.float,
        is_dynamic=False,
    )
    assert config.input_dtype is torch.quint8
    assert config.output_dtype is torch.quint8
    assert config.weight_dtype is torch.qint8
    assert config.bias_dtype is torch.float32
    assert config.is_dynamic is False
    assert config.input_dtype_with_constraints is QUINT8_CONSTRAINED
    assert config.weight_dtype_with_constraints == DTypeWithConstraints(dtype=torch.qint8)
    empty = DTypeConfig()
    assert empty.input_dtype is None and empty.weight_dtype is None and empty.is_dynamic is None
    assert "input_dtype=DTypeWithConstraints" in repr(config)
    assert "weight_dtype=torch.qint8" in repr(config)


def test_dtype_config_equality_and_hash():
    again = DTypeConfig(
        input_dtype=torch.quint8,
        output_dtype=torch.quint8,
        weight_dtype=torch.qint8,
        bias_dtype=torch.float32,
    )
    assert again == WEIGHTED_INT8 and hash(again) == hash(WEIGHTED_INT8)
    assert again != DTypeConfig(input_dtype=torch.quint8)


@pytest.mark.parametrize(
    "kwargs, parts",
    [
        ({"input_dtype": "quint8"}, ["DTypeConfig.input_dtype", "'quint8'", "torch.dtype"]),
        ({"output_dtype": 8}, ["DTypeConfig.output_dtype", "8", "torch.dtype"]),
        ({"weight_dtype": [torch.qint8]}, ["DTypeConfig.weight_dtype", "torch.dtype"]),
        ({"bias_dtype": "float"}, ["DTypeConfig.bias_dtype", "'float'", "torch.dtype"]),
        ({"is_dynamic": 1}, ["DTypeConfig.is_dynamic", "1", "True, False or None"]),
    ],
)
def test_dtype_config_validation(kwargs, parts):
    with pytest.raises(ConfigError) as excinfo:
        DTypeConfig(**kwargs)
    assert_config_error(excinfo, *parts)


def test_dtype_config_dict_round_trip():
    config = DTypeConfig(
        input_dtype=QUINT8_CONSTRAINED,
        output_dtype=torch.float,
        weight_dtype=torch.qint8,
        bias_dtype=torch.float,
        is_dynamic=True,
    )
    as_dict = config.to_dict()
    assert as_dict["input_dtype"] == QUINT8_CONSTRAINED
    assert as_dict["is_dynamic"] is True
    assert DTypeConfig.from_dict(as_dict) == config
    assert DTypeConfig.from_dict({"input_dtype": torch.quint8}).input_dtype is torch.quint8
    with pytest.raises(ConfigError) as excinfo:
        DTypeConfig.from_dict({"input_dtyp": torch.quint8})
    assert_config_error(excinfo, "DTypeConfig", "'input_dtyp'", "one of the keys")
    with pytest.raises(ConfigError):
        DTypeConfig.from_dict([("input_dtype", torch.quint8)])


# -- BackendPatternConfig ---------------------------------------------------------


def test_every_pattern_config_setter():
    config = (
        BackendPatternConfig()
        .set_pattern((torch.nn.Conv2d, torch.nn.ReLU))
        .set_observation_type(ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT)
        .add_dtype_config(WEIGHTED_INT8)
        .set_root_module(torch.nn.Conv2d)
        .set_qat_module(nniqat.ConvReLU2d)
        .set_reference_quantized_module(nnqr.Conv2d)
        .set_fused_module(nni.ConvReLU2d)
        .set_fuser_method(fuse_conv2d_relu)
        ._set_root_node_getter(root_node_getter)
        ._set_extra_inputs_getter(extra_inputs_getter)
        ._set_num_tensor_args_to_observation_type({0: ObservationType.INPUT_OUTPUT_NOT_OBSERVED})
        ._set_input_type_to_index({"weight": 1, "bias": 2})
    )
    assert config.pattern == (torch.nn.Conv2d, torch.nn.ReLU)
    assert config.observation_type is ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
    assert config.dtype_configs == [WEIGHTED_INT8]
    assert config.root_module is torch.nn.Conv2d
    assert config.qat_module is nniqat.ConvReLU2d
    assert config.reference_quantized_module is nnqr.Conv2d
    assert config.fused_module is nni.ConvReLU2d
    assert config.fuser_method is fuse_conv2d_relu
    assert config._root_node_getter is root_node_getter
    assert config._extra_inputs_getter is extra_inputs_getter
    assert config._num_tensor_args_to_observation_type == {
        0: ObservationType.INPUT_OUTPUT_NOT_OBSERVED
    }
    assert config._input_type_to_index == {"weight": 1, "bias": 2}
    assert config.pattern_complex_format == (torch.nn.ReLU, torch.nn.Conv2d)

    other = DTypeConfig(input_dtype=torch.float16, output_dtype=torch.float16)
    config.set_dtype_configs([other, WEIGHTED_INT8])
    assert config.dtype_configs == [other, WEIGHTED_INT8]
    config.add_dtype_config(WEIGHTED_INT8)
    assert len(config.dtype_configs) == 3


def test_defaults():
    config = BackendPatternConfig(torch.nn.Linear)
    assert config.observation_type is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    assert config.dtype_configs == []
    assert config.root_module is None and config.fuser_method is None
    assert config._num_tensor_args_to_observation_type == {}
    assert config._input_type_to_index == {}
    assert config._pattern_complex_format is None


@pytest.mark.parametrize(
    "pattern, complex_format",
    [
        (torch.nn.Linear, torch.nn.Linear),
        (F.relu, F.relu),
        (torch.add, torch.add),
        (operator.add, operator.add),
        ("relu", "relu"),
        ((torch.nn.Conv2d, torch.nn.ReLU), (torch.nn.ReLU, torch.nn.Conv2d)),
        ((torch.nn.Linear, F.relu), (F.relu, torch.nn.Linear)),
        (
            (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.ReLU),
            (torch.nn.ReLU, (torch.nn.BatchNorm2d, torch.nn.Conv2d)),
        ),
        ((torch.add, "relu"), ("relu", torch.add)),
    ],
)
def test_simple_patterns_and_their_complex_format(pattern, complex_format):
    config = BackendPatternConfig(pattern)
    assert config.pattern == pattern
    assert config.pattern_complex_format == complex_format
    assert to_complex_format(pattern) == complex_format


def test_complex_pattern_format():
    # conv - bn - add(., x) - relu, as in torch.ao's conv_bn_add_relu configs
    pattern = (torch.nn.ReLU, (torch.add, (torch.nn.BatchNorm2d, torch.nn.Conv2d), "x"))
    config = (
        BackendPatternConfig()
        ._set_pattern_complex_format(pattern)
        ._set_root_node_getter(root_node_getter)
    )
    assert config.pattern is None
    assert config._pattern_complex_format == pattern
    assert config.pattern_complex_format == pattern
    assert config.describe_pattern().startswith("complex (ReLU, (add, (BatchNorm2d, Conv2d)")
    assert format_pattern(("relu", torch.nn.Linear)) == "('relu', Linear)"
    backend = BackendConfig("b").set_backend_pattern_config(config)
    assert backend.get(pattern) is config


def test_pattern_and_complex_format_are_exclusive():
    with pytest.raises(ConfigError) as excinfo:
        BackendPatternConfig(torch.nn.Linear)._set_pattern_complex_format(torch.nn.Linear)
    assert_config_error(excinfo, "pattern_complex_format", "Linear", "only one of the two")
    with pytest.raises(ConfigError) as excinfo:
        BackendPatternConfig()._set_pattern_complex_format(torch.nn.Linear).set_pattern(
            torch.nn.Linear
        )
    assert_config_error(excinfo, "BackendPatternConfig.pattern", "only one of the two")


def test_missing_pattern_is_an_error_when_used():
    with pytest.raises(ConfigError) as excinfo:
        BackendConfig().set_backend_pattern_config(BackendPatternConfig())
    assert_config_error(excinfo, "BackendPatternConfig.pattern", "None", "set_pattern()")


@pytest.mark.parametrize(
    "call, parts",
    [
        (
            lambda c: c.set_pattern((torch.nn.Conv2d,) * 4),
            ["BackendPatternConfig.pattern", "Conv2d", "2- or 3-tuple"],
        ),
        (
            lambda c: c.set_pattern(()),
            ["BackendPatternConfig.pattern", "()", "2- or 3-tuple"],
        ),
        (
            lambda c: c.set_pattern((torch.nn.ReLU, (torch.nn.Conv2d, torch.nn.ReLU))),
            ["BackendPatternConfig.pattern[1]", "a single op, not a tuple"],
        ),
        (
            lambda c: c.set_pattern(5),
            ["BackendPatternConfig.pattern", "5 (int)", "a module class, a function"],
        ),
        (
            lambda c: c._set_pattern_complex_format((torch.nn.ReLU, 3)),
            ["BackendPatternConfig.pattern_complex_format[1]", "3 (int)", "a module class"],
        ),
        (
            lambda c: c.set_observation_type("OUTPUT_SHARE_OBSERVER_WITH_INPUT"),
            ["BackendPatternConfig.observation_type", "'OUTPUT_SHARE", "one of ["],
        ),
        (
            lambda c: c.add_dtype_config({"input_dtype": torch.quint8}),
            ["BackendPatternConfig.dtype_configs[]", "a DTypeConfig"],
        ),
        (
            lambda c: c.set_dtype_configs(WEIGHTED_INT8),
            ["BackendPatternConfig.dtype_configs", "a list of DTypeConfig"],
        ),
        (
            lambda c: c.set_dtype_configs([WEIGHTED_INT8, "x"]),
            ["BackendPatternConfig.dtype_configs[1]", "'x' (str)", "a DTypeConfig"],
        ),
        (
            lambda c: c.set_root_module(torch.nn.Linear(1, 1)),
            ["BackendPatternConfig.root_module", "Linear", "a torch.nn.Module subclass"],
        ),
        (
            lambda c: c.set_qat_module(int),
            ["BackendPatternConfig.qat_module", "class builtins.int", "torch.nn.Module subclass"],
        ),
        (
            lambda c: c.set_reference_quantized_module("Linear"),
            ["BackendPatternConfig.reference_quantized_module", "'Linear'", "torch.nn.Module"],
        ),
        (
            lambda c: c.set_fused_module(F.relu),
            ["BackendPatternConfig.fused_module", "relu", "torch.nn.Module subclass"],
        ),
        (
            lambda c: c.set_fuser_method("fuse"),
            ["BackendPatternConfig.fuser_method", "'fuse'", "a callable or None"],
        ),
        (
            lambda c: c._set_root_node_getter(1),
            ["BackendPatternConfig.root_node_getter", "1 (int)", "a callable or None"],
        ),
        (
            lambda c: c._set_extra_inputs_getter(1.5),
            ["BackendPatternConfig.extra_inputs_getter", "1.5", "a callable or None"],
        ),
        (
            lambda c: c._set_num_tensor_args_to_observation_type({"2": ObservationType(0)}),
            ["num_tensor_args_to_observation_type key", "'2'", "an int"],
        ),
        (
            lambda c: c._set_num_tensor_args_to_observation_type({2: 0}),
            ["num_tensor_args_to_observation_type[2]", "0 (int)", "an ObservationType"],
        ),
        (
            lambda c: c._set_input_type_to_index({1: 1}),
            ["input_type_to_index key", "1 (int)", "a str such as 'weight'"],
        ),
        (
            lambda c: c._set_input_type_to_index({"weight": "1"}),
            ["input_type_to_index['weight']", "'1'", "an int argument index"],
        ),
    ],
)
def test_pattern_config_validation_names_field_value_and_expectation(call, parts):
    with pytest.raises(ConfigError) as excinfo:
        call(BackendPatternConfig())
    assert_config_error(excinfo, "got", "expected", *parts)


def test_optional_setters_accept_none():
    config = BackendPatternConfig(torch.nn.Linear).set_root_module(torch.nn.Linear)
    config.set_root_module(None).set_fuser_method(None)._set_root_node_getter(None)
    assert config.root_module is None and config.fuser_method is None


def test_pattern_config_dict_round_trip():
    config = (
        BackendPatternConfig((torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.ReLU))
        .add_dtype_config(WEIGHTED_INT8)
        .set_fused_module(nni.ConvBnReLU2d)
        .set_fuser_method(fuse_conv2d_relu)
        ._set_root_node_getter(root_node_getter)
        ._set_extra_inputs_getter(extra_inputs_getter)
        ._set_num_tensor_args_to_observation_type({1: ObservationType.INPUT_OUTPUT_NOT_OBSERVED})
        ._set_input_type_to_index({"weight": 1})
    )
    as_dict = config.to_dict()
    assert as_dict["fuser_method"] is fuse_conv2d_relu
    assert as_dict["root_node_getter"] is root_node_getter
    assert BackendPatternConfig.from_dict(as_dict) == config

    complex_config = BackendPatternConfig()._set_pattern_complex_format(
        (torch.nn.ReLU, (torch.add, torch.nn.Conv2d, "x"))
    )
    assert "pattern" not in complex_config.to_dict()
    assert BackendPatternConfig.from_dict(complex_config.to_dict()) == complex_config


def test_pattern_config_from_dict_errors():
    with pytest.raises(ConfigError) as excinfo:
        BackendPatternConfig.from_dict({"pattern": torch.nn.Linear, "root": torch.nn.Linear})
    assert_config_error(excinfo, "BackendPatternConfig", "'root'", "one of the keys")
    with pytest.raises(ConfigError) as excinfo:
        BackendPatternConfig.from_dict({"pattern": torch.nn.Linear, "dtype_configs": [3]})
    assert_config_error(excinfo, "dtype_configs[0]", "3 (int)", "a DTypeConfig or a dict")
    with pytest.raises(ConfigError):
        BackendPatternConfig.from_dict("pattern")
    with pytest.raises(ConfigError) as excinfo:
        BackendPatternConfig.from_dict({"pattern": "relu", "dtype_configs": 3})
    assert_config_error(excinfo, "BackendPatternConfig.dtype_configs", "3 (int)", "a list")


# -- BackendConfig ----------------------------------------------------------------


def test_seed_001_backend_config():
    backend_config = seed_001_backend_config()
    assert backend_config.name == "my_backend"
    assert len(backend_config) == 3
    configs = backend_config.configs
    assert [c.pattern for c in configs] == [
        torch.nn.Linear,
        (torch.nn.Conv2d, torch.nn.ReLU),
        nni.ConvReLU2d,
    ]
    assert configs[0].qat_module is nnqat.Linear
    # configs is a copy
    configs.pop()
    assert len(backend_config.configs) == 3
    assert backend_config.get((torch.nn.ReLU, torch.nn.Conv2d)).fused_module is nni.ConvReLU2d
    assert backend_config.get(torch.nn.Conv2d) is None
    assert backend_config.patterns() == ["Linear", "(ReLU, Conv2d)", "ConvReLU2d"]
    assert "my_backend" in repr(backend_config)


def test_set_name_and_set_backend_pattern_configs():
    backend_config = BackendConfig().set_name("other")
    assert backend_config.name == "other"
    configs = seed_001_backend_config().configs
    assert backend_config.set_backend_pattern_configs(configs) is backend_config
    assert backend_config.configs == configs
    with pytest.raises(ConfigError) as excinfo:
        BackendConfig().set_name(3)
    assert_config_error(excinfo, "BackendConfig.name", "3 (int)", "a str")
    with pytest.raises(ConfigError) as excinfo:
        BackendConfig().set_backend_pattern_config(WEIGHTED_INT8)
    assert_config_error(excinfo, "BackendConfig.configs[]", "a BackendPatternConfig")
    with pytest.raises(ConfigError) as excinfo:
        BackendConfig().set_backend_pattern_configs(configs[0])
    assert_config_error(excinfo, "BackendConfig.configs", "a list of BackendPatternConfig")


def test_duplicate_pattern_is_an_error_unless_replace():
    backend_config = seed_001_backend_config()
    replacement = BackendPatternConfig(torch.nn.Linear).add_dtype_config(
        DTypeConfig(input_dtype=torch.float16, output_dtype=torch.float16)
    )
    with pytest.raises(DuplicatePatternError) as excinfo:
        backend_config.set_backend_pattern_config(replacement)
    assert_config_error(excinfo, "my_backend", "Linear", "already configured", "replace=True")
    assert isinstance(excinfo.value, ConfigError)
    # the same pattern in simple and complex form is the same key
    with pytest.raises(DuplicatePatternError):
        backend_config.set_backend_pattern_config(
            BackendPatternConfig()._set_pattern_complex_format((torch.nn.ReLU, torch.nn.Conv2d))
        )
    backend_config.set_backend_pattern_config(replacement, replace=True)
    assert backend_config.get(torch.nn.Linear) is replacement
    assert len(backend_config) == 3
    backend_config.set_backend_pattern_configs([replacement], replace=True)
    with pytest.raises(DuplicatePatternError):
        backend_config.set_backend_pattern_configs([replacement])


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (
            3,
            ConfigError,
            "BackendConfig.configs[2]: got 3 (int); expected a BackendPatternConfig",
        ),
        (
            BackendPatternConfig(torch.nn.Linear),  # the list's first, once more
            DuplicatePatternError,
            "BackendConfig.configs[2]: BackendConfig 'chip': got pattern Linear, which is "
            "already configured; expected each pattern once (pass replace=True to replace it)",
        ),
    ],
)
def test_set_backend_pattern_configs_adds_all_or_none(bad, error, message):
    """It added the configs before the refused one, as set_dtype_configs does not."""
    backend_config = BackendConfig("chip").set_backend_pattern_config(
        BackendPatternConfig(torch.nn.ReLU)
    )
    configs = [BackendPatternConfig(torch.nn.Linear), BackendPatternConfig(torch.nn.Conv2d), bad]
    with pytest.raises(error) as refused:
        backend_config.set_backend_pattern_configs(configs)
    assert str(refused.value) == message
    assert backend_config.patterns() == ["ReLU"]


def test_backend_config_dict_round_trip():
    backend_config = seed_001_backend_config()
    as_dict = backend_config.to_dict()
    assert as_dict["name"] == "my_backend"
    assert len(as_dict["configs"]) == 3
    assert all(isinstance(item, dict) for item in as_dict["configs"])
    again = BackendConfig.from_dict(as_dict)
    assert again == backend_config
    assert again is not backend_config
    # BackendPatternConfig objects are accepted in "configs" too
    assert (
        BackendConfig.from_dict({"name": "my_backend", "configs": backend_config.configs})
        == backend_config
    )
    assert BackendConfig.from_dict({}) == BackendConfig()
    assert backend_config != BackendConfig("my_backend")


def test_backend_config_from_dict_errors():
    with pytest.raises(ConfigError) as excinfo:
        BackendConfig.from_dict({"name": "x", "patterns": []})
    assert_config_error(excinfo, "BackendConfig", "'patterns'", "one of the keys")
    with pytest.raises(ConfigError) as excinfo:
        BackendConfig.from_dict({"configs": [torch.nn.Linear]})
    assert_config_error(excinfo, "BackendConfig.configs[0]", "Linear", "a dict")
    with pytest.raises(ConfigError):
        BackendConfig.from_dict([])
    with pytest.raises(ConfigError) as excinfo:
        BackendConfig.from_dict({"configs": 3})
    assert_config_error(excinfo, "BackendConfig.configs", "3 (int)", "a list")


def test_constraints_without_dtype_survive_the_dict_round_trip():
    bounds_only = DTypeWithConstraints(quant_min_lower_bound=0, quant_max_upper_bound=127)
    config = DTypeConfig(input_dtype=bounds_only, output_dtype=torch.quint8)
    assert config.to_dict()["input_dtype"] == bounds_only
    assert DTypeConfig.from_dict(config.to_dict()) == config
