"""Values every annotator leaves float: 8 bits would ruin them on any backend.

Both kinds were found on real models, and both peers quantize them:

* **constant math**, ops no model input's values reach
  (:func:`qcore.engine.constants.reached_by_inputs`): rotary position angles,
  ``arange(T) * inv_freq``, rounded to T/255 rad;
* **normalization statistics**: the mean, variance or norm a normalization
  divides by, through ``+ eps`` to its ``rsqrt``/``sqrt``/``reciprocal``, and the
  multiply or divide that applies it. RMSNorm written out (LLaMA's:
  ``h * rsqrt(h.pow(2).mean(-1) + eps)``) rounded a quiet token's variance to
  0, and rsqrt made that 1/sqrt(eps): 10 dB on fbgemm, -2 dB on that token
  (torch.ao the same). Float there costs a few elementwise ops per token;
* **attention masks**: values made with a large negative constant
  (``(1 - mask) * finfo.min``, ``-10000``, ``-inf``), every op carrying them on
  (``scores + mask``), and the softmax reading them. An observer of
  ``scores + mask`` spans -1.7e38, so every real score rounded to 0 (BERT on
  qnnpack 10.8 dB, LLaMA -0.2; with the add float 29.3 and 20.6).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.engine.constants import attribute, reached_by_inputs

__all__ = ["CONSTANT_MATH_REASON", "MASK_REASON", "STATISTIC_REASON", "kept_float"]

CONSTANT_MATH_REASON = (
    "computes on the model's constants and sizes only (no input's values reach it: "
    "position tables, rotary angles): float is exact there; 8 bits would round every value"
)

MASK_REASON = (
    "carries an attention mask (a large negative constant such as finfo.min): an "
    "observer spanning it would round every real score to 0; it stays float"
)
#: A constant at or below this is a mask value, not a number a model computes with.
MASK_VALUE = -1e3

STATISTIC_REASON = (
    "computes or applies a normalization statistic (a variance or norm divided by): "
    "rounded to 8 bits, a small one becomes 0 and the division blows it up; it stays float"
)

_NORMALIZERS = {"rsqrt", "sqrt", "reciprocal"}
_REDUCTIONS = {"mean", "sum", "var", "std", "norm", "linalg_vector_norm", "var_mean"}
# what may stand between a reduction and its normalizer: ``+ eps``, a cast, a clamp
_BETWEEN = {"add", "sub", "mul", "div", "truediv", "to", "float", "_to_copy", "clamp", "clamp_min"}
_BETWEEN_OR_NORMALIZER = _BETWEEN | _NORMALIZERS
_APPLIERS = {"mul", "div", "truediv"}
_MAX_STEPS = 6


def kept_float(gm: GraphModule, carries_values: Callable[[Node], bool]) -> dict[Node, str]:
    """Each node to leave float, with the reason explain gives.

    ``carries_values(node)``: whether the node's value is a tensor (any dtype),
    not a size, for the front door's graph.
    """
    reached = reached_by_inputs(gm, carries_values)
    kept = {
        node: CONSTANT_MATH_REASON
        for node in gm.graph.nodes
        if node.op in ("call_function", "call_method", "call_module") and node not in reached
    }
    for node in _normalization_statistics(gm.graph.nodes):
        kept.setdefault(node, STATISTIC_REASON)
    for node in _mask_carriers(gm):
        kept.setdefault(node, MASK_REASON)
    return kept


def _word(node: Node) -> str:
    """The op's name for both graphs: ``rsqrt`` for torch.rsqrt, ``x.rsqrt()`` and
    ``aten.rsqrt.default``; ``div`` for ``/``; in-place forms as their op."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        target = node.target
        if target in (operator.truediv, operator.itruediv):
            return "div"
        if target in (operator.add, operator.iadd, operator.mul, operator.imul):
            return target.__name__.removeprefix("i")
        if target in (operator.sub, operator.isub):
            return "sub"
        name = getattr(target, "__name__", str(target)).split(".")[0]
    else:
        return ""
    return name.removesuffix("_")


def _tensor_args(node: Node) -> list[Node]:
    return [arg for arg in node.args if isinstance(arg, Node)]


def _statistic_behind(start: Node) -> list[Node] | None:
    """The chain from ``start`` back to the reduction it was computed by, through
    elementwise ops with one tensor operand (``+ eps``); None if there is none."""
    chain, node = [], start
    for _ in range(_MAX_STEPS):
        word = _word(node)
        chain.append(node)
        if word in _REDUCTIONS:
            return chain
        inputs = _tensor_args(node)
        if word not in _BETWEEN_OR_NORMALIZER or len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def _normalization_statistics(nodes) -> set[Node]:
    kept: set[Node] = set()
    for node in nodes:
        word = _word(node)
        if word in _NORMALIZERS and _tensor_args(node):
            chain = _statistic_behind(_tensor_args(node)[0])
            if chain is not None:
                kept.update(chain)
                kept.add(node)
                kept.update(user for user in node.users if _word(user) in _APPLIERS)
        elif word == "div" and len(node.args) > 1 and isinstance(node.args[1], Node):
            chain = _statistic_behind(node.args[1])  # x / x.norm(dim=-1, keepdim=True)
            if chain is not None:
                kept.update(chain)
                kept.add(node)
    return kept


# Ops whose output is bounded whatever their input: a mask stops there (they read
# it, so they stay float; what they give is an ordinary value).
_BOUNDING = {"softmax", "_softmax", "log_softmax", "_log_softmax", "sigmoid", "exp", "tanh"}


def _is_mask_constant(value: Any) -> bool:
    return isinstance(value, float) and (value <= MASK_VALUE or math.isinf(value))


def _flat(values: Iterable[Any]) -> Iterable[Any]:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _flat(value)
        else:
            yield value


# Ops that make a mask from a constant, and ops a mask flows through (combined,
# reshaped, added to scores). Not a clamp(min=-1e4): a range guard, no mask; and
# nothing computing (linear, matmul) carries one on.
_MASK_MAKERS = {
    "mul",
    "div",
    "truediv",
    "masked_fill",
    "where",
    "full",
    "full_like",
    "new_full",
    "fill",
    "scalar_tensor",
    "add",
    "sub",
    "rsub",
}
_MASK_FLOWS = {
    "add",
    "sub",
    "rsub",
    "mul",
    "where",
    "masked_fill",
    "minimum",
    "maximum",
    "min",
    "max",
    "cat",
    "expand",
    "expand_as",
    "repeat",
    "permute",
    "transpose",
    "squeeze",
    "index",
}

_SCALINGS = {"mul", "div", "truediv"}
# what turns an attention mask input into the 0/1 tensor a constant scales
_MASK_SHAPING = {
    "rsub",
    "sub",
    "to",
    "_to_copy",
    "float",
    "type_as",
    "unsqueeze",
    "expand",
    "view",
    "reshape",
    "getitem",
    "slice",
    "select",
    "contiguous",
    "clone",
}
_MASK_CARRYING = _MASK_FLOWS | _MASK_SHAPING


def _makes_mask(gm: GraphModule, node: Node) -> bool:
    """``node`` writes a mask value: a large negative or infinite constant argument
    (``* finfo.min``, ``masked_fill(..., -inf)``, ``full(..., -10000.0)``), or it
    reads a constant tensor holding one."""
    if node.op == "get_attr":
        value = attribute(gm, node.target)
        return (
            isinstance(value, torch.Tensor)
            and not isinstance(value, torch.nn.Parameter)
            and value.is_floating_point()
            and value.numel() > 0
            and bool((value <= MASK_VALUE).any())
        )
    if node.op not in ("call_function", "call_method") or _word(node) not in _MASK_MAKERS:
        return False
    return any(_is_mask_constant(v) for v in _flat((*node.args, *node.kwargs.values())))


def _mask_carriers(gm: GraphModule) -> set[Node]:
    """Nodes computing with mask values, the bounded ops (softmax) reading them, and
    the 0/1 mask a constant scales into one (``(1 - mask) * finfo.min``): rounded,
    its 1.0 came out 0.99999, and every kept position was scaled to -3.4e33."""
    carriers: set[Node] = set()
    kept: set[Node] = set()
    for node in gm.graph.nodes:
        word = _word(node)
        reads_mask = any(arg in carriers for arg in node.all_input_nodes)
        if word in _BOUNDING:
            if reads_mask:
                kept.add(node)
            continue
        if (reads_mask and word in _MASK_CARRYING) or _makes_mask(gm, node):
            carriers.add(node)
            if not reads_mask and word in _SCALINGS:
                kept.update(_scaled_mask(node))
    return {n for n in carriers | kept if n.op not in ("get_attr", "placeholder")}


def _scaled_mask(scaling: Node) -> list[Node]:
    """The ops making the one tensor ``scaling`` multiplies by a mask constant, back
    to the graph input, through the shaping ops above."""
    found, inputs = [], _tensor_args(scaling)
    node = inputs[0] if len(inputs) == 1 else None
    for _ in range(_MAX_STEPS):
        if node is None or _word(node) not in _MASK_SHAPING:
            break
        found.append(node)
        inputs = _tensor_args(node)
        node = inputs[0] if len(inputs) == 1 else None
    return found
