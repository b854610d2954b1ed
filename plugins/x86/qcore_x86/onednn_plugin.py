"""The ``onednn`` backend's hook implementations (entry point ``qcore.backends: onednn``).

torch.ao's ``onednn`` BackendConfig: the same engine and int8 ops as ``x86``,
plus conv2d + add (+ relu) and linear + leaky_relu/tanh fused at prepare, so a
residual block's conv, add and relu run as one oneDNN kernel on the FX path too.
"""

from __future__ import annotations

from qcore.plugin.markers import hookimpl
from qcore_x86 import config

QCORE_PLUGIN_API_VERSION = 1

BACKEND = config.ONEDNN_BACKEND


@hookimpl
def qcore_backend_pattern_configs(backend):
    """torch 2.13's native ``onednn`` patterns, for ``onednn`` only."""
    if backend != BACKEND:
        return None
    return config.onednn_pattern_configs()


@hookimpl
def qcore_backend_kernels(backend):
    """The x86 engine's kernels, the same as ``x86``'s (``qcore_x86.plugin``)."""
    if backend != BACKEND:
        return None
    from qcore_x86.plugin import x86_kernels

    return x86_kernels()


@hookimpl
def qcore_default_qconfig_mapping(backend, is_qat):
    """torch.ao's default ``onednn`` QConfigMapping (PTQ or QAT), from qcore's observers;
    on a CPU without VNNI with 7-bit activations (``reduce_range``), as x86's: int8
    sums saturate there with 8-bit ones (see ``qcore_x86.onednn``)."""
    if backend != BACKEND:
        return None
    from qcore.config.qconfig import default_qconfig_mapping
    from qcore_x86.onednn import cpu_has_vnni

    reduce_range = None if cpu_has_vnni() else True
    return default_qconfig_mapping(BACKEND, is_qat=is_qat, reduce_range=reduce_range)


@hookimpl
def qcore_backend_quantizer(backend, is_qat):
    """PT2E by name: oneDNN's recipe, x86's ``X86Quantizer``."""
    if backend != BACKEND:
        return None
    from qcore_x86.quantizer import X86Quantizer

    return X86Quantizer(is_qat=is_qat)
