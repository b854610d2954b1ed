"""Save and load converted models without running code from the file.

``torch.save(model)`` pickles a whole model, and ``torch.load(weights_only=False)``
runs whatever the pickle says: a crafted file runs any command. :func:`save`
writes a model as plain data instead -- its graph (each node's operator by name),
its modules (each class by name, with its plain attributes), its tensors and
``qcore.explain``'s report -- and :func:`load` reads it with
``torch.load(weights_only=True)`` (tensors and plain containers only), then
rebuilds the model through allow-lists: graph operators must be torch's tensor
operators, ``operator``/``math`` functions or ``qcore.ops``; modules must be
``torch.nn``/``torch.ao.nn`` classes, qcore's own, or those of an installed backend
plugin the file names. Anything else is refused by name before any of it runs.

Example::

    >>> quantized = qcore.convert_fx(prepared)          # or qcore.convert_pt2e(...)
    >>> qcore.save(quantized, "model.qcore")
    >>> loaded = qcore.load("model.qcore")              # runs nothing from the file
    >>> torch.equal(loaded(x), quantized(x))
    True

Packed weights are packed again on load for each kernel's own engine, whatever
``torch.backends.quantized.engine`` says, so the loaded model computes exactly
what the saved one did. Your own modules or functions (a custom module class, a
``torch.fx.wrap``-ed function) are loaded only when you name them: ``allow=``.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import functools
import io
import keyword
import math
import operator
import os
import pickle
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import IO, Any

import torch
from torch.fx import Graph, GraphModule, Node

from qcore.config.errors import describe

__all__ = ["FORMAT", "VERSION", "RefusedFileError", "UnsupportedModelError", "load", "save"]

FORMAT = "qcore.model"
"""The ``format`` field of every file :func:`save` writes."""
VERSION = 1
"""The format version :func:`save` writes and the newest :func:`load` reads."""

FileLike = str | os.PathLike | IO[bytes]


class RefusedFileError(ValueError):
    """:func:`load` refused a file: it is not a qcore.save file, or it names
    something (an operator, a class, an attribute) outside the allow-lists.
    Nothing from the file has run."""


class UnsupportedModelError(TypeError):
    """:func:`save` cannot write the model as plain data (a hook, a class or a
    function outside the allow-lists, an attribute that is not plain data)."""


# --------------------------------------------------------------------------
# Allow-lists
# --------------------------------------------------------------------------

# Names containing these are never resolved, whatever their namespace: file and
# storage access, raw pointers, Python callbacks (hooks, apply_), printing.
_DENIED = re.compile(
    r"file|storage|set_|data_ptr|pin_memory|share_memory|dlpack|numpy|print|"
    r"from_buffer|hook|backward|apply_|map_|map2_|save|load|jit|compile",
    re.IGNORECASE,
)

_OPERATOR = (
    "abs add and_ contains eq floordiv ge getitem gt iadd iand ifloordiv imod imul index "
    "inv invert ior ipow irshift ilshift is_ is_not isub itruediv ixor le lshift lt matmul "
    "mod mul ne neg not_ or_ pos pow rshift setitem sub truediv truth xor"
).split()
_BUILTINS = "abs bool divmod float getattr int len max min pow round sum".split()
_TORCH_EXTRAS = (
    "_assert _check _check_is_size sym_float sym_int sym_ite sym_max sym_min sym_not "
    "is_tensor is_floating_point is_complex"
).split()
_HELPER_MODULES = ("torch._jit_internal", "torch.overrides")
_OP_NAMESPACES = ("aten", "prims", "quantized", "quantized_decomposed", "torchao")
_HIGHER_ORDER = (
    "associative_scan",
    "cond",
    "map_impl",
    "scan",
    "while_loop",
    "wrap_with_autocast",
    "wrap_with_set_grad_enabled",
)
# Modules whose classes (nn.Modules, dataclasses and enums) a file may name.
_TRUSTED_PACKAGES = ("qcore", "qcore_fbgemm", "qcore_qnnpack", "qcore_x86")
_TRUSTED_TORCH = ("torch.nn.modules", "torch.ao.nn", "torch.nn.intrinsic", "torch.fx")

# Module attributes save leaves out: structure, hooks (checked empty) and
# what GraphModule regenerates from its graph.
_MODULE_INTERNALS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_is_full_backward_hook",
    }
)
_HOOKS = (
    "_backward_pre_hooks",
    "_backward_hooks",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_GRAPH_MODULE_INTERNALS = frozenset(
    {
        "_graph",
        "_code",
        "_lineno_map",
        "_prologue_start",
        "_in_spec",
        "_out_spec",
        "_replace_hooks",
        "_create_node_hooks",
        "_erase_node_hooks",
        "_deepcopy_hooks",
        "_tracer_extras",
        "_tracer_cls",
        "shape_env",
        "meta",
        "range_constraints",
        "_qcore_report",
    }
)
_RESERVED = _MODULE_INTERNALS | _GRAPH_MODULE_INTERNALS | frozenset(_HOOKS)
_NODE_OPS = ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")
_SEGMENT = re.compile(r"^[A-Za-z0-9_]+$")


def _is_public_name(name: Any) -> bool:
    return isinstance(name, str) and not name.startswith("_") and not _DENIED.search(name)


class _AllowList:
    """The functions, tensor methods and classes a file may name, both ways."""

    def __init__(self, allow: Iterable[Any] = (), backends: Iterable[str] = ()) -> None:
        self.functions: dict[str, Callable] = {}
        self.extra_classes: dict[str, type] = {}
        for name, value in _standard_functions():
            self.functions.setdefault(name, value)
        # a class alone is refused too: an Enum class iterates over its members
        if isinstance(allow, (str, bytes, type)) or not isinstance(allow, Iterable):
            raise TypeError(
                f"allow: got {describe(allow)}; expected a list of classes (nn.Module "
                "subclasses, dataclasses, enums) or functions"
            )
        for item in allow:
            if isinstance(item, type):
                self.extra_classes[_class_key(item)] = item
            elif callable(item):
                self.functions[_function_key(item)] = item
            else:
                raise TypeError(
                    f"allow: got {item!r}; expected classes (nn.Module subclasses, "
                    "dataclasses, enums) or functions"
                )
        self.function_names: dict[int, str] = {}
        for name, value in self.functions.items():  # torch.relu before its other names
            self.function_names.setdefault(id(value), name)
        self.tensor_methods = {
            name
            for name in dir(torch.Tensor)
            if _is_public_name(name) and callable(getattr(torch.Tensor, name, None))
        }
        plugin_packages, self.unserved_backends = _plugin_packages(backends)
        self.packages = set(_TRUSTED_PACKAGES) | plugin_packages

    # functions -------------------------------------------------------------

    def function_name(self, value: Any, where: str) -> dict:
        if isinstance(value, torch._ops.OpOverload):
            namespace, name = value._schema.name.split("::", 1)
            self._check_op(namespace, name, value._overloadname, where)
            return {
                "$": "op",
                "namespace": namespace,
                "name": name,
                "overload": value._overloadname,
            }
        if isinstance(value, torch._ops.OpOverloadPacket):
            namespace, name = value._qualified_op_name.split("::", 1)
            self._check_op(namespace, name, None, where)
            return {"$": "op", "namespace": namespace, "name": name, "overload": None}
        if isinstance(value, torch._ops.HigherOrderOperator):
            if value.name() not in _HIGHER_ORDER:
                raise UnsupportedModelError(
                    f"{where}: higher-order operator {value.name()!r} is not one qcore.load "
                    f"rebuilds; expected one of {list(_HIGHER_ORDER)}"
                )
            return {"$": "hop", "name": value.name()}
        name = self.function_names.get(id(value))
        if name is None:
            raise UnsupportedModelError(
                f"{where}: function {_describe_callable(value)} is not in qcore.load's "
                "allow-list (torch's tensor operators, torch.nn.functional, operator, math, "
                "qcore.ops); pass it in allow=[...] to qcore.save and qcore.load if you trust it"
            )
        return {"$": "function", "name": name}

    @staticmethod
    def _check_op(namespace: str, name: str, overload: str | None, where: str) -> None:
        if namespace not in _OP_NAMESPACES:
            raise UnsupportedModelError(
                f"{where}: operator namespace {namespace!r} ({namespace}::{name}) is not one "
                f"qcore.load resolves; expected one of {list(_OP_NAMESPACES)}"
            )
        if _DENIED.search(name) or (overload and _DENIED.search(overload)):
            raise UnsupportedModelError(
                f"{where}: operator {namespace}::{name} is on qcore.load's deny-list "
                "(file, storage, pointer or callback access)"
            )

    def resolve_function(self, data: dict, where: str) -> Any:
        kind = data.get("$")
        if kind == "function":
            name = data.get("name")
            value = self.functions.get(name) if isinstance(name, str) else None
            if value is None:
                raise RefusedFileError(
                    f"{where}: function {name!r} is not in qcore.load's allow-list (torch's "
                    "tensor operators, torch.nn.functional, operator, math, qcore.ops); "
                    "pass it in allow=[...] if you trust it"
                )
            return value
        if kind == "op":
            namespace, name, overload = (
                data.get("namespace"),
                data.get("name"),
                data.get("overload"),
            )
            if not (
                isinstance(namespace, str)
                and isinstance(name, str)
                and (overload is None or isinstance(overload, str))
                and _SEGMENT.match(name)
                and (overload is None or _SEGMENT.match(overload))
            ):
                raise RefusedFileError(f"{where}: malformed operator reference {data!r}")
            try:
                self._check_op(namespace, name, overload, where)
            except UnsupportedModelError as error:
                raise RefusedFileError(str(error)) from None
            _register_decomposed_ops()
            try:
                packet = getattr(getattr(torch.ops, namespace), name)
                return packet if overload is None else getattr(packet, overload)
            except (AttributeError, RuntimeError):
                raise RefusedFileError(
                    f"{where}: operator {namespace}::{name}.{overload} is not registered in "
                    "this torch (a newer torch, or a library that registers it, not imported?)"
                ) from None
        if kind == "hop":
            name = data.get("name")
            if name not in _HIGHER_ORDER:
                raise RefusedFileError(
                    f"{where}: higher-order operator {name!r} is not one qcore.load rebuilds; "
                    f"expected one of {list(_HIGHER_ORDER)}"
                )
            return getattr(torch.ops.higher_order, name)
        raise RefusedFileError(f"{where}: expected a function reference, got {data!r}")

    # classes ---------------------------------------------------------------

    def class_name(self, cls: type, where: str, kind: str) -> str:
        key = _class_key(cls)
        try:
            resolved = self.resolve_class(key, where, kind)
        except RefusedFileError as error:
            raise UnsupportedModelError(
                str(error).replace("qcore.load", "qcore.save/qcore.load")
            ) from None
        if resolved is not cls:
            raise UnsupportedModelError(f"{where}: class {key} does not resolve to itself by name")
        return key

    def resolve_class(self, key: Any, where: str, kind: str) -> type:
        """``key`` is ``module:qualname``, in a trusted package: torch.nn, torch.ao.nn,
        torch.fx, qcore, or a plugin of a backend the file names (loaded as
        ``get_backend`` loads it). Only modules already imported are looked in: a
        module the file names is never imported."""
        if not isinstance(key, str) or key.count(":") != 1:
            raise RefusedFileError(f"{where}: malformed class reference {key!r}")
        if key in self.extra_classes:
            return self.extra_classes[key]
        module_name, qualname = key.split(":")
        trusted = module_name.split(".")[0] in self.packages or any(
            module_name == prefix or module_name.startswith(prefix + ".")
            for prefix in _TRUSTED_TORCH
        )
        segments = qualname.split(".")
        names = [*module_name.split("."), *segments]
        if not trusted or any(not s.isidentifier() or s.startswith("__") for s in names):
            if self.unserved_backends:  # most likely the class of a plugin missing here
                raise RefusedFileError(
                    f"{where}: class {key} comes from no package qcore.load trusts here, and "
                    f"the file was saved for a backend this machine cannot serve: "
                    f"{'; '.join(self.unserved_backends)}"
                )
            raise RefusedFileError(
                f"{where}: class {key} is not one qcore.load rebuilds (torch.nn, torch.ao.nn, "
                "qcore and installed backend plugins); pass the class in allow=[...] if you "
                "trust it"
            )
        module = sys.modules.get(module_name)
        value: Any = module
        for segment in segments:
            value = getattr(value, segment, None)
        if not isinstance(value, type):
            raise RefusedFileError(
                f"{where}: class {key} is not loaded in this process (is the backend plugin "
                "that defines it installed?)"
            )
        valid = {
            "module": issubclass(value, torch.nn.Module) and not issubclass(value, GraphModule),
            "value": dataclasses.is_dataclass(value) or issubclass(value, enum.Enum),
            "type": issubclass(value, (torch.nn.Module, torch.fx.Tracer)),
        }[kind]
        if not valid:
            expected = {
                "module": "an nn.Module class",
                "value": "a dataclass or enum",
                "type": "an nn.Module or torch.fx.Tracer class",
            }[kind]
            raise RefusedFileError(f"{where}: class {key} is not {expected}")
        return value


@functools.cache
def _standard_functions() -> tuple[tuple[str, Callable], ...]:
    """(name, function) for torch's tensor operators, torch.nn.functional, operator,
    math and qcore.ops; names on the deny-list left out."""
    from qcore import ops

    found: list[tuple[str, Callable]] = []
    variable = torch._C._VariableFunctions
    native = [name for name in dir(variable) if not name.startswith("__")]
    python = [*getattr(torch.functional, "__all__", ()), *_TORCH_EXTRAS]
    for name in [*native, *python]:
        value = getattr(torch, name, None)
        if callable(value) and not _DENIED.search(name):
            found.append((f"torch.{name}", value))
    for name in native:
        if not _DENIED.search(name):
            found.append((f"torch._C._VariableFunctions.{name}", getattr(variable, name)))
    namespaces = {
        "torch.nn.functional": torch.nn.functional,
        "torch._C._nn": torch._C._nn,
        "torch.fft": torch.fft,
        "torch.linalg": torch.linalg,
        "torch.special": torch.special,
        "torch.Tensor": torch.Tensor,
    }
    for prefix, namespace in namespaces.items():
        for name in dir(namespace):
            value = getattr(namespace, name, None)
            if not _is_public_name(name) or isinstance(value, type) or not callable(value):
                continue
            module = str(getattr(value, "__module__", None) or "torch")
            # torch's operators, not its helpers that build or dispatch to other callables
            if module.startswith("torch") and module not in _HELPER_MODULES:
                found.append((f"{prefix}.{name}", value))
    found += [(f"operator.{name}", getattr(operator, name)) for name in _OPERATOR]
    found += [(f"builtins.{name}", getattr(builtins, name)) for name in _BUILTINS]
    found += [
        (f"math.{name}", getattr(math, name))
        for name in dir(math)
        if not name.startswith("_") and callable(getattr(math, name))
    ]
    found += [(f"qcore.ops.{name}", getattr(ops, name)) for name in ops.__all__]
    return tuple(found)


def _class_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _function_key(value: Any) -> str:
    return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', value)}"


def _describe_callable(value: Any) -> str:
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)
    module = getattr(value, "__module__", None)
    return f"{module}.{name}" if module else str(name)


def _plugin_packages(backends: Iterable[str]) -> tuple[set[str], list[str]]:
    """Top-level packages of the plugins serving ``backends`` (loading them), and
    for each backend no plugin here serves, why."""
    from qcore.plugin import BackendLoadError, UnknownBackendError, get_backend, list_backends

    packages: set[str] = set()
    unserved: list[str] = []
    installed = set(list_backends())
    for name in backends:
        if name not in installed:
            unserved.append(
                f"backend {name!r} is not installed here (pip install its plugin, or take it "
                "out of QCORE_BLOCK_PLUGINS)"
            )
            continue
        try:
            backend = get_backend(name)
        except (UnknownBackendError, BackendLoadError) as error:
            unserved.append(f"backend {name!r} does not load here: {error}")
            continue
        for plugin in backend.plugins:
            obj = plugin.obj
            if isinstance(obj, type(sys)):
                module = obj.__name__
            else:
                module = getattr(obj if isinstance(obj, type) else type(obj), "__module__", "")
            package = str(module or "").split(".")[0]
            if package and package not in sys.stdlib_module_names and package != "torch":
                packages.add(package)
    return packages, unserved


def _register_decomposed_ops() -> None:
    """torch registers ``quantized_decomposed`` ops when this module is imported."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401


def _import_qcore_classes() -> None:
    """The qcore modules whose classes converted models hold, so they can be found."""
    import qcore.engine.reference  # noqa: F401
    import qcore.kernels  # noqa: F401
    import qcore.pt2e  # noqa: F401
    import qcore.pt2e.fused  # noqa: F401
    import qcore.pt2e.guard  # noqa: F401


# --------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------


class _Encoder:
    def __init__(self, allow: _AllowList) -> None:
        self.allow = allow
        self.tensors: dict[str, torch.Tensor] = {}
        self.tensor_meta: dict[str, dict] = {}
        self._keys: dict[int, str] = {}
        self._keep: list[Any] = []  # keeps ids stable while encoding
        self._module_paths: dict[int, str] = {}

    def tensor(self, value: torch.Tensor, where: str) -> dict:
        key = self._keys.get(id(value))
        if key is None:
            if value.layout != torch.strided or type(value) not in (
                torch.Tensor,
                torch.nn.Parameter,
            ):
                raise UnsupportedModelError(
                    f"{where}: a {type(value).__name__} (layout {value.layout}); qcore.save "
                    "stores dense torch.Tensors and Parameters"
                )
            key = str(len(self._keys))
            self._keys[id(value)] = key
            self._keep.append(value)
            self.tensors[key] = value.detach()
            self.tensor_meta[key] = {
                "parameter": isinstance(value, torch.nn.Parameter),
                "requires_grad": bool(value.requires_grad),
            }
        return {"$": "tensor", "key": key}

    def value(self, value: Any, where: str) -> Any:
        if value is None or type(value) in (bool, int, float, str):
            return value
        if isinstance(value, torch.Tensor):
            return self.tensor(value, where)
        if isinstance(value, Node):
            return {"$": "node", "name": value.name}
        if isinstance(value, torch.Size):
            return {"$": "size", "items": [int(v) for v in value]}
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {"$": "tuple", "items": [self.value(v, where) for v in value]}
        if isinstance(value, list):  # torch.fx's immutable_list too
            return [self.value(v, where) for v in value]
        if isinstance(value, (dict, MappingProxyType)):  # OrderedDict, torch.fx's immutable_dict
            return {
                "$": "dict",
                "items": [[self.value(k, where), self.value(v, where)] for k, v in value.items()],
            }
        if type(value) in (set, frozenset):
            items = sorted((self.value(v, where) for v in value), key=repr)
            return {"$": type(value).__name__, "items": items}
        if isinstance(value, slice):
            items = [self.value(v, where) for v in (value.start, value.stop, value.step)]
            return {"$": "slice", "items": items}
        if value is Ellipsis:
            return {"$": "ellipsis"}
        if isinstance(value, complex):
            return {"$": "complex", "items": [value.real, value.imag]}
        for kind, cls in _TORCH_ENUMS.items():
            if isinstance(value, cls):
                return {"$": kind, "name": str(value).replace("torch.", "")}
        if isinstance(value, torch.device):
            return {"$": "device", "name": str(value)}
        if isinstance(value, enum.Enum):
            cls = self.allow.class_name(type(value), where, "value")
            return {"$": "enum", "class": cls, "value": self.value(value.value, where)}
        for plain in (bool, int, float, str):  # subclasses (torch's TorchVersion): the value
            if isinstance(value, plain):
                return plain(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            cls = self.allow.class_name(type(value), where, "value")
            names = [f.name for f in dataclasses.fields(value)]
            fields = {name: self.value(getattr(value, name), f"{where}.{name}") for name in names}
            # what __post_init__ or a method set beside the fields (a transformers
            # config's _attn_implementation_internal): the loaded object needs it too
            extra = {
                name: self.value(attribute, f"{where}.{name}")
                for name, attribute in getattr(value, "__dict__", {}).items()
                if name not in fields
            }
            encoded = {"$": "object", "class": cls, "fields": fields}
            return {**encoded, "extra": extra} if extra else encoded
        if isinstance(value, type):
            return {"$": "class", "name": self.allow.class_name(value, where, "type")}
        from qcore.engine.explain import Report

        if isinstance(value, Report):
            entries = [self.value(e, f"{where}.entries") for e in value.entries]
            return {"$": "report", "backend": value.backend, "entries": entries}
        if callable(value) and not isinstance(value, torch.nn.Module):
            return self.allow.function_name(value, where)
        raise UnsupportedModelError(
            f"{where}: a {type(value).__module__}.{type(value).__qualname__} is not plain data "
            "qcore.save can store (numbers, strings, tensors, dtypes, containers of them)"
        )

    def module(self, module: torch.nn.Module, where: str) -> dict:
        first = self._module_paths.get(id(module))
        if first is not None:  # one module under two names (a shared observer) stays one
            return {"kind": "alias", "path": first}
        self._module_paths[id(module)] = where
        self._keep.append(module)
        if isinstance(module, GraphModule):
            return self.graph_module(module, where)
        cls = self.allow.class_name(type(module), where, "module")
        state = module.__getstate__()
        if not isinstance(state, dict):
            raise UnsupportedModelError(
                f"{where}: {cls}.__getstate__ returns a {type(state).__name__}; qcore.save "
                "stores modules whose state is a dict"
            )
        entry = self._structure(module, state, where)
        entry.update({"kind": "module", "class": cls})
        # a report on a plain module: the user's model quantize_dynamic swapped layers in
        entry["attributes"] = self._attributes(state, _MODULE_INTERNALS | {"_qcore_report"}, where)
        entry["report"] = self._report(module, where)
        return entry

    def _report(self, module: torch.nn.Module, where: str) -> Any:
        from qcore.engine.explain import report_of

        report = report_of(module)
        return None if report is None else self.value(report, f"{where}.report")

    def _structure(self, module: torch.nn.Module, state: dict, where: str) -> dict:
        for hooks in _HOOKS:
            if state.get(hooks):
                raise UnsupportedModelError(
                    f"{where}: the module has {hooks[1:]} ({len(state[hooks])}); hooks are code, "
                    "which qcore.save does not store: remove them before saving"
                )
        parameters = {
            name: None if p is None else self.tensor(p, f"{where}.{name}")
            for name, p in state.get("_parameters", {}).items()
        }
        buffers = {
            name: None if b is None else self.tensor(b, f"{where}.{name}")
            for name, b in state.get("_buffers", {}).items()
        }
        modules = {
            name: None if child is None else self.module(child, _join(where, name))
            for name, child in state.get("_modules", {}).items()
        }
        return {
            "parameters": parameters,
            "buffers": buffers,
            "non_persistent": sorted(state.get("_non_persistent_buffers_set", ())),
            "modules": modules,
        }

    def _attributes(self, state: dict, skip: frozenset, where: str) -> dict:
        skipped = skip | frozenset(_HOOKS)
        return {
            name: self.value(value, f"{where}.{name}")
            for name, value in state.items()
            if name not in skipped
        }

    def graph_module(self, gm: GraphModule, where: str) -> dict:
        from qcore.pt2e.graph import _refuse_train

        state = dict(gm.__dict__)
        entry = self._structure(gm, state, where)
        tracer = state.get("_tracer_cls")
        entry.update(
            {
                "kind": "graph_module",
                "class_name": _class_name_of(gm),
                "graph": self.graph(gm.graph, where),
                "attributes": self._attributes(
                    state, _MODULE_INTERNALS | _GRAPH_MODULE_INTERNALS, where
                ),
                "report": self._report(gm, where),
                "tracer": None if tracer is None else self.value(tracer, f"{where}._tracer_cls"),
                "refuse_train_eval": type(gm).train is _refuse_train,
            }
        )
        return entry

    def graph(self, graph: Graph, where: str) -> dict:
        nodes = []
        for node in graph.nodes:
            at = f"{where}: node {node.name!r}"
            target: Any = node.target
            if node.op == "call_function":
                target = self.allow.function_name(node.target, f"{at} ({node.op})")
            nodes.append(
                {
                    "name": node.name,
                    "op": node.op,
                    "target": target,
                    "args": self.value(node.args, at),
                    "kwargs": self.value(node.kwargs, at),
                }
            )
        codegen = graph._codegen
        if type(codegen) is torch.fx.graph.CodeGen:
            encoded_codegen: dict = {"kind": "plain"}
        elif type(codegen) is torch.fx.graph._PyTreeCodeGen:
            from torch.utils._pytree import treespec_dumps

            info = codegen.pytree_info
            encoded_codegen = {
                "kind": "pytree",
                "orig_args": list(info.orig_args),
                "in_spec": None if info.in_spec is None else treespec_dumps(info.in_spec),
                "out_spec": None if info.out_spec is None else treespec_dumps(info.out_spec),
            }
        else:
            raise UnsupportedModelError(
                f"{where}: graph code generator {type(codegen).__name__}; qcore.save "
                "stores torch.fx's CodeGen and _PyTreeCodeGen"
            )
        tracer = getattr(graph, "_tracer_cls", None)
        return {
            "nodes": nodes,
            "codegen": encoded_codegen,
            "tracer": None if tracer is None else self.value(tracer, f"{where}.graph._tracer_cls"),
        }


_TORCH_ENUMS = {
    "dtype": torch.dtype,
    "layout": torch.layout,
    "memory_format": torch.memory_format,
    "qscheme": torch.qscheme,
}


def _class_name_of(gm: GraphModule) -> str:
    """The name torch.fx gave the graph module's class (export's subgraphs: "<lambda>")."""
    name = type(gm).__name__
    return name if name.isidentifier() and not keyword.iskeyword(name) else "GraphModule"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _backends_of(model: torch.nn.Module) -> list[str]:
    from qcore.engine.explain import report_of

    names = set()
    for module in model.modules():
        report = report_of(module)
        if report is not None:
            names.add(report.backend)
    return sorted(names)


def save(model: torch.nn.Module, f: FileLike, *, allow: Iterable[Any] = ()) -> None:
    """Write ``model`` (a converted model, FX or PT2E, lowered or reference) to ``f``
    as plain data that :func:`load` reads back without running code from the file.

    ``f`` is a path or a binary file object. ``allow`` names your own classes or
    functions the model holds (a custom module class, a ``torch.fx.wrap``-ed
    function); pass the same to :func:`load`. Raises :class:`UnsupportedModelError`
    naming what cannot be stored (a hook, an attribute that is not plain data).

    Example::

        >>> qcore.save(qcore.convert_fx(prepared), "model.qcore")
        >>> loaded = qcore.load("model.qcore")
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: got {type(model).__name__}; expected a torch.nn.Module")
    if isinstance(f, (str, os.PathLike)) and os.path.isdir(f):
        raise IsADirectoryError(
            f"f: got {os.fspath(f)!r}, a directory; expected the path of a file to write"
        )
    _import_qcore_classes()
    backends = _backends_of(model)
    encoder = _Encoder(_AllowList(allow, backends))
    encoded = encoder.module(model, "model")
    import qcore

    payload = {
        "format": FORMAT,
        "version": VERSION,
        "qcore_version": qcore.__version__,
        "torch_version": str(torch.__version__),
        "backends": backends,
        "model": encoded,
        "tensors": encoder.tensors,
        "tensor_meta": encoder.tensor_meta,
    }
    torch.save(payload, f)


# --------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------


def _expect(condition: bool, where: str, what: str, got: Any) -> None:
    if not condition:
        shown = repr(got)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise RefusedFileError(f"{where}: expected {what}, got {shown}")


def _identifier(name: Any, where: str, field: str) -> str:
    _expect(
        isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name),
        where,
        f"{field} to be a Python identifier",
        name,
    )
    return name


class _Decoder:
    def __init__(self, allow: _AllowList, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.allow = allow
        self._raw = tensors
        self._meta = meta
        self._tensors: dict[str, torch.Tensor] = {}
        self._modules: dict[str, torch.nn.Module] = {}

    def tensor(self, key: Any, where: str) -> torch.Tensor:
        _expect(isinstance(key, str) and key in self._raw, where, "a key of the tensor table", key)
        if key not in self._tensors:
            raw = self._raw[key]
            meta = self._meta.get(key, {})
            _expect(
                isinstance(meta, dict)
                and all(type(meta.get(k, False)) is bool for k in ("parameter", "requires_grad")),
                where,
                "tensor metadata {'parameter': bool, 'requires_grad': bool}",
                meta,
            )
            _expect(
                not meta.get("requires_grad") or raw.is_floating_point() or raw.is_complex(),
                where,
                "requires_grad only on floating-point tensors",
                raw.dtype,
            )
            if meta.get("parameter"):
                value: torch.Tensor = torch.nn.Parameter(raw, bool(meta.get("requires_grad")))
            else:
                value = raw.requires_grad_(True) if meta.get("requires_grad") else raw
            self._tensors[key] = value
        return self._tensors[key]

    def value(self, data: Any, where: str, nodes: dict[str, Node] | None = None) -> Any:
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        if isinstance(data, list):
            return [self.value(v, where, nodes) for v in data]
        _expect(isinstance(data, dict) and isinstance(data.get("$"), str), where, "a value", data)
        kind = data["$"]
        items = data.get("items")
        if kind in ("tuple", "set", "frozenset", "slice", "size", "complex", "dict"):
            _expect(isinstance(items, list), where, f"a list of {kind} items", items)
        if kind == "tuple":
            return tuple(self.value(v, where, nodes) for v in items)
        if kind == "dict":
            pairs = []
            for pair in items:
                _expect(isinstance(pair, list) and len(pair) == 2, where, "a [key, value]", pair)
                pairs.append((self.value(pair[0], where, nodes), self.value(pair[1], where, nodes)))
            return dict(pairs)
        if kind in ("set", "frozenset"):
            decoded = [self.value(v, where, nodes) for v in items]
            return set(decoded) if kind == "set" else frozenset(decoded)
        if kind == "slice":
            _expect(len(items) == 3, where, "three slice fields", items)
            return slice(*(self.value(v, where, nodes) for v in items))
        if kind == "size":
            _expect(all(type(v) is int for v in items), where, "integer sizes", items)
            return torch.Size(items)
        if kind == "complex":
            _expect(all(type(v) is float for v in items), where, "two floats", items)
            return complex(*items)
        if kind == "ellipsis":
            return Ellipsis
        if kind == "tensor":
            return self.tensor(data.get("key"), where)
        if kind == "node":
            name = data.get("name")
            _expect(nodes is not None, where, "no graph node reference outside a graph", data)
            _expect(name in nodes, where, "a node defined earlier in the graph", name)
            return nodes[name]
        if kind in _TORCH_ENUMS:
            name = data.get("name")
            value = getattr(torch, name, None) if _is_public_name(name) else None
            _expect(isinstance(value, _TORCH_ENUMS[kind]), where, f"a torch {kind} name", name)
            return value
        if kind == "device":
            name = data.get("name")
            _expect(isinstance(name, str), where, "a device name", name)
            return torch.device(name)
        if kind == "enum":
            cls = self.allow.resolve_class(data.get("class"), where, "value")
            _expect(issubclass(cls, enum.Enum), where, "an enum class", data.get("class"))
            try:
                return cls(self.value(data.get("value"), where))
            except ValueError:
                raise RefusedFileError(f"{where}: {data.get('value')!r} is not a {cls}") from None
        if kind == "object":
            cls = self.allow.resolve_class(data.get("class"), where, "value")
            fields = data.get("fields")
            names = [f.name for f in dataclasses.fields(cls)]
            _expect(
                isinstance(fields, dict) and sorted(fields) == sorted(names),
                where,
                f"the fields {names} of {cls.__qualname__}",
                fields,
            )
            extra = data.get("extra", {})
            _expect(
                isinstance(extra, dict)
                and all(isinstance(n, str) and n.isidentifier() for n in extra),
                where,
                "attributes by name",
                extra,
            )
            instance = cls.__new__(cls)
            for name, encoded in [*((n, fields[n]) for n in names), *extra.items()]:
                object.__setattr__(instance, name, self.value(encoded, f"{where}.{name}"))
            return instance
        if kind == "class":
            return self.allow.resolve_class(data.get("name"), where, "type")
        if kind == "report":
            from qcore.engine.explain import Entry, Report

            entries = [self.value(e, where) for e in data.get("entries") or []]
            _expect(all(isinstance(e, Entry) for e in entries), where, "report entries", entries)
            _expect(isinstance(data.get("backend"), str), where, "a backend name", data)
            return Report(data["backend"], entries)
        if kind in ("function", "op", "hop"):
            return self.allow.resolve_function(data, where)
        raise RefusedFileError(f"{where}: unknown value kind {kind!r}")

    def module(self, data: Any, where: str) -> torch.nn.Module:
        _expect(isinstance(data, dict), where, "a module entry", data)
        kind = data.get("kind")
        if kind == "alias":
            path = data.get("path")
            _expect(path in self._modules, where, "the path of a module read before", path)
            return self._modules[path]
        if kind == "graph_module":
            module: torch.nn.Module = self.graph_module(data, where)
        else:
            _expect(kind == "module", where, "kind 'module', 'graph_module' or 'alias'", kind)
            module = self._plain_module(data, where)
        self._modules[where] = module
        return module

    def _plain_module(self, data: dict, where: str) -> torch.nn.Module:
        cls = self.allow.resolve_class(data.get("class"), where, "module")
        state = self._structure(data, where)
        attributes = self._attributes(data, where)
        state.update(attributes)
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        try:
            module.__setstate__(state)
        except Exception as error:
            raise RefusedFileError(
                f"{where}: rebuilding {cls.__qualname__} from the file's state failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        self._attach_report(module, data, where)
        return module

    def _structure(self, data: dict, where: str) -> dict:
        parameters, buffers, modules = (data.get(k) for k in ("parameters", "buffers", "modules"))
        for field, value in (
            ("parameters", parameters),
            ("buffers", buffers),
            ("modules", modules),
        ):
            _expect(isinstance(value, dict), where, f"'{field}' as a dict", value)
            for name in value:
                _expect(
                    _SEGMENT.match(str(name)) is not None and not str(name).startswith("__"),
                    where,
                    f"{field} names of letters, digits and _",
                    name,
                )
        decoded_parameters = {}
        for name, ref in parameters.items():
            value = None if ref is None else self.value(ref, _join(where, name))
            _expect(
                value is None or isinstance(value, torch.nn.Parameter),
                where,
                f"parameter {name!r} to be a Parameter",
                type(value).__name__,
            )
            decoded_parameters[name] = value
        decoded_buffers = {}
        for name, ref in buffers.items():
            value = None if ref is None else self.value(ref, _join(where, name))
            _expect(
                value is None or isinstance(value, torch.Tensor),
                where,
                f"buffer {name!r} to be a tensor",
                type(value).__name__,
            )
            decoded_buffers[name] = value
        non_persistent = data.get("non_persistent", [])
        _expect(
            isinstance(non_persistent, list) and set(non_persistent) <= set(buffers),
            where,
            "non-persistent buffers among the buffers",
            non_persistent,
        )
        return {
            "_parameters": decoded_parameters,
            "_buffers": decoded_buffers,
            "_non_persistent_buffers_set": set(non_persistent),
            "_modules": {
                name: None if child is None else self.module(child, _join(where, name))
                for name, child in modules.items()
            },
        }

    def _attributes(self, data: dict, where: str) -> dict:
        attributes = data.get("attributes")
        _expect(isinstance(attributes, dict), where, "'attributes' as a dict", attributes)
        decoded = {}
        for name, value in attributes.items():
            _expect(
                isinstance(name, str)
                and name.isidentifier()
                and not name.startswith("__")
                and name not in _RESERVED,
                where,
                "an attribute name",
                name,
            )
            decoded[name] = self.value(value, f"{where}.{name}")
        return decoded

    def graph_module(self, data: dict, where: str) -> GraphModule:
        from qcore.engine.scripting import keep_model_when_scripted
        from qcore.pt2e.graph import refuse_train_eval

        class_name = _identifier(data.get("class_name"), where or "model", "class_name")
        gm = GraphModule(torch.nn.Module(), Graph(), class_name=class_name)
        state = self._structure(data, where)
        gm.__dict__.update(state)
        for name, value in self._attributes(data, where).items():
            gm.__dict__[name] = value
        graph = self.graph(data.get("graph"), gm, where)
        tracer = data.get("tracer")
        if tracer is not None:
            gm._tracer_cls = self.value(tracer, where)
        try:
            gm.graph = graph  # generates forward from the checked graph
        except Exception as error:
            raise RefusedFileError(
                f"{where}: the graph does not compile: {type(error).__name__}: {error}"
            ) from error
        self._attach_report(gm, data, where)
        if data.get("refuse_train_eval") is True:
            refuse_train_eval(gm)
        return keep_model_when_scripted(gm)  # as convert left it (engine/scripting.py)

    def _attach_report(self, module: torch.nn.Module, data: dict, where: str) -> None:
        from qcore.engine.explain import Report, attach_report

        report = data.get("report")
        if report is not None:
            decoded = self.value(report, where)
            _expect(isinstance(decoded, Report), where, "a report", report)
            attach_report(module, decoded)

    def graph(self, data: Any, owner: GraphModule, where: str) -> Graph:
        _expect(
            isinstance(data, dict) and isinstance(data.get("nodes"), list),
            where or "model",
            "a graph with a list of nodes",
            data,
        )
        tracer = data.get("tracer")
        graph = Graph(tracer_cls=None if tracer is None else self.value(tracer, where))
        nodes: dict[str, Node] = {}
        outputs = 0
        for index, entry in enumerate(data["nodes"]):
            at = f"{where}: node {index}"
            _expect(isinstance(entry, dict), at, "a node entry", entry)
            name = _identifier(entry.get("name"), at, "name")
            at = f"{where}: node {name!r}"
            _expect(name not in nodes, at, "a name used once", name)
            op = entry.get("op")
            _expect(op in _NODE_OPS, at, f"op in {list(_NODE_OPS)}", op)
            target = self._target(op, entry.get("target"), owner, at)
            args = self.value(entry.get("args"), at, nodes)
            kwargs = self.value(entry.get("kwargs"), at, nodes)
            _expect(isinstance(args, tuple), at, "args as a tuple", args)
            _expect(
                isinstance(kwargs, dict)
                and all(
                    isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)
                    for k in kwargs
                ),
                at,
                "kwargs keyed by identifiers",
                kwargs,
            )
            if op == "call_function" and target is builtins.getattr:
                _expect(
                    len(args) == 2 and _is_public_name(args[1]) and not kwargs,
                    at,
                    "getattr(value, public attribute name)",
                    args,
                )
            if op == "output":
                outputs += 1
            node = graph.create_node(op, target, args, kwargs, name=name)
            _expect(node.name == name, at, "a name the graph keeps", node.name)
            nodes[name] = node
        _expect(outputs == 1, where or "model", "one output node", outputs)
        graph._codegen = self._codegen(data.get("codegen"), where or "model")
        return graph

    def _target(self, op: str, target: Any, owner: GraphModule, at: str) -> Any:
        if op == "call_function":
            _expect(isinstance(target, dict), at, "a function reference", target)
            return self.allow.resolve_function(target, at)
        if op == "placeholder":
            _expect(
                isinstance(target, str)
                and target.lstrip("*").isidentifier()
                and not keyword.iskeyword(target.lstrip("*"))
                and len(target) - len(target.lstrip("*")) <= 2,
                at,
                "an input name",
                target,
            )
            return target
        if op == "output":
            _expect(target == "output", at, "'output'", target)
            return target
        if op == "call_method":
            _expect(
                target in self.allow.tensor_methods,
                at,
                "a public torch.Tensor method outside the deny-list",
                target,
            )
            return target
        _expect(
            isinstance(target, str)
            and target
            and all(_SEGMENT.match(s) and not s.startswith("__") for s in target.split(".")),
            at,
            "a dotted attribute path",
            target,
        )
        self._check_path(owner, target, op, at)
        return target

    @staticmethod
    def _check_path(owner: GraphModule, target: str, op: str, at: str) -> None:
        """get_attr and call_module reach only what the file itself put there."""
        *path, last = target.split(".")
        module: torch.nn.Module = owner
        for segment in path:
            child = module.__dict__["_modules"].get(segment)
            _expect(
                isinstance(child, torch.nn.Module),
                at,
                f"submodule {segment!r} of the model",
                target,
            )
            module = child
        if op == "call_module":
            _expect(
                isinstance(module.__dict__["_modules"].get(last), torch.nn.Module),
                at,
                "a submodule of the model",
                target,
            )
            return
        stored = module.__dict__
        found = (
            last in stored["_parameters"]
            or last in stored["_buffers"]
            or last in stored["_modules"]
            or (last in stored and last not in _RESERVED)
        )
        _expect(found, at, "a parameter, buffer, submodule or stored attribute", target)

    def _codegen(self, data: Any, where: str) -> Any:
        _expect(isinstance(data, dict), where, "a codegen entry", data)
        kind = data.get("kind")
        if kind == "plain":
            return torch.fx.graph.CodeGen()
        _expect(kind == "pytree", where, "codegen 'plain' or 'pytree'", kind)
        from torch.utils._pytree import treespec_loads

        orig_args = data.get("orig_args")
        _expect(isinstance(orig_args, list), where, "orig_args as a list", orig_args)
        for name in orig_args:
            _identifier(name, where, "an input name")
        specs = []
        for field in ("in_spec", "out_spec"):
            text = data.get(field)
            _expect(text is None or isinstance(text, str), where, f"{field} as JSON", text)
            try:
                specs.append(None if text is None else treespec_loads(text))
            except Exception as error:
                raise RefusedFileError(f"{where}: {field} does not parse: {error}") from None
        _check_keyword_inputs(specs[0], where)
        info = torch.fx.graph._PyTreeInfo(orig_args, specs[0], specs[1])
        return torch.fx.graph._PyTreeCodeGen(info)


def _check_keyword_inputs(in_spec: Any, where: str) -> None:
    """torch.fx writes the keys of an in_spec's keyword inputs into forward's code."""
    if in_spec is None or in_spec.type is not tuple or in_spec.num_children != 2:
        return
    args, kwargs = in_spec.child(0), in_spec.child(1)
    if args.type is tuple and kwargs.type is dict:
        for key in kwargs.context:
            _identifier(key, where, "in_spec's keyword input names")


def _name_of(f: Any) -> str:
    return os.fspath(f) if isinstance(f, (str, os.PathLike)) else "the file"


def _read(f: FileLike) -> Any:
    """torch.load with weights_only=True: tensors and plain containers, no code."""
    try:
        with warnings.catch_warnings():
            # torch.load's notice that it would hand a TorchScript archive to
            # torch.jit.load: with weights_only=True it refuses it instead.
            warnings.filterwarnings("ignore", "'torch.load' received a zip file", UserWarning)
            return torch.load(f, map_location="cpu", weights_only=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError):
        raise
    except OSError as error:
        # torch's zip reader raises EINVAL for an archive cut short: the file opened,
        # so it is the content, not the path, that is wrong.
        raise RefusedFileError(
            f"qcore.load refused {_name_of(f)}: torch.load(weights_only=True) cannot read it "
            f"({type(error).__name__}: {error}): the archive is truncated or corrupt; "
            "qcore.load reads files written by qcore.save"
        ) from None
    except pickle.UnpicklingError as error:
        lines = str(error).strip().splitlines()
        named = next((line.strip() for line in lines if "GLOBAL" in line), "")
        if named:
            raise RefusedFileError(
                f"qcore.load refused {_name_of(f)}: it names Python objects to build, not plain "
                f"data ({named.split(' was not')[0]}): torch.load(weights_only=False) would "
                "run code from the file to build them. Nothing from it ran. qcore.load reads "
                "files written by qcore.save (a whole-model torch.save file runs code when "
                "loaded: load it only if you trust it, then qcore.save it)"
            ) from None
        raise RefusedFileError(
            f"qcore.load refused {_name_of(f)}: torch.load(weights_only=True) cannot read it "
            f"({lines[-1] if lines else type(error).__name__}); qcore.load reads files written "
            "by qcore.save"
        ) from None
    except Exception as error:
        if "TorchScript" in str(error):
            raise RefusedFileError(
                f"qcore.load refused {_name_of(f)}: it is a TorchScript archive "
                "(torch.jit.save), which holds code; qcore.load reads files written by qcore.save"
            ) from None
        raise RefusedFileError(
            f"qcore.load refused {_name_of(f)}: torch.load(weights_only=True) cannot read it "
            f"({type(error).__name__}: {error}); qcore.load reads files written by qcore.save"
        ) from None


def load(f: FileLike, *, allow: Iterable[Any] = ()) -> torch.nn.Module:
    """Read a model :func:`save` wrote, without running code from the file.

    The file is read with ``torch.load(weights_only=True)``; every operator,
    class and attribute it names is checked against qcore's allow-lists before
    the model is built, and a file that names anything else is refused with a
    :class:`RefusedFileError` saying what. Packed weights are packed for each
    kernel's own engine, whatever ``torch.backends.quantized.engine`` is.
    ``allow`` names your own classes or functions, as passed to :func:`save`.

    Example::

        >>> loaded = qcore.load("model.qcore")
        >>> print(qcore.explain(loaded))
    """
    payload = _read(f)
    where = f"qcore.load refused {_name_of(f)}"
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise RefusedFileError(
            f"{where}: format is {got!r}, expected {FORMAT!r}: not a file written by qcore.save"
        )
    version = payload.get("version")
    if not isinstance(version, int) or not 1 <= version <= VERSION:
        raise RefusedFileError(
            f"{where}: version {version!r}; this qcore reads versions 1 to {VERSION}"
        )
    tensors, meta = payload.get("tensors"), payload.get("tensor_meta", {})
    _expect(isinstance(tensors, dict), where, "'tensors' as a dict", type(tensors).__name__)
    for key, value in tensors.items():
        _expect(
            isinstance(key, str) and type(value) is torch.Tensor,
            where,
            "'tensors' to hold tensors",
            f"{key!r}: {type(value).__name__}",
        )
    _expect(isinstance(meta, dict), where, "'tensor_meta' as a dict", type(meta).__name__)
    backends = payload.get("backends", [])
    _expect(
        isinstance(backends, list) and all(isinstance(b, str) for b in backends),
        where,
        "'backends' as a list of names",
        backends,
    )
    _import_qcore_classes()
    decoder = _Decoder(_AllowList(allow, backends), tensors, meta)
    try:
        return decoder.module(payload.get("model"), "model")
    except RecursionError:
        raise RefusedFileError(f"{where}: the model is nested too deeply") from None
    except RefusedFileError as error:
        raise RefusedFileError(f"qcore.load refused {_name_of(f)}: {error}") from None
    except Exception as error:  # a value of the right kind but out of range, say
        raise RefusedFileError(
            f"{where}: the model it describes does not rebuild: {type(error).__name__}: {error}"
        ) from error


def _roundtrip(model: torch.nn.Module, allow: Iterable[Any] = ()) -> torch.nn.Module:
    """save then load through memory (tests, and checking a model saves)."""
    buffer = io.BytesIO()
    save(model, buffer, allow=allow)
    buffer.seek(0)
    return load(buffer, allow=allow)
