"""The x86 backend's dtype configs and pattern configs (torch 2.13's native x86)."""

from __future__ import annotations

import torch

from qcore.config import BackendPatternConfig, DTypeConfig
from qcore.config.onednn_fusions import conv_add_pattern_configs, linear_eltwise_pattern_configs
from qcore.config.standard_ops import standard_pattern_configs

BACKEND = "x86"

weighted_op_quint8 = DTypeConfig(
    input_dtype=torch.quint8,
    output_dtype=torch.quint8,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
)
"""Static int8: quint8 activations, qint8 weights, float bias."""

default_op_quint8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8)
"""Static int8 for ops without weights."""

dynamic_int8 = DTypeConfig(
    input_dtype=torch.quint8,
    output_dtype=torch.float,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
    is_dynamic=True,
)
"""Dynamic int8: weights quantized ahead of time, activations on the fly."""

dynamic_float16 = DTypeConfig(
    input_dtype=torch.float16,
    output_dtype=torch.float,
    weight_dtype=torch.float16,
    bias_dtype=torch.float,
    is_dynamic=True,
)
"""Dynamic float16."""

weight_only_quint8 = DTypeConfig(
    input_dtype=torch.float, output_dtype=torch.float, weight_dtype=torch.quint8
)
"""Weight-only quint8 (embeddings)."""

weight_only_quint4x2 = DTypeConfig(
    input_dtype=torch.float, output_dtype=torch.float, weight_dtype=torch.quint4x2
)
"""Weight-only 4-bit (embeddings)."""


def pattern_configs() -> list[BackendPatternConfig]:
    """x86's 192 pattern configs."""
    return standard_pattern_configs(
        conv=[weighted_op_quint8],
        linear=[weighted_op_quint8, dynamic_int8, dynamic_float16],
        # x86 accepts binary and fixed-qparams ops with the weighted dtype
        # config (its weight and bias dtypes are unused there), as torch.ao does.
        binary_op=[weighted_op_quint8],
        cat=[default_op_quint8],
        own_qparams_op=[default_op_quint8],
        fixed_qparams_op=[weighted_op_quint8],
        shared_qparams_op=[default_op_quint8],
        tensor_info_op=[default_op_quint8],
        batch_norm=[default_op_quint8],
        rnn=[dynamic_int8, dynamic_float16],
        embedding=[weight_only_quint8, weight_only_quint4x2],
    )


# -- onednn: torch 2.13's native onednn config, the same engine as x86 --------

ONEDNN_BACKEND = "onednn"

weight_only_qint8 = DTypeConfig(
    input_dtype=torch.float, output_dtype=torch.float, weight_dtype=torch.qint8
)
"""Weight-only qint8 (onednn's embeddings)."""

input_output_only_quint8 = DTypeConfig(
    input_dtype=torch.quint8,
    output_dtype=torch.quint8,
    weight_dtype=torch.float,
    bias_dtype=torch.float,
)
"""quint8 activations around float weights (onednn's layer norm)."""


def onednn_pattern_configs() -> list[BackendPatternConfig]:
    """onednn's pattern configs: x86's families (with onednn's dtype configs), plus
    conv2d + add (+ relu) and linear + leaky_relu/tanh fusions."""
    return [
        *standard_pattern_configs(conv=[weighted_op_quint8]),
        *conv_add_pattern_configs([weighted_op_quint8]),
        *standard_pattern_configs(linear=[weighted_op_quint8, dynamic_int8]),
        *linear_eltwise_pattern_configs([weighted_op_quint8, dynamic_int8]),
        *standard_pattern_configs(
            binary_op=[default_op_quint8],
            cat=[default_op_quint8],
            own_qparams_op=[default_op_quint8],
            fixed_qparams_op=[default_op_quint8],
            shared_qparams_op=[default_op_quint8],
            batch_norm=[default_op_quint8],
        ),
        # torch.ao's order: layer norm before the RNNs (the families' order puts it last)
        *standard_pattern_configs(layer_norm=[input_output_only_quint8]),
        *standard_pattern_configs(rnn=[dynamic_int8], embedding=[weight_only_qint8]),
    ]


def inductor_recipe(mode: str = "default"):
    """Inductor with frozen weights: torch's x86 int8 passes (oneDNN's qconv/qlinear
    with their post-ops, the quantize/dequantize around them fused away) match the
    reference form's ``quantized_decomposed`` graph, as they match torchao's.

    ``"reduce-overhead"`` adds Inductor's C++ wrapper: the compiled graph's kernel
    calls run from C++, not Python. On this project's machine that took 15-30% off
    the zoo's compiled latency and added 2-7 s to each compile, which Inductor does
    not cache across processes for these graphs (their packed oneDNN weights cannot
    be pickled), so it is not the default (benchmarks/PT2E.md).

    Inductor's size asserts (a stride check of every oneDNN call's output, on every
    call: 5% of a small conv net's compiled latency) are off: ``qcore.compile``
    checks each compiled signature's first call against the reference form
    instead, which a graph lowered with wrong strides fails."""
    from qcore import CompileRecipe

    if mode == "reduce-overhead":
        return CompileRecipe(
            "inductor",
            {"freezing": True, "cpp_wrapper": True, "size_asserts": False},
            concat_linears=True,
            summary="Inductor with oneDNN's int8 passes, frozen weights and its C++ wrapper",
        )
    return CompileRecipe(
        "inductor",
        {"freezing": True, "size_asserts": False},
        concat_linears=True,
        summary="Inductor with oneDNN's int8 passes and frozen weights",
    )
