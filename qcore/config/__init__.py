"""Layer 1, config: pure data describing what a backend supports.

API-compatible with ``torch.ao.quantization.backend_config``: the tutorial's
code ports by changing its imports to ``from qcore import ...``.
"""

from qcore.config.backend import BackendConfig
from qcore.config.dtypes import DTypeConfig, DTypeWithConstraints, ObservationType
from qcore.config.errors import ConfigError, DuplicatePatternError
from qcore.config.pattern import BackendPatternConfig, MatchAllNode

__all__ = [
    "BackendConfig",
    "BackendPatternConfig",
    "ConfigError",
    "DTypeConfig",
    "DTypeWithConstraints",
    "DuplicatePatternError",
    "MatchAllNode",
    "ObservationType",
]
