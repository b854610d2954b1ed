"""The backend registry: plugins found, loaded on demand, isolated from each other.

A :class:`Plugin` moves through FOUND -> LOADED, or FOUND -> FAILED with the
exception kept; BLOCKED plugins are never imported. A :class:`Backend` is built
the first time its name is asked for, from the plugins that serve it; one
broken plugin fails its own backend only.
"""

from __future__ import annotations

import difflib
import enum
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from qcore.config import BackendConfig, BackendPatternConfig
from qcore.config.errors import QCoreWarning, describe
from qcore.plugin import hookspecs
from qcore.plugin.discovery import (
    BLOCK_PLUGINS_ENV,
    IN_PROCESS,
    PluginSpec,
    autoload_disabled,
    blocked_names,
    find_entry_point_plugins,
    in_process_spec,
)
from qcore.plugin.kernels import Kernel
from qcore.plugin.markers import PLUGIN_API_VERSION, PROJECT_NAME
from qcore.plugin.union import Conflict, unite

__all__ = [
    "NATIVE",
    "Backend",
    "BackendLoadError",
    "BackendRegistry",
    "Plugin",
    "PluginAPIVersionError",
    "PluginState",
    "UnknownBackendError",
]

NATIVE = "native"

# The backends this project publishes, so an unknown name can say what to install.
FIRST_PARTY_DISTRIBUTIONS = {
    "fbgemm": "qcore-fbgemm",
    "qnnpack": "qcore-qnnpack",
    "x86": "qcore-x86",
    "onednn": "qcore-x86",
}


class UnknownBackendError(LookupError):
    """No installed plugin serves the backend name asked for."""


class BackendLoadError(RuntimeError):
    """A backend's plugin failed to import, to validate, or raised in a hook.

    The original exception is the ``__cause__``.
    """


class PluginAPIVersionError(BackendLoadError):
    """A plugin was written for another plugin-API version than this qcore's."""


class PluginState(enum.Enum):
    FOUND = "not loaded"
    LOADED = "ok"
    FAILED = "failed"
    BLOCKED = "blocked"


@dataclass
class Plugin:
    """One plugin: its spec, its state and, once loaded, its module or object."""

    spec: PluginSpec
    state: PluginState = PluginState.FOUND
    error: BaseException | None = None
    obj: Any = None

    @property
    def name(self) -> str:
        return self.spec.name

    def error_summary(self) -> str:
        if self.error is None:
            return ""
        return f"{type(self.error).__name__}: {self.error}"


@dataclass(frozen=True)
class Backend:
    """A backend as its plugins contribute it.

    ``config`` is the united BackendConfig; ``conflicts`` lists the fields on
    which contributors disagreed (see ``qcore.plugin.union``).
    """

    name: str
    config: BackendConfig
    kernels: tuple[Kernel, ...]
    plugins: tuple[Plugin, ...]
    conflicts: tuple[Conflict, ...] = ()
    _registry: BackendRegistry | None = field(default=None, repr=False, compare=False)

    def default_qconfig_mapping(self, is_qat: bool = False) -> Any | None:
        """The first contributing plugin's default QConfigMapping, or None."""
        return self._registry._first_answer(self, "qcore_default_qconfig_mapping", is_qat=is_qat)

    def quantizer(self, is_qat: bool = False) -> Any | None:
        """A plugin's hand-written PT2E Quantizer for this backend, or None."""
        return self._registry._first_answer(self, "qcore_backend_quantizer", is_qat=is_qat)


class BackendRegistry:
    """Finds plugins, loads them when their backend is asked for, keeps them apart.

    ``qcore.list_backends``/``get_backend`` use one process-wide instance; tests
    may build their own with ``find=`` and ``environ=``.
    """

    def __init__(
        self,
        find: Callable[[], list[PluginSpec]] = find_entry_point_plugins,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self._find = find
        self._environ = environ
        self._plugins: list[Plugin] | None = None
        self._in_process: list[Plugin] = []
        self._backends: dict[str, Backend] = {}
        self._failures: dict[str, BackendLoadError] = {}
        self._lock = threading.RLock()
        self._manager = pluggy.PluginManager(PROJECT_NAME)
        self._manager.add_hookspecs(hookspecs)

    # -- what is installed (no plugin imported) -----------------------------

    def plugins(self) -> list[Plugin]:
        """Every plugin known, in discovery order (in-process ones last)."""
        with self._lock:
            if self._plugins is None:
                specs = [] if autoload_disabled(self._environ) else self._find()
                specs = sorted(specs, key=lambda s: (s.backend, s.distribution, s.target))
                blocked = blocked_names(self._environ)
                self._plugins = [
                    Plugin(
                        spec,
                        PluginState.BLOCKED if spec.is_blocked_by(blocked) else PluginState.FOUND,
                    )
                    for spec in specs
                ]
            return self._plugins + self._in_process

    def names(self) -> list[str]:
        """Backend names served by at least one plugin, sorted, plus ``"native"``."""
        return sorted({plugin.spec.backend for plugin in self.plugins()} | {NATIVE})

    def register(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin serving backend ``name``."""
        if not isinstance(name, str) or not name or name == NATIVE:
            raise ValueError(
                f"register_plugin: name: got {describe(name)}; "
                f"expected a backend name other than {NATIVE!r}"
            )
        with self._lock:
            self._in_process.append(Plugin(in_process_spec(plugin, name)))
            self._backends.pop(name, None)
            self._backends.pop(NATIVE, None)
            self._failures.pop(name, None)

    # -- backends (plugins imported on demand) ------------------------------

    def get(self, name: str) -> Backend:
        """The backend ``name``; raises UnknownBackendError or BackendLoadError."""
        with self._lock:
            if name in self._backends:
                return self._backends[name]
            if name in self._failures:
                raise self._failures[name]
            if name == NATIVE:
                backend = self._build_native()
            else:
                try:
                    backend = self._build(name)
                except BackendLoadError as error:
                    self._failures[name] = error
                    raise
            self._backends[name] = backend
            return backend

    def _serving(self, name: str) -> list[Plugin]:
        serving = [plugin for plugin in self.plugins() if plugin.spec.backend == name]
        if not serving:
            raise UnknownBackendError(self._unknown_message(name))
        return serving

    def _unknown_message(self, name: str) -> str:
        installed = self.names()
        message = f"unknown backend {name!r}; installed backends: {', '.join(installed)}"
        if name in FIRST_PARTY_DISTRIBUTIONS:
            message += f". {name!r} is provided by: pip install {FIRST_PARTY_DISTRIBUTIONS[name]}"
        else:
            close = difflib.get_close_matches(str(name), installed, n=1)
            if close:
                message += f". Did you mean {close[0]!r}?"
        return message

    def _build(self, name: str) -> Backend:
        serving = self._serving(name)
        usable = [plugin for plugin in serving if plugin.state is not PluginState.BLOCKED]
        if not usable:
            raise BackendLoadError(
                f"backend {name!r}: every plugin serving it is blocked by "
                f"{BLOCK_PLUGINS_ENV} ({', '.join(plugin.name for plugin in serving)})"
            )
        for plugin in usable:
            self._load(plugin)
        failed = [plugin for plugin in usable if plugin.state is PluginState.FAILED]
        if failed:
            first = failed[0]
            error_type = (
                PluginAPIVersionError
                if isinstance(first.error, PluginAPIVersionError)
                else BackendLoadError
            )
            raise error_type(
                f"backend {name!r} could not be loaded: plugin {first.name} "
                f"({first.spec.target}) failed: {first.error_summary()}"
            ) from first.error
        pattern_sources = []
        kernels: list[Kernel] = []
        for plugin in usable:
            configs = self._call(plugin, "qcore_backend_pattern_configs", BackendPatternConfig)
            kernels += self._call(plugin, "qcore_backend_kernels", Kernel)
            pattern_sources.append((plugin.name, configs))
        config, conflicts = unite(name, pattern_sources)
        # What an installed plugin's config refers to may appear in JSON configs.
        from qcore.config.json import allow_config

        allow_config(config)
        return Backend(name, config, tuple(kernels), tuple(usable), tuple(conflicts), self)

    def _build_native(self) -> Backend:
        backends, broken = [], []
        for name in self.names():
            if name == NATIVE:
                continue
            try:
                backends.append(self.get(name))
            except BackendLoadError as error:
                broken.append(f"{name} ({error})")
        config, conflicts = unite(
            NATIVE, [(backend.name, backend.config.configs) for backend in backends]
        )
        if broken:
            warnings.warn(
                f"'native' leaves out backends that failed to load: {'; '.join(broken)}. "
                "Run `qcore backends` for details.",
                QCoreWarning,
                stacklevel=4,
            )
        if conflicts:
            warnings.warn(
                f"'native': {len(conflicts)} pattern field(s) differ between backends; the first "
                "backend in name order was kept. Run `qcore show native` to see them.",
                QCoreWarning,
                stacklevel=4,
            )
        plugins = tuple(plugin for backend in backends for plugin in backend.plugins)
        kernels = tuple(kernel for backend in backends for kernel in backend.kernels)
        return Backend(NATIVE, config, kernels, plugins, tuple(conflicts), self)

    # -- loading and calling, each plugin on its own ------------------------

    def _load(self, plugin: Plugin) -> None:
        if plugin.state is not PluginState.FOUND:
            return
        try:
            obj = plugin.spec.load()
            _check_api_version(plugin, obj)
            self._manager.register(obj, name=plugin.name)
            self._manager.check_pending()
        except Exception as error:  # a plugin must never take the others down
            if self._manager.get_plugin(plugin.name) is not None:
                self._manager.unregister(name=plugin.name)
            plugin.state, plugin.error = PluginState.FAILED, error
            return
        plugin.state, plugin.obj = PluginState.LOADED, obj

    def _hookimpl(self, plugin: Plugin, hook_name: str) -> Callable | None:
        """The plugin's implementation of the hook, called with the arguments it
        declares (pluggy's rule: an implementation may take fewer than the spec)."""
        for impl in getattr(self._manager.hook, hook_name).get_hookimpls():
            if impl.plugin is plugin.obj:
                function, wanted = impl.function, set(impl.argnames)
                return lambda **kwargs: function(
                    **{name: value for name, value in kwargs.items() if name in wanted}
                )
        return None

    def _call(self, plugin: Plugin, hook_name: str, item_type: type) -> list:
        function = self._hookimpl(plugin, hook_name)
        if function is None:
            return []
        try:
            result = function(backend=plugin.spec.backend)
            if result is None:
                return []
            items = list(result)
            for index, item in enumerate(items):
                if not isinstance(item, item_type):
                    raise TypeError(
                        f"{hook_name}() returned {describe(item)} at index {index}; "
                        f"expected a list of {item_type.__name__}"
                    )
            return items
        except Exception as error:
            plugin.state, plugin.error = PluginState.FAILED, error
            raise BackendLoadError(
                f"backend {plugin.spec.backend!r} could not be loaded: plugin {plugin.name} "
                f"raised in {hook_name}: {plugin.error_summary()}"
            ) from error

    def _first_answer(self, backend: Backend, hook_name: str, **kwargs: Any) -> Any | None:
        for plugin in backend.plugins:
            function = self._hookimpl(plugin, hook_name)
            if function is None:
                continue
            try:
                answer = function(backend=plugin.spec.backend, **kwargs)
            except Exception as error:
                raise BackendLoadError(
                    f"plugin {plugin.name} raised in {hook_name}: {type(error).__name__}: {error}"
                ) from error
            if answer is not None:
                return answer
        return None


def _check_api_version(plugin: Plugin, obj: Any) -> None:
    declared = getattr(obj, "QCORE_PLUGIN_API_VERSION", None)
    if declared is None and plugin.spec.distribution == IN_PROCESS:
        return  # written in this very process, against this very qcore
    if declared != PLUGIN_API_VERSION:
        what = (
            "declares no QCORE_PLUGIN_API_VERSION"
            if declared is None
            else (f"was written for plugin API {declared!r}")
        )
        raise PluginAPIVersionError(
            f"plugin {plugin.name} {what}; this qcore implements plugin API "
            f"{PLUGIN_API_VERSION}. Install a {plugin.spec.distribution} release made for it."
        )
