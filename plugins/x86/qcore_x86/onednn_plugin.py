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

_ONEDNN_PACKED = {f"conv{d}d{relu}" for d in (1, 2, 3) for relu in ("", "_relu")}
"""Kernel families packed for the onednn engine (as torch.ao's onednn backend runs
them: faster than x86's packing at batch 32 here); the rest as x86's."""


@hookimpl
def qcore_backend_pattern_configs(backend):
    """torch 2.13's native ``onednn`` patterns, for ``onednn`` only."""
    if backend != BACKEND:
        return None
    return config.onednn_pattern_configs()


@hookimpl
def qcore_backend_kernels(backend):
    """Convs packed for the onednn engine and its fused ``conv2d_add[_relu]`` first,
    as torch.ao's onednn backend runs them; then x86's kernels (``qcore_x86.plugin``)."""
    if backend != BACKEND:
        return None
    from qcore.kernels import kernels_for
    from qcore_x86.onednn import onednn_engine_conv_add_kernels, onednn_kernels
    from qcore_x86.plugin import declared_kernels

    convs = [k for k in kernels_for("onednn") if k.name.split(".")[1] in _ONEDNN_PACKED]
    kernels = [*convs, *onednn_engine_conv_add_kernels(), *kernels_for("x86"), *onednn_kernels()]
    # Kernels of patterns onednn never gives them carry the reason (``qcore check``).
    return declared_kernels(kernels, config.onednn_pattern_configs(), BACKEND)


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


@hookimpl
def qcore_compile_recipe(backend, mode):
    """Inductor with oneDNN's int8 passes and frozen weights, plus its C++ wrapper in
    ``"reduce-overhead"`` mode (``config.inductor_recipe``): what ``qcore.compile``
    runs onednn models with."""
    if backend != BACKEND:
        return None
    return config.inductor_recipe(mode)


@hookimpl
def qcore_recommended_algorithms(backend):
    """None of qcore's algorithms by default, as for x86 (``plugin.py``), whose
    per-channel weight quantization onednn shares. Measured on FX only
    (benchmarks/ALGORITHMS.md): equalize + correct_bias +0.3, +1.4, -0.3 and 0.0 dB
    on the four example models; x86's losses on depthwise nets keep it at none."""
    if backend != BACKEND:
        return None
    return []
