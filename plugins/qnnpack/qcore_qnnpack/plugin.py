"""The ``qnnpack`` backend's hook implementations (entry point ``qcore.backends: qnnpack``)."""

from __future__ import annotations

from qcore.plugin.markers import hookimpl
from qcore.plugin.recipes import AlgorithmStep
from qcore_qnnpack import config

QCORE_PLUGIN_API_VERSION = 1

BACKEND = config.BACKEND


@hookimpl
def qcore_backend_pattern_configs(backend):
    """torch 2.13's native ``qnnpack`` patterns, for ``qnnpack`` only."""
    if backend != BACKEND:
        return None
    return config.pattern_configs()


@hookimpl
def qcore_backend_kernels(backend):
    """qcore's int8 kernel library, packed for the qnnpack engine."""
    if backend != BACKEND:
        return None
    from qcore.kernels.library import declare_unconfigured, kernels_for

    # Kernels of patterns this config leaves out carry the reason (``qcore check``).
    return declare_unconfigured(kernels_for("qnnpack"), config.pattern_configs(), BACKEND)


@hookimpl
def qcore_default_qconfig_mapping(backend, is_qat):
    """The default ``qnnpack`` QConfigMapping (PTQ or QAT), built from qcore's observers."""
    if backend != BACKEND:
        return None
    from qcore.config.qconfig import default_qconfig_mapping

    return default_qconfig_mapping(BACKEND, is_qat=is_qat)


@hookimpl
def qcore_recommended_algorithms(backend):
    """Cross-layer equalization, then bias correction: what
    ``qcore.quantize(..., algorithms="recommended")`` runs for ``qnnpack``.

    qnnpack quantizes weights per tensor: one wide output channel sets the scale
    of the whole layer. Equalization evens the channels' ranges where ReLUs alone
    stand between layers; correct_bias then removes the mean shift the rounding
    leaves. Equalization does not cross ReLU6 here (``relu6_to_relu``, AIMET's
    choice, stays opt-in): it replaces ReLU6 by ReLU, which changes the float model
    wherever activations pass 6, and a recommended recipe must keep the float
    function. Crossing ReLU6 gained 0.1-0.7 dB on the example MobileNetV2s at
    their own input scale and lost 16 dB at twice it (benchmarks/ALGORITHMS.md,
    "qnnpack's recipe keeps ReLU6"); this recipe measured +0.2 dB on average over
    the four example models at both scales (-0.5 to +1.3).
    """
    if backend != BACKEND:
        return None
    return [
        AlgorithmStep("equalize", reason="per-tensor weights: even out channel ranges"),
        AlgorithmStep("correct_bias", reason="remove the output shift weight rounding leaves"),
    ]
