"""The JSON form of a BackendConfig, with classes and functions resolved only
through an allow-list.

Format (version 1)::

    {
      "format": "qcore.BackendConfig",
      "version": 1,
      "name": "my_backend",
      "configs": [
        {
          "pattern": [{"ref": "torch.nn.modules.conv.Conv2d"}, "relu"],
          "observation_type": "OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT",
          "dtype_configs": [
            {
              "input_dtype": {"dtype": "quint8", "quant_min_lower_bound": 0,
                              "quant_max_upper_bound": 255,
                              "scale_min_lower_bound": 0.000244140625},
              "output_dtype": "quint8",
              "weight_dtype": "qint8",
              "bias_dtype": "float32",
              "is_dynamic": false
            }
          ],
          "root_module": "torch.nn.modules.conv.Conv2d",
          "fuser_method": "my_plugin.fusers.fuse_conv_relu",
          "num_tensor_args_to_observation_type": {"2": "OUTPUT_SHARE_OBSERVER_WITH_INPUT"},
          "input_type_to_index": {"weight": 1, "bias": 2}
        }
      ]
    }

Rules:

* **Patterns** (``pattern``, ``pattern_complex_format``): a JSON string is a
  *method name* (``"relu"`` means ``Tensor.relu``); ``{"ref": "qualified.name"}``
  is a class or function; a JSON array is a tuple (the simple form in forward
  order, or the nested complex form).
* **Reference fields** (``root_module``, ``qat_module``,
  ``reference_quantized_module_for_root``, ``fused_module``, ``fuser_method``,
  ``root_node_getter``, ``extra_inputs_getter``) hold only references, so they
  are plain qualified-name strings.
* **Callable fields** (``fuser_method``, ``root_node_getter``,
  ``extra_inputs_getter``) name functions the engine *calls* (the fuser with
  ``(is_qat, *modules)`` when it fuses, the getters with each match), so they
  take only functions meant for that (see "What a callable field may name").
* **Module fields** take torch.nn.Module subclasses; ``qat_module`` and
  ``reference_quantized_module_for_root`` only those with a ``from_float``
  classmethod (prepare calls ``qat_module.from_float(float_module)``).
* **Dtypes** are torch attribute names (``"quint8"``, ``"float32"``;
  ``"torch.quint8"`` is read too). A dtype with constraints is an object with
  a ``"dtype"`` key and the non-None DTypeWithConstraints fields.
* **Observation types** are ObservationType member names.
* Non-finite floats are written ``{"float": "inf"}``.

Qualified names are ``module.qualname`` of the object (``torch.add``,
``operator.add``, ``torch.nn.modules.linear.Linear``). A config file is data,
never code: reading a name **never imports a module** (importing runs the
module's code; ``qcore.__main__`` would run the CLI and exit). A name resolves
only inside modules already imported, by looking in their namespaces without
running ``__getattr__`` hooks or descriptors; script modules (``__main__``,
``*.__main__``) and dunder attributes (``__subclasses__``, ``__globals__``)
are never reached. An :class:`Allowlist` admits names under its module
prefixes (by default ``torch``, ``qcore`` and ``operator``) and objects
registered one by one with :meth:`Allowlist.allow`. Plugins register their
fuser methods and modules with :func:`allow` (or :func:`allow_config`), or a
whole package with :func:`allow_module_prefix`; a plugin's modules are
imported when the plugin loads, before its names are read.

What a callable field may name
------------------------------

The prefixes admit any function under ``torch`` and ``qcore``; the engine
calls a callable field's function, so ``"fuser_method": "torch.load"`` (or
``torch.hub.load``, ``qcore.cli.main``) would run at fuse time. Config files
are data, never code (issue 14, section 2): a callable field resolves only to

* a Python function (a ``def``, not a class or builtin) *defined* in one of the
  allow-list's **callable modules**, modules that hold nothing but fusers and
  getters: by default :data:`DEFAULT_CALLABLE_MODULES` (qcore's
  ``qcore.config.fusers`` and ``qcore.config.onednn_fusions``, torch.ao's
  ``fuser_method_mappings`` and ``backend_config.onednn``); add a module of
  your own with :func:`allow_callable_module` (exact modules, not prefixes:
  a prefix admits whatever lands under it later); or
* an object **registered** with :func:`allow` (whoever registers it vouches for
  it in any field). A loaded plugin's fusers and getters are registered this
  way: the registry calls :func:`allow_config` on every backend it loads, which
  registers what each field of the config holds *for that kind of field* (a
  function a plugin's pattern matches is not thereby callable).

Anything else in a callable field is a ConfigError naming the field, the name
and what is allowed, when read and when written (:func:`to_json` refuses a
config :func:`from_json` would refuse). Patterns are matched by identity and
never called, so they keep the prefix rule; ``BackendConfig.from_dict`` takes
Python objects, not names (a string there is "not a callable"). No other
config is read from JSON: QConfig and observer settings have no JSON form.

Every failure to read a document is a :class:`ConfigError` whose message starts
with the failing field's path in the document
(``configs[2].dtype_configs[0].input_dtype.quant_max_upper_bound: got 300
(int); expected a value within torch.quint8's range [0, 255]``).
"""

from __future__ import annotations

import inspect
import json as _json
import math
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch

# qcore's own callable modules (DEFAULT_CALLABLE_MODULES) are imported with the
# reader, so their fusers and getters can be named before any backend loads.
import qcore.config.fusers  # noqa: F401
import qcore.config.onednn_fusions  # noqa: F401
from qcore.config.backend import BackendConfig
from qcore.config.dtypes import DTypeConfig, DTypeWithConstraints, ObservationType
from qcore.config.errors import ConfigError, describe, relocate
from qcore.config.pattern import MAX_PATTERN_DEPTH, BackendPatternConfig

__all__ = [
    "Allowlist",
    "DEFAULT_CALLABLE_MODULES",
    "FORMAT",
    "VERSION",
    "allow",
    "allow_callable_module",
    "allow_config",
    "allow_module_prefix",
    "default_allowlist",
    "from_json",
    "qualified_name",
    "to_json",
]

FORMAT = "qcore.BackendConfig"
VERSION = 1

DEFAULT_MODULE_PREFIXES = ("operator", "qcore", "torch")

# Modules of fusers and getters only: their functions may fill a callable field.
DEFAULT_CALLABLE_MODULES = (
    "qcore.config.fusers",
    "qcore.config.onednn_fusions",
    "torch.ao.quantization.fuser_method_mappings",
    "torch.ao.quantization.backend_config.onednn",
)

# Modules whose objects report an implementation module as ``__module__``.
_MODULE_ALIASES = {"_operator": "operator"}

_REF_FIELDS = (
    "root_module",
    "qat_module",
    "reference_quantized_module_for_root",
    "fused_module",
    "fuser_method",
    "root_node_getter",
    "extra_inputs_getter",
)
# The reference fields whose object the engine calls.
_CALLABLE_FIELDS = ("fuser_method", "root_node_getter", "extra_inputs_getter")
_PATTERN_FIELDS = ("pattern", "pattern_complex_format")
_CONSTRAINT_FIELDS = (
    "quant_min_lower_bound",
    "quant_max_upper_bound",
    "scale_min_lower_bound",
    "scale_max_upper_bound",
    "scale_exact_match",
    "zero_point_exact_match",
    "scale_power_of_two",
)
_DTYPE_KINDS = ("input_dtype", "output_dtype", "weight_dtype")


# A document nests about six deep, plus its patterns: the limit keeps the
# recursive decoders far from Python's recursion limit.
MAX_DEPTH = MAX_PATTERN_DEPTH + 32

# A script module runs its program when imported and is never a library.
_SCRIPT_MODULE = "__main__"


def _within(module_name: str, prefix: str) -> bool:
    return module_name == prefix or module_name.startswith(prefix + ".")


def _is_script_module(module_name: str) -> bool:
    return _SCRIPT_MODULE in module_name.split(".")


def _kind(obj: Any) -> str:
    """What ``obj`` is, for a message, without calling its ``__repr__`` (code of
    the object a hostile name reached)."""
    if isinstance(obj, type):
        return f"class {obj.__qualname__}"
    return f"an object of type {type(obj).__qualname__}"


def _namespace(obj: Any) -> dict[str, Any]:
    """An object's own ``__dict__``, read without running its class's
    ``__getattribute__`` (a lazy module's would load it)."""
    try:
        namespace = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return {}
    return namespace if isinstance(namespace, dict) else dict(namespace)


def _canonical_module(module_name: str) -> str:
    top, _, rest = module_name.partition(".")
    if top in _MODULE_ALIASES:
        return _MODULE_ALIASES[top] + ("." + rest if rest else "")
    return module_name


def _lookup_loaded(name: str) -> Any:
    """Resolve ``name`` using only modules already imported; raise LookupError."""
    parts = name.split(".")
    for index in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:index]))
        if module is None:
            continue
        obj: Any = module
        try:
            for part in parts[index:]:
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise LookupError(name)


def _derive_name(obj: Any) -> str | None:
    """The importable qualified name of a module-level class or function, or None."""
    module_name = getattr(obj, "__module__", None)
    if not isinstance(module_name, str):
        return None
    module_name = _canonical_module(module_name)
    candidates = []
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(qualname, str) and "<locals>" not in qualname:
        candidates.append(f"{module_name}.{qualname}")
    name = getattr(obj, "__name__", None)
    if isinstance(name, str) and f"{module_name}.{name}" not in candidates:
        candidates.append(f"{module_name}.{name}")
    for candidate in candidates:
        try:
            if _lookup_loaded(candidate) is obj:
                return candidate
        except LookupError:
            pass
    # Module-level aliases such as torch.nn.functional.max_pool2d (made by a factory).
    module = sys.modules.get(module_name)
    if module is not None:
        for attribute, value in vars(module).items():
            if value is obj and not attribute.startswith("__"):
                return f"{module_name}.{attribute}"
    return None


def qualified_name(obj: Any) -> str | None:
    """The qualified name JSON uses for ``obj``, or None if it has none
    (a lambda, a local function, an instance)."""
    return _derive_name(obj)


def _check_module_name(field: str, module_name: Any) -> None:
    parts = module_name.split(".") if isinstance(module_name, str) else []
    if not parts or not all(part.isidentifier() for part in parts):
        raise ConfigError(
            f"{field}: got {describe(module_name)}; expected a dotted module name such as "
            "'qcore_mychip'"
        )
    if _SCRIPT_MODULE in parts:
        raise ConfigError(
            f"{field}: got {module_name!r}; expected a library module, not a script module "
            "(__main__ runs a program; it is never allowed)"
        )


class Allowlist:
    """Which qualified names JSON may refer to.

    A name is allowed when it lies under one of the module prefixes
    (``"torch"`` admits ``torch.nn.modules.conv.Conv2d``, not ``torchvision``)
    or in one of the callable modules, or when the object was registered with
    :meth:`allow`. A callable field (``fuser_method`` and the getters) takes
    only a function defined in a callable module or a registered object (see
    :meth:`is_callable_allowed`). Resolving a name
    imports nothing: it is looked up in modules already imported, through
    modules and classes only; every module met on the way, and the object's own
    ``__module__``, must be allowed too, so ``torch.os.system`` is refused. Script
    modules (``__main__``, ``*.__main__``) are never allowed.

    Example::

        >>> allowlist = Allowlist()              # torch, qcore, operator
        >>> allowlist.allow(my_fuser)            # a module-level function
        >>> allowlist.allow(make_fuser(nn.ReLU), name="my_plugin.fuse_relu")
        >>> allowlist.allow_module_prefix("my_plugin")
        >>> allowlist.allow_callable_module("my_plugin.fusers")
    """

    def __init__(
        self,
        prefixes: Iterable[str] = DEFAULT_MODULE_PREFIXES,
        callable_modules: Iterable[str] = DEFAULT_CALLABLE_MODULES,
    ) -> None:
        self._prefixes: list[str] = []
        self._callable_modules: list[str] = []
        self._by_name: dict[str, Any] = {}
        self._by_id: dict[int, str] = {}
        # Registered objects a callable field may hold, by id (the object kept alive).
        self._callables: dict[int, Any] = {}
        for prefix in prefixes:
            self.allow_module_prefix(prefix)
        for module_name in callable_modules:
            self.allow_callable_module(module_name)

    def __repr__(self) -> str:
        return (
            f"Allowlist(prefixes={self.prefixes}, callable_modules={self.callable_modules}, "
            f"registered={len(self._by_name)})"
        )

    @property
    def prefixes(self) -> list[str]:
        return sorted(self._prefixes)

    @property
    def callable_modules(self) -> list[str]:
        return sorted(self._callable_modules)

    @property
    def registered_names(self) -> list[str]:
        return sorted(self._by_name)

    def copy(self) -> Allowlist:
        other = Allowlist(self._prefixes, self._callable_modules)
        other._by_name = dict(self._by_name)
        other._by_id = dict(self._by_id)
        other._callables = dict(self._callables)
        return other

    # -- registration ---------------------------------------------------

    def allow_module_prefix(self, prefix: str) -> None:
        """Allow every name under the module ``prefix`` (e.g. ``"qcore_mychip"``)
        in patterns and module fields; a callable field takes a function only
        from a callable module (:meth:`allow_callable_module`) or registered."""
        _check_module_name("Allowlist.prefix", prefix)
        if prefix not in self._prefixes:
            self._prefixes.append(prefix)

    def allow_callable_module(self, module_name: str) -> None:
        """Let the functions *defined* in module ``module_name`` (exactly that
        module, e.g. ``"qcore_mychip.fusers"``) fill callable fields
        (``fuser_method``, ``root_node_getter``, ``extra_inputs_getter``); its
        names are allowed everywhere else too. Give a module that holds
        nothing but fusers and getters: the engine calls what a config names."""
        _check_module_name("Allowlist.callable_module", module_name)
        if module_name not in self._callable_modules:
            self._callable_modules.append(module_name)

    def allow(self, obj: Any, name: str | None = None) -> Any:
        """Allow one object; returns it, so it can decorate a function.

        ``name`` defaults to the object's qualified name; give one for an object
        that has none (a closure made by a factory). A name already registered
        for another object is an error. A registered object may fill any
        field, a callable one included: register only what a config may call.
        """
        return self._register(obj, name, callable_field=True)

    def _register(self, obj: Any, name: str | None, *, callable_field: bool) -> Any:
        if name is None:
            name = _derive_name(obj)
            if name is None:
                raise ConfigError(
                    f"Allowlist.allow: got {describe(obj)}; expected a module-level class or "
                    "function (it has no importable qualified name); define it at module "
                    "level or pass name='package.module.name'"
                )
        elif not isinstance(name, str) or not all(p.isidentifier() for p in name.split(".")):
            raise ConfigError(
                f"Allowlist.allow name: got {describe(name)}; expected a dotted name such "
                "as 'my_plugin.fusers.fuse_conv_relu'"
            )
        existing = self._by_name.get(name)
        if existing is not None and existing is not obj:
            raise ConfigError(
                f"Allowlist.allow name: got {name!r} for {describe(obj)}; expected a name not "
                f"already registered (it names {describe(existing)})"
            )
        self._by_name[name] = obj
        self._by_id.setdefault(id(obj), name)
        if callable_field:
            self._callables[id(obj)] = obj
        return obj

    def allow_config(self, config: BackendConfig) -> list[str]:
        """Allow every class and function a BackendConfig refers to, for the
        kind of field that holds it: what its callable fields hold may be
        named in callable fields, what its patterns and module fields hold
        only in patterns and module fields.

        Returns one line per object that could not be registered (no
        qualified name), naming its field; nothing is raised for those.
        """
        problems = []
        for index, pattern_config in enumerate(config.configs):
            for field_name, obj in _referenced_objects(pattern_config):
                callable_field = field_name in _CALLABLE_FIELDS
                name = self.name_for(obj)
                if name is not None and (not callable_field or self.is_callable_allowed(obj)):
                    continue
                try:
                    self._register(obj, name, callable_field=callable_field)
                except ConfigError as error:
                    problems.append(f"configs[{index}].{field_name}: {error}")
        return problems

    # -- queries --------------------------------------------------------

    def is_module_allowed(self, module_name: str) -> bool:
        if _is_script_module(module_name):
            return False
        module_name = _canonical_module(module_name)
        return any(
            _within(module_name, prefix) for prefix in (*self._prefixes, *self._callable_modules)
        )

    def is_callable_allowed(self, obj: Any) -> bool:
        """Whether ``obj`` may fill a callable field: an object registered for
        one (:meth:`allow`, or :meth:`allow_config` from a callable field), or
        a Python function defined in a callable module. Nothing of ``obj``
        runs: its type and ``__module__`` are read, not called."""
        if self._callables.get(id(obj)) is obj:
            return True
        if type(obj) is not types.FunctionType:
            return False  # a class would be instantiated, a builtin is no fuser
        module_name = obj.__module__
        return isinstance(module_name, str) and (
            _canonical_module(module_name) in self._callable_modules
        )

    def describe_callables(self) -> str:
        return (
            f"a fuser or getter function defined in one of the callable modules "
            f"{self.callable_modules}, or one registered with qcore.config.json.allow(fn) (a "
            "loaded plugin's are); the engine calls it, so a config names no other function"
        )

    def is_name_allowed(self, name: str) -> bool:
        """Whether ``name`` is registered or lies under an allowed prefix
        (this does not check that it resolves)."""
        return name in self._by_name or self.is_module_allowed(name)

    def describe_allowed(self) -> str:
        text = f"names under the module prefixes {self.prefixes}"
        outside = [
            name
            for name in self.callable_modules
            if not any(_within(name, prefix) for prefix in self._prefixes)
        ]
        if outside:
            text += f" or in the callable modules {outside}"
        if self._by_name:
            text += f" or one of {len(self._by_name)} registered names"
        return (
            text + "; register others with qcore.config.json.allow(obj) or "
            "allow_module_prefix('package')"
        )

    def name_for(self, obj: Any) -> str | None:
        """The name ``obj`` is written under, or None if it is not allowed."""
        name = self._by_id.get(id(obj))
        if name is not None and self._by_name.get(name) is obj:
            return name
        name = _derive_name(obj)
        if name is not None and self.is_module_allowed(name):
            return name
        return None

    def reference(self, obj: Any, field: str) -> str:
        """Like :meth:`name_for` but raise a ConfigError naming ``field``."""
        name = self.name_for(obj)
        if name is not None:
            return name
        derived = _derive_name(obj)
        if derived is None:
            how = (
                "a module-level class or function (a lambda or local function has no "
                "qualified name); define it at module level, or register it with "
                "qcore.config.json.allow(obj, name='package.module.name')"
            )
        else:
            how = (
                f"an object in the allow-list ({self.describe_allowed()}); "
                f"{derived!r} is outside it"
            )
        raise ConfigError(f"{field}: got {describe(obj)}; expected {how}")

    def resolve(self, name: Any, field: str) -> Any:
        """The object ``name`` refers to; a ConfigError naming ``field`` if the
        name is not allowed or does not resolve.

        Nothing is imported and no code of the named objects runs: the name is
        looked up in modules already in ``sys.modules``, through their own
        namespaces (no module ``__getattr__``, no descriptors), so ``qcore.__main__``
        or ``torch.classes.x.y`` cannot start a program or raise from inside torch.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(
                f"{field}: got {describe(name)}; expected a qualified name string such as "
                "'torch.nn.modules.linear.Linear'"
            )
        if name in self._by_name:
            return self._by_name[name]
        parts = name.split(".")
        if not all(part.isidentifier() for part in parts) or len(parts) < 2:
            raise ConfigError(
                f"{field}: got {describe(name)}; expected a dotted qualified name such as "
                "'torch.nn.modules.linear.Linear'"
            )
        if _SCRIPT_MODULE in parts:
            raise ConfigError(
                f"{field}: got {name!r}, which names a script module; expected a name in a "
                "library module (__main__ runs a program and is never allowed)"
            )
        # A dunder attribute leads out of the object it is read on (__base__,
        # __subclasses__, __globals__, __builtins__); no config names one.
        dunder = next((part for part in parts if part.startswith("__")), None)
        if dunder is not None:
            raise ConfigError(
                f"{field}: got {name!r}; expected a name without dunder parts ({dunder!r} "
                "leads out of the object it is looked up on)"
            )
        if not self.is_module_allowed(name):
            raise ConfigError(
                f"{field}: got {name!r}, which is not in the allow-list; expected "
                f"{self.describe_allowed()}"
            )
        obj, rest = self._loaded_module(name, parts, field)
        for index, part in enumerate(rest):
            obj = self._attribute(obj, part, name, field, last=index == len(rest) - 1)
        if isinstance(obj, types.ModuleType):
            raise ConfigError(f"{field}: got {name!r}, a module; expected a class or function")
        if not isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            raise ConfigError(
                f"{field}: got {name!r}, which is {_kind(obj)}; expected a class or function"
            )
        if self._by_name.get(self._by_id.get(id(obj), "")) is obj:
            return obj  # registered one by one, wherever it was defined
        # The object must also be *defined* in the allow-list: re-exports of other
        # modules' objects (torch.nn.modules.module.OrderedDict) are refused, as are
        # objects that say nothing of where they come from.
        owner = getattr(obj, "__module__", None)
        if not isinstance(owner, str) or not self.is_module_allowed(owner):
            where = (
                f"defined in module {owner!r} outside the allow-list"
                if isinstance(owner, str)
                else f"with no module of its own (__module__ is {owner!r})"
            )
            raise ConfigError(
                f"{field}: got {name!r}, which is {describe(obj)} {where}; expected "
                f"{self.describe_allowed()}"
            )
        return obj

    def resolve_callable(self, name: Any, field: str) -> Any:
        """:meth:`resolve` for a callable field: the object must also pass
        :meth:`is_callable_allowed`, or a ConfigError names ``field``."""
        obj = self.resolve(name, field)
        if not self.is_callable_allowed(obj):
            raise ConfigError(
                f"{field}: got {name!r}, which is {describe(obj)}; expected "
                f"{self.describe_callables()}"
            )
        return obj

    def callable_reference(self, obj: Any, field: str) -> str:
        """:meth:`reference` for a callable field (what :meth:`resolve_callable`
        would read back)."""
        name = self.reference(obj, field)
        if not self.is_callable_allowed(obj):
            raise ConfigError(
                f"{field}: got {describe(obj)} ({name!r}); expected {self.describe_callables()}"
            )
        return name

    def _loaded_module(self, name: str, parts: list[str], field: str) -> tuple[Any, list[str]]:
        """The longest prefix of ``name`` that is an imported, allowed module, and
        the attribute names after it."""
        for index in range(len(parts) - 1, 0, -1):
            module_name = ".".join(parts[:index])
            module = sys.modules.get(module_name)
            if not isinstance(module, types.ModuleType):
                continue
            real_name = _namespace(module).get("__name__")
            if not (
                isinstance(real_name, str)
                and self.is_module_allowed(module_name)
                and self.is_module_allowed(real_name)
            ):
                raise ConfigError(
                    f"{field}: got {name!r}, which is looked up in module {module_name!r} "
                    f"(named {real_name!r}) outside the allow-list; expected "
                    f"{self.describe_allowed()}"
                )
            return module, parts[index:]
        raise ConfigError(
            f"{field}: got {name!r}; expected a name in a module already imported (reading "
            f"a config never imports one: import {'.'.join(parts[:-1])!r}, or load the "
            "plugin that defines it, first)"
        )

    def _attribute(self, obj: Any, part: str, name: str, field: str, *, last: bool) -> Any:
        """``obj.part`` for a module or class, looked up statically."""
        if isinstance(obj, types.ModuleType):
            # Only the module's own namespace: a module's __getattr__ may import
            # (torch's does, for torch._dynamo) or raise (torch.classes).
            namespace = _namespace(obj)
            if part not in namespace:
                raise ConfigError(
                    f"{field}: got {name!r}; expected an existing name, but module "
                    f"{namespace.get('__name__', '?')!r} has no attribute {part!r} (reading a "
                    "config imports nothing: a submodule must be imported first)"
                )
            value = namespace[part]
        elif isinstance(obj, type):
            try:
                # No metaclass __getattr__, no descriptor __get__: nothing runs.
                value = inspect.getattr_static(obj, part)
            except AttributeError:
                raise ConfigError(
                    f"{field}: got {name!r}; expected an existing name, but "
                    f"{describe(obj)} has no attribute {part!r}"
                ) from None
            if isinstance(value, staticmethod):
                value = value.__func__
        else:
            raise ConfigError(
                f"{field}: got {name!r}; expected a path through modules and classes, but "
                f"it passes through {_kind(obj)}"
            )
        if isinstance(value, types.ModuleType):
            module_name = _namespace(value).get("__name__")
            if not isinstance(module_name, str) or not self.is_module_allowed(module_name):
                raise ConfigError(
                    f"{field}: got {name!r}, which reaches module {module_name!r} outside "
                    f"the allow-list; expected {self.describe_allowed()}"
                )
        elif not last and not isinstance(value, type):
            raise ConfigError(
                f"{field}: got {name!r}; expected a path through modules and classes, but "
                f"{part!r} is {_kind(value)}"
            )
        return value


default_allowlist = Allowlist()
"""The allow-list used when none is passed: torch, qcore, operator, and
whatever plugins register."""


def allow(obj: Any, name: str | None = None) -> Any:
    """Register ``obj`` in the default allow-list (usable as a decorator)."""
    return default_allowlist.allow(obj, name)


def allow_module_prefix(prefix: str) -> None:
    """Allow every name under module ``prefix`` in the default allow-list."""
    default_allowlist.allow_module_prefix(prefix)


def allow_callable_module(module_name: str) -> None:
    """Let the functions defined in ``module_name`` fill callable fields in the
    default allow-list; see :meth:`Allowlist.allow_callable_module`."""
    default_allowlist.allow_callable_module(module_name)


def allow_config(config: BackendConfig) -> list[str]:
    """Register every object ``config`` refers to in the default allow-list;
    see :meth:`Allowlist.allow_config`."""
    return default_allowlist.allow_config(config)


def _referenced_objects(pattern_config: BackendPatternConfig) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    as_dict = pattern_config.to_dict()

    def walk(path: str, pattern: Any) -> None:
        if isinstance(pattern, tuple):
            for index, item in enumerate(pattern):
                walk(f"{path}[{index}]", item)
        elif not isinstance(pattern, str):
            found.append((path, pattern))

    for key in _PATTERN_FIELDS:
        if key in as_dict:
            walk(key, as_dict[key])
    for key in _REF_FIELDS:
        if key in as_dict:
            found.append((key, as_dict[key]))
    return found


# -- encoding ---------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    return value


def _encode_pattern(pattern: Any, field: str, allowlist: Allowlist) -> Any:
    if isinstance(pattern, str):
        return pattern
    if isinstance(pattern, tuple):
        return [
            _encode_pattern(item, f"{field}[{index}]", allowlist)
            for index, item in enumerate(pattern)
        ]
    return {"ref": allowlist.reference(pattern, field)}


def _encode_dtype(constrained: DTypeWithConstraints) -> Any:
    dtype = None if constrained.dtype is None else _dtype_name(constrained.dtype)
    if not constrained.has_constraints:
        return dtype
    result: dict[str, Any] = {"dtype": dtype}
    for name in _CONSTRAINT_FIELDS:
        value = getattr(constrained, name)
        if value is not None:
            result[name] = _number(value)
    return result


def _encode_dtype_config(dtype_config: DTypeConfig) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kind in _DTYPE_KINDS:
        constrained = getattr(dtype_config, f"{kind}_with_constraints")
        if constrained.dtype is not None or constrained.has_constraints:
            result[kind] = _encode_dtype(constrained)
    if dtype_config.bias_dtype is not None:
        result["bias_dtype"] = _dtype_name(dtype_config.bias_dtype)
    if dtype_config.is_dynamic is not None:
        result["is_dynamic"] = dtype_config.is_dynamic
    return result


def _encode_pattern_config(
    config: BackendPatternConfig, path: str, allowlist: Allowlist
) -> dict[str, Any]:
    as_dict = config.to_dict()
    result: dict[str, Any] = {}
    for key in _PATTERN_FIELDS:
        if key in as_dict:
            result[key] = _encode_pattern(as_dict[key], f"{path}.{key}", allowlist)
    result["observation_type"] = config.observation_type.name
    result["dtype_configs"] = [_encode_dtype_config(item) for item in config.dtype_configs]
    for key in _REF_FIELDS:
        if key in as_dict:
            if key in _CALLABLE_FIELDS:
                result[key] = allowlist.callable_reference(as_dict[key], f"{path}.{key}")
            else:
                result[key] = allowlist.reference(as_dict[key], f"{path}.{key}")
    if config._num_tensor_args_to_observation_type:
        result["num_tensor_args_to_observation_type"] = {
            str(count): observation_type.name
            for count, observation_type in config._num_tensor_args_to_observation_type.items()
        }
    if config._input_type_to_index:
        result["input_type_to_index"] = dict(config._input_type_to_index)
    return result


def to_json(
    config: BackendConfig, *, allowlist: Allowlist | None = None, indent: int | None = 2
) -> str:
    """Write ``config`` as JSON (see the module docstring for the format).

    Every class and function must be nameable and allowed by ``allowlist``
    (default: :data:`default_allowlist`); otherwise a ConfigError names the
    field (``configs[3].fuser_method``), the object and how to fix it.
    """
    if not isinstance(config, BackendConfig):
        raise ConfigError(f"to_json config: got {describe(config)}; expected a BackendConfig")
    allowlist = default_allowlist if allowlist is None else allowlist
    document = {
        "format": FORMAT,
        "version": VERSION,
        "name": config.name,
        "configs": [
            _encode_pattern_config(item, f"configs[{index}]", allowlist)
            for index, item in enumerate(config.configs)
        ],
    }
    return _json.dumps(document, indent=indent, allow_nan=False)


# -- decoding ---------------------------------------------------------------


def _expect(value: Any, kind: type | tuple[type, ...], field: str, expected: str) -> Any:
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(f"{field}: got {describe(value)}; expected {expected}")
    if not isinstance(value, kind):
        raise ConfigError(f"{field}: got {describe(value)}; expected {expected}")
    return value


def _decode_dtype(value: Any, field: str) -> torch.dtype:
    if isinstance(value, str):
        # torch's own namespace only: getattr(torch, name) would run torch's module
        # __getattr__, which imports torch._dynamo and friends for their names.
        dtype = vars(torch).get(value.removeprefix("torch."))
        if isinstance(dtype, torch.dtype):
            return dtype
    raise ConfigError(
        f"{field}: got {describe(value)}; expected a torch dtype name such as 'quint8', "
        "'qint8', 'float32' or 'float16'"
    )


def _decode_number(value: Any, field: str) -> Any:
    if isinstance(value, dict) and set(value) == {"float"}:
        text = value["float"]
        if text in ("inf", "-inf"):
            return float(text)
        raise ConfigError(f"{field}: got {describe(value)}; expected {{'float': 'inf'|'-inf'}}")
    number = _expect(value, (int, float), field, "a number")
    if isinstance(number, float) and not math.isfinite(number):
        # json reads 1e400 as inf; infinity is written {"float": "inf"}, on purpose.
        raise ConfigError(
            f"{field}: got {describe(value)}; expected a finite number (write infinity as "
            '{"float": "inf"})'
        )
    return number


def _decode_count(key: str, field: str) -> int:
    """A JSON object key read as a count of tensor arguments."""
    # str.isdigit() is true for "²" and "٣", which int() rejects or reads as 3.
    if not (key.isascii() and key.isdigit() and len(key) <= 9 and str(int(key)) == key):
        raise ConfigError(
            f"{field}: got key {describe(key)}; expected a non-negative integer written in "
            "ASCII digits without leading zeros, such as '2'"
        )
    return int(key)


def _decode_constrained(value: Any, field: str) -> DTypeWithConstraints:
    if value is None or isinstance(value, str):
        return DTypeWithConstraints(dtype=None if value is None else _decode_dtype(value, field))
    _expect(value, dict, field, "a dtype name or an object with a 'dtype' key")
    unknown = set(value) - {"dtype", *_CONSTRAINT_FIELDS}
    if unknown:
        raise ConfigError(
            f"{field}: got key {sorted(unknown)[0]!r}; expected one of "
            f"{['dtype', *_CONSTRAINT_FIELDS]}"
        )
    kwargs: dict[str, Any] = {}
    if value.get("dtype") is not None:
        kwargs["dtype"] = _decode_dtype(value["dtype"], f"{field}.dtype")
    for name in _CONSTRAINT_FIELDS:
        if value.get(name) is None:
            continue
        if name == "scale_power_of_two":
            kwargs[name] = _expect(value[name], bool, f"{field}.{name}", "true or false")
        else:
            kwargs[name] = _decode_number(value[name], f"{field}.{name}")
    try:
        return DTypeWithConstraints(**kwargs)
    except ConfigError as error:
        raise relocate(error, field, "DTypeWithConstraints") from None


def _decode_dtype_config(value: Any, field: str) -> DTypeConfig:
    _expect(value, dict, field, "an object")
    allowed = {*_DTYPE_KINDS, "bias_dtype", "is_dynamic"}
    unknown = set(value) - allowed
    if unknown:
        raise ConfigError(
            f"{field}: got key {sorted(unknown)[0]!r}; expected one of {sorted(allowed)}"
        )
    kwargs: dict[str, Any] = {}
    for kind in _DTYPE_KINDS:
        if kind in value:
            kwargs[kind] = _decode_constrained(value[kind], f"{field}.{kind}")
    if value.get("bias_dtype") is not None:
        kwargs["bias_dtype"] = _decode_dtype(value["bias_dtype"], f"{field}.bias_dtype")
    if value.get("is_dynamic") is not None:
        kwargs["is_dynamic"] = _expect(
            value["is_dynamic"], bool, f"{field}.is_dynamic", "true, false or null"
        )
    try:
        return DTypeConfig(**kwargs)
    except ConfigError as error:
        raise relocate(error, field, "DTypeConfig") from None


def _decode_observation_type(value: Any, field: str) -> ObservationType:
    if isinstance(value, str) and value in ObservationType.__members__:
        return ObservationType[value]
    raise ConfigError(
        f"{field}: got {describe(value)}; expected one of {list(ObservationType.__members__)}"
    )


def _decode_pattern(value: Any, field: str, allowlist: Allowlist) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return tuple(
            _decode_pattern(item, f"{field}[{index}]", allowlist)
            for index, item in enumerate(value)
        )
    if isinstance(value, dict) and set(value) == {"ref"}:
        return allowlist.resolve(value["ref"], f"{field}.ref")
    raise ConfigError(
        f"{field}: got {describe(value)}; expected a method name string, "
        '{"ref": "qualified.name"} or an array of those'
    )


_PATTERN_CONFIG_KEYS = (
    *_PATTERN_FIELDS,
    "observation_type",
    "dtype_configs",
    *_REF_FIELDS,
    "num_tensor_args_to_observation_type",
    "input_type_to_index",
)

# BackendPatternConfig's field names where its JSON key differs.
_JSON_KEY_OF_FIELD = {"reference_quantized_module": "reference_quantized_module_for_root"}


def _relocate_pattern_error(error: ConfigError, path: str) -> ConfigError:
    """A BackendPatternConfig's error, its field renamed to the document's path."""
    for field_name, key in _JSON_KEY_OF_FIELD.items():
        prefix = f"BackendPatternConfig.{field_name}"
        text = str(error)
        if text.startswith(prefix) and not text[len(prefix) :][:1].isidentifier():
            error = type(error)(f"BackendPatternConfig.{key}{text[len(prefix) :]}")
    return relocate(error, path, "BackendPatternConfig")


def _decode_pattern_config(value: Any, path: str, allowlist: Allowlist) -> BackendPatternConfig:
    _expect(value, dict, path, "an object describing a BackendPatternConfig")
    unknown = set(value) - set(_PATTERN_CONFIG_KEYS)
    if unknown:
        raise ConfigError(
            f"{path}: got key {sorted(unknown)[0]!r}; expected one of {list(_PATTERN_CONFIG_KEYS)}"
        )
    if not any(value.get(key) is not None for key in _PATTERN_FIELDS):
        raise ConfigError(
            f"{path}: got no pattern (keys {sorted(value)}); expected a 'pattern' or a "
            "'pattern_complex_format'"
        )
    as_dict: dict[str, Any] = {}
    for key in _PATTERN_FIELDS:
        if key in value:
            as_dict[key] = _decode_pattern(value[key], f"{path}.{key}", allowlist)
    if "observation_type" in value:
        as_dict["observation_type"] = _decode_observation_type(
            value["observation_type"], f"{path}.observation_type"
        )
    if "dtype_configs" in value:
        items = _expect(value["dtype_configs"], list, f"{path}.dtype_configs", "an array")
        as_dict["dtype_configs"] = [
            _decode_dtype_config(item, f"{path}.dtype_configs[{index}]")
            for index, item in enumerate(items)
        ]
    for key in _REF_FIELDS:
        if value.get(key) is not None:
            decode = allowlist.resolve_callable if key in _CALLABLE_FIELDS else allowlist.resolve
            as_dict[key] = decode(value[key], f"{path}.{key}")
    if "num_tensor_args_to_observation_type" in value:
        field = f"{path}.num_tensor_args_to_observation_type"
        mapping = _expect(value["num_tensor_args_to_observation_type"], dict, field, "an object")
        as_dict["num_tensor_args_to_observation_type"] = {
            _decode_count(key, field): _decode_observation_type(item, f"{field}[{key!r}]")
            for key, item in mapping.items()
        }
    if "input_type_to_index" in value:
        as_dict["input_type_to_index"] = _expect(
            value["input_type_to_index"], dict, f"{path}.input_type_to_index", "an object"
        )
    try:
        return BackendPatternConfig.from_dict(as_dict)
    except ConfigError as error:
        raise _relocate_pattern_error(error, path) from None


def _json_kind(value: Any) -> str:
    """A JSON value described cheaply: a top-level array may be huge or deep."""
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    return describe(value)


def _check_depth(document: Any) -> None:
    """Refuse documents nested deeper than any config (without recursing)."""
    stack: list[tuple[Any, int, str]] = [(document, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict):
            children: Iterable[tuple[Any, str]] = (
                (item, f"{path}.{key}" if path else str(key)) for key, item in value.items()
            )
        elif isinstance(value, list):
            children = ((item, f"{path}[{index}]") for index, item in enumerate(value))
        else:
            continue
        if depth > MAX_DEPTH:
            raise ConfigError(
                f"{path or 'BackendConfig JSON'}: got arrays or objects nested {depth} deep; "
                f"expected at most {MAX_DEPTH} levels (a pattern nests at most "
                f"{MAX_PATTERN_DEPTH})"
            )
        stack.extend((item, depth + 1, item_path) for item, item_path in children)


def _parse(text: Any) -> Any:
    if isinstance(text, (bytes, bytearray)):
        # JSON text is UTF-8 (RFC 8259). json.loads would guess UTF-16 or UTF-32 for
        # other bytes and import that codec's module: reading must import nothing.
        try:
            text = bytes(text).removeprefix(b"\xef\xbb\xbf").decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError(
                f"BackendConfig JSON: got bytes that are not UTF-8 ({error}); expected JSON "
                "text in UTF-8"
            ) from None
    try:
        # NaN and Infinity are read as floats, and refused where a number is read,
        # with the field's path: no field takes a non-finite number untagged.
        return _json.loads(text)
    except RecursionError:
        # json's parser recurses once per [ or {; "[" * 100000 exhausts the stack.
        raise ConfigError(
            f"BackendConfig JSON: got arrays or objects nested too deep to read; expected at "
            f"most {MAX_DEPTH} levels"
        ) from None
    except (TypeError, ValueError) as error:
        got = "text" if isinstance(text, (str, bytes, bytearray)) else describe(text)
        raise ConfigError(
            f"BackendConfig JSON: got {got} that is not JSON ({error}); expected a JSON object "
            "with 'name' and 'configs'"
        ) from None


def from_json(text: str | bytes, *, allowlist: Allowlist | None = None) -> BackendConfig:
    """Read a BackendConfig written by :func:`to_json` (or by hand).

    Names resolve only through ``allowlist`` (default:
    :data:`default_allowlist`) and only in modules already imported; a name
    outside it is a ConfigError naming the field path, the name and what is
    allowed, and nothing is imported for it. Any other failure is a ConfigError
    too, naming the field's path, the value and what was expected.
    """
    allowlist = default_allowlist if allowlist is None else allowlist
    document = _parse(text)
    if not isinstance(document, dict):
        raise ConfigError(
            f"BackendConfig JSON: got {_json_kind(document)}; expected an object with 'name' "
            "and 'configs'"
        )
    known = {"format", "version", "name", "configs"}
    unknown = set(document) - known
    if unknown:
        raise ConfigError(
            f"BackendConfig JSON: got key {sorted(unknown)[0]!r}; expected one of {sorted(known)}"
        )
    # After the keys are known, so that the path of a too-deep value names a field.
    _check_depth(document)
    if document.get("format", FORMAT) != FORMAT:
        raise ConfigError(f"format: got {describe(document['format'])}; expected {FORMAT!r}")
    version = document.get("version", VERSION)
    # True == 1 and 1.0 == 1 in Python; a version is an integer, and only this one.
    if type(version) is not int or version != VERSION:
        raise ConfigError(
            f"version: got {describe(version)}; expected {VERSION} (an integer: this qcore "
            f"reads version {VERSION})"
        )
    name = _expect(document.get("name", ""), str, "name", "a string")
    items = _expect(document.get("configs", []), list, "configs", "an array")
    config = BackendConfig(name)
    for index, item in enumerate(items):
        path = f"configs[{index}]"
        pattern_config = _decode_pattern_config(item, path, allowlist)
        try:
            config.set_backend_pattern_config(pattern_config)
        except ConfigError as error:
            raise _relocate_pattern_error(error, path) from None
    return config
