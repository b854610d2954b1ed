"""qcore.save / qcore.load: converted models round-trip bit for bit, and loading runs
no code from the file (issue 14, section 6).

``torch.load(weights_only=False)`` of a whole pickled model runs whatever the file
says. qcore.save writes plain data; qcore.load reads it with
``torch.load(weights_only=True)`` and rebuilds the model through allow-lists. Here:
every bundled example model, FX and PT2E, lowered and reference, on every installed
backend, loaded under another quantized engine, gives the saved model's outputs bit
for bit; and crafted files (pickles whose ``__reduce__`` runs a shell command, whole
pickled models, TorchScript archives, qcore files edited to name other functions,
classes or injected code) are refused with an error naming what, running nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import os
import pickle
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
from backends import FIRST_PARTY, backend_params, installed
from kernel_cases import CASES, STATEFUL, build
from torch import nn

import qcore
from qcore.config.errors import describe
from qcore.examples import EVAL_SEED, ZOO, export_batch_free
from qcore.kernels.packed import PackedWeights

ALL_BACKENDS = (*FIRST_PARTY, "onednn", "native")


def _leaves(output) -> list[torch.Tensor]:
    return torch.utils._pytree.tree_leaves(output)


def _assert_identical(expected, actual) -> None:
    expected, actual = _leaves(expected), _leaves(actual)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual, strict=True):
        assert e.dtype == a.dtype and e.shape == a.shape
        assert torch.equal(e, a), (e.float() - a.float()).abs().max()


def _run(model, inputs):
    with torch.no_grad():
        return model(*inputs)


def _other_engine(backend: str) -> str:
    """A quantized engine other than the backend's own, to load under."""
    engines = [e for e in torch.backends.quantized.supported_engines if e not in ("none",)]
    return next(e for e in ("qnnpack", "fbgemm", "x86") if e in engines and e != backend)


def _save_load(model, tmp_path, engine: str, **kwargs):
    """qcore.save to a file, qcore.load under ``engine``; the global engine is restored."""
    path = tmp_path / "model.qcore"
    qcore.save(model, path, **kwargs)
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        loaded = qcore.load(path, **kwargs)
        assert torch.backends.quantized.engine == engine, "load changed the global engine"
    finally:
        torch.backends.quantized.engine = before
    return loaded


def _packing_engines(model) -> list[tuple[str, str]]:
    return [(n, m.engine) for n, m in model.named_modules() if isinstance(m, PackedWeights)]


def _assert_same_model(loaded, original, inputs) -> None:
    assert [type(m).__name__ for m in loaded.modules()] == [
        type(m).__name__ for m in original.modules()
    ]
    assert _packing_engines(loaded) == _packing_engines(original)
    expected, actual = original.state_dict(), loaded.state_dict()
    assert list(actual) == list(expected)
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key
    _assert_identical(_run(original, inputs), _run(loaded, inputs))


# --------------------------------------------------------------------------
# Bit-exact round trips
# --------------------------------------------------------------------------


@functools.cache
def _prepared(name: str, backend: str, path: str):
    """The zoo model prepared and calibrated (cached: each is converted twice)."""
    entry = ZOO[name]
    calibration = entry.calibration_data(1)  # what is saved matters here, not its accuracy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what stays float; export's notes on nn.LSTM
        if path == "fx":
            prepared = qcore.prepare_fx(entry.make_model(), None, entry.example_inputs(), backend)
        else:
            exported = export_batch_free(entry.make_model(), calibration[0])
            prepared = qcore.prepare_pt2e(exported, backend)
        with torch.no_grad():
            for batch in calibration:
                prepared(*batch)
    return prepared


def _converted(name: str, backend: str, path: str, lower: bool):
    prepared = _prepared(name, backend, path)
    if path == "pt2e":
        return qcore.convert_pt2e(prepared, lower=lower)
    return (qcore.convert_fx if lower else qcore.convert_to_reference_fx)(prepared)


@pytest.mark.parametrize("lower", [True, False], ids=["lowered", "reference"])
@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params(ALL_BACKENDS))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_round_trips_bit_exact(name, backend, path, lower, tmp_path):
    converted = _converted(name, backend, path, lower)
    loaded = _save_load(converted, tmp_path, _other_engine(backend))
    assert qcore.explain(loaded) == qcore.explain(converted)
    inputs = ZOO[name].calibration_data(1, seed=EVAL_SEED)[0]  # not what it was calibrated on
    _assert_same_model(loaded, converted, inputs)


@pytest.mark.parametrize("lower", [True, False], ids=["lowered", "reference"])
@pytest.mark.parametrize("backend", backend_params(FIRST_PARTY))
@pytest.mark.parametrize("name", STATEFUL)
def test_kernel_round_trips_bit_exact(name, backend, lower, tmp_path):
    built = build(CASES[name], backend)
    model = built.converted if lower else built.reference
    _assert_same_model(_save_load(model, tmp_path, _other_engine(backend)), model, built.inputs)


@pytest.mark.parametrize("config", [{}, {"is_per_channel": True, "is_dynamic": True}])
def test_model_quantized_by_a_torchao_quantizer_round_trips(config, tmp_path):
    xnnpack = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "XNNPACKQuantizer is deprecated!"
        quantizer = xnnpack.XNNPACKQuantizer().set_global(
            xnnpack.get_symmetric_quantization_config(**config)
        )
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_pt2e(torch.export.export(model.eval(), (x,)).module(), quantizer)
    prepared(x)
    converted = qcore.convert_pt2e(prepared)  # the reference form: torchao names no backend
    _assert_same_model(_save_load(converted, tmp_path, _other_engine("x86")), converted, (x,))


def test_loaded_model_saves_again_to_the_same_model(tmp_path):
    backends = [b for b in FIRST_PARTY if installed(b)]
    if not backends:
        pytest.skip("needs a first-party backend plugin")
    name, backend = "resnet18_like", backends[0]
    converted = _converted(name, backend, "fx", True)
    first = _save_load(converted, tmp_path, backend)
    second = _save_load(first, tmp_path, backend)
    inputs = ZOO[name].calibration_data(1, seed=EVAL_SEED)[0]
    _assert_same_model(second, converted, inputs)


def test_pt2e_model_keeps_its_guard_dynamic_batch_and_train_refusal(tmp_path):
    from test_pt2e_save_load import _converted_with_dynamic_batch

    converted = _converted_with_dynamic_batch()
    loaded = _save_load(converted, tmp_path, torch.backends.quantized.engine)
    for rows in (3, 17):
        x = torch.randn(rows, 16)
        _assert_identical(converted(x), loaded(x))
    with pytest.raises(AssertionError, match=r"input 'x': dimension 1 is 12; .* exported for 16"):
        loaded(torch.randn(4, 12))
    with pytest.raises(NotImplementedError, match="Calling train"):
        loaded.train()


# --------------------------------------------------------------------------
# What save refuses, and allow=
# --------------------------------------------------------------------------


def _user_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


torch.fx.wrap("_user_scale")


class _UsesWrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _user_scale(self.linear(x))


def _tiny_converted(model: nn.Module | None = None) -> torch.fx.GraphModule:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 4)
            self.register_buffer("offset", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x) + self.offset).flatten(1) * x.shape[0]

    x = torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qcore.quantize((model or Tiny()).eval(), (x,), [(x,)], backend="native")


def test_a_function_outside_the_allow_list_is_saved_and_loaded_only_when_allowed(tmp_path):
    converted = _tiny_converted(_UsesWrapped())
    with pytest.raises(
        qcore.UnsupportedModelError, match=r"node '_user_scale'.*_user_scale.*allow="
    ):
        qcore.save(converted, tmp_path / "refused.qcore")
    path = tmp_path / "allowed.qcore"
    qcore.save(converted, path, allow=[_user_scale])
    with pytest.raises(qcore.RefusedFileError, match=r"function '.*_user_scale' is not in"):
        qcore.load(path)
    loaded = qcore.load(path, allow=[_user_scale])
    x = torch.randn(3, 8)
    _assert_identical(converted(x), loaded(x))


@dataclasses.dataclass
class _Settings:
    hidden: int = 8

    def __post_init__(self) -> None:
        self._implementation = "eager"  # beside the fields, as transformers' configs do


class _Configured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config, self.linear = _Settings(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (2.0 if self.config._implementation == "eager" else 1.0)


def test_an_allowed_dataclass_keeps_what_is_set_beside_its_fields(tmp_path):
    """Only the fields were saved: a transformers config lost
    _attn_implementation_internal and the loaded BERT failed at its first call."""
    model = _Configured().eval()
    path = tmp_path / "configured.qcore"
    qcore.save(model, path, allow=[_Configured, _Settings])
    loaded = qcore.load(path, allow=[_Configured, _Settings])
    assert vars(loaded.config) == {"hidden": 8, "_implementation": "eager"}
    x = torch.randn(2, 8)
    _assert_identical(model(x), loaded(x))


def test_a_file_for_a_backend_missing_here_says_so(tmp_path, monkeypatch):
    """A vendor backend's file loaded where its plugin is not installed (or is
    blocked) was refused as an untrusted class, with advice to pass allow=[...],
    which cannot import it: the message now names the backend and why."""
    from qcore import serialization

    model = _Configured().eval()  # stands in for a vendor kernel's class
    path = tmp_path / "vendor.qcore"
    monkeypatch.setattr(serialization, "_backends_of", lambda model: ["nochip"])
    qcore.save(model, path, allow=[_Configured, _Settings])
    with pytest.raises(
        qcore.RefusedFileError,
        match=r"class .*_Configured comes from no package qcore.load trusts here, and the file "
        r"was saved for a backend this machine cannot serve: backend 'nochip' is not installed",
    ):
        qcore.load(path)


def test_a_model_with_hooks_is_refused_by_save(tmp_path):
    converted = _tiny_converted()
    converted.linear.register_forward_hook(lambda *args: None)
    with pytest.raises(qcore.UnsupportedModelError, match=r"model\.linear: .*forward_hooks"):
        qcore.save(converted, tmp_path / "hooked.qcore")


def test_a_module_under_two_names_stays_one_module(tmp_path):
    shared = nn.ReLU()
    model = nn.Sequential(nn.Linear(4, 4), shared, nn.Linear(4, 4), shared)
    model[2].weight = model[0].weight  # a tied weight stays tied too
    loaded = _save_load(model, tmp_path, torch.backends.quantized.engine)
    assert loaded[1] is loaded[3]
    assert loaded[0].weight is loaded[2].weight
    x = torch.randn(2, 4)
    _assert_identical(model(x), loaded(x))


def test_a_float_model_round_trips_too(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    loaded = _save_load(model, tmp_path, torch.backends.quantized.engine)
    x = torch.randn(2, 3, 8, 8)
    _assert_identical(model(x), loaded(x))


# --------------------------------------------------------------------------
# Crafted files: refused, and nothing runs
# --------------------------------------------------------------------------


class _RunsShell:
    """Unpickled, runs a shell command that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _RunsPython:
    """Unpickled, runs Python source that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "marker"
    yield path
    assert not path.exists(), "the crafted file ran code"


def test_a_pickle_running_a_shell_command_is_refused(tmp_path, marker):
    data = pickle.dumps({"model": _RunsShell(str(marker))}, protocol=2)
    pickle.loads(data)  # the control: unpickled as torch.load(weights_only=False) would
    assert marker.exists()
    marker.unlink()
    path = tmp_path / "evil.pt"
    path.write_bytes(data)
    with pytest.raises(
        qcore.RefusedFileError,
        match=r"evil\.pt: .*GLOBAL posix.system.*would run code from the file.*Nothing from it ran",
    ):
        qcore.load(path)


@pytest.mark.parametrize("payload", [_RunsShell, _RunsPython])
def test_a_torch_save_file_running_code_is_refused(payload, tmp_path, marker):
    path = tmp_path / "evil.pt"
    torch.save({"format": "qcore.model", "model": payload(str(marker))}, path)
    with pytest.raises(qcore.RefusedFileError, match="names Python objects to build"):
        qcore.load(path)


def test_a_whole_pickled_model_is_refused(tmp_path):
    path = tmp_path / "whole.pt"
    torch.save(_tiny_converted(), path)
    with pytest.raises(qcore.RefusedFileError, match="whole-model torch.save"):
        qcore.load(path)


def test_a_torchscript_archive_is_refused(tmp_path):
    path = tmp_path / "scripted.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit's own notice
        torch.jit.save(torch.jit.script(nn.Linear(2, 2)), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning that it would run torch.jit.load
        with pytest.raises(qcore.RefusedFileError, match="TorchScript"):
            qcore.load(path)


def test_files_that_are_not_qcore_files_are_refused(tmp_path):
    torch.save({"weight": torch.zeros(2)}, tmp_path / "state.pt")
    with pytest.raises(qcore.RefusedFileError, match=r"format is None, expected 'qcore.model'"):
        qcore.load(tmp_path / "state.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(qcore.RefusedFileError, match="cannot read it"):
        qcore.load(tmp_path / "junk.pt")
    with pytest.raises(FileNotFoundError):
        qcore.load(tmp_path / "missing.pt")


@pytest.mark.parametrize("cut", [10, 50, 100])
def test_a_truncated_qcore_file_is_refused_as_truncated(cut, tmp_path):
    """torch's zip reader raises a bare OSError (EINVAL) for an archive cut short
    near its end; qcore.load passed every OSError through as if the path were wrong."""
    path = tmp_path / "model.qcore"
    qcore.save(_tiny_converted(), path)
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(qcore.RefusedFileError) as refused:
        qcore.load(path)
    assert str(path) in str(refused.value)
    assert "truncated or corrupt" in str(refused.value)


def test_saving_to_a_directory_names_the_directory(tmp_path):
    """torch.save failed in its C++ zip writer: 'enforce fail at inline_container.cc'."""
    with pytest.raises(IsADirectoryError) as refused:
        qcore.save(_tiny_converted(), tmp_path)
    assert str(refused.value) == (
        f"f: got {str(tmp_path)!r}, a directory; expected the path of a file to write"
    )


@pytest.mark.parametrize("operation", ["save", "load"])
@pytest.mark.parametrize("allow", [3, "torch.relu", nn.Linear])
def test_allow_that_is_not_a_list_is_refused_naming_allow(operation, allow, tmp_path):
    """allow=3 raised "'int' object is not iterable"; a string was split into letters."""
    path = tmp_path / "model.qcore"
    qcore.save(_tiny_converted(), path)
    with pytest.raises(TypeError) as refused:
        if operation == "save":
            qcore.save(_tiny_converted(), path, allow=allow)
        else:
            qcore.load(path, allow=allow)
    assert str(refused.value) == (
        f"allow: got {describe(allow)}; expected a list of classes (nn.Module subclasses, "
        "dataclasses, enums) or functions"
    )


# Each edit turns a legitimate qcore.save file into one that would run the marker
# command, reach Python internals or name something outside the allow-lists.


def _nodes(payload: dict) -> list[dict]:
    return payload["model"]["graph"]["nodes"]


def _first(payload: dict, op: str) -> dict:
    return next(node for node in _nodes(payload) if node["op"] == op)


def _set_function(name: str) -> Callable:
    def edit(payload, marker):
        _first(payload, "call_function")["target"] = {"$": "function", "name": name}

    return edit


def _set_op(namespace: str, name: str) -> Callable:
    def edit(payload, marker):
        target = {"$": "op", "namespace": namespace, "name": name, "overload": "default"}
        _first(payload, "call_function")["target"] = target

    return edit


def _getattr_dunder(payload, marker):
    node = _first(payload, "call_function")
    node["target"] = {"$": "function", "name": "builtins.getattr"}
    x = _first(payload, "placeholder")["name"]
    node["args"] = {"$": "tuple", "items": [{"$": "node", "name": x}, "__class__"]}


def _set_method(name: str) -> Callable:
    def edit(payload, marker):
        _first(payload, "call_method")["target"] = name

    return edit


def _inject_input_name(payload, marker):
    _first(payload, "placeholder")["target"] = f"x=__import__('os').system('touch {marker}')"


def _inject_node_name(payload, marker):
    _first(payload, "call_method")["name"] = f"y = __import__('os').system('touch {marker}')"


def _inject_kwarg(payload, marker):
    key = f"x=__import__('os').system('touch {marker}'),y"
    _first(payload, "call_method")["kwargs"] = {"$": "dict", "items": [[key, 1]]}


def _inject_orig_args(payload, marker):
    payload["model"]["graph"]["codegen"] = {
        "kind": "pytree",
        "orig_args": [f"x=__import__('os').system('touch {marker}')"],
        "in_spec": None,
        "out_spec": None,
    }


def _bad_treespec(payload, marker):
    _inject_orig_args(payload, marker)
    payload["model"]["graph"]["codegen"]["orig_args"] = ["x"]
    payload["model"]["graph"]["codegen"]["in_spec"] = '[1, {"type": "os.system"}]'


def _inject_in_spec_keyword(payload, marker):
    _inject_orig_args(payload, marker)
    key = f"x': __import__('os').system('touch {marker}'), 'y"
    _, spec = torch.utils._pytree.tree_flatten(((), {key: 1}))
    payload["model"]["graph"]["codegen"]["orig_args"] = ["x"]
    payload["model"]["graph"]["codegen"]["in_spec"] = torch.utils._pytree.treespec_dumps(spec)


def _get_attr_path(target: str) -> Callable:
    def edit(payload, marker):
        _first(payload, "get_attr")["target"] = target

    return edit


def _call_module_path(payload, marker):
    _first(payload, "call_module")["target"] = "__class__"


def _module_class(key: str) -> Callable:
    def edit(payload, marker):
        payload["model"]["modules"]["linear"]["class"] = key

    return edit


def _attribute(name: str, value) -> Callable:
    def edit(payload, marker):
        payload["model"]["attributes"][name] = value

    return edit


def _alias_elsewhere(payload, marker):
    payload["model"]["modules"]["linear"] = {"kind": "alias", "path": "model.__class__"}


def _format(payload, marker):
    payload["format"] = "something.else"


def _version(payload, marker):
    payload["version"] = 99


def _tensor_table(payload, marker):
    payload["tensors"]["0"] = f"touch {marker}"


CRAFTED = {
    "function os.system": (_set_function("os.system"), r"function 'os.system' is not in"),
    "function builtins.exec": (_set_function("builtins.exec"), r"'builtins.exec' is not in"),
    "function torch.load": (_set_function("torch.load"), r"'torch.load' is not in"),
    "function torch.from_file": (_set_function("torch.from_file"), r"'torch.from_file' is not"),
    "getattr(x, '__class__')": (_getattr_dunder, r"getattr\(value, public attribute name\)"),
    "aten::from_file": (_set_op("aten", "from_file"), r"aten::from_file is on .* deny-list"),
    "operator namespace": (_set_op("evil", "system"), r"namespace 'evil'"),
    "method register_hook": (_set_method("register_hook"), r"a public torch.Tensor method"),
    "method __reduce_ex__": (_set_method("__reduce_ex__"), r"a public torch.Tensor method"),
    "method numpy": (_set_method("numpy"), r"a public torch.Tensor method"),
    "code in an input name": (_inject_input_name, r"expected an input name"),
    "code in a node name": (_inject_node_name, r"expected name to be a Python identifier"),
    "code in a keyword": (_inject_kwarg, r"kwargs keyed by identifiers"),
    "code in forward's arguments": (_inject_orig_args, r"expected an input name"),
    "unknown pytree type": (_bad_treespec, r"in_spec does not parse"),
    "code in an in_spec keyword": (_inject_in_spec_keyword, r"in_spec's keyword input names"),
    "get_attr __class__": (_get_attr_path("__class__.__init__"), r"a dotted attribute path"),
    "get_attr missing": (_get_attr_path("not_there"), r"a parameter, buffer, submodule or"),
    "call_module __class__": (_call_module_path, r"a dotted attribute path"),
    "class posix:system": (_module_class("posix:system"), r"class posix:system is not one"),
    "class builtins:eval": (_module_class("builtins:eval"), r"class builtins:eval is not one"),
    "class qcore.__main__": (_module_class("qcore.__main__:main"), r"qcore.__main__:main"),
    "class not a module": (_module_class("qcore.engine.reference:QParams"), r"an nn.Module"),
    "value class subprocess": (
        _attribute("p", {"$": "object", "class": "subprocess:Popen", "fields": {}}),
        r"class subprocess:Popen is not one",
    ),
    "attribute __class__": (_attribute("__class__", 1), r"expected an attribute name"),
    "module alias": (_alias_elsewhere, r"the path of a module read before"),
    "format": (_format, r"format is 'something.else'"),
    "version": (_version, r"version 99"),
    "tensor table": (_tensor_table, r"'tensors' to hold tensors, got \"'0': str\""),
}


@pytest.mark.parametrize("edit", list(CRAFTED))
def test_an_edited_qcore_file_is_refused_naming_what(edit, tmp_path, marker):
    change, message = CRAFTED[edit]
    buffer = io.BytesIO()
    qcore.save(_tiny_converted(), buffer)
    buffer.seek(0)
    payload = copy.deepcopy(torch.load(buffer, weights_only=True))
    change(payload, str(marker))
    path = tmp_path / "crafted.qcore"
    torch.save(payload, path)
    with pytest.raises(qcore.RefusedFileError, match=message) as refused:
        qcore.load(path)
    assert "crafted.qcore" in str(refused.value)
    assert "qcore.__main__" not in sys.modules  # a file never makes qcore import a module


def test_the_unedited_file_loads(tmp_path):
    converted = _tiny_converted()
    loaded = _save_load(converted, tmp_path, torch.backends.quantized.engine)
    x = torch.randn(5, 8)
    _assert_identical(converted(x), loaded(x))


@pytest.mark.parametrize("reference", [True, False])
def test_a_weight_normed_layer_saves_in_either_form(reference, tmp_path):
    """The reference form kept weight_norm's load_state_dict pre-hook after its
    parametrization was removed, and qcore.save refused it as a user's hook."""

    class WeightNormed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))
            self.l2 = nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.l2(torch.relu(self.l1(x)))

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    backend = next((name for name in FIRST_PARTY if installed(name)), None)
    if backend is None:
        pytest.skip("needs a first-party backend")
    prepared = qcore.prepare_fx(WeightNormed().eval(), None, (x,), backend=backend)
    prepared(x)
    converted = (qcore.convert_to_reference_fx if reference else qcore.convert_fx)(prepared)
    path = tmp_path / "weight_normed.qcore"
    qcore.save(converted, path)
    _assert_identical(converted(x), qcore.load(path)(x))
