"""torch.ao's native BackendConfigs converted to qcore and back."""

import subprocess
import sys

import pytest
import torch

from qcore import BackendConfig, BackendPatternConfig, ConfigError, ObservationType
from qcore.config.torch_ao import (
    from_torch_ao,
    import_torch_ao_backend_config,
    to_torch_ao,
)

ao = import_torch_ao_backend_config()  # also loads the utils torch 2.13 forgets


def _x86():
    from torch.ao.quantization.backend_config.x86 import get_x86_backend_config

    return get_x86_backend_config()


GETTERS = {
    "fbgemm": (ao.get_fbgemm_backend_config, 192),
    "qnnpack": (ao.get_qnnpack_backend_config, 190),
    "x86": (_x86, 192),
}

_CONSTRAINT_FIELDS = (
    "dtype",
    "quant_min_lower_bound",
    "quant_max_upper_bound",
    "scale_min_lower_bound",
    "scale_max_upper_bound",
    "scale_exact_match",
    "zero_point_exact_match",
)


def dtype_config_fields(dtype_config):
    """A comparable tuple for a qcore or torch.ao DTypeConfig."""
    fields = []
    for kind in ("input", "output", "weight"):
        constrained = getattr(dtype_config, f"{kind}_dtype_with_constraints")
        fields.append(tuple(getattr(constrained, name) for name in _CONSTRAINT_FIELDS))
    return (*fields, dtype_config.bias_dtype, dtype_config.is_dynamic)


def pattern_config_fields(config):
    """Every field of a qcore or torch.ao BackendPatternConfig, comparable."""
    return (
        config.pattern,
        config._pattern_complex_format,
        config.observation_type.name,
        [dtype_config_fields(item) for item in config.dtype_configs],
        config.root_module,
        config.qat_module,
        config.reference_quantized_module,
        config.fused_module,
        config.fuser_method,
        config._root_node_getter,
        config._extra_inputs_getter,
        {k: v.name for k, v in config._num_tensor_args_to_observation_type.items()},
        dict(config._input_type_to_index),
    )


@pytest.fixture(params=sorted(GETTERS))
def native(request):
    getter, count = GETTERS[request.param]
    return request.param, getter(), count


def test_pattern_counts(native):
    name, ao_config, count = native
    config = from_torch_ao(ao_config)
    assert isinstance(config, BackendConfig)
    assert len(config) == len(ao_config.configs) == count
    assert config.name == ao_config.name


def test_every_field_of_every_pattern_is_kept(native):
    _, ao_config, _ = native
    config = from_torch_ao(ao_config)
    for ao_pattern_config, pattern_config in zip(ao_config.configs, config.configs, strict=True):
        assert isinstance(pattern_config, BackendPatternConfig)
        assert pattern_config_fields(pattern_config) == pattern_config_fields(ao_pattern_config)
        assert isinstance(pattern_config.observation_type, ObservationType)
    # the keys (complex formats) agree too
    assert list(ao_config._pattern_complex_format_to_config) == [
        c.pattern_complex_format for c in config.configs
    ]


def test_round_trip_back_to_torch_ao(native):
    _, ao_config, _ = native
    config = from_torch_ao(ao_config)
    ao_again = to_torch_ao(config)
    assert isinstance(ao_again, ao.BackendConfig)
    assert len(ao_again.configs) == len(ao_config.configs)
    for before, after in zip(ao_config.configs, ao_again.configs, strict=True):
        assert pattern_config_fields(after) == pattern_config_fields(before)
        for ao_dtype_config in after.dtype_configs:
            assert isinstance(ao_dtype_config, ao.DTypeConfig)
            assert isinstance(ao_dtype_config.input_dtype_with_constraints, ao.DTypeWithConstraints)
    assert from_torch_ao(ao_again) == config


def test_qnnpack_symmetric_constraints_are_preserved():
    config = from_torch_ao(ao.get_qnnpack_backend_config())
    linear = config.get(torch.nn.Linear)
    constrained = [
        dtype_config
        for dtype_config in linear.dtype_configs
        if dtype_config.input_dtype == torch.qint8
    ]
    assert constrained, "qnnpack's Linear has qint8 symmetric dtype configs"
    for dtype_config in constrained:
        act = dtype_config.input_dtype_with_constraints
        assert act.dtype == torch.qint8
        assert act.scale_min_lower_bound == 2**-12
        assert dtype_config.output_dtype_with_constraints == act
        weight = dtype_config.weight_dtype_with_constraints
        assert weight.scale_min_lower_bound == 2**-12
        assert (weight.quant_min_lower_bound, weight.quant_max_upper_bound) == (-127, 127)
    ao_back = to_torch_ao(config)
    ao_linear = ao_back._pattern_complex_format_to_config[torch.nn.Linear]
    assert any(
        dtype_config.input_dtype_with_constraints.scale_min_lower_bound == 2**-12
        for dtype_config in ao_linear.dtype_configs
    )


def test_fixed_qparams_and_advanced_fields_survive():
    config = from_torch_ao(ao.get_fbgemm_backend_config())
    sigmoid = config.get(torch.nn.Sigmoid)
    assert any(
        d.output_dtype_with_constraints.scale_exact_match == 1.0 / 256.0
        and d.output_dtype_with_constraints.zero_point_exact_match == 0
        for d in sigmoid.dtype_configs
    )
    assert any(c._num_tensor_args_to_observation_type for c in config.configs)
    assert any(c._input_type_to_index for c in config.configs)
    assert any(c.fuser_method is not None for c in config.configs)


def test_complex_format_patterns_survive():
    ao_config = ao.get_onednn_backend_config()
    config = from_torch_ao(ao_config)
    complex_ones = [c for c in config.configs if c._pattern_complex_format is not None]
    assert complex_ones and all(c.pattern is None for c in complex_ones)
    assert all(c._root_node_getter is not None for c in complex_ones)
    assert all(c._extra_inputs_getter is not None for c in complex_ones)
    assert from_torch_ao(to_torch_ao(config)) == config
    for before, after in zip(ao_config.configs, config.configs, strict=True):
        assert pattern_config_fields(after) == pattern_config_fields(before)


def test_qcore_only_config_to_torch_ao_and_back():
    config = BackendConfig("mine").set_backend_pattern_config(
        BackendPatternConfig()
        ._set_pattern_complex_format((torch.nn.ReLU, (torch.add, torch.nn.Conv2d, "x")))
        ._set_input_type_to_index({"weight": 1})
        ._set_num_tensor_args_to_observation_type(
            {2: ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT}
        )
    )
    ao_config = to_torch_ao(config)
    assert ao_config.name == "mine"
    only = ao_config.configs[0]
    assert only._num_tensor_args_to_observation_type == {
        2: ao.ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
    }
    assert from_torch_ao(ao_config) == config


def test_wrong_types_are_config_errors():
    with pytest.raises(ConfigError, match="from_torch_ao backend_config.*expected a torch.ao"):
        from_torch_ao(BackendConfig("x"))
    with pytest.raises(ConfigError, match="to_torch_ao config.*expected a qcore"):
        to_torch_ao(ao.BackendConfig("x"))


def test_invalid_torch_ao_value_names_pattern_and_field():
    ao_config = ao.BackendConfig("bad").set_backend_pattern_config(
        ao.BackendPatternConfig(torch.nn.Linear).set_root_module("Linear")
    )
    with pytest.raises(ConfigError) as excinfo:
        from_torch_ao(ao_config)
    assert "bad configs[0]" in str(excinfo.value)
    assert "BackendPatternConfig.root_module" in str(excinfo.value)


def test_importing_the_module_does_not_import_torch_ao_backend_config():
    code = (
        "import sys, qcore.config.torch_ao; "
        "print('torch.ao.quantization.backend_config' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
