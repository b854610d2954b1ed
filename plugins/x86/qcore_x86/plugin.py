"""The ``x86`` backend's hook implementations (entry point ``qcore.backends: x86``)."""

from __future__ import annotations

from qcore.plugin.markers import hookimpl
from qcore_x86 import config

QCORE_PLUGIN_API_VERSION = 1

BACKEND = config.BACKEND


@hookimpl
def qcore_backend_pattern_configs(backend):
    """torch 2.13's native ``x86`` patterns, for ``x86`` only."""
    if backend != BACKEND:
        return None
    return config.pattern_configs()


def x86_kernels() -> list:
    """qcore's int8 kernel library packed for the x86 engine, then oneDNN's fused
    kernels (``qcore_x86.onednn``) for what the library's refuse."""
    from qcore.kernels import kernels_for
    from qcore_x86.onednn import onednn_kernels

    return [*kernels_for("x86"), *onednn_kernels()]


@hookimpl
def qcore_backend_kernels(backend):
    """The x86 engine's kernels (:func:`x86_kernels`)."""
    if backend != BACKEND:
        return None
    return x86_kernels()


@hookimpl
def qcore_default_qconfig_mapping(backend, is_qat):
    """The default ``x86`` QConfigMapping (PTQ or QAT), built from qcore's observers."""
    if backend != BACKEND:
        return None
    from qcore.config.qconfig import default_qconfig_mapping

    return default_qconfig_mapping(BACKEND, is_qat=is_qat)


@hookimpl
def qcore_backend_quantizer(backend, is_qat):
    """oneDNN's int8 recipe for PT2E (``qcore_x86.quantizer``), in place of the one
    qcore compiles from the native config, which quantizes every pattern's output."""
    if backend != BACKEND:
        return None
    from qcore_x86.quantizer import X86Quantizer

    return X86Quantizer(is_qat=is_qat)


@hookimpl
def qcore_compile_recipe(backend):
    """Inductor with oneDNN's int8 passes and frozen weights (``config.inductor_recipe``):
    what ``qcore.compile`` runs x86 models with."""
    if backend != BACKEND:
        return None
    return config.inductor_recipe()
