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
    """Cross-layer equalization across ReLU6, then bias correction: what
    ``qcore.quantize(..., algorithms="recommended")`` runs for ``qnnpack``.

    qnnpack quantizes weights per tensor: one wide output channel sets the scale
    of the whole layer, and MobileNet-style depthwise convs (few weights per
    channel, ranges spread wide) lose the narrow channels to rounding. Equalization
    evens the channels' ranges; mobile nets put ReLU6 between their layers, so
    equalization only reaches them with ``relu6_to_relu`` (AIMET's choice too);
    correct_bias then removes the mean shift the rounding leaves. Measured
    (benchmarks/ALGORITHMS.md, PT2E, held-out data): the one recipe that gains on
    both MobileNetV2s (19.9 -> 20.5 dB and 2.8 -> 3.4 dB, where correct_bias alone
    loses 0.1 and 0.5), +0.6 dB on the ResNet-style net, EfficientNet, ConvNeXt
    and the transformer block within 0.1 dB (SiLU and GELU stop equalization),
    the MLP -0.3 dB: +0.2 dB on average over the seven models measured (BERT fails
    on qnnpack's PT2E path), the best mean of the recipes tried (correct_bias alone
    +0.16). Far from the 2 dB issue 17 hoped for: see the benchmark.
    """
    if backend != BACKEND:
        return None
    return [
        AlgorithmStep(
            "equalize",
            {"relu6_to_relu": True},
            reason="per-tensor weights: even out channel ranges (across ReLU6, as AIMET does)",
        ),
        AlgorithmStep("correct_bias", reason="remove the output shift weight rounding leaves"),
    ]
