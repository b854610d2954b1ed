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

__version__ = "0.1.0"

__all__ = [
    "BackendConfig",
    "BackendPatternConfig",
    "ConfigError",
    "DTypeConfig",
    "DTypeWithConstraints",
    "DuplicatePatternError",
    "ObservationType",
    "__version__",
]
