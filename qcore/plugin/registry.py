"""The backend registry: plugins found, loaded on demand, isolated from each other.

A :class:`Plugin` moves through FOUND -> LOADED, or FOUND -> FAILED with the
exception kept; BLOCKED plugins are never imported. A :class:`Backend` is built
the first time its name is asked for, from the plugins that serve it; one
broken plugin fails its own backend only.

Isolation: whatever a plugin raises (any BaseException but KeyboardInterrupt:
SystemExit included) while it is imported or a hook of it runs is caught, and
what it returns is validated inside the same guard, so the error names the
plugin. The registry's lock is never held while a plugin runs: a plugin slow to
import delays only the backends it serves.
"""

from __future__ import annotations

import difflib
import enum
import functools
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pluggy

from qcore.config import BackendConfig, BackendPatternConfig
from qcore.config.errors import DuplicatePatternError, QCoreWarning, describe
from qcore.config.pattern import format_pattern
from qcore.plugin import hookspecs
from qcore.plugin.discovery import (
    BLOCK_PLUGINS_ENV,
    IN_PROCESS,
    PluginSpec,
    autoload_disabled,
    blocked_names,
    find_entry_point_plugins,
    in_process_spec,
    normalize,
)
from qcore.plugin.isolation import call_isolated
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
    "owner_distribution",
]

NATIVE = "native"

# The backends this project publishes, so an unknown name can say what to install.
FIRST_PARTY_DISTRIBUTIONS = {
    "fbgemm": "qcore-fbgemm",
    "qnnpack": "qcore-qnnpack",
    "x86": "qcore-x86",
    "onednn": "qcore-x86",
}

T = TypeVar("T")


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
    failed_in: str = ""
    """The hook whose call or answer failed; empty when loading failed."""

    @property
    def name(self) -> str:
        return self.spec.name

    def error_summary(self) -> str:
        if self.error is None:
            return ""
        return f"{type(self.error).__name__}: {self.error}"


def owner_distribution(backend: str) -> str:
    """The distribution that owns ``backend`` (normalized): the first-party one
    for the backends qcore publishes (``qcore-x86`` for x86 and onednn), else
    ``qcore-<backend>``. Its contribution ranks first (see :func:`rank_plugins`)."""
    return normalize(FIRST_PARTY_DISTRIBUTIONS.get(backend, f"qcore-{backend}"))


def rank_plugins(backend: str, plugins: Iterable[Plugin]) -> list[Plugin]:
    """The plugins serving ``backend`` in the order their contributions are united:
    the backend's owner first (:func:`owner_distribution`), then the other
    installed distributions by (normalized) name, then in-process plugins in the
    order they were registered. Another vendor's extension of a backend can
    therefore add to it but never override what the owner set."""
    owner = owner_distribution(backend)

    def key(indexed: tuple[int, Plugin]) -> tuple:
        index, plugin = indexed
        in_process = plugin.spec.distribution == IN_PROCESS
        distribution = normalize(plugin.spec.distribution)
        return (distribution != owner, in_process, index if in_process else 0, distribution)

    return [plugin for _, plugin in sorted(enumerate(plugins), key=key)]


def is_first_party(backend: Backend) -> bool:
    """Whether ``backend`` is one qcore publishes, served by its own distribution."""
    if backend.name not in FIRST_PARTY_DISTRIBUTIONS:
        return False
    owner = owner_distribution(backend.name)
    return any(normalize(plugin.spec.distribution) == owner for plugin in backend.plugins)


@dataclass(frozen=True)
class Backend:
    """A backend as its plugins contribute it.

    ``config`` is the united BackendConfig; ``conflicts`` lists the fields on
    which contributors disagreed (see ``qcore.plugin.union``). ``plugins`` are
    in the order their contributions were united (the owner first);
    ``contributions`` holds each plugin's own pattern configs and kernels, by
    plugin name. For "native", ``left_out`` names the installed backends that
    failed to load, each with its error: native is the union of the others.
    """

    name: str
    config: BackendConfig
    kernels: tuple[Kernel, ...]
    plugins: tuple[Plugin, ...]
    conflicts: tuple[Conflict, ...] = ()
    _registry: BackendRegistry | None = field(default=None, repr=False, compare=False)
    contributions: tuple[tuple[str, tuple[BackendPatternConfig, ...], tuple[Kernel, ...]], ...] = (
        field(default=(), repr=False, compare=False)
    )
    left_out: tuple[tuple[str, str], ...] = ()

    def default_qconfig_mapping(self, is_qat: bool = False) -> Any | None:
        """The default QConfigMapping its plugins give, or None.

        The plugins are asked in order (the owner first) and the first answer
        wins. "native" asks no plugin and returns None: its default is qcore's
        own (``qcore.get_default_qconfig_mapping("native")``, torch.ao's default
        recipe), the same whatever is installed.
        """
        if self.name == NATIVE or self._registry is None:
            return None
        return self._registry._first_answer(self, "qcore_default_qconfig_mapping", is_qat=is_qat)

    def quantizer(self, is_qat: bool = False) -> Any | None:
        """A plugin's hand-written PT2E Quantizer for this backend, or None
        ("native" asks no plugin: it is compiled from the united config)."""
        found = self.own_quantizer(is_qat)
        return None if found is None else found[0]

    def own_quantizer(self, is_qat: bool = False) -> tuple[Any, Plugin] | None:
        """(the hand-written PT2E Quantizer, the plugin that gave it), or None."""
        if self.name == NATIVE or self._registry is None:
            return None
        return self._registry._first_answer(
            self, "qcore_backend_quantizer", is_qat=is_qat, with_plugin=True
        )

    def compile_recipe(self, mode: str = "default") -> Any | None:
        """How its plugins say its models run fastest compiled in ``mode`` (a
        :class:`qcore.CompileRecipe`; modes as :func:`qcore.compile`'s), or None:
        its eager kernels are its best. "native" asks no plugin."""
        from qcore.plugin.recipes import check_compile_mode

        check_compile_mode(mode)
        if self.name == NATIVE or self._registry is None:
            return None
        return self._registry._first_answer(self, "qcore_compile_recipe", mode=mode)

    def recommended_algorithms(self) -> tuple[Any, ...]:
        """The post-training algorithms its plugins recommend (``qcore.AlgorithmStep``
        objects, in order), empty when none answers. A plugin whose hook raises or
        answers something else is skipped with a warning naming it, so one broken
        plugin costs the recommendation, never the backend. "native" asks no plugin."""
        if self.name == NATIVE or self._registry is None:
            return ()
        answer = self._registry._first_answer(
            self, "qcore_recommended_algorithms", skip_failing=True
        )
        return () if answer is None else tuple(answer)


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
        # Guards the registry's state; never held while a plugin's code runs.
        self._lock = threading.RLock()
        # One per backend name: a backend is built once, by one thread at a time.
        self._build_locks: dict[str, threading.RLock] = {}
        self._generation = 0  # bumped by register(): builds started before are stale
        self._manager = pluggy.PluginManager(PROJECT_NAME)
        self._manager.add_hookspecs(hookspecs)

    # -- what is installed (no plugin imported) -----------------------------

    def plugins(self) -> list[Plugin]:
        """Every plugin known, in discovery order (in-process ones last)."""
        with self._lock:
            if self._plugins is None:
                specs = [] if self.autoload_disabled else self._find()
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

    @property
    def autoload_disabled(self) -> bool:
        """Whether QCORE_DISABLE_PLUGIN_AUTOLOAD keeps installed plugins unread."""
        return autoload_disabled(self._environ)

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
            self._generation += 1
            self._backends.pop(name, None)
            self._backends.pop(NATIVE, None)
            self._failures.pop(name, None)

    # -- backends (plugins imported on demand) ------------------------------

    def loaded(self, name: str) -> Backend | None:
        """The backend ``name`` if it was built already, else None; loads nothing."""
        with self._lock:
            return self._backends.get(name)

    def get(self, name: str) -> Backend:
        """The backend ``name``; raises UnknownBackendError or BackendLoadError."""
        if not isinstance(name, str):
            # else None was an unknown backend, "Did you mean 'onednn'?"
            raise TypeError(
                f"backend: got {describe(name)}; expected a backend name (str) such as 'x86' "
                f"(installed: {', '.join(self.names())})"
            )
        with self._lock:
            found = self._cached(name)
            if found is not None:
                return found
            build_lock = self._build_locks.setdefault(name, threading.RLock())
        with build_lock:  # plugins of other backends load meanwhile, in other threads
            with self._lock:
                found = self._cached(name)
                if found is not None:
                    return found
                generation = self._generation
            try:
                backend = self._build_native() if name == NATIVE else self._build(name)
            except BackendLoadError as error:
                with self._lock:
                    if generation == self._generation:
                        self._failures[name] = error
                raise
            with self._lock:
                if generation == self._generation:
                    self._backends[name] = backend
            return backend

    def _cached(self, name: str) -> Backend | None:
        if name in self._backends:
            return self._backends[name]
        if name in self._failures:
            raise self._failures[name]
        return None

    def _serving(self, name: str) -> list[Plugin]:
        serving = [plugin for plugin in self.plugins() if plugin.spec.backend == name]
        if not serving:
            raise UnknownBackendError(self._unknown_message(name))
        return rank_plugins(name, serving)

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
        contributions = []
        for plugin in usable:
            if plugin.state is not PluginState.LOADED:
                continue
            configs = self._call(plugin, "qcore_backend_pattern_configs", BackendPatternConfig)
            if plugin.state is PluginState.LOADED:
                kernels = self._call(plugin, "qcore_backend_kernels", Kernel)
            if plugin.state is PluginState.LOADED:
                contributions.append((plugin.name, tuple(configs), tuple(kernels)))
        failed = [plugin for plugin in usable if plugin.state is PluginState.FAILED]
        if failed:
            raise _load_error(name, failed, usable)
        config, conflicts = unite(name, [(label, configs) for label, configs, _ in contributions])
        # What an installed plugin's config refers to may appear in JSON configs.
        from qcore.config.json import allow_config

        allow_config(config)
        kernels = tuple(kernel for _, _, offered in contributions for kernel in offered)
        return Backend(
            name,
            config,
            kernels,
            tuple(usable),
            tuple(conflicts),
            self,
            contributions=tuple(contributions),
        )

    def _build_native(self) -> Backend:
        """The union of every installed backend.

        Backends are united first-party first (those qcore publishes, in name
        order), then the others in name order. A pattern a first-party backend's
        own plugin configures takes nothing from any other plugin (a reported
        conflict instead), so it is the same whatever else is installed. No plugin
        hook is called with ``backend="native"``.
        """
        backends, left_out = [], []
        for name in self.names():
            if name == NATIVE:
                continue
            try:
                backends.append(self.get(name))
            except BackendLoadError as error:
                if all(p.state is PluginState.BLOCKED for p in self._serving(name)):
                    continue  # the user asked for it to stay out
                left_out.append((name, str(error)))
        backends.sort(key=lambda backend: (not is_first_party(backend), backend.name))
        config, conflicts = unite(NATIVE, *_native_sources(backends))
        if left_out:
            warnings.warn(
                "'native' leaves out backends that failed to load: "
                + "; ".join(f"{name} ({error})" for name, error in left_out)
                + ". Run `qcore backends --load` for details.",
                QCoreWarning,
                stacklevel=4,
            )
        if conflicts:
            warnings.warn(
                f"'native': {len(conflicts)} pattern field(s) differ between backends; "
                "first-party backends' values were kept. Run `qcore show native` to see them.",
                QCoreWarning,
                stacklevel=4,
            )
        plugins = tuple(plugin for backend in backends for plugin in backend.plugins)
        kernels = _native_kernels(backends)
        contributions = tuple(c for backend in backends for c in backend.contributions)
        return Backend(
            NATIVE,
            config,
            kernels,
            plugins,
            tuple(conflicts),
            self,
            contributions=contributions,
            left_out=tuple(left_out),
        )

    # -- loading and calling, each plugin on its own ------------------------

    def _guard(self, plugin: Plugin, function: Callable[[], T]) -> T | None:
        """``function()``; whatever it raises (but KeyboardInterrupt) marks
        ``plugin`` FAILED with that error, and None is returned."""
        result, error = call_isolated(function)
        if error is not None:
            plugin.state, plugin.error = PluginState.FAILED, error
        return result

    def _load(self, plugin: Plugin) -> None:
        if plugin.state is not PluginState.FOUND:
            return
        obj = self._guard(plugin, plugin.spec.load)  # the import: no lock held
        if plugin.state is PluginState.FAILED:
            return
        self._guard(plugin, lambda: _check_api_version(plugin, obj))
        if plugin.state is PluginState.FAILED:
            return
        with self._lock:
            # One module may serve several backends: it is registered once.
            registered_here = not self._manager.is_registered(obj)
            if registered_here:
                self._guard(plugin, lambda: self._register(plugin, obj))
            if plugin.state is PluginState.FAILED:
                if registered_here and self._manager.is_registered(obj):
                    self._manager.unregister(obj)
                return
            plugin.state, plugin.obj = PluginState.LOADED, obj

    def _register(self, plugin: Plugin, obj: Any) -> None:
        self._manager.register(obj, name=plugin.name)
        self._manager.check_pending()

    def _hookimpl(self, plugin: Plugin, hook_name: str) -> Callable | None:
        """The plugin's implementation of the hook, called with the arguments it
        declares (pluggy's rule: an implementation may take fewer than the spec)."""
        with self._lock:
            impls = getattr(self._manager.hook, hook_name).get_hookimpls()
        for impl in impls:
            if impl.plugin is plugin.obj:
                function, wanted = impl.function, set(impl.argnames)
                return lambda **kwargs: function(
                    **{name: value for name, value in kwargs.items() if name in wanted}
                )
        return None

    def _call(self, plugin: Plugin, hook_name: str, item_type: type) -> list:
        """The plugin's answer to a list hook, validated; [] with the plugin
        FAILED if it raised or answered something else."""
        function = self._hookimpl(plugin, hook_name)
        if function is None:
            return []

        def call() -> list:
            result = function(backend=plugin.spec.backend)
            if result is None:
                return []
            if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Iterable):
                raise TypeError(
                    f"{hook_name}() returned {describe(result)}; "
                    f"expected a list of {item_type.__name__} or None"
                )
            items = list(result)
            for index, item in enumerate(items):
                if not isinstance(item, item_type):
                    raise TypeError(
                        f"{hook_name}() returned {describe(item)} at index {index}; "
                        f"expected a list of {item_type.__name__}"
                    )
            if item_type is BackendPatternConfig:
                _check_pattern_configs(hook_name, plugin, items)
            return items

        items = self._guard(plugin, call)
        if plugin.state is PluginState.FAILED:
            plugin.failed_in = hook_name
        return items or []

    def _first_answer(
        self,
        backend: Backend,
        hook_name: str,
        *,
        with_plugin: bool = False,
        skip_failing: bool = False,
        **kwargs: Any,
    ) -> Any | None:
        """The first non-None answer of the backend's plugins (in rank order),
        validated; a plugin that raises or answers something else is named: in a
        BackendLoadError, or (``skip_failing``, for advice a backend works without)
        in a warning, and the next plugin is asked."""
        for plugin in backend.plugins:
            function = self._hookimpl(plugin, hook_name)
            if function is None:
                continue
            ask = functools.partial(function, backend=plugin.spec.backend, **kwargs)
            answer, error = call_isolated(ask)
            if error is not None:
                failure = BackendLoadError(
                    f"backend {backend.name!r}: plugin {plugin.name} raised in {hook_name}: "
                    f"{type(error).__name__}: {error}"
                )
                if not skip_failing:
                    raise failure from error
                warnings.warn(f"{failure}; skipped", QCoreWarning, stacklevel=3)
                continue
            if answer is None:
                continue
            expected = _EXPECTED_ANSWER[hook_name]
            if not expected[0](answer):
                failure = BackendLoadError(
                    f"backend {backend.name!r}: plugin {plugin.name}: {hook_name}() returned "
                    f"{describe(answer)}; expected {expected[1]} or None"
                )
                if not skip_failing:
                    raise failure
                warnings.warn(f"{failure}; skipped", QCoreWarning, stacklevel=3)
                continue
            return (answer, plugin) if with_plugin else answer
        return None


def _native_sources(
    backends: list[Backend],
) -> tuple[list[tuple[str, tuple[BackendPatternConfig, ...]]], set[str]]:
    """Native's union sources in order, and the closed ones (:func:`unite`): a
    first-party backend's owner contributes under the backend's name, closed; what
    other distributions add to that backend, and third-party backends, contribute
    as themselves, so they add nothing to a pattern first-party owners configure."""
    sources: list[tuple[str, tuple[BackendPatternConfig, ...]]] = []
    closed: set[str] = set()
    for backend in backends:
        if not is_first_party(backend):
            sources.append((backend.name, tuple(backend.config.configs)))
            continue
        owner = owner_distribution(backend.name)
        owners = {p.name for p in backend.plugins if normalize(p.spec.distribution) == owner}
        for label, configs, _ in backend.contributions:
            if label in owners:
                sources.append((backend.name, configs))
                closed.add(backend.name)
            else:
                sources.append((label, configs))
    return sources, closed


def _native_kernels(backends: list[Backend]) -> tuple[Kernel, ...]:
    """Native's kernels, in union order: a pattern a first-party backend's owner
    configures or implements runs only first-party kernels, so a vendor's kernel
    cannot take an op there that a first-party kernel refused (it would change what
    native does to it once the vendor is installed)."""
    owned: list[Kernel] = []
    others: list[Kernel] = []
    closed_patterns: set[Any] = set()
    for backend in backends:
        if not is_first_party(backend):
            others.extend(backend.kernels)
            continue
        owner = owner_distribution(backend.name)
        owners = {p.name for p in backend.plugins if normalize(p.spec.distribution) == owner}
        for label, configs, offered in backend.contributions:
            if label in owners:
                owned.extend(offered)
                closed_patterns.update(config.pattern for config in configs)
                closed_patterns.update(kernel.pattern for kernel in offered)
            else:
                others.extend(offered)
    return (*owned, *(kernel for kernel in others if kernel.pattern not in closed_patterns))


def _is_qconfig_mapping(value: Any) -> bool:
    # qcore's QConfigMapping or torch.ao's: the attributes the engine reads.
    return not isinstance(value, (str, Mapping)) and all(
        hasattr(value, name)
        for name in ("global_qconfig", "object_type_qconfigs", "module_name_qconfigs")
    )


def _is_quantizer(value: Any) -> bool:
    from qcore.quantizer.quantizer import Quantizer

    return isinstance(value, Quantizer)


def _is_compile_recipe(value: Any) -> bool:
    from qcore.plugin.recipes import CompileRecipe

    return isinstance(value, CompileRecipe)


def _is_algorithm_steps(value: Any) -> bool:
    from qcore.plugin.recipes import AlgorithmStep

    return isinstance(value, (list, tuple)) and all(
        isinstance(step, AlgorithmStep) for step in value
    )


_EXPECTED_ANSWER: dict[str, tuple[Callable[[Any], bool], str]] = {
    "qcore_default_qconfig_mapping": (
        _is_qconfig_mapping,
        "a QConfigMapping (qcore's or torch.ao's)",
    ),
    "qcore_backend_quantizer": (_is_quantizer, "a qcore.Quantizer"),
    "qcore_compile_recipe": (_is_compile_recipe, "a qcore.CompileRecipe"),
    "qcore_recommended_algorithms": (
        _is_algorithm_steps,
        "a list or tuple of qcore.AlgorithmStep",
    ),
}


def _check_pattern_configs(
    hook_name: str, plugin: Plugin, configs: list[BackendPatternConfig]
) -> None:
    """What uniting the configs needs, checked while the plugin can still be named."""
    first_index: dict[Any, int] = {}  # pattern -> index of the config that set it
    for index, config in enumerate(configs):
        if config.pattern is None and config._pattern_complex_format is None:
            raise TypeError(
                f"{hook_name}() returned a BackendPatternConfig without a pattern at index "
                f"{index} ({config!r}); expected set_pattern() to have been called"
            )
        try:
            hash(config.pattern_complex_format)
        except TypeError as error:
            raise TypeError(
                f"{hook_name}() returned a BackendPatternConfig at index {index} whose "
                f"pattern {describe(config.pattern)} is unhashable; expected module classes, "
                "functions, method names or tuples of them"
            ) from error
        _refuse_second_config(hook_name, config.pattern_complex_format, index, first_index)
    # Uniting this plugin's configs alone runs what uniting them with the others will.
    unite(plugin.spec.backend, [(plugin.name, configs)])


def _refuse_second_config(
    hook_name: str, pattern: Any, index: int, first_index: dict[Any, int]
) -> None:
    """Record ``pattern``'s config at ``index``; raise where one came earlier. torch.ao's
    BackendConfig refuses a pattern set twice; uniting them silently let the second
    one's fields (a Conv2d root module on a Linear pattern) fill in the first's."""
    if pattern in first_index:
        raise DuplicatePatternError(
            f"{hook_name}() returned two BackendPatternConfigs for pattern "
            f"{format_pattern(pattern)} (at index {first_index[pattern]} and {index}); "
            "expected one per pattern, with all its dtype configs"
        )
    first_index[pattern] = index


def _load_error(name: str, failed: list[Plugin], usable: list[Plugin]) -> BackendLoadError:
    """The error for backend ``name``, naming its failed plugins and how to block them."""
    first = failed[0]
    what = f"raised in {first.failed_in}" if first.failed_in else "failed"
    message = (
        f"backend {name!r} could not be loaded: plugin {first.name} "
        f"({first.spec.target}) {what}: {first.error_summary()}"
    )
    if len(failed) > 1:
        message += f" (and {len(failed) - 1} more: {', '.join(p.name for p in failed[1:])})"
    blockable = [plugin for plugin in failed if plugin.spec.distribution != IN_PROCESS]
    message = message.rstrip(".")  # a sentence of the plugin's error may end it
    if blockable:
        names = ",".join(plugin.name for plugin in blockable)
        distributions = ", ".join(sorted({plugin.spec.distribution for plugin in blockable}))
        if len(blockable) < len(usable):
            message += (
                f". To load {name!r} without it, set {BLOCK_PLUGINS_ENV}={names} "
                f"(or uninstall {distributions})"
            )
        else:
            message += (
                f". To stop qcore importing it, set {BLOCK_PLUGINS_ENV}={names} "
                f"(or uninstall {distributions})"
            )
    version_error = isinstance(first.error, PluginAPIVersionError)
    error = (PluginAPIVersionError if version_error else BackendLoadError)(message)
    error.__cause__, error.__suppress_context__ = first.error, True
    return error


def _check_api_version(plugin: Plugin, obj: Any) -> None:
    declared = getattr(obj, "QCORE_PLUGIN_API_VERSION", None)
    if declared is None and plugin.spec.distribution == IN_PROCESS:
        return  # written in this very process, against this very qcore
    if type(declared) is not int or declared != PLUGIN_API_VERSION:  # True == 1 == 1.0
        if declared is None:
            what = "declares no QCORE_PLUGIN_API_VERSION"
        elif type(declared) is not int:
            what = f"declares QCORE_PLUGIN_API_VERSION = {describe(declared)}, which is not an int"
        else:
            what = f"was written for plugin API {declared}"
        raise PluginAPIVersionError(
            f"plugin {plugin.name} {what}; this qcore implements plugin API "
            f"{PLUGIN_API_VERSION} (an int). Install a {plugin.spec.distribution} release made "
            "for it"
        )
