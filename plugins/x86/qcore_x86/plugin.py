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


#: ``Kernel.no_model_reason`` of the library's PT2E kernels under x86's own Quantizer.
X86_QUANTIZER_LEAVES_FLOAT = (
    "x86's PT2E Quantizer (X86Quantizer, torchao's X86InductorQuantizer recipe) "
    "annotates this op only fused into a conv/linear or right after one, never on its "
    "own; the kernel serves graphs other Quantizers annotate (native, extensions)"
)


#: x86's kernels that onednn's default mappings never give a match they take.
ONEDNN_REFUSED = {
    **{
        f"conv_transpose{dims}d": (
            "onednn's default QConfigMappings give ConvTranspose per-channel weights (as "
            "torch.ao's do), which torch's int8 conv_transpose refuses"
        )
        for dims in (1, 2, 3)
    },
    **{
        family: (
            "onednn's config takes embeddings with qint8 weights; torch.ao's weight-only "
            "QConfig (float_qparams_weight_only_qconfig, the one the suite tries) gives quint8"
        )
        for family in ("embedding", "embedding_bag")
    },
}


def declared_kernels(kernels: list, pattern_configs: list, backend: str = BACKEND) -> list:
    """``kernels`` with ``no_model_reason`` set where ``backend`` (x86 or onednn: both
    quantize PT2E graphs with X86Quantizer) never gives them their pattern (``qcore
    check`` reports them by that reason): patterns its config leaves out, and
    torch.export ops its Quantizer leaves float on their own."""
    import dataclasses

    import torch

    from qcore.kernels.library import declare_unconfigured

    result = []
    for kernel in declare_unconfigured(kernels, pattern_configs, backend):
        exported = any(isinstance(op, torch._ops.OpOverload) for op in kernel.chain)
        if exported and not kernel.no_model_reason:
            kernel = dataclasses.replace(kernel, no_model_reason=X86_QUANTIZER_LEAVES_FLOAT)
        family = kernel.name.partition(".")[2]
        if backend == "onednn" and family in ONEDNN_REFUSED and not kernel.no_model_reason:
            kernel = dataclasses.replace(kernel, no_model_reason=ONEDNN_REFUSED[family])
        result.append(kernel)
    return result


@hookimpl
def qcore_backend_kernels(backend):
    """The x86 engine's kernels (:func:`x86_kernels`)."""
    if backend != BACKEND:
        return None
    return declared_kernels(x86_kernels(), config.pattern_configs())


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
def qcore_compile_recipe(backend, mode):
    """Inductor with oneDNN's int8 passes and frozen weights, plus its C++ wrapper in
    ``"reduce-overhead"`` mode (``config.inductor_recipe``): what ``qcore.compile``
    runs x86 models with."""
    if backend != BACKEND:
        return None
    return config.inductor_recipe(mode)


@hookimpl
def qcore_recommended_algorithms(backend):
    """None of qcore's algorithms by default: plain calibration is x86's best.

    x86 quantizes weights per output channel, so each channel already has its own
    scale and equalization has little to even out; bias correction gains on plain
    conv and linear nets and loses on depthwise ones. Measured
    (benchmarks/ALGORITHMS.md, PT2E, held-out data): correct_bias +0.5, +0.6 and
    +0.9 dB on the MLP, the ResNet-style net and BERT, -0.8 and -1.3 dB on the two
    MobileNetV2s; equalize +0.9 dB on the ResNet-style net, -0.1 on the MLP, within
    0.05 dB of plain elsewhere. On FX (7-bit activations) equalize + correct_bias
    gains 0.1-0.7 dB on three of the four example models; the depthwise losses on
    PT2E decide. Ask for them by name where your own model gains.
    """
    if backend != BACKEND:
        return None
    return []
