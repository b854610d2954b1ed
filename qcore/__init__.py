"""qcore: quantize PyTorch models for a backend chosen by name.

Backends are plugins, found through the ``qcore.backends`` entry point group::

    >>> import qcore
    >>> qcore.list_backends()
    ['fbgemm', 'native', 'onednn', 'qnnpack', 'x86']
    >>> config = qcore.get_backend_config("x86")

A converted model saves and loads without running code from the file
(``qcore.save``/``qcore.load``: plain data read with ``torch.load(weights_only=True)``,
every operator and class checked against allow-lists)::

    >>> qcore.save(qcore.convert_fx(prepared), "model.qcore")
    >>> loaded = qcore.load("model.qcore")      # bit-exact, whatever the quantized engine
"""

import sys as _sys
import warnings as _warnings

if "torch" not in _sys.modules:
    # qcore runs without NumPy, and so does torch (it loses only its NumPy interop),
    # but torch warns at import that NumPy is missing: `qcore backends` and every other
    # command printed it. Silenced only where qcore is first to import torch.
    with _warnings.catch_warnings():
        _warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
        import torch as _torch  # noqa: F401

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
    COMPILE_MODES,
    PLUGIN_API_VERSION,
    AlgorithmStep,
    Backend,
    BackendLoadError,
    CompileRecipe,
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

# The engine, observers and QConfigs load on first use, so that `import qcore`
# plus `qcore.list_backends()` stays cheap next to `import torch`.
_LAZY = {
    "prepare_fx": "qcore.api",
    "prepare_qat_fx": "qcore.api",
    "convert_fx": "qcore.api",
    "convert_to_reference_fx": "qcore.api",
    "fuse_fx": "qcore.api",
    "quantize": "qcore.api",
    "quantize_dynamic": "qcore.api",
    "explain": "qcore.api",
    "compile": "qcore.compiling",
    "equalize": "qcore.algorithms",
    "correct_bias": "qcore.algorithms",
    "smooth_quant": "qcore.algorithms",
    "adaround": "qcore.algorithms",
    "MinSQNR": "qcore.accuracy",
    "MetricBudget": "qcore.accuracy",
    "AccuracyBudgetNotMet": "qcore.accuracy",
    "CompiledModel": "qcore.compiling",
    "QConfig": "qcore.config.qconfig",
    "QConfigMapping": "qcore.config.qconfig",
    "get_default_qconfig_mapping": "qcore.api",
    "get_default_qat_qconfig_mapping": "qcore.api",
    "Report": "qcore.engine.explain",
    "QParams": "qcore.engine.reference",
    "prepare_pt2e": "qcore.pt2e",
    "prepare_qat_pt2e": "qcore.pt2e",
    "convert_pt2e": "qcore.pt2e",
    "quantize_pt2e": "qcore.pt2e",
    "Quantizer": "qcore.quantizer",
    "ComposableQuantizer": "qcore.quantizer",
    "QuantizationConfig": "qcore.quantizer",
    "QuantizationSpec": "qcore.quantizer",
    "SharedQuantizationSpec": "qcore.quantizer",
    "FixedQParamsQuantizationSpec": "qcore.quantizer",
    "DerivedQuantizationSpec": "qcore.quantizer",
    "QuantizationAnnotation": "qcore.quantizer",
    "save": "qcore.serialization",
    "load": "qcore.serialization",
    "RefusedFileError": "qcore.serialization",
    "UnsupportedModelError": "qcore.serialization",
    "sync_observers": "qcore.distributed",
    "SyncResult": "qcore.distributed",
    "ObserverSyncError": "qcore.distributed",
    "ObserverMismatchError": "qcore.distributed",
    "RankTimeoutError": "qcore.distributed",
}


_SUBPACKAGES = frozenset(
    {"accuracy", "algorithms", "config", "observers", "plugin", "pt2e", "quantizer"}
)


def __getattr__(name: str):
    import importlib

    module_name = _LAZY.get(name)
    if module_name is None and name in _SUBPACKAGES:
        # qcore.algorithms.equalized_pairs(...) after a bare `import qcore`, as the
        # user guide writes it
        return importlib.import_module(f"qcore.{name}")
    if module_name is None:
        observers = importlib.import_module("qcore.observers")
        if name in observers.__all__:
            return getattr(observers, name)
        raise AttributeError(f"module 'qcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_LAZY))


__all__ = [
    "BackendConfig",
    "BackendPatternConfig",
    "ConfigError",
    "DTypeConfig",
    "DTypeWithConstraints",
    "DuplicatePatternError",
    "ObservationType",
    "COMPILE_MODES",
    "PLUGIN_API_VERSION",
    "AlgorithmStep",
    "Backend",
    "BackendLoadError",
    "CompileRecipe",
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
