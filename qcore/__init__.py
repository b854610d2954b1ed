"""qcore: quantize PyTorch models for a backend chosen by name.

Backends are plugins, found through the ``qcore.backends`` entry point group::

    >>> import qcore
    >>> qcore.list_backends()
    ['fbgemm', 'native', 'qnnpack', 'x86']
    >>> config = qcore.get_backend_config("x86")
"""

from qcore.config import (
    BackendConfig,
    BackendPatternConfig,
    ConfigError,
    DTypeConfig,
    DTypeWithConstraints,
    DuplicatePatternError,
    ObservationType,
)
from qcore.config.errors import QCoreWarning
from qcore.plugin import (
    PLUGIN_API_VERSION,
    Backend,
    BackendLoadError,
    Kernel,
    PluginAPIVersionError,
    UnknownBackendError,
    get_backend,
    get_backend_config,
    hookimpl,
    list_backends,
    register_plugin,
)

__version__ = "0.1.0"

__all__ = [
    "BackendConfig",
    "BackendPatternConfig",
    "ConfigError",
    "DTypeConfig",
    "DTypeWithConstraints",
    "DuplicatePatternError",
    "ObservationType",
    "PLUGIN_API_VERSION",
    "Backend",
    "BackendLoadError",
    "Kernel",
    "PluginAPIVersionError",
    "QCoreWarning",
    "UnknownBackendError",
    "__version__",
    "get_backend",
    "get_backend_config",
    "hookimpl",
    "list_backends",
    "register_plugin",
]
