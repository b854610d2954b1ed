"""Layer 3, plugin: hook specifications, discovery, the backend registry.

The functions here act on one process-wide :class:`BackendRegistry`.
"""

from __future__ import annotations

from typing import Any

from qcore.config import BackendConfig
from qcore.plugin.kernels import Kernel
from qcore.plugin.markers import PLUGIN_API_VERSION, hookimpl, hookspec
from qcore.plugin.recipes import COMPILE_MODES, AlgorithmStep, CompileRecipe
from qcore.plugin.registry import (
    NATIVE,
    Backend,
    BackendLoadError,
    BackendRegistry,
    Plugin,
    PluginAPIVersionError,
    PluginState,
    UnknownBackendError,
)
from qcore.plugin.union import Conflict

__all__ = [
    "COMPILE_MODES",
    "NATIVE",
    "PLUGIN_API_VERSION",
    "AlgorithmStep",
    "Backend",
    "BackendLoadError",
    "BackendRegistry",
    "CompileRecipe",
    "Conflict",
    "Kernel",
    "Plugin",
    "PluginAPIVersionError",
    "PluginState",
    "UnknownBackendError",
    "default_registry",
    "get_backend",
    "get_backend_config",
    "hookimpl",
    "hookspec",
    "list_backends",
    "register_plugin",
]

_default_registry = BackendRegistry()


def default_registry() -> BackendRegistry:
    """The process-wide registry behind ``list_backends`` and ``get_backend``."""
    return _default_registry


def list_backends() -> list[str]:
    """Names of the installed backends, sorted, and ``"native"``. Imports no plugin.

    Example::

        >>> qcore.list_backends()
        ['fbgemm', 'native', 'x86']
    """
    return _default_registry.names()


def get_backend(name: str) -> Backend:
    """The backend ``name``, loading the plugins that serve it.

    Raises UnknownBackendError (listing what is installed) or BackendLoadError
    (with the plugin's own exception as ``__cause__``).

    Example::

        >>> backend = qcore.get_backend("fbgemm")
        >>> len(backend.config.configs), backend.plugins[0].spec.distribution
        (192, 'qcore-fbgemm')
    """
    return _default_registry.get(name)


def get_backend_config(name: str) -> BackendConfig:
    """A fresh copy of backend ``name``'s BackendConfig, yours to modify.

    Example::

        >>> config = qcore.get_backend_config("native")
    """
    return BackendConfig.from_dict(get_backend(name).config.to_dict())


def register_plugin(plugin: Any, name: str) -> None:
    """Register an in-process plugin (a module or object with ``@hookimpl``
    functions) serving backend ``name``: for tests and notebooks.

    Example::

        >>> class MyChip:
        ...     @qcore.hookimpl
        ...     def qcore_backend_pattern_configs(self, backend):
        ...         return [linear_config]
        >>> qcore.register_plugin(MyChip(), name="mychip")
    """
    _default_registry.register(plugin, name)
