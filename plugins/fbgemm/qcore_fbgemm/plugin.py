"""The ``fbgemm`` backend's hook implementations (entry point ``qcore.backends: fbgemm``)."""

from __future__ import annotations

from qcore.plugin.markers import hookimpl
from qcore_fbgemm import config

QCORE_PLUGIN_API_VERSION = 1

BACKEND = config.BACKEND


@hookimpl
def qcore_backend_pattern_configs(backend):
    """torch 2.13's native ``fbgemm`` patterns, for ``fbgemm`` only."""
    if backend != BACKEND:
        return None
    return config.pattern_configs()


@hookimpl
def qcore_backend_kernels(backend):
    """qcore's int8 kernel library, packed for the fbgemm engine."""
    if backend != BACKEND:
        return None
    from qcore.kernels.library import declare_unconfigured, kernels_for

    # Kernels of patterns this config leaves out carry the reason (``qcore check``).
    return declare_unconfigured(kernels_for("fbgemm"), config.pattern_configs(), BACKEND)


@hookimpl
def qcore_default_qconfig_mapping(backend, is_qat):
    """The default ``fbgemm`` QConfigMapping (PTQ or QAT), built from qcore's observers."""
    if backend != BACKEND:
        return None
    from qcore.config.qconfig import default_qconfig_mapping

    return default_qconfig_mapping(BACKEND, is_qat=is_qat)


@hookimpl
def qcore_recommended_algorithms(backend):
    """None of qcore's algorithms by default: plain calibration is fbgemm's best.

    fbgemm, as x86, quantizes weights per output channel (each channel its own
    scale: little for equalization to even out) and activations to 7 bits; bias
    correction gains on some nets and loses on depthwise ones
    (benchmarks/ALGORITHMS.md). Ask for them by name where your own model gains.
    """
    if backend != BACKEND:
        return None
    return []
