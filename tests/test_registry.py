"""Unit tests of discovery and the registry, with plugins given in-process.

Real installs are covered by test_installed_plugins.py under tox.
"""

import types
import warnings

import importlib_metadata
import pytest
import torch

import qcore
from qcore import BackendPatternConfig, DTypeConfig, ObservationType, hookimpl
from qcore.config.errors import ConfigError, describe
from qcore.plugin import BackendRegistry, PluginState
from qcore.plugin.discovery import PluginSpec, find_entry_point_plugins
from qcore.plugin.kernels import Kernel

INT8 = DTypeConfig(torch.quint8, torch.quint8, torch.qint8, torch.float)
FP16 = DTypeConfig(torch.float16, torch.float16, torch.float16, torch.float16)
QINT8 = DTypeConfig(torch.qint8, torch.qint8, torch.qint8, torch.float)


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


def test_two_configs_for_one_pattern_from_one_hook_are_refused():
    """They were merged silently: the second's Conv2d root module landed on the
    Linear pattern. torch.ao's BackendConfig refuses a pattern set twice."""
    configs = [linear(INT8), linear(FP16, root_module=torch.nn.Conv2d)]
    bad = spec("bad", "qcore-bad", plugin_module("bad", configs))
    good = spec("good", "qcore-good", plugin_module("good", [linear(INT8)]))
    reg = registry(bad, good)
    with pytest.raises(
        qcore.BackendLoadError,
        match=r"plugin qcore-bad:bad .* raised in qcore_backend_pattern_configs: "
        r"DuplicatePatternError: .* two BackendPatternConfigs for pattern Linear "
        r"\(at index 0 and 1\)",
    ) as error:
        reg.get("bad")
    assert isinstance(error.value.__cause__, qcore.config.errors.DuplicatePatternError)
    assert reg.get("good").config.configs[0].root_module is None


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


@pytest.mark.parametrize("name", [None, 3, ["mychip"]])
def test_a_backend_name_that_is_no_string_is_refused_naming_backend(name):
    """None was an unknown backend, "Did you mean 'onednn'?"; a list raised
    "unhashable type"."""
    reg = registry(spec("mychip", "qcore-mychip", plugin_module("m", [])))
    with pytest.raises(TypeError) as refused:
        reg.get(name)
    assert str(refused.value) == (
        f"backend: got {describe(name)}; expected a backend name (str) such as 'x86' "
        "(installed: mychip, native)"
    )


@pytest.mark.parametrize(
    "function",
    [qcore.get_backend_config, qcore.get_default_qconfig_mapping, qcore.get_backend],
)
def test_the_public_functions_taking_a_backend_name_refuse_none(function):
    with pytest.raises(TypeError, match=r"^backend: got None \(NoneType\); expected a backend"):
        function(None)


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
    # The backend's owner (qcore-x86) comes first, though qcore-a-vendor sorts before it.
    assert [p.spec.distribution for p in backend.plugins] == ["qcore-x86", "qcore-a-vendor"]
    assert config.dtype_configs == [INT8, FP16]
    assert config.root_module is torch.nn.Linear
    assert backend.conflicts == ()


def test_a_vendor_extension_cannot_override_the_owner():
    def fuse(is_qat, conv, relu):
        return torch.nn.Sequential(conv, relu)

    conv_relu = (torch.nn.Conv2d, torch.nn.ReLU)
    vendor_config = BackendPatternConfig(conv_relu).set_fuser_method(fuse)
    vendor = spec("x86", "qcore-aaa", plugin_module("aaa", [vendor_config]))
    owner = spec(
        "x86",
        "qcore-x86",
        plugin_module("x86", [BackendPatternConfig(conv_relu).set_fuser_method(fuse_owner)]),
    )
    backend = registry(vendor, owner).get("x86")
    assert backend.config.configs[0].fuser_method is fuse_owner
    (conflict,) = backend.conflicts
    assert (conflict.kept_source, conflict.ignored_source) == ("qcore-x86:x86", "qcore-aaa:x86")


def fuse_owner(is_qat, conv, relu):
    return torch.ao.nn.intrinsic.ConvReLU2d(conv, relu)


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


def test_native_takes_nothing_from_third_parties_on_first_party_patterns():
    """A third party's dtype config was appended to a pattern first-party backends
    configure: a vendor's quint8 Embedding config made native's float Embedding int8
    (39.35 -> 37.89 dB). Third parties, and extensions of a first-party backend, now
    add nothing to such a pattern (a reported conflict); a pattern only they
    configure still joins the union, and first-party backends unite as before."""
    conv = BackendPatternConfig(torch.nn.Conv2d).set_dtype_configs([INT8])
    owners = [
        spec("fbgemm", "qcore-fbgemm", plugin_module("fbgemm", [linear(FP16)])),
        spec("x86", "qcore-x86", plugin_module("x86", [linear(INT8)])),
    ]
    extension = spec("x86", "qcore-vendor", plugin_module("ext", [linear(QINT8)]))
    vendor = spec(
        "vendor",
        "qcore-vendor",
        plugin_module("vendor", [linear(QINT8, root_module=torch.nn.Linear), conv]),
    )
    alone = registry(*owners).get("native")
    reg = registry(*owners, extension, vendor)
    with pytest.warns(qcore.QCoreWarning, match="first-party backends' values were kept"):
        native = reg.get("native")
    assert reg.get("x86").config.get(torch.nn.Linear).dtype_configs == [INT8, QINT8]
    linear_config = native.config.get(torch.nn.Linear)
    assert linear_config.dtype_configs == alone.config.get(torch.nn.Linear).dtype_configs
    assert linear_config.dtype_configs == [FP16, INT8]
    assert linear_config.root_module is None
    assert native.config.get(torch.nn.Conv2d).dtype_configs == [INT8]  # only the vendor's
    ignored = {(c.field, c.ignored_source) for c in native.conflicts}
    assert ignored == {
        ("dtype_configs", "qcore-vendor:x86"),
        ("dtype_configs", "vendor"),
        ("root_module", "vendor"),
    }
    assert any(
        str(c).startswith("Linear: dtype_configs come from first-party backends only")
        and "(first fbgemm); vendor's DTypeConfig(input_dtype=torch.qint8" in str(c)
        for c in native.conflicts
    )


def test_native_runs_first_party_kernels_alone_on_first_party_patterns():
    """Native's configs were closed to third parties on first-party patterns, its
    kernels not: a vendor's Linear kernel, tried after a first-party one refused an
    op, would lower it in native once the vendor was installed."""

    def kernels(*offered):
        return {"qcore_backend_kernels": lambda backend: list(offered)}

    def kernel(name, pattern):
        return Kernel(name=name, pattern=pattern, engine="fbgemm", lower=lambda match: None)

    first = kernel("x86.linear", torch.nn.Linear)
    owner = spec("x86", "qcore-x86", plugin_module("x86", [linear(INT8)], **kernels(first)))
    vendor_linear, vendor_conv = kernel("v.linear", torch.nn.Linear), kernel("v.conv", "conv")
    vendor = spec(
        "vendor",
        "qcore-vendor",
        plugin_module("vendor", [linear(INT8)], **kernels(vendor_linear, vendor_conv)),
    )
    extension = spec(
        "x86", "qcore-ext", plugin_module("ext", [], **kernels(kernel("e.linear", torch.nn.Linear)))
    )
    reg = registry(owner, vendor, extension)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        native = reg.get("native")
    assert [k.name for k in native.kernels] == ["x86.linear", "v.conv"]
    assert [k.name for k in reg.get("vendor").kernels] == ["v.linear", "v.conv"]


def test_get_backend_config_returns_a_copy():
    qcore.register_plugin(plugin_module("copy", [linear(INT8)]), name="copytest")
    config = qcore.get_backend_config("copytest")
    config.configs[0].add_dtype_config(FP16)
    assert qcore.get_backend_config("copytest").configs[0].dtype_configs == [INT8]


def test_default_qconfig_mapping_first_answer_wins():
    answers = {}

    def mapping(label):
        def hook(backend, is_qat):
            answers[label] = is_qat
            return MAPPINGS[label]

        return hook

    a = spec("x", "qcore-a", plugin_module("a", [], qcore_default_qconfig_mapping=mapping("a")))
    b = spec("x", "qcore-b", plugin_module("b", [], qcore_default_qconfig_mapping=mapping("b")))
    assert registry(b, a).get("x").default_qconfig_mapping(is_qat=True) is MAPPINGS["a"]
    assert answers == {"a": True}


MAPPINGS = {"a": qcore.QConfigMapping(), "b": qcore.QConfigMapping()}


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


# -- issue 14 section 3: plugins are isolated, whatever they do ------------------


class CarelessSDKError(BaseException):
    """Neither an Exception nor SystemExit."""


@pytest.mark.parametrize("raised", [SystemExit(3), CarelessSDKError("sdk"), GeneratorExit()])
def test_any_base_exception_at_import_is_contained(raised):
    good = spec("good", "qcore-good", plugin_module("good", [linear(INT8)]))
    bad = spec("bad", "qcore-bad", error=raised)
    reg = registry(bad, good)
    with pytest.raises(qcore.BackendLoadError, match="qcore-bad:bad") as error:
        reg.get("bad")
    assert error.value.__cause__ is raised
    assert reg.plugins()[0].state is PluginState.FAILED
    with pytest.warns(qcore.QCoreWarning, match="leaves out backends that failed to load: bad"):
        native = reg.get("native")
    assert len(native.config) == 1 and native.left_out[0][0] == "bad"


@pytest.mark.parametrize("raised", [SystemExit(3), CarelessSDKError("sdk")])
def test_any_base_exception_in_a_hook_is_contained(raised):
    bad = spec("bad", "qcore-bad", plugin_module("bad", raises=raised))
    good = spec("good", "qcore-good", plugin_module("good", [linear(INT8)]))
    reg = registry(bad, good)
    with pytest.raises(qcore.BackendLoadError, match="raised in qcore_backend_pattern_configs"):
        reg.get("bad")
    assert len(reg.get("good").config) == 1


def test_keyboard_interrupt_is_not_contained():
    bad = spec("bad", "qcore-bad", plugin_module("bad", raises=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        registry(bad).get("bad")


@pytest.mark.parametrize(
    "configs, text",
    [
        ([BackendPatternConfig().add_dtype_config(INT8)], "without a pattern at index 0"),
        (42, r"returned 42 \(int\); expected a list of BackendPatternConfig or None"),
        ({"Linear": INT8}, r"expected a list of BackendPatternConfig or None"),
    ],
)
def test_an_invalid_contribution_fails_its_plugin_only(configs, text):
    bad = spec("bad", "qcore-bad", plugin_module("bad", configs))
    good = spec("good", "qcore-good", plugin_module("good", [linear(INT8)]))
    reg = registry(bad, good)
    with pytest.warns(qcore.QCoreWarning, match="leaves out backends that failed"):
        native = reg.get("native")  # native survives, without the culprit
    assert [name for name, _ in native.left_out] == ["bad"]
    assert len(native.config) == 1
    with pytest.raises(qcore.BackendLoadError, match="plugin qcore-bad:bad") as error:
        reg.get("bad")
    assert error.match(text)


def test_one_module_serves_two_entry_points():
    seen = []

    def configs():
        seen.append(len(seen))
        return [linear(INT8)]

    module = plugin_module("twin", configs)
    reg = registry(spec("twin-a", "qcore-twin", module), spec("twin-b", "qcore-twin", module))
    assert len(reg.get("twin-a").config) == 1
    assert len(reg.get("twin-b").config) == 1  # was: "Plugin already registered"
    assert seen == [0, 1]


@pytest.mark.parametrize(
    "blocked", ["qcore-evil2", "QCORE_EVIL2", "qcore.evil2", "qcore-evil2:evil", "Evil"]
)
def test_blocked_names_are_pep503_normalized(blocked):
    loaded = []
    evil = spec("evil", "QCore_Evil2", error=AssertionError("imported"))
    object.__setattr__(evil, "_loader", lambda: loaded.append(1))
    reg = registry(evil, environ={"QCORE_BLOCK_PLUGINS": f" other , {blocked}"})
    assert reg.plugins()[0].state is PluginState.BLOCKED
    with pytest.raises(qcore.BackendLoadError, match="blocked by QCORE_BLOCK_PLUGINS"):
        reg.get("evil")
    assert loaded == []


def test_a_plugin_slow_to_import_does_not_block_other_backends():
    import threading
    import time

    release = threading.Event()

    def slow_load():
        release.wait(10)
        return plugin_module("slow", [linear(INT8)])

    slow = PluginSpec("slow", "qcore-slow.plugin", "qcore-slow", "1.0", slow_load)
    fast = spec("fast", "qcore-fast", plugin_module("fast", [linear(INT8)]))
    reg = registry(slow, fast)
    reg.get("fast")
    loader = threading.Thread(target=reg.get, args=("slow",))
    loader.start()
    try:
        time.sleep(0.2)  # the loader is inside the slow import now
        answered = []
        asker = threading.Thread(target=lambda: answered.append(reg.get("fast")))
        asker.start()
        asker.join(2)
        assert answered, "get('fast') waited for another backend's plugin import"
        assert reg.names() == ["fast", "native", "slow"]
    finally:
        release.set()
        loader.join(10)
    assert len(reg.get("slow").config) == 1


def test_two_threads_asking_for_one_backend_load_it_once():
    import threading

    calls = []

    def load():
        calls.append(1)
        return plugin_module("once", [linear(INT8)])

    once = PluginSpec("once", "qcore-once.plugin", "qcore-once", "1.0", load)
    reg = registry(once)
    results = []
    threads = [threading.Thread(target=lambda: results.append(reg.get("once"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert calls == [1] and len({id(backend) for backend in results}) == 1


@pytest.mark.parametrize("answer", ["x86", {"": None}, 42])
def test_a_bad_default_mapping_names_the_plugin(answer):
    module = plugin_module("m", [], qcore_default_qconfig_mapping=lambda backend, is_qat: answer)
    backend = registry(spec("m", "qcore-m", module)).get("m")
    with pytest.raises(qcore.BackendLoadError, match="plugin qcore-m:m") as error:
        backend.default_qconfig_mapping()
    assert error.match(r"qcore_default_qconfig_mapping\(\) returned .*expected a QConfigMapping")


def test_a_bad_quantizer_names_the_plugin():
    module = plugin_module("m", [], qcore_backend_quantizer=lambda backend, is_qat: "x86")
    backend = registry(spec("m", "qcore-m", module)).get("m")
    with pytest.raises(qcore.BackendLoadError, match=r"plugin qcore-m:m.*expected a qcore.Quan"):
        backend.quantizer()


@pytest.mark.parametrize("pattern", [42, (), ("",), (torch.nn.Linear, None), [torch.nn.Linear]])
def test_kernel_pattern_is_validated(pattern):
    with pytest.raises(ConfigError, match=r"Kernel.pattern \(kernel 'k'\): got"):
        qcore.Kernel(name="k", pattern=pattern, engine="x86")


def test_a_kernel_with_a_bad_pattern_fails_its_plugin_by_name():
    def kernels(backend):
        return [qcore.Kernel(name="k", pattern=42, engine="x86")]

    module = plugin_module("m", [linear(INT8)], qcore_backend_kernels=kernels)
    with pytest.raises(qcore.BackendLoadError, match="qcore-m:m.*raised in qcore_backend_kernels"):
        registry(spec("m", "qcore-m", module)).get("m")


def test_the_load_error_says_how_to_block_a_broken_extension():
    owner = spec("x86", "qcore-x86", plugin_module("x86", [linear(INT8)]))
    vendor = spec("x86", "qcore-vendor", plugin_module("v", raises=RuntimeError("SDK")))
    reg = registry(owner, vendor)
    with pytest.raises(qcore.BackendLoadError, match="QCORE_BLOCK_PLUGINS=qcore-vendor:x86"):
        reg.get("x86")
    blocked = registry(owner, vendor, environ={"QCORE_BLOCK_PLUGINS": "qcore-vendor:x86"})
    assert len(blocked.get("x86").config) == 1
