"""Unit tests of discovery and the registry, with plugins given in-process.

Real installs are covered by test_installed_plugins.py under tox.
"""

import types

import importlib_metadata
import pytest
import torch

import qcore
from qcore import BackendPatternConfig, DTypeConfig, ObservationType, hookimpl
from qcore.plugin import BackendRegistry, PluginState
from qcore.plugin.discovery import PluginSpec, find_entry_point_plugins

INT8 = DTypeConfig(torch.quint8, torch.quint8, torch.qint8, torch.float)
FP16 = DTypeConfig(torch.float16, torch.float16, torch.float16, torch.float16)


def plugin_module(name, configs=None, kernels=None, version=1, raises=None, **extra):
    module = types.ModuleType(name)
    if version is not None:
        module.QCORE_PLUGIN_API_VERSION = version

    @hookimpl
    def qcore_backend_pattern_configs(backend):
        if raises:
            raise raises
        return configs() if callable(configs) else configs

    module.qcore_backend_pattern_configs = qcore_backend_pattern_configs
    for hook_name, function in extra.items():
        setattr(module, hook_name, hookimpl(function))
    return module


def spec(backend, distribution, module=None, error=None):
    def load():
        if error is not None:
            raise error
        return module

    return PluginSpec(backend, f"{distribution}.plugin", distribution, "1.0", load)


def linear(*dtype_configs, **fields):
    config = BackendPatternConfig(torch.nn.Linear).set_dtype_configs(list(dtype_configs))
    for name, value in fields.items():
        getattr(config, f"set_{name}")(value)
    return config


def registry(*specs, environ=None):
    return BackendRegistry(find=lambda: list(specs), environ=environ or {})


def test_listing_loads_nothing():
    loaded = []
    plugin = spec("chip", "qcore-chip", plugin_module("chip", [linear(INT8)]))
    original = plugin._loader
    object.__setattr__(plugin, "_loader", lambda: loaded.append(1) or original())
    reg = registry(plugin)
    assert reg.names() == ["chip", "native"]
    assert loaded == [] and reg.plugins()[0].state is PluginState.FOUND
    assert len(reg.get("chip").config) == 1 and loaded == [1]


def test_import_failure_is_isolated_and_keeps_its_cause():
    good = spec("good", "qcore-good", plugin_module("good", [linear(INT8)]))
    bad = spec("bad", "qcore-bad", error=ImportError("no module named vendor_sdk"))
    reg = registry(bad, good)
    with pytest.raises(qcore.BackendLoadError, match="qcore-bad:bad.*vendor_sdk") as error:
        reg.get("bad")
    assert isinstance(error.value.__cause__, ImportError)
    assert reg.get("good").config.configs[0].pattern is torch.nn.Linear
    assert reg.plugins()[0].state is PluginState.FAILED
    with pytest.warns(qcore.QCoreWarning, match="leaves out backends that failed"):
        assert len(reg.get("native").config) == 1


def test_hook_failure_is_isolated():
    bad = spec("bad", "qcore-bad", plugin_module("bad", raises=RuntimeError("SDK missing")))
    good = spec("good", "qcore-good", plugin_module("good", [linear(INT8)]))
    reg = registry(bad, good)
    with pytest.raises(qcore.BackendLoadError, match="raised in qcore_backend_pattern_configs"):
        reg.get("bad")
    assert len(reg.get("good").config) == 1


def test_hook_returning_the_wrong_type_names_the_hook_and_value():
    bad = spec("bad", "qcore-bad", plugin_module("bad", ["not a config"]))
    with pytest.raises(qcore.BackendLoadError, match=r"returned 'not a config' \(str\) at index 0"):
        registry(bad).get("bad")


def test_misspelled_hook_is_a_load_error():
    module = plugin_module("typo", [linear(INT8)], qcore_backend_kernel=lambda backend: [])
    with pytest.raises(qcore.BackendLoadError, match="qcore_backend_kernel"):
        registry(spec("typo", "qcore-typo", module)).get("typo")


@pytest.mark.parametrize(
    "version, text",
    [(2, "written for plugin API 2; this qcore implements plugin API 1"), (None, "declares no")],
)
def test_plugin_api_version_mismatch(version, text):
    old = spec("old", "qcore-old", plugin_module("old", [linear(INT8)], version=version))
    with pytest.raises(qcore.PluginAPIVersionError, match=text) as error:
        registry(old).get("old")
    assert "qcore-old:old" in str(error.value)


def test_unknown_backend_lists_installed_and_suggests():
    reg = registry(spec("mychip", "qcore-mychip", plugin_module("m", [])))
    with pytest.raises(qcore.UnknownBackendError, match="installed backends: mychip, native"):
        reg.get("mychp")
    with pytest.raises(qcore.UnknownBackendError, match="Did you mean 'mychip'"):
        reg.get("mychp")
    with pytest.raises(qcore.UnknownBackendError, match="pip install qcore-qnnpack"):
        reg.get("qnnpack")


def test_environment_controls():
    found = [spec("a", "qcore-a", plugin_module("a", [linear(INT8)]))]
    assert registry(*found, environ={"QCORE_DISABLE_PLUGIN_AUTOLOAD": "1"}).names() == ["native"]
    blocked = registry(*found, environ={"QCORE_BLOCK_PLUGINS": "qcore-a"})
    assert blocked.plugins()[0].state is PluginState.BLOCKED
    with pytest.raises(qcore.BackendLoadError, match="blocked by QCORE_BLOCK_PLUGINS"):
        blocked.get("a")


def test_register_plugin_in_process():
    reg = registry()

    class Notebook:
        @hookimpl
        def qcore_backend_pattern_configs(self, backend):
            return [linear(INT8)]

    reg.register(Notebook(), name="notebook")
    assert reg.names() == ["native", "notebook"]
    assert reg.get("notebook").plugins[0].spec.distribution == "<in-process>"
    with pytest.raises(ValueError, match="name: got 'native'"):
        reg.register(Notebook(), name="native")


def test_several_plugins_serving_one_backend_are_united():
    first = spec("x86", "qcore-a-vendor", plugin_module("a", [linear(FP16)]))
    second = spec(
        "x86", "qcore-x86", plugin_module("b", [linear(INT8, root_module=torch.nn.Linear)])
    )
    backend = registry(second, first).get("x86")
    (config,) = backend.config.configs
    assert config.dtype_configs == [FP16, INT8]
    assert config.root_module is torch.nn.Linear  # unset in the first source: filled in
    assert backend.conflicts == ()


def test_native_union_and_conflict_rule():
    share = ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
    a = spec("a", "qcore-a", plugin_module("a", [linear(INT8)]))
    b = spec("b", "qcore-b", plugin_module("b", [linear(FP16, observation_type=share)]))
    reg = registry(b, a)
    with pytest.warns(qcore.QCoreWarning, match="1 pattern field"):
        native = reg.get("native")
    (config,) = native.config.configs
    assert config.dtype_configs == [INT8, FP16]
    assert config.observation_type is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    (conflict,) = native.conflicts
    assert (conflict.field, conflict.kept_source, conflict.ignored_source) == (
        "observation_type",
        "a",
        "b",
    )
    assert "Linear: observation_type" in str(conflict)
    # The plugins' own objects are untouched.
    assert reg.get("a").config.configs[0].dtype_configs == [INT8]


def test_get_backend_config_returns_a_copy():
    qcore.register_plugin(plugin_module("copy", [linear(INT8)]), name="copytest")
    config = qcore.get_backend_config("copytest")
    config.configs[0].add_dtype_config(FP16)
    assert qcore.get_backend_config("copytest").configs[0].dtype_configs == [INT8]


def test_default_qconfig_mapping_first_answer_wins():
    def mapping(answer):
        return lambda backend, is_qat: (answer, is_qat)

    a = spec("x", "qcore-a", plugin_module("a", [], qcore_default_qconfig_mapping=mapping("a")))
    b = spec("x", "qcore-b", plugin_module("b", [], qcore_default_qconfig_mapping=mapping("b")))
    assert registry(b, a).get("x").default_qconfig_mapping(is_qat=True) == ("a", True)


class FakeDist:
    def __init__(self, name):
        self.name, self.version = name, "2.0"


def test_entry_points_are_sorted_and_deduplicated(monkeypatch):
    def entry_point(name, value, dist):
        ep = importlib_metadata.EntryPoint(name=name, value=value, group="qcore.backends")
        return ep._for(FakeDist(dist))

    found = [
        entry_point("x86", "zz.plugin", "qcore-zz"),
        entry_point("fbgemm", "qcore_fbgemm.plugin", "qcore-fbgemm"),
        entry_point("x86", "qcore_x86.plugin", "qcore-x86"),
        entry_point("x86", "qcore_x86.plugin", "qcore-x86"),  # same dist twice on sys.path
    ]
    monkeypatch.setattr(importlib_metadata, "entry_points", lambda group: found)
    names = [(s.backend, s.distribution) for s in find_entry_point_plugins()]
    assert names == [("fbgemm", "qcore-fbgemm"), ("x86", "qcore-x86"), ("x86", "qcore-zz")]
