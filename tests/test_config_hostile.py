"""Config files are data, never code (issue 14, section 2).

A BackendConfig document may come from anywhere. Reading one must never import
a module (importing runs code: ``qcore.__main__`` runs the CLI on the host's
argv and exits), never let an exception other than ConfigError escape, and never
accept nonsense. Each ConfigError names the field's path in the document, the
value and what was expected.

The hand-written cases below are the ones our QA reproduced; the fuzz tests
(hypothesis, derandomized and bounded so they run in every tox env) try
thousands of documents: valid ones mutated one to three times, arbitrary JSON
values, and arbitrary text.

The engine *calls* what a callable field (``fuser_method``, the getters)
names, so a document that reads must never hold a function of torch, qcore or
the standard library there other than the fusers and getters: every document
read here is checked for that, and every name the fuzz draws from (the
functions and classes of the modules in ENUMERATED_MODULES) is tried there.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import re
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.ao.quantization.backend_config.onednn
import torch.ao.quantization.fuser_method_mappings
import torch.hub
import torch.jit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qcore.cli
import qcore.config.fusers  # noqa: F401  (its fusers are names the fuzz refers to)
import qcore.config.onednn_fusions
import qcore.serialization  # noqa: F401  (qcore.serialization.load is a hostile name)
from qcore import (
    BackendConfig,
    BackendPatternConfig,
    ConfigError,
    DTypeWithConstraints,
    ObservationType,
)
from qcore.config.json import Allowlist, from_json, to_json

# Each document must be read well within this; a hang is a failure, not a stuck CI.
SECONDS_PER_DOCUMENT = 2.0

# The first field name in every from_json error message (its path in the document).
TOP_LEVEL_FIELD = re.compile(r"(BackendConfig JSON|format|version|name|configs)\b")


class Hang(BaseException):
    """A document took longer than SECONDS_PER_DOCUMENT to read (a BaseException,
    so that no ``except Exception`` on the way swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` where a timer signal can (POSIX, main
    thread); elsewhere the elapsed time is still checked afterwards."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if usable:

        def interrupt(signum: int, frame: types.FrameType | None) -> None:
            raise Hang(f"still reading after {seconds} s")

        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.perf_counter()
    try:
        yield
    finally:
        if usable:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    if elapsed > seconds:
        raise Hang(f"took {elapsed:.2f} s")


# The modules whose functions a callable field may name by default, written out
# here (json.py's DEFAULT_CALLABLE_MODULES): the test is the oracle, not the code.
FUSER_MODULES = {
    "qcore.config.fusers",
    "qcore.config.onednn_fusions",
    "torch.ao.quantization.fuser_method_mappings",
    "torch.ao.quantization.backend_config.onednn",
}
# JSON key -> BackendPatternConfig attribute, for the fields the engine calls.
CALLABLE_FIELDS = {
    "fuser_method": "fuser_method",
    "root_node_getter": "_root_node_getter",
    "extra_inputs_getter": "_extra_inputs_getter",
}


def is_fuser(obj: Any) -> bool:
    """A function (not a class or builtin) defined in one of FUSER_MODULES."""
    return type(obj) is types.FunctionType and obj.__module__ in FUSER_MODULES


def check_callables(config: BackendConfig) -> None:
    """Nothing but a fuser or getter sits where the engine calls it."""
    for index, pattern_config in enumerate(config.configs):
        for key, attribute in CALLABLE_FIELDS.items():
            obj = getattr(pattern_config, attribute)
            assert obj is None or is_fuser(obj), f"configs[{index}].{key} holds {obj!r}"


def read_hostile(text: Any, allowlist: Allowlist | None = None) -> ConfigError | None:
    """Read ``text`` and check the promises; the ConfigError, if any."""
    before = set(sys.modules)
    error: ConfigError | None = None
    try:
        with time_limit(SECONDS_PER_DOCUMENT):
            config = from_json(text, allowlist=allowlist)
        if allowlist is None:  # the default allow-list: no test registered a callable
            check_callables(config)
    except ConfigError as config_error:
        error = config_error
    except BaseException as escaped:  # SystemExit from a script module included
        pytest.fail(
            f"{type(escaped).__name__} escaped from_json: {escaped!s:.300} "
            f"(document {str(text)[:300]!r})"
        )
    imported = sorted(set(sys.modules) - before)
    assert not imported, f"reading {str(text)[:300]!r} imported {imported[:10]}"
    if error is not None:
        message = str(error)
        assert TOP_LEVEL_FIELD.match(message), f"no field path at the start of {message!r}"
        assert "got" in message and "expected" in message, message
    return error


def one_config(**fields: Any) -> str:
    config = {"pattern": {"ref": "torch.nn.modules.linear.Linear"}}
    config.update(fields)
    return json.dumps({"configs": [config]})


def input_dtype(**constrained: Any) -> str:
    return one_config(dtype_configs=[{"input_dtype": {"dtype": "quint8", **constrained}}])


def ref(name: str) -> str:
    return one_config(pattern={"ref": name})


# -- the cases QA reproduced, and their neighbours ------------------------------

# (id, document, words the message must contain)
HOSTILE_CASES: list[tuple[str, Any, list[str]]] = [
    # refs that ran code: imports of script modules, of modules with newer
    # syntax, torch's lazy __getattr__, torch.classes' raising __getattr__
    ("qcore.__main__", ref("qcore.__main__.x"), ["configs[0].pattern.ref", "script module"]),
    (
        "qcore.__main__ as a fuser",
        one_config(fuser_method="qcore.__main__.main"),
        ["configs[0].fuser_method", "'qcore.__main__.main'", "script module"],
    ),
    (
        "torch.utils.model_dump.__main__",
        ref("torch.utils.model_dump.__main__"),
        ["'torch.utils.model_dump.__main__'", "script module"],
    ),
    ("__main__ itself", ref("__main__.x"), ["'__main__.x'", "script module"]),
    (
        "torch.classes",
        ref("torch.classes.x.y"),
        ["configs[0].pattern.ref", "'torch.classes.x.y'", "no attribute 'x'"],
    ),
    (
        "newer syntax",
        ref("torch.testing._internal.py312_intrinsics.x"),
        ["'torch.testing._internal.py312_intrinsics.x'", "imports nothing"],
    ),
    ("torch lazy submodule", ref("torch._dynamo.optimize"), ["no attribute '_dynamo'"]),
    (
        "dtype through torch.__getattr__",
        one_config(dtype_configs=[{"input_dtype": "_dynamo"}]),
        ["configs[0].dtype_configs[0].input_dtype", "'_dynamo'", "a torch dtype name"],
    ),
    (
        "not yet imported",
        ref("torch.utils.model_dump.get_model_info"),
        ["expected an existing name", "imports nothing"],
    ),
    # objects reached around the owner check
    (
        "__subclasses__",
        ref("torch.nn.Module.__base__.__subclasses__"),
        ["'torch.nn.Module.__base__.__subclasses__'", "dunder"],
    ),
    ("__globals__", ref("torch.nn.functional.relu.__globals__"), ["dunder"]),
    ("__builtins__", ref("torch.nn.functional.__builtins__"), ["dunder"]),
    (
        "no __module__",
        ref("torch.fx.graph._torch_but_not_dynamo"),
        ["'torch.fx.graph._torch_but_not_dynamo'", "no module of its own"],
    ),
    ("through a function", ref("torch.nn.functional.relu.x"), ["modules and classes"]),
    ("not a class or function", ref("torch.ops.aten.add"), ["expected a class or function"]),
    ("re-exported module", ref("torch.serialization.pickle.loads"), ["module 'pickle'"]),
    (
        "re-exported class",
        ref("torch.nn.modules.module.OrderedDict"),
        ["module 'collections'"],
    ),
    # exceptions that escaped
    (
        "10**400 bound",
        input_dtype(quant_min_lower_bound=10**400),
        ["dtype_configs[0].input_dtype.quant_min_lower_bound", "401 digits", "range [0, 255]"],
    ),
    (
        "-10**400 scale",
        input_dtype(scale_max_upper_bound=-(10**400)),
        ["input_dtype.scale_max_upper_bound", "401 digits", "scale"],
    ),
    ("1e400 bound", input_dtype(scale_exact_match=1e400), ["scale_exact_match", "finite"]),
    (
        "5000-digit integer",
        input_dtype(quant_min_lower_bound=0).replace(": 0", ": " + "9" * 5000),
        ["BackendConfig JSON", "not JSON"],
    ),
    ("deep arrays", "[" * 100000, ["BackendConfig JSON", "nested"]),
    ("deep objects", '{"configs": ' + '{"a": ' * 100000, ["nested"]),
    (
        "deep but well formed",
        one_config(pattern=json.loads("[" * 200 + '"relu"' + "]" * 200)),
        ["configs[0].pattern", "nested"],
    ),
    (
        "superscript key",
        one_config(num_tensor_args_to_observation_type={"²": "INPUT_OUTPUT_NOT_OBSERVED"}),
        ["num_tensor_args_to_observation_type", "'²'", "ASCII digits"],
    ),
    (
        "Arabic-Indic digit key",
        one_config(num_tensor_args_to_observation_type={"٣": "INPUT_OUTPUT_NOT_OBSERVED"}),
        ["num_tensor_args_to_observation_type", "'٣'", "ASCII digits"],
    ),
    (
        "leading zero key",
        one_config(num_tensor_args_to_observation_type={"02": "INPUT_OUTPUT_NOT_OBSERVED"}),
        ["'02'", "ASCII digits"],
    ),
    (
        "huge key",
        one_config(num_tensor_args_to_observation_type={"9" * 5000: "INPUT_OUTPUT_NOT_OBSERVED"}),
        ["num_tensor_args_to_observation_type", "ASCII digits"],
    ),
    (
        "NaN literal",
        input_dtype(scale_exact_match=math.nan),
        ["input_dtype.scale_exact_match", "nan", "a finite number"],
    ),
    (
        "Infinity literal",
        input_dtype(quant_max_upper_bound=math.inf),
        ["input_dtype.quant_max_upper_bound", "inf", "a finite number"],
    ),
    ("NaN as a name", json.dumps({"name": math.nan}), ["name", "nan", "a string"]),
    ("bytes not UTF-8", b'{"name": "\xff"}', ["BackendConfig JSON", "not UTF-8"]),
    # json.loads would import the UTF-16 codec's module to read these
    ("UTF-16 bytes", '{"name": "x"}'.encode("utf-16-be"), ["BackendConfig JSON", "not JSON"]),
    ("not text at all", 42, ["BackendConfig JSON", "not JSON"]),
    # nonsense that was accepted
    (
        "quint8 bounds -500..-100",
        input_dtype(quant_min_lower_bound=-500, quant_max_upper_bound=-100),
        ["input_dtype.quant_min_lower_bound", "-500", "torch.quint8's range [0, 255]"],
    ),
    (
        "qint8 bound 128",
        one_config(
            dtype_configs=[{"weight_dtype": {"dtype": "qint8", "quant_max_upper_bound": 128}}]
        ),
        ["weight_dtype.quant_max_upper_bound", "128", "[-128, 127]"],
    ),
    (
        "quint4x2 bound 16",
        one_config(
            dtype_configs=[{"weight_dtype": {"dtype": "quint4x2", "quant_max_upper_bound": 16}}]
        ),
        ["quant_max_upper_bound", "16", "[0, 15]"],
    ),
    (
        "min > max",
        input_dtype(quant_min_lower_bound=200, quant_max_upper_bound=100),
        ["input_dtype.quant_min_lower_bound", "200", "quant_max_upper_bound=100"],
    ),
    (
        "fractional bound",
        input_dtype(quant_min_lower_bound=0.5),
        ["quant_min_lower_bound", "0.5", "whole number"],
    ),
    (
        "zero point 1.5",
        input_dtype(zero_point_exact_match=1.5),
        ["input_dtype.zero_point_exact_match", "1.5", "an int zero point"],
    ),
    (
        "zero point out of range",
        input_dtype(zero_point_exact_match=256),
        ["zero_point_exact_match", "256", "[0, 255]"],
    ),
    (
        "zero point outside the bounds",
        input_dtype(quant_min_lower_bound=0, quant_max_upper_bound=127, zero_point_exact_match=128),
        ["zero_point_exact_match", "128", "quant_max_upper_bound=127"],
    ),
    (
        "infinite fixed scale",
        input_dtype(scale_exact_match={"float": "inf"}),
        ["input_dtype.scale_exact_match", "inf", "a finite scale"],
    ),
    (
        "infinite lower scale bound",
        input_dtype(scale_min_lower_bound={"float": "inf"}),
        ["scale_min_lower_bound", "a finite scale"],
    ),
    (
        "zero scale",
        input_dtype(scale_exact_match=0),
        ["scale_exact_match", "greater than 0"],
    ),
    (
        "fixed scale outside the bounds",
        input_dtype(scale_min_lower_bound=0.5, scale_exact_match=0.25),
        ["scale_exact_match", "0.25", "scale_min_lower_bound=0.5"],
    ),
    ("empty pattern", one_config(pattern=""), ["configs[0].pattern", "''", "method name"]),
    ("empty array", one_config(pattern=[]), ["configs[0].pattern", "()"]),
    (
        "empty method name in a tuple",
        one_config(pattern=["relu", ""]),
        ["configs[0].pattern[1]", "''", "method name"],
    ),
    (
        "not an identifier",
        one_config(pattern_complex_format=["relu", "a b"]),
        ["configs[0].pattern_complex_format[1]", "'a b'"],
    ),
    ("no pattern", json.dumps({"configs": [{}]}), ["configs[0]", "no pattern"]),
    ('"version": true', json.dumps({"version": True}), ["version", "True (bool)", "expected 1"]),
    ('"version": 1.0', json.dumps({"version": 1.0}), ["version", "1.0 (float)", "expected 1"]),
    (
        "index as bool",
        one_config(input_type_to_index={"weight": True}),
        ["configs[0].input_type_to_index['weight']", "True"],
    ),
    (
        "reference module key",
        one_config(reference_quantized_module_for_root="torch.add"),
        ["configs[0].reference_quantized_module_for_root:", "torch.nn.Module subclass"],
    ),
]


@pytest.mark.parametrize(
    "document, words", [case[1:] for case in HOSTILE_CASES], ids=[case[0] for case in HOSTILE_CASES]
)
def test_hostile_documents_are_refused_by_field(document, words):
    if isinstance(document, str) and "torch._dynamo" in document and "torch._dynamo" in sys.modules:
        # An earlier test (any prepare_fx) imported it: the name then resolves
        # without importing anything, and there is no lazy load left to refuse.
        pytest.skip("torch._dynamo is already imported in this session")
    error = read_hostile(document)
    assert error is not None, "accepted"
    for word in words:
        assert word in str(error), str(error)


def test_script_modules_are_never_allowed():
    allowlist = Allowlist()
    for prefix in ("__main__", "qcore.__main__", "torch.utils.model_dump.__main__"):
        with pytest.raises(ConfigError, match="script module"):
            allowlist.allow_module_prefix(prefix)
        assert not allowlist.is_module_allowed(prefix)
        assert not allowlist.is_name_allowed(prefix + ".x")


def test_a_script_module_already_loaded_is_still_refused(monkeypatch):
    # Under `python -m qcore`, qcore/__main__.py is loaded; a name into it is still
    # refused, whatever sys.modules holds.
    script = types.ModuleType("qcore.__main__")
    script.main = lambda: 0
    monkeypatch.setitem(sys.modules, "qcore.__main__", script)
    error = read_hostile(one_config(fuser_method="qcore.__main__.main"))
    assert error is not None and "script module" in str(error)


def test_a_module_registered_under_another_name_is_checked_by_its_own(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.my_alias", sys.modules["os"])
    error = read_hostile(ref("torch.my_alias.system"))
    assert error is not None and "(named 'os')" in str(error)


def test_a_lazy_module_is_not_loaded_by_a_name(monkeypatch):
    import importlib.util

    spec = importlib.util.find_spec("torch.utils.model_dump")
    assert spec is not None and spec.loader is not None
    lazy = importlib.util.module_from_spec(spec)
    importlib.util.LazyLoader(spec.loader).exec_module(lazy)
    # Accessing any attribute of a lazy module runs its code; a name must not.
    monkeypatch.setitem(sys.modules, "torch.utils.model_dump", lazy)
    error = read_hostile(ref("torch.utils.model_dump.get_model_info"))
    assert error is not None and "no attribute 'get_model_info'" in str(error)
    assert type(lazy).__name__ == "_LazyModule", "the module was loaded"


def test_registered_objects_still_resolve_by_name():
    allowlist = Allowlist()
    allowlist.allow(time.perf_counter, name="my_plugin.clock")
    config = from_json(one_config(root_node_getter="my_plugin.clock"), allowlist=allowlist)
    assert config.configs[0]._root_node_getter is time.perf_counter


def test_static_methods_resolve_and_other_class_attributes_do_not(monkeypatch):
    class Holder:
        @staticmethod
        def fuse(is_qat: bool, *modules: Any) -> Any:
            return modules[0]

    module = types.ModuleType("qcore_hostile_probe")
    module.Holder = Holder
    Holder.__module__ = module.__name__
    Holder.fuse.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    text = one_config(fuser_method="qcore_hostile_probe.Holder.fuse")
    # A prefix admits the name in patterns, not where the engine calls it...
    error = read_hostile(text, Allowlist(["torch", "qcore_hostile_probe"]))
    assert error is not None and "callable modules" in str(error)
    # ...a callable module does.
    allowlist = Allowlist(["torch"], callable_modules=["qcore_hostile_probe"])
    assert from_json(text, allowlist=allowlist).configs[0].fuser_method is Holder.fuse
    error = read_hostile(one_config(fuser_method="qcore_hostile_probe.Holder.mro"), allowlist)
    assert error is not None and "expected a class or function" in str(error)


# -- callable fields: config files are data, never code ----------------------------

# Names the prefixes admit (torch, qcore, operator) of code that must never be
# called as a fuser or getter, and names outside them.
HOSTILE_CALLABLES = [
    "torch.load",
    "torch.hub.load",
    "qcore.cli.main",
    "builtins.exec",
    "torch.add",  # a torch function
    "torch.save",
    "torch.manual_seed",
    "torch.jit.load",
    "torch.nn.functional.relu",
    "operator.call",  # calls its argument
    "qcore.serialization.load",
    "qcore.config.json.allow_module_prefix",
    "qcore.plugin.register_plugin",
    "torch.nn.modules.container.Sequential",  # a class: calling it instantiates it
    "qcore.config.fusers.FusionError",  # a class, in a callable module
    "qcore.config.fusers.nni.ConvReLU2d",  # through a callable module to a class
    # imported into a callable module, defined elsewhere
    "torch.ao.quantization.fuser_method_mappings.get_combined_dict",
    "qcore.config.fusers.fuse_conv_bn_eval",
]
# What the shipped configs and torch.ao's own use.
LEGIT_CALLABLES = [
    "qcore.config.fusers.fuse_linear_relu",
    "qcore.config.fusers.fuse_conv2d_relu",  # a closure made by sequential_fuser
    "qcore.config.fusers.fuse_conv_bn",
    "qcore.config.onednn_fusions.fuse_conv_add",
    "qcore.config.onednn_fusions.conv_add_left_root",
    "qcore.config.onednn_fusions.conv_add_right_extra_inputs",
    "torch.ao.quantization.fuser_method_mappings.fuse_conv_bn",
    "torch.ao.quantization.backend_config.onednn._conv_add_root_node_getter_left",
    "torch.ao.quantization.backend_config.onednn._conv_add_extra_inputs_getter_left",
]


@pytest.mark.parametrize("name", HOSTILE_CALLABLES)
@pytest.mark.parametrize("field", list(CALLABLE_FIELDS))
def test_callable_fields_refuse_code_that_is_not_a_fuser(field, name):
    error = read_hostile(one_config(**{field: name}))
    assert error is not None, f"{field}={name!r} was read: the engine would call it"
    message = str(error)
    assert message.startswith(f"configs[0].{field}: got {name!r}"), message
    assert "callable modules" in message or "not in the allow-list" in message, message


@pytest.mark.parametrize("name", LEGIT_CALLABLES)
@pytest.mark.parametrize("field", list(CALLABLE_FIELDS))
def test_callable_fields_accept_fusers_and_getters(field, name):
    assert read_hostile(one_config(**{field: name})) is None


def test_a_refusal_says_what_a_callable_field_takes():
    message = str(read_hostile(one_config(fuser_method="torch.load")))
    for words in [
        "configs[0].fuser_method: got 'torch.load', which is function torch.serialization.load",
        "expected a fuser or getter function defined in one of the callable modules",
        "'qcore.config.fusers'",
        "registered with qcore.config.json.allow(fn)",
    ]:
        assert words in message, message


def test_qcore_fusers_are_read_in_a_fresh_process():
    # The reader imports qcore's callable modules itself: no backend need load first.
    import subprocess

    code = (
        "import json\n"
        "from qcore.config.json import from_json\n"
        "config = {'pattern': 'relu', 'fuser_method': 'qcore.config.fusers.fuse_linear_relu',\n"
        "          'root_node_getter': 'qcore.config.onednn_fusions.conv_add_left_root'}\n"
        "from_json(json.dumps({'configs': [config]}))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def vendor_op(x: Any) -> Any:
    """A function a vendor's pattern matches (never meant to be called by a config)."""
    return x


def vendor_fuse(is_qat: bool, op: Any, relu: Any) -> Any:
    return torch.nn.Sequential(op, relu)


def test_allow_config_registers_each_object_for_the_kind_of_field_it_fills():
    # What the registry does with a loaded plugin's config.
    config = BackendConfig("vendor").set_backend_pattern_config(
        BackendPatternConfig((vendor_op, torch.nn.ReLU)).set_fuser_method(vendor_fuse)
    )
    allowlist = Allowlist(["torch"])
    assert allowlist.allow_config(config) == []
    assert from_json(to_json(config, allowlist=allowlist), allowlist=allowlist) == config
    # the pattern's function is not thereby callable...
    error = read_hostile(one_config(fuser_method=f"{__name__}.vendor_op"), allowlist)
    assert error is not None and "callable modules" in str(error)
    # ...and a function some plugin uses as its fuser is (the plugin vouched for it).
    text = one_config(root_node_getter=f"{__name__}.vendor_fuse")
    assert from_json(text, allowlist=allowlist).configs[0]._root_node_getter is vendor_fuse
    torch_fuser = BackendConfig("odd").set_backend_pattern_config(
        BackendPatternConfig(torch.nn.Linear).set_fuser_method(torch.add)
    )
    assert allowlist.allow_config(torch_fuser) == []
    assert from_json(one_config(fuser_method="torch.add"), allowlist=allowlist)
    assert read_hostile(one_config(fuser_method="torch.add")) is not None


def test_to_json_refuses_what_from_json_would():
    config = BackendConfig("odd").set_backend_pattern_config(
        BackendPatternConfig(torch.nn.Linear).set_fuser_method(torch.load)
    )
    with pytest.raises(ConfigError) as excinfo:
        to_json(config, allowlist=Allowlist())
    message = str(excinfo.value)
    assert message.startswith("configs[0].fuser_method: got function torch.serialization.load")
    assert "callable modules" in message and "registered with" in message


def test_from_dict_takes_no_names_for_callable_fields():
    for key in CALLABLE_FIELDS:
        with pytest.raises(ConfigError) as excinfo:
            BackendConfig.from_dict({"configs": [{"pattern": "relu", key: "torch.load"}]})
        message = str(excinfo.value)
        assert f"BackendConfig.configs[0].{key}: got 'torch.load'" in message, message
        assert "a callable or None" in message


@pytest.mark.parametrize(
    "field, name, words",
    [
        ("qat_module", "torch.nn.modules.linear.Linear", ["from_float classmethod", "QAT module"]),
        ("qat_module", "torch.load", ["torch.nn.Module subclass"]),
        ("qat_module", "torch.nn.modules.container.Sequential", ["from_float classmethod"]),
        (
            "reference_quantized_module_for_root",
            "torch.nn.modules.container.Sequential",
            ["from_float classmethod", "reference quantized module"],
        ),
        ("reference_quantized_module_for_root", "torch.hub.load", ["torch.nn.Module subclass"]),
        ("root_module", "torch.hub.load", ["torch.nn.Module subclass"]),
        ("fused_module", "qcore.cli.main", ["torch.nn.Module subclass"]),
    ],
)
def test_module_fields_take_module_classes_of_their_kind(field, name, words):
    error = read_hostile(one_config(**{field: name}))
    assert error is not None
    assert str(error).startswith(f"configs[0].{field}: got "), str(error)
    for word in words:
        assert word in str(error), str(error)


def test_qat_and_reference_modules_of_torch_ao_are_read():
    config = from_json(
        one_config(
            qat_module="torch.ao.nn.qat.modules.linear.Linear",
            reference_quantized_module_for_root="torch.ao.nn.quantized.reference.modules.linear.Linear",
        )
    ).configs[0]
    assert config.qat_module is torch.ao.nn.qat.Linear
    assert config.reference_quantized_module is torch.ao.nn.quantized.reference.Linear
    with pytest.raises(ConfigError, match="from_float classmethod"):
        BackendPatternConfig(torch.nn.Linear).set_qat_module(torch.nn.Linear)


FIRST_PARTY = ("fbgemm", "qnnpack", "x86", "onednn", "native")


def installed_backends() -> list[str]:
    """The backends that load here (tox's thirdparty environment installs broken
    ones on purpose)."""
    from backends import installed

    from qcore.plugin import list_backends

    return [name for name in list_backends() if installed(name)]


def _only_first_party_installed() -> bool:
    from qcore.plugin import list_backends

    return set(list_backends()) <= set(FIRST_PARTY)


@pytest.mark.parametrize("backend", installed_backends())
def test_every_installed_config_round_trips(backend):
    """Shipped configs still read back; qcore's own without any registration
    (their fusers and getters live in the callable modules)."""
    from qcore.plugin import get_backend

    config = get_backend(backend).config
    # native unites every installed backend: a vendor's objects make it third-party
    first_party = backend in FIRST_PARTY and (backend != "native" or _only_first_party_installed())
    allowlist = Allowlist() if first_party else None
    text = to_json(config, allowlist=allowlist)
    again = from_json(text, allowlist=allowlist)
    assert again == config
    if first_party:
        check_callables(again)


# -- the same rules through the Python API and from_dict ---------------------------


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(dtype=torch.quint8, quant_min_lower_bound=-500), ["-500", "[0, 255]"]),
        (dict(dtype=torch.qint8, quant_max_upper_bound=10**400), ["401 digits", "[-128, 127]"]),
        (dict(quant_max_upper_bound=10**400), ["401 digits", "int64/uint64"]),
        (dict(dtype=torch.quint8, zero_point_exact_match=1.5), ["1.5", "an int zero point"]),
        (dict(dtype=torch.quint8, zero_point_exact_match=True), ["True", "an int, a float"]),
        (dict(scale_exact_match=math.inf), ["scale_exact_match", "a finite scale"]),
        (dict(scale_min_lower_bound=10**400), ["scale_min_lower_bound", "a finite scale"]),
        (dict(scale_max_upper_bound=math.nan), ["scale_max_upper_bound", "an int, a float"]),
        (dict(dtype=torch.uint4, quant_max_upper_bound=16), ["16", "[0, 15]"]),
        (dict(dtype=torch.int4, quant_min_lower_bound=-9), ["-9", "[-8, 7]"]),
        (dict(dtype=torch.float8_e4m3fn, quant_max_upper_bound=449), ["449", "448"]),
    ],
)
def test_constraints_are_checked_on_construction(fields, words):
    with pytest.raises(ConfigError) as excinfo:
        DTypeWithConstraints(**fields)
    for word in ["DTypeWithConstraints.", "got", "expected", *words]:
        assert word in str(excinfo.value), str(excinfo.value)


def test_sensible_constraints_still_construct():
    assert DTypeWithConstraints(dtype=torch.bool, quant_min_lower_bound=0).dtype is torch.bool
    assert DTypeWithConstraints(dtype=torch.qint8, quant_min_lower_bound=-127.0)
    assert DTypeWithConstraints(dtype=torch.quint8, scale_max_upper_bound=math.inf)
    assert DTypeWithConstraints(dtype=torch.float8_e4m3fn, quant_min_lower_bound=-448.0)
    assert DTypeWithConstraints(
        dtype=torch.quint8,
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_exact_match=2 / 256,
        zero_point_exact_match=128,
    )


def test_from_dict_failures_are_config_errors_with_a_path():
    too_deep: Any = "relu"
    for _ in range(5000):
        too_deep = (too_deep, "relu")
    cases = [
        ({1: 2, "x": 3}, ["BackendConfig", "expected one of the keys"]),
        ({"configs": [{1: 2, "x": 3}]}, ["BackendConfig.configs[0]", "one of the keys"]),
        (
            {"configs": [{"pattern": "relu", "dtype_configs": [{1: 2, "x": 3}]}]},
            ["BackendConfig.configs[0].dtype_configs[0]", "one of the keys"],
        ),
        (
            {"configs": [{"pattern_complex_format": too_deep}]},
            ["BackendConfig.configs[0].pattern_complex_format", "nested at most 32"],
        ),
        ({"configs": [{"pattern": ""}]}, ["BackendConfig.configs[0].pattern", "''"]),
        (
            {"configs": [{"pattern": "relu", "num_tensor_args_to_observation_type": {-1: None}}]},
            ["BackendConfig.configs[0].num_tensor_args_to_observation_type key", "-1"],
        ),
        (
            {"configs": [{"pattern": "relu"}, {"pattern": "relu"}]},
            ["BackendConfig.configs[1]", "already configured"],
        ),
        ({"configs": [{}]}, ["BackendConfig.configs[0].pattern", "got None"]),
    ]
    for document, words in cases:
        with pytest.raises(ConfigError) as excinfo:
            BackendConfig.from_dict(document)
        for word in ["got", "expected", *words]:
            assert word in str(excinfo.value), str(excinfo.value)


def test_plugin_api_version_must_be_an_int_not_a_bool():
    # True == 1, so a plugin declaring True passed as plugin API 1.
    from qcore.plugin import BackendRegistry, PluginAPIVersionError
    from qcore.plugin.discovery import PluginSpec

    def plugin(version: Any) -> PluginSpec:
        module = types.ModuleType(f"version_{version!r}")
        module.QCORE_PLUGIN_API_VERSION = version
        return PluginSpec("chip", "qcore-chip.plugin", "qcore-chip", "1.0", lambda: module)

    for version in (True, 1.0):
        registry = BackendRegistry(find=lambda version=version: [plugin(version)], environ={})
        with pytest.raises(PluginAPIVersionError, match="QCORE_PLUGIN_API_VERSION = .*not an int"):
            registry.get("chip")
    registry = BackendRegistry(find=lambda: [plugin(1)], environ={})
    assert len(registry.get("chip").config) == 0


# -- fuzz ---------------------------------------------------------------------------

FUZZ = settings(
    derandomize=True,  # the same documents on every run and every CI machine
    database=None,
    deadline=timedelta(seconds=SECONDS_PER_DOCUMENT),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=False,
)

# Module classes, for patterns and for the module fields.
MODULE_REFS = [
    "torch.nn.modules.conv.Conv2d",
    "torch.nn.modules.linear.Linear",
    "torch.nn.modules.activation.ReLU",
    "torch.nn.modules.batchnorm.BatchNorm2d",
    "torch.ao.nn.intrinsic.modules.fused.ConvReLU2d",
    "torch.ao.nn.qat.modules.linear.Linear",
    "torch.ao.nn.quantized.reference.modules.linear.Linear",
]
FUNCTION_REFS = [
    "torch.add",
    "operator.add",
    "_operator.mul",
    "torch.nn.functional.relu",
    "torch._C._nn.linear",
    "qcore.config.fusers.fuse_linear_relu",
]
# For the fields with more to them than a module class.
QAT_REFS = ["torch.ao.nn.qat.modules.linear.Linear", "torch.ao.nn.qat.Conv2d"]
REFERENCE_REFS = ["torch.ao.nn.quantized.reference.modules.linear.Linear"]
CALLABLE_REFS = LEGIT_CALLABLES

# Every class and function in these modules' namespaces, by the name the reader
# resolves (a fixed list of modules, so the fuzz draws the same names each run).
ENUMERATED_MODULES = [
    "operator",
    "torch",
    "torch.nn.functional",
    "torch.hub",
    "torch.jit",
    "torch.serialization",
    "torch.nn.modules.container",
    "torch.ao.quantization",
    "torch.ao.quantization.fuser_method_mappings",
    "torch.ao.quantization.backend_config.onednn",
    "qcore",
    "qcore.cli",
    "qcore.serialization",
    "qcore.config.json",
    "qcore.config.fusers",
    "qcore.config.onednn_fusions",
]


def enumerate_names() -> list[str]:
    names = set()
    for module_name in ENUMERATED_MODULES:
        for attribute, value in list(vars(sys.modules[module_name]).items()):
            # The value's type only: isinstance() may read a hostile __class__.
            kind = type(value)
            if attribute.startswith("__") or not (
                kind in (types.FunctionType, types.BuiltinFunctionType) or issubclass(kind, type)
            ):
                continue
            names.add(f"{module_name}.{attribute}")
    return sorted(names)


ALLOWED_NAMES = enumerate_names()
METHOD_NAMES = ["relu", "add", "view", "sigmoid", "x"]
# dtype name -> the range its quant bounds are drawn from
DTYPES = {
    "quint8": (0, 255),
    "qint8": (-128, 127),
    "torch.qint32": (-(2**31), 2**31 - 1),
    "quint4x2": (0, 15),
    "uint8": (0, 255),
    "int8": (-128, 127),
    "float8_e4m3fn": (-448, 448),
}
PLAIN_DTYPES = ["float32", "float16", "torch.float", "bfloat16", *DTYPES]
SCALES = [2**-12, 1 / 256, 2 / 256, 0.5, 1.0]

# Values and keys a mutation puts in place of a valid one.
HOSTILE_REFS = [
    "qcore.__main__.main",
    "qcore.__main__",
    "__main__.x",
    "torch.utils.model_dump.__main__.main",
    "torch.classes.x.y",
    "torch.ops.aten.add",
    "torch.testing._internal.py312_intrinsics.x",
    "torch._dynamo.optimize",
    "torch.onnx.export",
    "torch.utils.model_dump.get_model_info",
    "torch.nn.Module.__base__.__subclasses__",
    "torch.nn.functional.relu.__globals__",
    "torch.fx.graph._torch_but_not_dynamo",
    "torch.os.system",
    "os.system",
    "builtins.eval",
    "torch.nn",
    "torch..x",
    "torch",
    "",
]
HOSTILE_VALUES: list[Any] = [
    *({"ref": name} for name in HOSTILE_REFS),
    *HOSTILE_REFS,
    10**400,
    -(10**400),
    2**63,
    2**64,
    -1,
    1.5,
    -0.0,
    1e-320,
    1e308,
    math.inf,
    -math.inf,
    math.nan,
    {"float": "inf"},
    {"float": "-inf"},
    {"float": "nan"},
    {"float": 1},
    True,
    False,
    None,
    "",
    "٣",
    "²",
    "_dynamo",
    "onnx",
    [],
    {},
    [[[[[["relu"]]]]]],
    json.loads("[" * 80 + "]" * 80),
    {"ref": ["torch.add"]},
    {"ref": "torch.add", "x": 1},
]
HOSTILE_KEYS = ["²", "٣", "-1", "02", "9" * 40, "", "ref", "float", "dtype", "pattern", "zzz"]
KNOWN_KEYS = [
    "format",
    "version",
    "name",
    "configs",
    "pattern",
    "pattern_complex_format",
    "observation_type",
    "dtype_configs",
    "root_module",
    "fuser_method",
    "input_dtype",
    "dtype",
    "quant_min_lower_bound",
    "scale_exact_match",
    "zero_point_exact_match",
    "num_tensor_args_to_observation_type",
    "ref",
    "float",
]

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities included: json.dumps writes NaN, Infinity
    | st.text(max_size=12)
    | st.sampled_from(HOSTILE_REFS)
    | st.sampled_from(HOSTILE_REFS).map(lambda name: {"ref": name})  # a fresh dict each time
)
json_values = st.recursive(
    json_leaves,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=16,
)


# The near-valid documents are built from one seeded random.Random per example:
# drawing each field through hypothesis costs ~100 draws a document, ten times
# the cost of reading it, and the fuzz must stay cheap enough for every tox env.


def operand(rnd: random.Random) -> Any:
    kind = rnd.choice(["method", "module", "function"])
    if kind == "method":
        return rnd.choice(METHOD_NAMES)
    return {"ref": rnd.choice(MODULE_REFS if kind == "module" else FUNCTION_REFS)}


def random_pattern(rnd: random.Random) -> tuple[str, Any]:
    """(key, pattern): a simple pattern, or a complex one three items wide at the
    top (a simple pattern never is, so the two never name the same key)."""
    if rnd.random() < 0.5:
        items = [operand(rnd) for _ in range(rnd.choice([1, 2, 3]))]
        return "pattern", items[0] if len(items) == 1 else items
    inner = [operand(rnd) for _ in range(rnd.randint(1, 3))]
    return "pattern_complex_format", [operand(rnd), inner, operand(rnd)]


def random_dtype(rnd: random.Random) -> Any:
    if rnd.random() < 0.5:
        return rnd.choice(PLAIN_DTYPES)
    name = rnd.choice(sorted(DTYPES))
    low, high = DTYPES[name]
    constrained: dict[str, Any] = {"dtype": name}
    quant_min = rnd.randint(low, high)
    quant_max = rnd.randint(quant_min, high)
    if rnd.random() < 0.5:
        constrained["quant_min_lower_bound"] = quant_min
        constrained["quant_max_upper_bound"] = quant_max
    scale_min, scale_max = sorted(rnd.choices(SCALES, k=2))
    if rnd.random() < 0.5:
        constrained["scale_min_lower_bound"] = scale_min
        constrained["scale_max_upper_bound"] = rnd.choice([scale_max, {"float": "inf"}])
    if rnd.random() < 0.5:
        constrained["scale_exact_match"] = scale_min
        constrained["zero_point_exact_match"] = rnd.randint(quant_min, quant_max)
    return constrained


def random_dtype_config(rnd: random.Random) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kind in ("input_dtype", "output_dtype", "weight_dtype"):
        if rnd.random() < 0.5:
            result[kind] = random_dtype(rnd)
    if rnd.random() < 0.5:
        result["bias_dtype"] = rnd.choice(["float32", "float16", None])
    if rnd.random() < 0.5:
        result["is_dynamic"] = rnd.choice([True, False, None])
    return result


def random_pattern_config(rnd: random.Random) -> dict[str, Any]:
    key, pattern = random_pattern(rnd)
    config: dict[str, Any] = {key: pattern}
    if rnd.random() < 0.5:
        config["observation_type"] = rnd.choice(list(ObservationType.__members__))
    config["dtype_configs"] = [random_dtype_config(rnd) for _ in range(rnd.randint(0, 2))]
    # torch.nn.Linear is the class a pattern names torch.nn.modules.linear.Linear
    for field, refs in (
        ("root_module", [*MODULE_REFS, "torch.nn.Linear"]),
        ("fused_module", MODULE_REFS),
        ("qat_module", QAT_REFS),
        ("reference_quantized_module_for_root", REFERENCE_REFS),
    ):
        if rnd.random() < 0.25:
            config[field] = rnd.choice(refs)
    for field in CALLABLE_FIELDS:
        if rnd.random() < 0.25:
            config[field] = rnd.choice(CALLABLE_REFS)
    if rnd.random() < 0.5:
        counts = rnd.sample(["0", "1", "2", "3"], rnd.randint(0, 3))
        members = list(ObservationType.__members__)
        config["num_tensor_args_to_observation_type"] = {c: rnd.choice(members) for c in counts}
    if rnd.random() < 0.5:
        config["input_type_to_index"] = {"weight": 1, "bias": 2}
    return config


def random_valid_document(rnd: random.Random) -> dict[str, Any]:
    configs, seen = [], set()
    for _ in range(rnd.randint(0, 3)):
        config = random_pattern_config(rnd)
        # Two configs for one pattern are a (correct) DuplicatePatternError.
        key = json.dumps(config.get("pattern", config.get("pattern_complex_format")))
        if key not in seen:
            seen.add(key)
            configs.append(config)
    document: dict[str, Any] = {"configs": configs}
    if rnd.random() < 0.5:
        document.update(format="qcore.BackendConfig", version=1)
    if rnd.random() < 0.5:
        document["name"] = rnd.choice(["", "x86", "my chip", "名前", "\u0000"])
    return document


def random_json(rnd: random.Random, depth: int = 0) -> Any:
    """An arbitrary JSON value, hostile leaves included."""
    roll = rnd.random()
    if depth < 3 and roll < 0.15:
        return [random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
    if depth < 3 and roll < 0.3:
        keys = rnd.sample(KNOWN_KEYS + HOSTILE_KEYS, rnd.randint(0, 3))
        return {key: random_json(rnd, depth + 1) for key in keys}
    if roll < 0.6:
        return hostile(rnd)
    return rnd.choice(
        [
            rnd.randint(-(2**70), 2**70),
            rnd.uniform(-1e6, 1e6),
            rnd.choice(METHOD_NAMES + PLAIN_DTYPES + list(ObservationType.__members__)),
            "".join(rnd.choice("ab٣²_. \u0000é") for _ in range(rnd.randint(0, 6))),
        ]
    )


def hostile(rnd: random.Random) -> Any:
    # A copy: a later mutation may change the value in place.
    return copy.deepcopy(rnd.choice(HOSTILE_VALUES))


def _slots(value: Any, found: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in a document, depth first."""
    if isinstance(value, dict):
        for key in list(value):
            found.append((value, key))
            _slots(value[key], found)
    elif isinstance(value, list):
        for index in range(len(value)):
            found.append((value, index))
            _slots(value[index], found)
    return found


def mutate(rnd: random.Random, document: dict[str, Any]) -> None:
    """One change to ``document`` in place: a value replaced by a hostile or
    arbitrary one, a key removed or added, a value wrapped."""
    container, key = rnd.choice(_slots(document, [(None, None)]))
    if container is None:  # the document itself
        document[rnd.choice(HOSTILE_KEYS)] = random_json(rnd)
        return
    action = rnd.choice(["hostile", "hostile", "arbitrary", "delete", "add", "wrap"])
    if action == "hostile":
        container[key] = hostile(rnd)
    elif action == "arbitrary":
        container[key] = random_json(rnd)
    elif action == "delete":
        del container[key]
    elif action == "add" and isinstance(container, dict):
        container[rnd.choice(HOSTILE_KEYS + KNOWN_KEYS)] = random_json(rnd)
    elif action == "add":
        container.insert(key, random_json(rnd))
    else:
        container[key] = rnd.choice([[container[key]], {"ref": container[key]}])


def name_a_callable(rnd: random.Random, document: dict[str, Any]) -> None:
    """A callable field of one config set to any name the prefixes admit."""
    configs = document.get("configs")
    targets = (
        [item for item in configs if isinstance(item, dict)] if isinstance(configs, list) else []
    )
    if targets:
        rnd.choice(targets)[rnd.choice(list(CALLABLE_FIELDS))] = rnd.choice(ALLOWED_NAMES)


def mutated_document(rnd: random.Random) -> tuple[int, str]:
    """(number of mutations, JSON text) of a valid document mutated 0 to 3 times."""
    document = random_valid_document(rnd)
    count = rnd.randint(0, 3)
    for _ in range(count):
        if rnd.random() < 0.25:
            name_a_callable(rnd, document)
        else:
            mutate(rnd, document)
    text = json.dumps(document)  # NaN and infinities are written as JSON's non-standard words
    if count and rnd.random() < 0.1:  # now and then, broken text
        text = text[: rnd.randint(0, len(text))]
    return count, text


# Documents read per hypothesis example: hypothesis's own cost per example is
# several times that of reading one document.
BATCH = 4
NEAR_VALID_EXAMPLES = 1000


@settings(FUZZ, max_examples=NEAR_VALID_EXAMPLES)
@given(st.randoms(use_true_random=True))
def test_fuzz_near_valid_documents(rnd):
    for _ in range(BATCH):
        count, text = mutated_document(rnd)
        error = read_hostile(text)
        if count == 0:
            # The generator's documents are valid: every refusal is of a mutation.
            assert error is None, f"a valid document was refused: {error}"


@settings(FUZZ, max_examples=400)
@given(json_values)
def test_fuzz_arbitrary_json(value):
    read_hostile(json.dumps(value))
    # the same value where a document expects each kind of thing
    read_hostile(json.dumps({"configs": [value]}))
    read_hostile(json.dumps({"configs": [{"pattern": value}]}))


@settings(FUZZ, max_examples=400)
@given(st.text(max_size=60) | st.binary(max_size=60))
def test_fuzz_arbitrary_text(text):
    read_hostile(text)


@settings(FUZZ, max_examples=200)
@given(json_values)
def test_fuzz_from_dict(value):
    # from_dict reads Python values; only ConfigError may escape it too.
    for document in (
        value,
        {"configs": [value]},
        {"configs": [{"pattern": value}]},
        {"configs": [{"pattern": "relu", "dtype_configs": [value]}]},
    ):
        try:
            with time_limit(SECONDS_PER_DOCUMENT):
                BackendConfig.from_dict(document)
        except ConfigError as error:
            assert "got" in str(error) and "expected" in str(error), str(error)


def test_fuzz_callable_fields_with_every_allowed_name():
    """Each of ALLOWED_NAMES in each callable field (some 10,000 documents, read
    without read_hostile's per-document bookkeeping: about a second)."""
    before = set(sys.modules)
    accepted = set()
    for field in CALLABLE_FIELDS:
        for name in ALLOWED_NAMES:
            try:
                check_callables(from_json(one_config(**{field: name})))
            except ConfigError as error:
                assert str(error).startswith(f"configs[0].{field}: got {name!r}"), str(error)
                assert "expected" in str(error), str(error)
            else:
                accepted.add(name)
    assert set(sys.modules) == before
    # The other way round: every function defined in a callable module is read.
    fusers = {
        name
        for name in ALLOWED_NAMES
        if is_fuser(vars(sys.modules[name.rpartition(".")[0]])[name.rpartition(".")[2]])
    }
    assert accepted == fusers
    assert len(fusers) > 30 and len(ALLOWED_NAMES) > 1000


def test_fuzz_documents_are_valid_before_mutation():
    """The generator itself: without mutation it produces loadable documents of
    every kind, so the fuzz mutates near-valid documents, not only early refusals."""
    rnd = random.Random(14)
    configs = [from_json(json.dumps(random_valid_document(rnd))) for _ in range(300)]
    patterns = [pattern for config in configs for pattern in config.configs]
    assert len(patterns) > 300
    assert any(p.pattern is None for p in patterns) and any(p.fuser_method for p in patterns)
    constraints = [d.input_dtype_with_constraints for p in patterns for d in p.dtype_configs]
    assert any(c.zero_point_exact_match is not None for c in constraints)


def _fusing_config(**hooks):
    """A conv -> relu fusion config with one of its callables replaced."""
    from qcore.config import BackendConfig, BackendPatternConfig, DTypeConfig

    config = BackendPatternConfig((torch.nn.Conv2d, torch.nn.ReLU)).add_dtype_config(
        DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8)
    )
    config.set_fuser_method(hooks.get("fuser", lambda is_qat, conv, relu: torch.nn.Sequential()))
    if "root" in hooks:
        config._set_root_node_getter(hooks["root"])
    return BackendConfig("hooks").set_backend_pattern_config(config)


@pytest.mark.parametrize(
    "hooks, message",
    [
        (
            # torch.ao's older signature; the pattern as configured, not reversed
            {"fuser": lambda conv, relu: None},
            r"BackendPatternConfig\(\(Conv2d, ReLU\)\)\.fuser_method function .* raised "
            "TypeError: .* takes 2 positional arguments but 3 were given",
        ),
        (
            {"fuser": lambda is_qat, conv, relu: None},
            r"BackendPatternConfig\(\(Conv2d, ReLU\)\)\.fuser_method function .* returned "
            r"None \(NoneType\); expected the fused module",
        ),
        (
            {"root": lambda nested: None},
            r"\.root_node_getter returned None \(NoneType\); expected one of the nodes the "
            r"pattern matched \(\['_1', '_0'\]\)",
        ),
    ],
    ids=["fuser signature", "fuser returns None", "root getter returns None"],
)
def test_a_configs_callable_that_fails_at_prepare_names_the_config_and_field(hooks, message):
    """These raised TypeError or AttributeError from inside qcore's fuser and matcher
    ("'NoneType' object has no attribute 'training'"), naming no config."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.nn.ReLU()).eval()
    with pytest.raises(ConfigError, match=message):
        qcore.prepare_fx(
            model, None, (torch.randn(1, 3, 4, 4),), backend_config=_fusing_config(**hooks)
        )


@pytest.mark.parametrize(
    "pattern", [torch.nn.Linear(8, 4), int], ids=["module instance", "not a module class"]
)
def test_a_pattern_that_can_match_nothing_is_refused(pattern):
    from qcore.config import BackendPatternConfig

    with pytest.raises(
        ConfigError, match="BackendPatternConfig.pattern: got .*; expected a module"
    ):
        BackendPatternConfig(pattern)


def test_a_module_instance_as_fuser_method_is_refused():
    from qcore.config import BackendPatternConfig

    with pytest.raises(ConfigError, match="fuser_method: got .*not a module instance"):
        BackendPatternConfig((torch.nn.Conv2d, torch.nn.ReLU)).set_fuser_method(torch.nn.ReLU())


def test_torch_aos_config_objects_are_named_as_torch_aos():
    """ "got DTypeConfig(...) (DTypeConfig); expected a DTypeConfig" read as a
    contradiction; torch.ao's ObservationType was refused by the setter while
    from_dict took it."""
    from torch.ao.quantization.backend_config import DTypeConfig as TorchAoDTypeConfig
    from torch.ao.quantization.backend_config import ObservationType as TorchAoObservationType

    from qcore.config import BackendPatternConfig, ObservationType

    config = BackendPatternConfig(torch.nn.Linear)
    with pytest.raises(ConfigError, match=r"\(torch.ao's DTypeConfig: qcore.config.torch_ao con"):
        config.add_dtype_config(TorchAoDTypeConfig(input_dtype=torch.quint8))
    config.set_observation_type(TorchAoObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT)
    assert config.observation_type is ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
