"""Convs a compiler's int8 pass must not take: those whose outputs read zero padding
only, and geometries oneDNN's int8 conv gets wrong on this CPU.

Inductor lowers ``dequantize(int8 weight) -> conv`` to oneDNN's int8 conv, which
leaves outputs that read zero padding only as garbage (a padding wider than the
kernel's reach, or a dilation stepping over a narrow input: 30-150 steps off, and
torchao + Inductor's models too). qcore's eager kernels check each call
(``qcore.kernels.scripted.reads_padding_only``); in the graph handed to a compiler,
such a conv gets its weight as a float constant (the dequantized integers, the same
values), which no int8 pass matches, so it computes as the reference does.

The same float weight goes to a conv of a geometry oneDNN's int8 conv computes
wrongly on the CPU compiling it (:mod:`qcore.kernels.onednn_probe`; Inductor would
lower it to that conv).

The input size is the one prepare recorded (for a dynamic dimension, the one
export saw): a model compiled for other spatial sizes is checked at those.

Inductor's int8 conv + add fusion also sizes a padded 1-D conv's output wrongly
(torch 2.13: "Attempting to broadcast a dimension of length 20 ... [2, 8, 22]",
at compile time). torchao's x86 quantizer leaves a bare conv1d float, so its
graphs never meet it; qcore's FX x86 and onednn configs quantize conv1d + add. A
1-D conv whose output reaches an add gets its float weight the same way.
"""

from __future__ import annotations

import operator

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
from torch.fx import GraphModule, Node

from qcore.engine.conv_padding import explicit_padding, per_dim
from qcore.engine.kernel_check import recorded
from qcore.kernels.onednn_probe import ConvGeometry, conv_wrong_here
from qcore.kernels.scripted import reads_padding_only

__all__ = ["float_weights_where_padding_only"]

_CONVS = {
    torch.ops.aten.conv1d.default,
    torch.ops.aten.conv2d.default,
    torch.ops.aten.conv3d.default,
    torch.ops.aten.conv1d.padding,
    torch.ops.aten.conv2d.padding,
    torch.ops.aten.conv3d.padding,
}
_WEIGHT_DEQUANTIZE = {
    torch.ops.quantized_decomposed.dequantize_per_channel.default,
    torch.ops.quantized_decomposed.dequantize_per_tensor.default,
}


def float_weights_where_padding_only(gm: GraphModule) -> int:
    """Give each conv of ``gm`` that reads zero padding only its weight as a float
    constant (in place); returns how many were changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CONVS or len(node.args) < 2:
            continue
        weight = node.args[1]
        value = _constant_value(gm, weight)
        if value is None:
            continue
        if not (
            _reads_padding_only(gm, node, value.shape)
            or _conv1d_into_add(node, value)
            or _wrong_on_this_cpu(gm, node, value.shape)
        ):
            continue
        name = f"{node.name}_float_weight"
        gm.register_buffer(name, value)
        with gm.graph.inserting_before(node):
            node.replace_input_with(weight, gm.graph.get_attr(name))
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return changed


def _constant_value(gm: GraphModule, weight: object) -> torch.Tensor | None:
    """The float weight a dequantize of constants computes, or None."""
    if not (
        isinstance(weight, Node)
        and weight.op == "call_function"
        and weight.target in _WEIGHT_DEQUANTIZE
    ):
        return None
    args = []
    for arg in weight.args:
        if isinstance(arg, Node):
            if arg.op != "get_attr":
                return None
            arg = getattr(gm, arg.target)
        args.append(arg)
    return weight.target(*args, **weight.kwargs).detach()


_ADDS = {torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor, torch.add, operator.add}
_QDQ = {
    torch.ops.quantized_decomposed.quantize_per_tensor.default,
    torch.ops.quantized_decomposed.dequantize_per_tensor.default,
    torch.ops.quantized_decomposed.quantize_per_tensor.tensor,
    torch.ops.quantized_decomposed.dequantize_per_tensor.tensor,
}


def _conv1d_into_add(conv: Node, weight: torch.Tensor) -> bool:
    """A 1-D conv whose output, past quantize/dequantize, an add reads."""
    if weight.dim() != 3:
        return False
    stack = list(conv.users)
    while stack:
        user = stack.pop()
        if user.op == "call_function" and user.target in _QDQ:
            stack.extend(user.users)
        elif user.op == "call_function" and user.target in _ADDS:
            return True
    return False


_GEOMETRY = (("stride", 3, 1), ("padding", 4, 0), ("dilation", 5, 1))  # name, position, default


def _wrong_on_this_cpu(gm: GraphModule, conv: Node, weight_shape: torch.Size) -> bool:
    """A geometry oneDNN's int8 conv computes wrongly on this CPU
    (:mod:`qcore.kernels.onednn_probe`, on inputs of the conv's int8 range)."""
    kernel = list(weight_shape[2:])
    geometry = _geometry(conv, kernel)
    groups = conv.kwargs.get("groups", conv.args[6] if len(conv.args) > 6 else 1)
    input_range = _uint8_input_range(conv.args[0])
    if geometry is None or not isinstance(groups, int) or input_range is None:
        return False  # not an int8 conv Inductor would lower
    stride, padding, dilation = geometry
    found = recorded(conv.args[0], gm, example_sizes=True)
    geometry = ConvGeometry.of_weight(weight_shape, stride, padding, dilation, groups)
    return conv_wrong_here(geometry, found[0] if found else None, input_range) is not None


def _uint8_input_range(x: object) -> tuple[int, int, int] | None:
    """(quant_min, quant_max, zero point) of the uint8 dequantize feeding a conv: the
    range its inputs use (7 bits on a CPU whose int8 sums saturate at 8)."""
    if not (isinstance(x, Node) and x.op == "call_function" and x.target in _QDQ):
        return None
    if len(x.args) < 6 or x.args[5] != torch.uint8 or "dequantize" not in str(x.target):
        return None
    low, high, zero_point = x.args[3], x.args[4], x.args[2]
    if not (isinstance(low, int) and isinstance(high, int)):
        return None
    if not isinstance(zero_point, int):
        zero_point = (low + high) // 2
    return low, high, zero_point


def _geometry(conv: Node, kernel: list[int]) -> tuple[list, list, list] | None:
    """(stride, explicit padding, dilation) of an aten conv call, or None where torch
    pads one side more ("same" with an even reach)."""
    dims = len(kernel)
    stride, padding, dilation = (
        conv.kwargs.get(name, conv.args[index] if len(conv.args) > index else default)
        for name, index, default in _GEOMETRY
    )
    stride, dilation = per_dim(stride, dims), per_dim(dilation, dims)
    explicit = explicit_padding(padding, kernel, dilation)
    return None if explicit is None else (stride, explicit, dilation)


def _reads_padding_only(gm: GraphModule, conv: Node, weight_shape: torch.Size) -> bool:
    kernel = list(weight_shape[2:])
    geometry = _geometry(conv, kernel)
    if geometry is None:
        return False  # "same" padding one side more: not one of these geometries
    stride, explicit, dilation = geometry
    found = recorded(conv.args[0], gm, example_sizes=True)
    # with no recorded size, only padding wider than the kernel's reach can tell
    sizes = list(found[0]) if found else [1 << 20] * len(kernel)
    return reads_padding_only(sizes, kernel, stride, explicit, dilation)
