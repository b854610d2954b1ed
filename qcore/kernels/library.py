"""The full kernel set for one engine: what a plugin registers.

Example (a plugin's hook)::

    @hookimpl
    def qcore_backend_kernels(backend):
        return kernels_for("fbgemm") if backend == "fbgemm" else None

Each family lists its patterns (module classes, functions, method names, and
forward chains for fused relu); ``kernels_for`` names them ``engine.family``.
Where an engine lacks a kernel (:data:`UNAVAILABLE`), the kernel is still
registered and refuses with the reason, so explain tells the user why the
pattern stays in reference form.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.intrinsic.qat as nniqat
import torch.nn.functional as F

from qcore.kernels import activations, binary, norms, shape
from qcore.kernels.dynamic import DynamicLinear, DynamicRNN
from qcore.kernels.dynamic_cells import DynamicCell
from qcore.kernels.embedding import QuantizedEmbedding, QuantizedEmbeddingBag
from qcore.kernels.weighted import QuantizedConv, QuantizedConvTranspose, QuantizedLinear
from qcore.plugin.kernels import Kernel, KernelUnavailable

__all__ = [
    "ENGINES",
    "PACKED_AS",
    "UNAVAILABLE",
    "declare_unconfigured",
    "families",
    "kernels_for",
    "no_model_reason",
]

ENGINES = ("fbgemm", "qnnpack", "x86", "onednn")

aten = torch.ops.aten

# torch.export graphs (PT2E) call the aten overloads.
RELU = (torch.nn.ReLU, F.relu, torch.relu, "relu", aten.relu.default, aten.relu_.default)

#: family -> reason, per engine: torch 2.13 has no (working) such kernel for it.
UNAVAILABLE: dict[str, dict[str, str]] = {
    "onednn": {
        f"conv_transpose{dims}d": (
            "torch 2.13's onednn int8 conv_transpose is off by many quantization steps "
            "against the reference (fbgemm and qnnpack agree with it)"
        )
        for dims in (1, 2, 3)
    },
    "qnnpack": {
        "conv_transpose3d": (
            "torch 2.13's qnnpack int8 conv_transpose3d is off by many quantization steps "
            "against the reference (its 1d and 2d agree)"
        ),
    },
}


#: family -> the packed format it uses, per engine, where not the engine's own. torch's
#: x86 engine packs a transposed conv for oneDNN on CPUs with VNNI (whose int8
#: conv_transpose is off by many steps here, see UNAVAILABLE) and for fbgemm
#: elsewhere: x86's kernel always takes the fbgemm format, which agrees with the
#: reference on both kinds of CPU.
# torch's static int8 conv and linear take and give quint8 activations only, on
# every engine ("Expected activation data type QUInt8").
UNSIGNED_FAMILIES = ("conv", "linear_relu", "linear")
UNSIGNED_ONLY = (torch.quint8,)

PACKED_AS: dict[str, dict[str, str]] = {
    "x86": {f"conv_transpose{dims}d": "fbgemm" for dims in (1, 2, 3)},
}


#: Why the conformance suite checks no kernel of these patterns (``Kernel.no_model_reason``).
QAT_ONLY = (
    "a QAT module or conv/linear fused with batch norm for QAT: convert folds the batch "
    "norm and gives the float module (to_float), which the float pattern's kernel takes"
)
NO_TENSOR_METHOD = (
    "torch.Tensor has no such method (torch.ao's configs list the name), so no model can call it"
)


FUSED_CHAIN = (
    "a conv, linear or batch norm followed by relu: the first-party configs fuse the pair "
    "into one module (FX: torch.ao's fusion patterns; PT2E: qcore's convert) or declare "
    "no such chain, so no model reaches lowering as this chain; it serves a config that "
    "quantizes the pair unfused"
)
MIXED_CHAIN = (
    "mixes a torch.fx-traced op (a function, method or activation module) with a "
    "torch.export aten op: no traced or exported graph holds both"
)
TRACED_THROUGH = (
    "torch.fx traces this torch.nn.functional wrapper through, recording the Tensor "
    "method it calls: no traced graph holds the function itself"
)
_WEIGHTED_OR_NORM = (
    torch.nn.Linear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
)


def _is_aten(op) -> bool:
    return isinstance(op, torch._ops.OpOverload)


def no_model_reason(pattern) -> str:
    """Why no conformance model can exercise ``pattern`` with a first-party backend
    (``Kernel.no_model_reason``), or ''.

    Example::

        >>> no_model_reason(nniqat.ConvBn2d) == QAT_ONLY
        True
    """
    chain = pattern if isinstance(pattern, tuple) else (pattern,)
    first = chain[0]
    if isinstance(first, type) and first not in (nni.BNReLU2d, nni.BNReLU3d):
        if first.__module__.startswith("torch.ao.nn.intrinsic.qat") or "Bn" in first.__name__:
            return QAT_ONLY
    if isinstance(first, str) and not hasattr(torch.Tensor, first):
        return NO_TENSOR_METHOD
    if first in (F.sigmoid, F.tanh):
        return TRACED_THROUGH
    # An exported graph holds aten ops, and modules only where convert builds
    # reference modules (the weighted op a chain starts with).
    rest = chain[1:] if isinstance(first, type) else chain
    if any(map(_is_aten, chain)) and not all(map(_is_aten, rest)):
        return MIXED_CHAIN
    if len(chain) > 1 and first in _WEIGHTED_OR_NORM:
        return FUSED_CHAIN
    return ""


def declare_unconfigured(
    kernels: list[Kernel], pattern_configs: list, backend: str
) -> list[Kernel]:
    """``kernels``, those whose pattern none of ``pattern_configs`` declares given that
    as their ``no_model_reason`` (the kernel library serves every engine; a backend's
    config quantizes only some of its patterns). Patterns of aten ops (PT2E graphs)
    and kernels with a reason already are left as they are.

    Example (a plugin's hook)::

        return declare_unconfigured(kernels_for("fbgemm"), config.pattern_configs(), "fbgemm")
    """
    declared = set()
    for config in pattern_configs:
        for pattern in (config.pattern, config.fused_module):
            if pattern is not None:
                declared.add(pattern if isinstance(pattern, tuple) else (pattern,))
    result = []
    for kernel in kernels:
        if kernel.no_model_reason or kernel.chain in declared or any(map(_is_aten, kernel.chain)):
            result.append(kernel)
            continue
        why = f"{backend}'s config declares no such pattern, so it never reaches lowering"
        result.append(dataclasses.replace(kernel, no_model_reason=why))
    return result


def _with_relu(patterns, relu_patterns=RELU) -> list:
    return [(p, r) for p in patterns for r in relu_patterns]


def families() -> list[tuple[str, list, object]]:
    """(family name, patterns, lower) in the order kernels are tried."""
    conv_kinds = []
    for dims in (1, 2, 3):
        conv = getattr(torch.nn, f"Conv{dims}d")
        fused_relu = [getattr(nni, f"ConvReLU{dims}d"), getattr(nniqat, f"ConvReLU{dims}d")]
        fused_relu += [getattr(nni, f"ConvBnReLU{dims}d"), getattr(nniqat, f"ConvBnReLU{dims}d")]
        plain = [conv, getattr(nni, f"ConvBn{dims}d"), getattr(nniqat, f"ConvBn{dims}d")]
        relu = functools.partial(QuantizedConv.lower, relu=True)
        conv_kinds += [
            (f"conv{dims}d_relu", fused_relu + _with_relu([conv]), relu),
            (f"conv{dims}d", plain, QuantizedConv.lower),
            (
                f"conv_transpose{dims}d",
                [getattr(torch.nn, f"ConvTranspose{dims}d")],
                QuantizedConvTranspose.lower,
            ),
        ]
    add = (operator.add, torch.add, aten.add.Tensor, aten.add_.Tensor)
    mul = (operator.mul, torch.mul, aten.mul.Tensor, aten.mul_.Tensor)
    relu_linear = functools.partial(QuantizedLinear.lower, relu=True)
    dynamic_relu = functools.partial(DynamicLinear.lower, relu=True)
    return [
        ("linear_relu", [nni.LinearReLU, *_with_relu([torch.nn.Linear])], relu_linear),
        ("linear", [torch.nn.Linear, nni.LinearBn1d, nniqat.LinearBn1d], QuantizedLinear.lower),
        ("linear_relu_dynamic", [nni.LinearReLU, *_with_relu([torch.nn.Linear])], dynamic_relu),
        ("linear_dynamic", [torch.nn.Linear], DynamicLinear.lower),
        *conv_kinds,
        ("rnn_dynamic", [torch.nn.LSTM, torch.nn.GRU], DynamicRNN.lower),
        (
            "rnn_cell_dynamic",
            [torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell],
            DynamicCell.lower,
        ),
        ("embedding", [torch.nn.Embedding], QuantizedEmbedding.lower),
        ("embedding_bag", [torch.nn.EmbeddingBag], QuantizedEmbeddingBag.lower),
        ("add_relu", _with_relu(add), functools.partial(binary.lower_binary, op="add", relu=True)),
        ("add", list(add), functools.partial(binary.lower_binary, op="add")),
        ("mul_relu", _with_relu(mul), functools.partial(binary.lower_binary, op="mul", relu=True)),
        ("mul", list(mul), functools.partial(binary.lower_binary, op="mul")),
        ("cat", [torch.cat, aten.cat.default], binary.lower_cat),
        # bmm: PT2E annotates it under matmul's pattern; the int8 matmul batches 3-D operands
        ("matmul", [torch.matmul, aten.matmul.default, aten.bmm.default], binary.lower_matmul),
        (
            "batch_norm2d_relu",
            [nni.BNReLU2d, *_with_relu([torch.nn.BatchNorm2d])],
            functools.partial(norms.lower_batch_norm, dims=2),
        ),
        ("batch_norm2d", [torch.nn.BatchNorm2d], functools.partial(norms.lower_batch_norm, dims=2)),
        (
            "batch_norm3d_relu",
            [nni.BNReLU3d, *_with_relu([torch.nn.BatchNorm3d])],
            functools.partial(norms.lower_batch_norm, dims=3),
        ),
        ("batch_norm3d", [torch.nn.BatchNorm3d], functools.partial(norms.lower_batch_norm, dims=3)),
        ("layer_norm", [torch.nn.LayerNorm, F.layer_norm], norms.lower_layer_norm),
        ("group_norm", [torch.nn.GroupNorm, F.group_norm], norms.lower_group_norm),
        (
            "instance_norm",
            [
                torch.nn.InstanceNorm1d,
                torch.nn.InstanceNorm2d,
                torch.nn.InstanceNorm3d,
                F.instance_norm,
            ],
            norms.lower_instance_norm,
        ),
        (
            "hardswish",
            [torch.nn.Hardswish, F.hardswish, aten.hardswish.default, aten.hardswish_.default],
            activations.lower_hardswish,
        ),
        ("elu", [torch.nn.ELU, F.elu], activations.lower_elu),
        ("leaky_relu", [torch.nn.LeakyReLU, F.leaky_relu], activations.lower_leaky_relu),
        (
            "sigmoid",
            [torch.nn.Sigmoid, torch.sigmoid, F.sigmoid, "sigmoid", aten.sigmoid.default],
            functools.partial(activations.lower_fixed_qparams, op="sigmoid"),
        ),
        (
            "tanh",
            [torch.nn.Tanh, torch.tanh, F.tanh, "tanh", aten.tanh.default],
            functools.partial(activations.lower_fixed_qparams, op="tanh"),
        ),
        (
            "hardsigmoid",
            [torch.nn.Hardsigmoid, F.hardsigmoid, "hardsigmoid"],
            functools.partial(activations.lower_fixed_qparams, op="hardsigmoid"),
        ),
        ("relu", [*RELU, "relu_"], activations.lower_relu),
        (
            "clamp",
            [
                torch.nn.ReLU6,
                F.relu6,
                torch.nn.Hardtanh,
                F.hardtanh,
                torch.clamp,
                "clamp",
                aten.hardtanh.default,
                aten.hardtanh_.default,
            ],
            activations.lower_clamp,
        ),
        ("pool_and_shape", list(shape.SELECTING_PATTERNS), shape.lower_selecting),
        ("average", list(shape.AVERAGING_PATTERNS), shape.lower_averaging),
    ]


def _unavailable(reason: str, match):
    raise KernelUnavailable(reason)


def kernels_for(engine: str) -> list[Kernel]:
    """Every kernel family, packed for ``engine`` (``fbgemm``, ``qnnpack``, ``x86`` or
    ``onednn``)."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: qcore's kernel library covers {ENGINES}")
    missing = UNAVAILABLE.get(engine, {})
    packed_as = PACKED_AS.get(engine, {})
    kernels = []
    for family, patterns, lower in families():
        if family in missing:
            lower = functools.partial(_unavailable, missing[family])
        packing = packed_as.get(family, engine)
        unsigned = family.startswith(UNSIGNED_FAMILIES) and not family.endswith("_dynamic")
        dtypes = UNSIGNED_ONLY if unsigned else ()
        for pattern in patterns:
            reason = missing.get(family, "") or no_model_reason(pattern)
            kernels.append(Kernel(f"{engine}.{family}", pattern, packing, lower, dtypes, reason))
    return kernels
