"""Graph inputs that arrive, and outputs that leave, as torch quantized tensors.

torch.ao's ``input_quantized_idxs``/``output_quantized_idxs``: a model that is
one stage of a quantized pipeline takes the previous stage's int8 tensor and
hands its own on, without a float round trip at its edges.

- A quantized input is dequantized where it enters (``x.dequantize()``, which
  also passes a float tensor through unchanged) and then quantized with the
  qparams calibration chose, like any other input. Taking the caller's int8
  tensor straight into the first kernel would be faster, but qcore's kernels
  are chosen for the calibrated qparams, so the caller's could silently differ.
- A quantized output is the int8 tensor the model computed, handed on without
  its final dequantize. An output that is not quantized (explain says why) is
  an error naming its index: it cannot leave as int8.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore import ops
from qcore.engine.custom_config import UnsupportedSetting
from qcore.engine.in_place import eliminate_dead_code_keeping_state_writes
from qcore.kernels.runtime import quiet_quantized_tensors

__all__ = ["as_quantized", "output_values", "quantize_boundaries", "skip_requantize"]


def _dequantize_inputs(gm: GraphModule, indexes: tuple[int, ...]) -> None:
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    for index in indexes:
        if index >= len(placeholders):
            raise UnsupportedSetting(
                f"prepare_custom_config.input_quantized_indexes: got {index}; the model has "
                f"{len(placeholders)} input(s)"
            )
        placeholder = placeholders[index]
        with gm.graph.inserting_after(placeholder):
            dequantized = gm.graph.call_method("dequantize", (placeholder,))
        for user in list(placeholder.users):
            if user is not dequantized:
                user.replace_input_with(placeholder, dequantized)


def _is_call(node: Any, function: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is function


def as_quantized(gm: GraphModule, node: Any, what: str) -> Node:
    """The torch quantized tensor behind the float value ``node`` (``what`` names it
    in the error when it is not quantized)."""
    if isinstance(node, Node) and node.op == "call_method" and node.target == "dequantize":
        return node.args[0]  # a kernel's int8 output, dequantized for a float user
    if _is_call(node, ops.dequantize_per_tensor):  # reference form: plain integers
        quiet_quantized_tensors()
        quantized, scale, zero_point, *_ = node.args
        with gm.graph.inserting_after(node):
            return gm.graph.call_function(
                torch._make_per_tensor_quantized_tensor, (quantized, scale, zero_point)
            )
    raise UnsupportedSetting(
        f"{what} is not quantized per tensor (it comes from {getattr(node, 'name', node)!r}); "
        "qcore.explain(model) says why, or drop the index to pass it in float"
    )


def output_values(gm: GraphModule) -> list[Any]:
    """The model's outputs in order: the elements of a returned tuple, list or dict
    (its values), else the one returned value."""
    value = next(node for node in gm.graph.nodes if node.op == "output").args[0]
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _quantize_outputs(gm: GraphModule, indexes: tuple[int, ...]) -> None:
    output = next(node for node in gm.graph.nodes if node.op == "output")
    value = output.args[0]
    values = output_values(gm)
    for index in indexes:
        if index >= len(values):
            raise UnsupportedSetting(
                f"prepare_custom_config.output_quantized_indexes: got {index}; the model "
                f"returns {len(values)} output(s)"
            )
        where = f"prepare_custom_config.output_quantized_indexes: output {index}"
        values[index] = as_quantized(gm, values[index], where)
    if isinstance(value, dict):
        new_value: Any = dict(zip(value, values, strict=True))
    elif isinstance(value, (tuple, list)):
        new_value = type(value)(values)
    else:
        new_value = values[0]
    output.args = (new_value,)


def quantize_boundaries(
    gm: GraphModule, input_indexes: tuple[int, ...], output_indexes: tuple[int, ...]
) -> None:
    """Make ``gm`` (converted, modified in place) take and return torch quantized
    tensors at the given input and output indexes."""
    if not input_indexes and not output_indexes:
        return
    _dequantize_inputs(gm, input_indexes)
    _quantize_outputs(gm, output_indexes)
    eliminate_dead_code_keeping_state_writes(gm)
    gm.graph.lint()
    gm.recompile()


def skip_requantize(
    gm: GraphModule, quantized: Node, scale: float, zero_point: int, dtype: torch.dtype
) -> None:
    """``quantize_per_tensor(x.dequantize(), scale, zero_point, dtype)`` where ``x``
    (``quantized``) already has exactly those qparams is ``x``: the kernel after it
    takes the int8 tensor as is (torch.ao's rule for a producer's int8 output)."""
    for dequantize in list(quantized.users):
        if dequantize.op != "call_method" or dequantize.target != "dequantize":
            continue
        for user in list(dequantize.users):
            if not _is_call(user, torch.quantize_per_tensor):
                continue
            _, user_scale, user_zero_point, user_dtype = user.args
            same = (
                _constant(gm, user_scale) == float(scale)
                and _constant(gm, user_zero_point) == int(zero_point)
                and user_dtype == dtype
            )
            if same:
                user.replace_all_uses_with(quantized)
                gm.graph.erase_node(user)


def _constant(gm: GraphModule, arg: Any) -> float | None:
    """A scalar argument's value, read from its buffer when it is a ``get_attr``."""
    if isinstance(arg, Node):
        if arg.op != "get_attr":
            return None
        owner_name, _, name = arg.target.rpartition(".")
        arg = getattr(gm.get_submodule(owner_name) if owner_name else gm, name)
    if isinstance(arg, torch.Tensor):
        return float(arg.reshape(-1)[0]) if arg.numel() == 1 else None
    return float(arg)
