"""Small models, one kernel family each, for the kernel tests (numerics, save/load).

    case = CASES["add_relu"]
    built = build(case, "fbgemm")      # prepared, reference form, lowered, inputs
    built.converted(*built.inputs)

Each case's model is its op alone (or fused chain) on quantized inputs, so the
model's output is the op's output: the reference form ends in the op's output
quantize/dequantize, and one quantization step is that quantize's scale.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import qcore
from qcore import ops
from qcore.config.qconfig import (
    QConfigMapping,
    default_dynamic_qconfig,
    float16_dynamic_qconfig,
    float_qparams_weight_only_qconfig,
)


class Fn(nn.Module):
    """A module running ``fn`` on one input (so the op is a traced call_function/method)."""

    def __init__(self, fn, *children: nn.Module) -> None:
        super().__init__()
        self.fn = fn
        self.children_ = nn.ModuleList(children)

    def forward(self, x):
        return self.fn(self, x)


class Fn2(Fn):
    """``fn`` on two inputs."""

    def forward(self, x, y):
        return self.fn(self, x, y)


class Wrap(nn.Module):
    """The case's model as a child, so a module case stays one call_module node."""

    def __init__(self, model: nn.Module, arity: int) -> None:
        super().__init__()
        self.model = model
        self.arity = arity

    def forward(self, x):
        return self.model(x)


class Wrap2(Wrap):
    def forward(self, x, y):
        return self.model(x, y)


def seq(*modules: nn.Module) -> nn.Module:
    return nn.Sequential(*modules)


@dataclass(frozen=True)
class Case:
    make: Any  # () -> nn.Module
    shapes: tuple  # input shapes (float inputs, standard normal)
    family: str  # the kernel family expected, e.g. "add_relu"
    mapping: str = "default"  # default | dynamic | fp16 | weight_only
    node: str | None = None  # the node explain reports the kernel on (default: the first op)
    indices: tuple = ()  # integer inputs (embeddings): (num_embeddings, shape)
    extra: dict = field(default_factory=dict)


def _bn(cls, n):
    def make():
        with torch.random.fork_rng():
            torch.manual_seed(3)
            bn = cls(n)
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-0.3, 0.3)
        return bn.eval()

    return make


CASES: dict[str, Case] = {
    "linear": Case(lambda: nn.Linear(16, 8), ((4, 16),), "linear"),
    "linear_relu": Case(lambda: seq(nn.Linear(16, 8), nn.ReLU()), ((4, 16),), "linear_relu"),
    "conv1d": Case(lambda: nn.Conv1d(4, 6, 3), ((2, 4, 10),), "conv1d"),
    "conv2d_bn_relu": Case(
        lambda: seq(nn.Conv2d(4, 6, 3, padding=1), _bn(nn.BatchNorm2d, 6)(), nn.ReLU()),
        ((2, 4, 8, 8),),
        "conv2d_relu",
    ),
    "conv2d_depthwise": Case(lambda: nn.Conv2d(4, 4, 3, groups=4), ((2, 4, 8, 8),), "conv2d"),
    "conv3d_relu": Case(
        lambda: seq(nn.Conv3d(3, 4, 3), nn.ReLU()), ((1, 3, 6, 6, 6),), "conv3d_relu"
    ),
    "conv_transpose1d": Case(
        lambda: nn.ConvTranspose1d(4, 3, 3, stride=2), ((2, 4, 7),), "conv_transpose1d"
    ),
    "conv_transpose2d": Case(
        lambda: nn.ConvTranspose2d(4, 3, 3, stride=2), ((2, 4, 5, 5),), "conv_transpose2d"
    ),
    "conv_transpose3d": Case(
        lambda: nn.ConvTranspose3d(3, 2, 2), ((1, 3, 4, 4, 4),), "conv_transpose3d"
    ),
    "add": Case(lambda: Fn2(lambda m, x, y: x + y), ((2, 8, 5), (2, 8, 5)), "add"),
    "add_relu": Case(
        lambda: Fn2(lambda m, x, y: F.relu(torch.add(x, y))), ((2, 8, 5), (2, 8, 5)), "add_relu"
    ),
    "mul": Case(lambda: Fn2(lambda m, x, y: x * y), ((2, 8, 5), (2, 8, 5)), "mul"),
    "mul_relu": Case(
        lambda: Fn2(lambda m, x, y: torch.relu(x * y)), ((2, 8, 5), (2, 8, 5)), "mul_relu"
    ),
    "add_scalar": Case(lambda: Fn(lambda m, x: x + 0.75), ((2, 8, 5),), "add"),
    "mul_scalar": Case(lambda: Fn(lambda m, x: x * 0.25), ((2, 8, 5),), "mul"),
    "cat": Case(
        lambda: Fn2(lambda m, x, y: torch.cat([x, 3 * y], 1)),
        ((2, 3, 5), (2, 4, 5)),
        "cat",
        node="cat",
    ),
    "batch_norm2d": Case(_bn(nn.BatchNorm2d, 4), ((2, 4, 6, 6),), "batch_norm2d"),
    "batch_norm2d_relu": Case(
        lambda: seq(_bn(nn.BatchNorm2d, 4)(), nn.ReLU()), ((2, 4, 6, 6),), "batch_norm2d_relu"
    ),
    "batch_norm3d": Case(_bn(nn.BatchNorm3d, 3), ((1, 3, 4, 4, 4),), "batch_norm3d"),
    "instance_norm2d": Case(
        lambda: nn.InstanceNorm2d(4, affine=True), ((2, 4, 6, 6),), "instance_norm"
    ),
    "group_norm": Case(lambda: Fn(lambda m, x: F.group_norm(x, 2)), ((2, 4, 6, 6),), "group_norm"),
    "hardswish": Case(lambda: nn.Hardswish(), ((2, 8, 5),), "hardswish"),
    "elu": Case(lambda: nn.ELU(0.7), ((2, 8, 5),), "elu"),
    "leaky_relu": Case(lambda: nn.LeakyReLU(0.1), ((2, 8, 5),), "leaky_relu"),
    "sigmoid": Case(lambda: nn.Sigmoid(), ((2, 8, 5),), "sigmoid"),
    "tanh": Case(lambda: Fn(lambda m, x: torch.tanh(x)), ((2, 8, 5),), "tanh"),
    "hardsigmoid": Case(lambda: nn.Hardsigmoid(), ((2, 8, 5),), "hardsigmoid"),
    "relu": Case(
        lambda: seq(nn.Linear(8, 8), nn.Identity(), nn.ReLU()), ((3, 8),), "relu", node="2"
    ),
    "relu6": Case(
        lambda: seq(nn.Linear(8, 8), nn.Identity(), nn.ReLU6()), ((3, 8),), "clamp", node="2"
    ),
    "hardtanh": Case(
        lambda: seq(nn.Linear(8, 8), nn.Hardtanh(-0.5, 0.5)), ((3, 8),), "clamp", node="1"
    ),
    # After a conv, the input is channels-last (every int8 conv returns that layout);
    # torch 2.13's qnnpack clamp scrambles such an input.
    "conv2d_relu6": Case(
        lambda: seq(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU6()),
        ((2, 3, 6, 6),),
        "clamp",
        node="1",
    ),
    "conv3d_hardtanh": Case(
        lambda: Fn(lambda m, x: F.hardtanh(m.children_[0](x), -0.4, 0.6), nn.Conv3d(2, 3, 1)),
        ((1, 2, 3, 4, 4),),
        "clamp",
        node="hardtanh",
    ),
    "conv2d_clamp": Case(
        lambda: Fn(lambda m, x: m.children_[0](x).clamp(-0.3, 0.5), nn.Conv2d(3, 4, 1)),
        ((2, 3, 5, 5),),
        "clamp",
        node="clamp",
    ),
    "conv2d_clamp_min": Case(
        lambda: Fn(lambda m, x: torch.clamp(m.children_[0](x), min=-0.2), nn.Conv2d(3, 4, 1)),
        ((2, 3, 5, 5),),
        "clamp",
        node="clamp",
    ),
    "conv2d_elu": Case(
        lambda: seq(nn.Conv2d(3, 4, 3, padding=1), nn.ELU(0.5)), ((2, 3, 6, 6),), "elu", node="1"
    ),
    "max_pool2d": Case(
        lambda: seq(nn.Conv2d(3, 4, 1), nn.MaxPool2d(2)),
        ((2, 3, 8, 8),),
        "pool_and_shape",
        node="1",
    ),
    "avg_pool2d": Case(
        lambda: seq(nn.Conv2d(3, 4, 1), nn.AvgPool2d(2)), ((2, 3, 8, 8),), "average", node="1"
    ),
    "adaptive_avg_pool2d": Case(
        lambda: seq(nn.Conv2d(3, 4, 1), nn.AdaptiveAvgPool2d(2)),
        ((2, 3, 8, 8),),
        "average",
        node="1",
    ),
    "shape_ops": Case(
        lambda: Fn(
            lambda m, x: m.children_[0](x).reshape(2, 4, 16).transpose(1, 2).flatten(1),
            nn.Conv2d(3, 4, 1),
        ),
        ((2, 3, 4, 4),),
        "pool_and_shape",
        node="reshape",
    ),
    "linear_dynamic": Case(lambda: nn.Linear(16, 8), ((4, 16),), "linear_dynamic", "dynamic"),
    "linear_dynamic_fp16": Case(lambda: nn.Linear(16, 8), ((4, 16),), "linear_dynamic", "fp16"),
    "lstm_dynamic": Case(
        lambda: nn.LSTM(8, 12, num_layers=2, batch_first=True),
        ((2, 5, 8),),
        "rnn_dynamic",
        "dynamic",
    ),
    "gru_dynamic_fp16": Case(
        lambda: nn.GRU(8, 12, bidirectional=True), ((5, 2, 8),), "rnn_dynamic", "fp16"
    ),
    "embedding": Case(
        lambda: nn.Embedding(20, 8), (), "embedding", "weight_only", indices=(20, (3, 4))
    ),
    "embedding_bag": Case(
        lambda: nn.EmbeddingBag(20, 8, mode="sum"),
        (),
        "embedding_bag",
        "weight_only",
        indices=(20, (3, 4)),
    ),
}


def mapping_for(kind: str, backend: str):
    if kind == "default":
        return qcore.get_default_qconfig_mapping(backend)
    qconfig = {
        "dynamic": default_dynamic_qconfig,
        "fp16": float16_dynamic_qconfig,
        "weight_only": float_qparams_weight_only_qconfig,
    }[kind]
    return QConfigMapping().set_global(qconfig)


def inputs_for(case: Case, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    if case.indices:
        count, shape = case.indices
        return (torch.randint(0, count, shape, generator=generator),)
    return tuple(torch.randn(*shape, generator=generator) for shape in case.shapes)


@dataclass
class Built:
    model: nn.Module
    prepared: Any
    reference: Any
    converted: Any
    inputs: tuple


def build(case: Case, backend: str, seed: int = 0) -> Built:
    """Prepare (weights from ``seed``), calibrate, convert to reference and lowered forms."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        inner = case.make().eval()
        model = (Wrap2 if len(case.shapes) == 2 else Wrap)(inner, len(case.shapes)).eval()
    example = inputs_for(case, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fixed-qparams op's override notice, reduce_range
        prepared = qcore.prepare_fx(model, mapping_for(case.mapping, backend), example, backend)
        with torch.no_grad():
            for batch in range(4):
                prepared(*inputs_for(case, 4 * seed + batch))
        reference = qcore.convert_to_reference_fx(prepared)
        converted = qcore.convert_fx(prepared)
    return Built(model, prepared, reference, converted, inputs_for(case, 10))


def output_scale(reference) -> float | None:
    """The scale of the reference's last per-tensor quantize before its output
    (quantized_decomposed in the public reference form, qcore.ops in the lowering's)."""
    quantize = (ops.quantize_per_tensor, torch.ops.quantized_decomposed.quantize_per_tensor.default)
    scale = None
    for node in reference.graph.nodes:
        if node.op == "call_function" and node.target in quantize:
            scale = float(node.args[1])
    return scale


STATEFUL = [
    "linear_relu",
    "conv2d_bn_relu",
    "conv_transpose2d",
    "add_relu",
    "cat",
    "batch_norm2d",
    "group_norm",
    "linear_dynamic",
    "lstm_dynamic",
    "gru_dynamic_fp16",
    "embedding",
    "embedding_bag",
]
"""Cases whose kernels hold state (packed weights, qparams): the save/load tests' set."""
