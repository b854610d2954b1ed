"""The BackendConfig tutorial (seed 002), steps 2-4, ported by changing only
its import lines; then round trips and the step-5 QConfig checks."""

# The tutorial's imports, its torch.ao.quantization.backend_config line changed
# to qcore, plus the helpers these tests use.
import pytest
import torch
from torch.ao.quantization import (
    MinMaxObserver,
    QConfig,
    default_weight_observer,
    get_default_qconfig_mapping,
)

from qcore import (
    BackendConfig,
    BackendPatternConfig,
    ConfigError,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
)
from qcore.config.compat import accepts, find_accepting_dtype_config, rejection_reasons
from qcore.config.json import Allowlist, from_json, to_json

# --- steps 2-4, verbatim from the tutorial --------------------------------------
# fmt: off

quint8_with_constraints = DTypeWithConstraints(
    dtype=torch.quint8,
    quant_min_lower_bound=0,
    quant_max_upper_bound=255,
    scale_min_lower_bound=2 ** -12,
)

# Specify the dtypes passed to the quantized ops in the reference model spec
weighted_int8_dtype_config = DTypeConfig(
    input_dtype=quint8_with_constraints,
    output_dtype=quint8_with_constraints,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float)

def fuse_conv2d_relu(is_qat, conv, relu):
    """Return a fused ConvReLU2d from individual conv and relu modules."""
    return torch.ao.nn.intrinsic.ConvReLU2d(conv, relu)

linear_config = BackendPatternConfig() \
    .set_pattern(torch.nn.Linear) \
    .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT) \
    .add_dtype_config(weighted_int8_dtype_config) \
    .set_root_module(torch.nn.Linear) \
    .set_qat_module(torch.nn.qat.Linear) \
    .set_reference_quantized_module(torch.ao.nn.quantized.reference.Linear)

# For fusing Conv2d + ReLU into ConvReLU2d
# No need to set observation type and dtype config here, since we are not
# inserting quant-dequant ops in this step yet
conv_relu_config = BackendPatternConfig() \
    .set_pattern((torch.nn.Conv2d, torch.nn.ReLU)) \
    .set_fused_module(torch.ao.nn.intrinsic.ConvReLU2d) \
    .set_fuser_method(fuse_conv2d_relu)

# For quantizing ConvReLU2d
fused_conv_relu_config = BackendPatternConfig() \
    .set_pattern(torch.ao.nn.intrinsic.ConvReLU2d) \
    .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT) \
    .add_dtype_config(weighted_int8_dtype_config) \
    .set_root_module(torch.nn.Conv2d) \
    .set_qat_module(torch.ao.nn.intrinsic.qat.ConvReLU2d) \
    .set_reference_quantized_module(torch.ao.nn.quantized.reference.Conv2d)

backend_config = BackendConfig("my_backend") \
    .set_backend_pattern_config(linear_config) \
    .set_backend_pattern_config(conv_relu_config) \
    .set_backend_pattern_config(fused_conv_relu_config)

# fmt: on

# --- step 5's QConfig ---------------------------------------------------------------

# Note: Here we use a quant_max of 127, but this could be up to 255 (see `quint8_with_constraints`)
activation_observer = MinMaxObserver.with_args(quant_min=0, quant_max=127, eps=2**-12)
qconfig = QConfig(activation=activation_observer, weight=default_weight_observer)


# --- tests ---------------------------------------------------------------------------


def test_tutorial_backend_config_shape():
    assert backend_config.name == "my_backend"
    assert len(backend_config) == 3
    assert backend_config.configs == [linear_config, conv_relu_config, fused_conv_relu_config]
    assert backend_config.get((torch.nn.ReLU, torch.nn.Conv2d)) is conv_relu_config
    assert linear_config.dtype_configs[0].input_dtype_with_constraints.scale_min_lower_bound == (
        2**-12
    )


def test_dict_round_trip():
    assert BackendConfig.from_dict(backend_config.to_dict()) == backend_config


def test_json_round_trip():
    # The tutorial's fuser lives in this test module: outside the default
    # allow-list until registered (as a plugin's registry does for its configs).
    with pytest.raises(ConfigError, match=r"configs\[1\]\.fuser_method.*fuse_conv2d_relu"):
        to_json(backend_config)
    allowlist = Allowlist()
    assert allowlist.allow_config(backend_config) == []
    text = to_json(backend_config, allowlist=allowlist)
    assert '"torch.nn.modules.linear.Linear"' in text
    assert "fuse_conv2d_relu" in text
    again = from_json(text, allowlist=allowlist)
    assert again == backend_config
    assert again.get((torch.nn.ReLU, torch.nn.Conv2d)).fuser_method is fuse_conv2d_relu
    assert to_json(again, allowlist=allowlist) == text


def test_step_5_qconfig_is_accepted_for_linear_and_conv_relu():
    assert accepts(backend_config, torch.nn.Linear, qconfig)
    assert accepts(backend_config, torch.ao.nn.intrinsic.ConvReLU2d, qconfig)
    accepted, rejected = find_accepting_dtype_config(linear_config, qconfig)
    assert accepted is weighted_int8_dtype_config and rejected == []


def test_fusion_only_pattern_has_no_dtype_config():
    reasons = rejection_reasons(backend_config, (torch.nn.Conv2d, torch.nn.ReLU), qconfig)
    assert len(reasons) == 1 and "no DTypeConfig" in reasons[0]


def test_default_qconfig_is_rejected_with_the_eps_reason():
    default_qconfig = get_default_qconfig_mapping().global_qconfig
    for pattern in (torch.nn.Linear, torch.ao.nn.intrinsic.ConvReLU2d):
        assert not accepts(backend_config, pattern, default_qconfig)
        reasons = rejection_reasons(backend_config, pattern, default_qconfig)
        assert len(reasons) == 1
        assert (
            "eps 1.1920928955078125e-07 is below scale_min_lower_bound "
            "0.000244140625 (2**-12)" in reasons[0]
        )


def test_unknown_pattern_is_rejected_with_a_reason():
    reasons = rejection_reasons(backend_config, torch.nn.Sigmoid, qconfig)
    assert reasons == ["no pattern Sigmoid in backend 'my_backend'"]
    assert not accepts(
        backend_config, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.ReLU), qconfig
    )


def test_from_dict_reads_torch_aos_own_to_dict_output():
    # it raised ConfigError on torch.ao's ObservationType and DTypeWithConstraints
    import torch.ao.quantization.backend_config as ao

    from qcore.config.torch_ao import from_torch_ao, import_torch_ao_backend_config

    import_torch_ao_backend_config()
    native = ao.get_native_backend_config()
    read = BackendConfig.from_dict(native.to_dict())
    assert read.to_dict() == from_torch_ao(native).to_dict()
    constrained = ao.DTypeWithConstraints(dtype=torch.quint8, scale_min_lower_bound=2**-12)
    dtype_config = DTypeConfig.from_dict(
        {"input_dtype": constrained, "output_dtype": torch.quint8, "weight_dtype": torch.qint8}
    )
    assert dtype_config.input_dtype_with_constraints.scale_min_lower_bound == 2**-12
    assert dtype_config.weight_dtype == torch.qint8
