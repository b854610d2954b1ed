"""The JSON form: round trips, tagged forms, and the allow-list."""

import builtins
import importlib
import json
import operator
import sys

import pytest
import torch
import torch.ao.nn.intrinsic as nni
import torch.nn.functional as F

import qcore.config.json as qjson
from qcore import (
    BackendConfig,
    BackendPatternConfig,
    ConfigError,
    DTypeConfig,
    DTypeWithConstraints,
    DuplicatePatternError,
    ObservationType,
)
from qcore.config.json import Allowlist, from_json, qualified_name, to_json

CONSTRAINED = DTypeWithConstraints(
    dtype=torch.quint8,
    quant_min_lower_bound=0,
    quant_max_upper_bound=255,
    scale_min_lower_bound=2**-12,
    scale_max_upper_bound=1.0,
)
FIXED = DTypeWithConstraints(
    dtype=torch.quint8, scale_exact_match=1.0 / 256.0, zero_point_exact_match=0
)


def fuse_linear_relu(is_qat, linear, relu):
    return nni.LinearReLU(linear, relu)


def root_getter(pattern):
    return pattern[-1]


def full_config():
    """Every field, both pattern formats, functions, builtins and method names."""
    return (
        BackendConfig("everything")
        .set_backend_pattern_config(
            BackendPatternConfig(torch.nn.Linear)
            .add_dtype_config(
                DTypeConfig(
                    input_dtype=CONSTRAINED,
                    output_dtype=CONSTRAINED,
                    weight_dtype=torch.qint8,
                    bias_dtype=torch.float,
                    is_dynamic=False,
                )
            )
            .add_dtype_config(
                DTypeConfig(
                    input_dtype=torch.quint8,
                    output_dtype=torch.float,
                    weight_dtype=torch.float16,
                    is_dynamic=True,
                )
            )
            .set_root_module(torch.nn.Linear)
            .set_qat_module(torch.ao.nn.qat.Linear)
            .set_reference_quantized_module(torch.ao.nn.quantized.reference.Linear)
        )
        .set_backend_pattern_config(
            BackendPatternConfig((torch.nn.Linear, torch.nn.ReLU))
            .set_fused_module(nni.LinearReLU)
            .set_fuser_method(fuse_linear_relu)
        )
        .set_backend_pattern_config(
            BackendPatternConfig((torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.ReLU))
        )
        .set_backend_pattern_config(
            BackendPatternConfig("relu").set_observation_type(
                ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
            )
        )
        .set_backend_pattern_config(
            BackendPatternConfig(torch.nn.Sigmoid).add_dtype_config(
                DTypeConfig(input_dtype=FIXED, output_dtype=FIXED)
            )
        )
        .set_backend_pattern_config(
            BackendPatternConfig((torch.add, "relu"))
            ._set_num_tensor_args_to_observation_type(
                {
                    0: ObservationType.INPUT_OUTPUT_NOT_OBSERVED,
                    2: ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT,
                }
            )
            ._set_input_type_to_index({"weight": 1, "bias": 2})
        )
        .set_backend_pattern_config(BackendPatternConfig(operator.add))
        .set_backend_pattern_config(BackendPatternConfig(F.max_pool2d))
        .set_backend_pattern_config(
            BackendPatternConfig()
            ._set_pattern_complex_format(
                (torch.nn.ReLU, (operator.add, (torch.nn.BatchNorm2d, torch.nn.Conv2d), "x"))
            )
            ._set_root_node_getter(root_getter)
            ._set_extra_inputs_getter(root_getter)
        )
    )


@pytest.fixture
def allowlist():
    allowlist = Allowlist()
    allowlist.allow(fuse_linear_relu)
    allowlist.allow(root_getter)
    return allowlist


def test_round_trip_of_every_field(allowlist):
    config = full_config()
    text = to_json(config, allowlist=allowlist)
    again = from_json(text, allowlist=allowlist)
    assert again == config
    assert to_json(again, allowlist=allowlist) == text
    assert from_json(to_json(again, allowlist=allowlist, indent=None), allowlist=allowlist) == (
        config
    )


def test_tagged_forms(allowlist):
    document = json.loads(to_json(full_config(), allowlist=allowlist))
    assert document["format"] == "qcore.BackendConfig" and document["version"] == 1
    assert document["name"] == "everything"
    linear, linear_relu, conv_bn_relu, relu, sigmoid, add_relu, op_add, pool, cplx = document[
        "configs"
    ]
    assert linear["pattern"] == {"ref": "torch.nn.modules.linear.Linear"}
    assert linear["root_module"] == "torch.nn.modules.linear.Linear"
    assert linear["qat_module"] == "torch.ao.nn.qat.modules.linear.Linear"
    assert linear["observation_type"] == "OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT"
    static, dynamic = linear["dtype_configs"]
    assert static["input_dtype"] == {
        "dtype": "quint8",
        "quant_min_lower_bound": 0,
        "quant_max_upper_bound": 255,
        "scale_min_lower_bound": 2**-12,
        "scale_max_upper_bound": 1.0,
    }
    assert static["weight_dtype"] == "qint8" and static["bias_dtype"] == "float32"
    assert static["is_dynamic"] is False
    assert dynamic == {
        "input_dtype": "quint8",
        "output_dtype": "float32",
        "weight_dtype": "float16",
        "is_dynamic": True,
    }
    assert linear_relu["pattern"] == [
        {"ref": "torch.nn.modules.linear.Linear"},
        {"ref": "torch.nn.modules.activation.ReLU"},
    ]
    assert linear_relu["fuser_method"] == f"{__name__}.fuse_linear_relu"
    assert len(conv_bn_relu["pattern"]) == 3
    # a method name stays a plain string, distinct from a reference
    assert relu["pattern"] == "relu"
    assert relu["observation_type"] == "OUTPUT_SHARE_OBSERVER_WITH_INPUT"
    assert sigmoid["dtype_configs"][0]["input_dtype"]["scale_exact_match"] == 1 / 256
    assert add_relu["pattern"] == [{"ref": "torch.add"}, "relu"]
    assert add_relu["num_tensor_args_to_observation_type"] == {
        "0": "INPUT_OUTPUT_NOT_OBSERVED",
        "2": "OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT",
    }
    assert add_relu["input_type_to_index"] == {"weight": 1, "bias": 2}
    assert op_add["pattern"] == {"ref": "operator.add"}
    assert pool["pattern"] == {"ref": "torch.nn.functional.max_pool2d"}
    assert "pattern" not in cplx
    assert cplx["pattern_complex_format"] == [
        {"ref": "torch.nn.modules.activation.ReLU"},
        [
            {"ref": "operator.add"},
            [
                {"ref": "torch.nn.modules.batchnorm.BatchNorm2d"},
                {"ref": "torch.nn.modules.conv.Conv2d"},
            ],
            "x",
        ],
    ]
    assert cplx["root_node_getter"] == f"{__name__}.root_getter"


def test_qualified_names():
    assert qualified_name(torch.nn.Conv2d) == "torch.nn.modules.conv.Conv2d"
    assert qualified_name(torch.add) == "torch.add"
    assert qualified_name(operator.add) == "operator.add"
    assert qualified_name(F.relu) == "torch.nn.functional.relu"
    assert qualified_name(lambda x: x) is None


def test_hand_written_json_without_format_header():
    text = json.dumps(
        {
            "name": "hand",
            "configs": [
                {
                    "pattern": [{"ref": "torch.nn.Conv2d"}, {"ref": "torch.nn.ReLU"}],
                    "dtype_configs": [{"input_dtype": "torch.quint8", "weight_dtype": "qint8"}],
                    "fused_module": "torch.ao.nn.intrinsic.ConvReLU2d",
                }
            ],
        }
    )
    config = from_json(text)
    pattern_config = config.configs[0]
    assert pattern_config.pattern == (torch.nn.Conv2d, torch.nn.ReLU)
    assert pattern_config.fused_module is nni.ConvReLU2d
    assert pattern_config.dtype_configs == [
        DTypeConfig(input_dtype=torch.quint8, weight_dtype=torch.qint8)
    ]


def test_non_finite_floats_are_tagged():
    config = BackendConfig("inf").set_backend_pattern_config(
        BackendPatternConfig(torch.nn.ReLU).add_dtype_config(
            DTypeConfig(
                input_dtype=DTypeWithConstraints(
                    dtype=torch.quint8, scale_max_upper_bound=float("inf")
                )
            )
        )
    )
    text = to_json(config)
    assert '{"float": "inf"}' in text.replace("\n", "").replace("  ", "")
    assert "Infinity" not in text
    assert from_json(text) == config


# -- refusals -------------------------------------------------------------------


def _one_pattern(pattern_json, **extra):
    return json.dumps({"name": "x", "configs": [{"pattern": pattern_json, **extra}]})


class ImportRecorder:
    """Records every import, by statement or importlib, from its creation on."""

    def __init__(self, monkeypatch):
        self.names = []
        real_import_module = importlib.import_module
        real_import = builtins.__import__

        def recording_import_module(name, package=None):
            self.names.append(name)
            return real_import_module(name, package)

        def recording_import(name, *args, **kwargs):
            self.names.append(name)
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(importlib, "import_module", recording_import_module)
        monkeypatch.setattr(builtins, "__import__", recording_import)


@pytest.mark.parametrize(
    "name", ["os.system", "subprocess.Popen", "antigravity.geohash", "builtins.eval"]
)
def test_names_outside_the_allowlist_are_refused_without_import(monkeypatch, name):
    top = name.split(".")[0]
    was_loaded = top in sys.modules
    recorder = ImportRecorder(monkeypatch)
    with pytest.raises(ConfigError) as excinfo:
        from_json(_one_pattern({"ref": name}))
    message = str(excinfo.value)
    assert "configs[0].pattern.ref" in message
    assert repr(name) in message
    assert "not in the allow-list" in message
    assert "['operator', 'qcore', 'torch']" in message
    assert recorder.names == []
    assert (top in sys.modules) == was_loaded


def test_reference_fields_are_refused_too(monkeypatch):
    recorder = ImportRecorder(monkeypatch)
    with pytest.raises(ConfigError) as excinfo:
        from_json(_one_pattern("relu", fuser_method="subprocess.Popen"))
    assert "configs[0].fuser_method" in str(excinfo.value)
    assert "'subprocess.Popen'" in str(excinfo.value)
    assert recorder.names == []


@pytest.mark.parametrize(
    "name, words",
    [
        ("torch.os.system", ["reaches module 'os'", "outside the allow-list"]),
        ("torch.nn.modules.module.OrderedDict", ["module 'collections'", "outside"]),
        ("torch.nn", ["a module", "expected a class or function"]),
        ("torchvision.models.resnet18", ["not in the allow-list"]),
        ("torch.no_such_thing_here", ["expected an existing name", "imports nothing"]),
        ("torch.nn.Linear.no_attr", ["has no attribute 'no_attr'"]),
        ("os", ["expected a dotted qualified name"]),
        ("torch..x", ["expected a dotted qualified name"]),
    ],
)
def test_escapes_and_bad_names(name, words):
    with pytest.raises(ConfigError) as excinfo:
        from_json(_one_pattern({"ref": name}))
    for word in words:
        assert word in str(excinfo.value)
    assert "configs[0].pattern.ref" in str(excinfo.value)


def test_resolving_imports_nothing(monkeypatch):
    recorder = ImportRecorder(monkeypatch)
    config = from_json(_one_pattern({"ref": "torch.ao.nn.intrinsic.modules.fused.ConvReLU2d"}))
    assert config.configs[0].pattern is nni.ConvReLU2d
    assert recorder.names == []


def test_a_module_not_yet_imported_is_not_imported_for_a_name(monkeypatch):
    # torch.utils.model_dump is a tool torch itself never imports.
    assert "torch.utils.model_dump" not in sys.modules
    recorder = ImportRecorder(monkeypatch)
    with pytest.raises(ConfigError) as excinfo:
        from_json(_one_pattern({"ref": "torch.utils.model_dump.get_model_info"}))
    message = str(excinfo.value)
    assert "configs[0].pattern.ref" in message
    assert "'torch.utils.model_dump.get_model_info'" in message
    assert "imports nothing" in message
    assert recorder.names == []
    assert "torch.utils.model_dump" not in sys.modules


def test_lambda_is_refused_with_a_clear_error():
    config = BackendConfig("x").set_backend_pattern_config(
        BackendPatternConfig((torch.nn.Linear, torch.nn.ReLU)).set_fuser_method(
            lambda is_qat, linear, relu: nni.LinearReLU(linear, relu)
        )
    )
    with pytest.raises(ConfigError) as excinfo:
        to_json(config)
    message = str(excinfo.value)
    assert "configs[0].fuser_method" in message
    assert "<lambda>" in message
    assert "define it at module level" in message
    assert "allow(obj, name=" in message


def test_local_function_is_refused_and_can_be_registered_by_name():
    def local_getter(pattern):
        return pattern

    config = BackendConfig("x").set_backend_pattern_config(
        BackendPatternConfig(torch.nn.Linear)._set_root_node_getter(local_getter)
    )
    with pytest.raises(ConfigError, match=r"configs\[0\]\.root_node_getter.*local_getter"):
        to_json(config)
    allowlist = Allowlist()
    with pytest.raises(ConfigError, match="pass name="):
        allowlist.allow(local_getter)
    assert allowlist.allow_config(config)[0].startswith("configs[0].root_node_getter")
    allowlist.allow(local_getter, name="my_plugin.getters.local_getter")
    text = to_json(config, allowlist=allowlist)
    assert '"my_plugin.getters.local_getter"' in text
    assert from_json(text, allowlist=allowlist) == config
    # unknown to the default allow-list, and never imported
    with pytest.raises(ConfigError, match="not in the allow-list"):
        from_json(text)


def test_module_level_function_outside_allowlist_is_refused():
    config = BackendConfig("x").set_backend_pattern_config(
        BackendPatternConfig(torch.nn.Linear)._set_root_node_getter(root_getter)
    )
    with pytest.raises(ConfigError) as excinfo:
        to_json(config, allowlist=Allowlist())
    assert "configs[0].root_node_getter" in str(excinfo.value)
    assert f"'{__name__}.root_getter' is outside it" in str(excinfo.value)


def test_allow_module_prefix(monkeypatch):
    allowlist = Allowlist(prefixes=["torch"])
    text = _one_pattern({"ref": "operator.add"})
    with pytest.raises(ConfigError):
        from_json(text, allowlist=allowlist)
    allowlist.allow_module_prefix("operator")
    assert from_json(text, allowlist=allowlist).configs[0].pattern is operator.add
    assert allowlist.is_module_allowed("operator")
    assert not allowlist.is_module_allowed("operatorx")
    with pytest.raises(ConfigError, match="dotted module name"):
        allowlist.allow_module_prefix("bad prefix")


def test_default_allowlist_helpers(monkeypatch):
    monkeypatch.setattr(qjson, "default_allowlist", Allowlist())
    assert qjson.allow(fuse_linear_relu) is fuse_linear_relu
    assert qjson.default_allowlist.name_for(fuse_linear_relu) == f"{__name__}.fuse_linear_relu"
    qjson.allow_module_prefix("qcore_mychip")
    assert qjson.default_allowlist.is_name_allowed("qcore_mychip.fusers.fuse")
    assert qjson.allow_config(full_config()) == []


def test_registering_a_name_twice_for_different_objects_is_an_error():
    allowlist = Allowlist()
    allowlist.allow(fuse_linear_relu, name="p.fuse")
    allowlist.allow(fuse_linear_relu, name="p.fuse")  # idempotent
    with pytest.raises(ConfigError, match="already registered"):
        allowlist.allow(root_getter, name="p.fuse")


# -- malformed documents ------------------------------------------------------------


@pytest.mark.parametrize(
    "document, words",
    [
        ("not json", ["not JSON"]),
        ("[]", ["BackendConfig JSON", "an object"]),
        ('{"name": 1}', ["name", "1 (int)", "a string"]),
        ('{"version": 2}', ["version", "2", "expected 1"]),
        ('{"format": "other"}', ["format", "'other'"]),
        ('{"nme": "x"}', ["'nme'", "expected one of"]),
        (_one_pattern(7), ["configs[0].pattern", "7 (int)", "a method name string"]),
        (_one_pattern({"reff": "torch.add"}), ["configs[0].pattern", "reff"]),
        (
            _one_pattern("relu", observation_type="SHARE"),
            ["configs[0].observation_type", "'SHARE'", "OUTPUT_SHARE_OBSERVER_WITH_INPUT"],
        ),
        (
            _one_pattern("relu", dtype_configs=[{"input_dtype": "quint9"}]),
            ["configs[0].dtype_configs[0].input_dtype", "'quint9'", "a torch dtype name"],
        ),
        (
            _one_pattern("relu", dtype_configs=[{"input_dtype": {"dtype": "quint8", "q": 1}}]),
            ["configs[0].dtype_configs[0].input_dtype", "'q'", "expected one of"],
        ),
        (
            _one_pattern(
                "relu",
                dtype_configs=[{"input_dtype": {"dtype": "quint8", "quant_min_lower_bound": "0"}}],
            ),
            ["dtype_configs[0].input_dtype.quant_min_lower_bound", "'0'", "a number"],
        ),
        (
            _one_pattern(
                "relu",
                dtype_configs=[
                    {
                        "input_dtype": {
                            "dtype": "quint8",
                            "quant_min_lower_bound": 9,
                            "quant_max_upper_bound": 1,
                        }
                    }
                ],
            ),
            ["dtype_configs[0].input_dtype", "quant_min_lower_bound", "9"],
        ),
        (
            _one_pattern("relu", dtype_configs=[{"is_dynamic": 1}]),
            ["dtype_configs[0].is_dynamic", "1 (int)", "true, false or null"],
        ),
        (_one_pattern("relu", dtype_configs={}), ["configs[0].dtype_configs", "an array"]),
        (_one_pattern("relu", root_module=3), ["configs[0].root_module", "3 (int)"]),
        (
            _one_pattern("relu", root_module="torch.add"),
            ["configs[0]", "root_module", "torch.nn.Module subclass"],
        ),
        (
            _one_pattern("relu", num_tensor_args_to_observation_type={"two": "X"}),
            ["num_tensor_args_to_observation_type", "'two'", "integer"],
        ),
        (_one_pattern("relu", extra=1), ["configs[0]", "'extra'", "expected one of"]),
        (
            _one_pattern(["relu", "relu", "relu", "relu"]),
            ["configs[0].pattern: got", "2- or 3-tuple"],
        ),
    ],
)
def test_malformed_documents(document, words):
    with pytest.raises(ConfigError) as excinfo:
        from_json(document)
    for word in words:
        assert word in str(excinfo.value), str(excinfo.value)


def test_duplicate_pattern_in_json():
    text = json.dumps({"configs": [{"pattern": "relu"}, {"pattern": "relu"}]})
    with pytest.raises(DuplicatePatternError, match=r"configs\[1\].*'relu'"):
        from_json(text)


def test_to_json_requires_a_backend_config():
    with pytest.raises(ConfigError, match="expected a BackendConfig"):
        to_json({"name": "x"})
