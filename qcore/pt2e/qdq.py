"""The PT2E reference form: observers become the ecosystem's decomposed quantize ops.

Each observer becomes ``torch.ops.quantized_decomposed`` quantize -> dequantize
(what torchao and ExecuTorch emit and what Inductor's int8 passes, torch.export
and ONNX QDQ export recognise), on plain integer tensors:

* static: ``quantize_per_tensor.default`` / ``dequantize_per_tensor.default``
  (scale and zero point as literals), or the ``per_channel`` pair (qparams in
  buffers);
* dynamic: ``choose_qparams.tensor`` (``choose_qparams_symmetric.tensor`` for a
  symmetric qscheme) feeding the ``.tensor`` overloads;
* float16: a ``convert_element_type.no_fuse`` round trip;
* an observer that knows its own conversion (a ``convert(model, node)`` method,
  like torchao's affine observers) converts itself;
* anything else (a float32 placeholder, e.g. a bias left in float) is dropped.

A dequantize returns the dtype of the tensor it stands for (``out_dtype``: a
bfloat16 model stays bfloat16). :func:`fold_quantized_constants` then quantizes
the constant inputs (weights, and any pure ops on them such as a transpose) once:
the graph keeps the integers (``_frozen_param<N>`` buffers) and their dequantize.

Numerics are the decomposed ops' own (``round(x / scale) + zero_point``), as in
torchao; qcore.ops (bit-exact with fbgemm) stay the lowering's form.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
from torch.fx import GraphModule, Node

from qcore import ops
from qcore.engine.backend_annotator import is_quantized_dtype
from qcore.engine.constants import Constants
from qcore.engine.observe import DerivedObserver
from qcore.engine.reference import observed_qparams

__all__ = [
    "DEQUANTIZE_OPS",
    "QUANTIZE_OPS",
    "duplicate_dequantize",
    "fold_quantized_constants",
    "replace_observer",
]

qd = torch.ops.quantized_decomposed

# The plain dtype holding each quantized dtype's values; float8 holds itself.
_UNDERLYING = {
    **ops.STORAGE_DTYPES,
    torch.float8_e5m2: torch.float8_e5m2,
    torch.float8_e4m3fn: torch.float8_e4m3fn,
}

_PER_CHANNEL = (
    torch.per_channel_affine,
    torch.per_channel_symmetric,
    torch.per_channel_affine_float_qparams,
)
_SYMMETRIC = (torch.per_tensor_symmetric, torch.per_channel_symmetric)


def _quantize_ops() -> tuple:
    ops = [
        qd.quantize_per_tensor.default,
        qd.quantize_per_tensor.tensor,
        qd.quantize_per_channel.default,
    ]
    torchao_ops = getattr(torch.ops, "torchao", None)
    if torchao_ops is not None and hasattr(torchao_ops, "quantize_affine"):
        ops.append(torchao_ops.quantize_affine)  # torchao's affine observers emit it
    return tuple(ops)


QUANTIZE_OPS = _quantize_ops()
"""The quantize ops whose constant inputs are folded (torchao folds the same)."""


def _dtype_range(dtype: torch.dtype) -> tuple[int, int]:
    if dtype == torch.quint4x2:
        return 0, 15
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return int(info.min), int(info.max)


def _range(observer: Any, dtype: torch.dtype, full_range: bool) -> tuple[int, int]:
    """The observer's range, or the dtype's (QConfig semantics: ``full_range``)."""
    if full_range or getattr(observer, "quant_min", None) is None:
        return _dtype_range(_UNDERLYING[dtype])
    return int(observer.quant_min), int(observer.quant_max)


def _dequantize_kwargs(source: Node) -> dict:
    value = source.meta.get("val")
    dtype = getattr(value, "dtype", torch.float32)
    if isinstance(value, torch.Tensor) and dtype.is_floating_point and dtype != torch.float32:
        return {"out_dtype": dtype}
    return {}


def _buffer(gm: GraphModule, hint: str, value: torch.Tensor) -> Node:
    name, index = hint, 0
    while hasattr(gm, name):
        index += 1
        name = f"{hint}_{index}"
    gm.register_buffer(name, value)
    return gm.graph.get_attr(name)


def _qparams(gm: GraphModule, observer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(observer, DerivedObserver):
        return observer.derive(gm)
    return observed_qparams(observer)


def _convertible(observer: Any) -> bool:
    dtype = getattr(observer, "dtype", torch.float32)
    return dtype in _UNDERLYING or dtype == torch.float16


def replace_observer(gm: GraphModule, node: Node, observer: Any, full_range: bool) -> None:
    """Replace the call of ``observer`` (``node``) by its quantize -> dequantize pair."""
    if callable(getattr(observer, "convert", None)):
        observer.convert(gm, node)  # the observer's own representation
        return
    graph, source = gm.graph, node.args[0]
    dtype = getattr(observer, "dtype", torch.float32)
    dq_kwargs = _dequantize_kwargs(source)
    replacement: Any = source
    with graph.inserting_before(node):
        if type(observer).__name__ == "ReuseInputObserver" or not _convertible(observer):
            pass  # a float32 placeholder (a bias kept in float): nothing to quantize
        elif dtype == torch.float16:
            half = graph.call_function(qd.convert_element_type.no_fuse, (source, torch.float16))
            back = getattr(source.meta.get("val"), "dtype", torch.float32)
            replacement = graph.call_function(qd.convert_element_type.no_fuse, (half, back))
        elif getattr(observer, "is_dynamic", False):
            replacement = _dynamic(graph, source, observer, dtype, dq_kwargs)
        elif is_quantized_dtype(dtype) or dtype in _UNDERLYING:
            replacement = _static(gm, node, source, observer, dtype, full_range, dq_kwargs)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


def _static(
    gm: GraphModule,
    node: Node,
    source: Node,
    observer: Any,
    dtype: torch.dtype,
    full_range: bool,
    dq_kwargs: dict,
) -> Node:
    graph = gm.graph
    scale, zero_point = _qparams(gm, observer)
    quant_min, quant_max = _range(observer, dtype, full_range)
    target = _UNDERLYING[dtype]
    qscheme = getattr(observer, "qscheme", torch.per_tensor_affine)
    per_channel = qscheme in _PER_CHANNEL or (
        isinstance(observer, DerivedObserver) and torch.as_tensor(scale).numel() > 1
    )
    if per_channel:
        axis = int(getattr(observer, "ch_axis", 0) or 0)
        scale_node = _buffer(gm, f"{node.target}_scale", torch.as_tensor(scale).reshape(-1))
        zero_point_node = _buffer(
            gm, f"{node.target}_zero_point", torch.as_tensor(zero_point).reshape(-1)
        )
        args = (scale_node, zero_point_node, axis, quant_min, quant_max, target)
        quantize, dequantize = qd.quantize_per_channel.default, qd.dequantize_per_channel.default
    else:
        scale_value = float(torch.as_tensor(scale).reshape(-1)[0])
        zero_point_value = int(torch.as_tensor(zero_point).reshape(-1)[0])
        args = (scale_value, zero_point_value, quant_min, quant_max, target)
        quantize, dequantize = qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default
    quantized = graph.call_function(quantize, (source, *args))
    return graph.call_function(dequantize, (quantized, *args), dq_kwargs)


def _dynamic(graph: Any, source: Node, observer: Any, dtype: torch.dtype, dq_kwargs: dict) -> Node:
    target = _UNDERLYING.get(dtype)
    if target not in (torch.uint8, torch.int8):
        raise ValueError(
            f"dynamic quantization to {dtype}: the reference form takes uint8 or int8 "
            "(quantized_decomposed.choose_qparams)"
        )
    quant_min, quant_max = _range(observer, dtype, full_range=False)
    eps = getattr(observer, "eps", None)
    eps = float(eps) if eps is not None else torch.finfo(torch.float32).eps
    qscheme = getattr(observer, "qscheme", torch.per_tensor_affine)
    choose = (
        qd.choose_qparams_symmetric.tensor if qscheme in _SYMMETRIC else qd.choose_qparams.tensor
    )
    chosen = graph.call_function(choose, (source, quant_min, quant_max, eps, target))
    scale = graph.call_function(operator.getitem, (chosen, 0))
    zero_point = graph.call_function(operator.getitem, (chosen, 1))
    args = (scale, zero_point, quant_min, quant_max, target)
    quantized = graph.call_function(qd.quantize_per_tensor.tensor, (source, *args))
    return graph.call_function(qd.dequantize_per_tensor.tensor, (quantized, *args), dq_kwargs)


# ---------------------------------------------------------------------------------- folding


def fold_quantized_constants(gm: GraphModule) -> int:
    """Quantize constant inputs once: each quantize op (:data:`QUANTIZE_OPS`) computable
    from constants becomes a ``_frozen_param<N>`` buffer holding its integers. Returns
    how many were folded. Ops on constants that feed no quantize stay as they are."""
    constants = Constants(gm)
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in QUANTIZE_OPS:
            continue
        if node not in constants:
            continue
        value = constants.value(node)
        index = 0
        while hasattr(gm, f"_frozen_param{index}"):
            index += 1
        name = f"_frozen_param{index}"
        gm.register_buffer(name, value.clone())
        with gm.graph.inserting_before(node):
            frozen = gm.graph.get_attr(name)
        # the float weight's meta would describe the wrong dtype: keep the quantize's
        frozen.meta.update(node.meta)
        node.replace_all_uses_with(frozen)
        gm.graph.erase_node(node)
        folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
    return folded


DEQUANTIZE_OPS = (
    qd.dequantize_per_tensor.default,
    qd.dequantize_per_tensor.tensor,
    qd.dequantize_per_channel.default,
)


def duplicate_dequantize(gm: GraphModule, *, annotated_users_only: bool = True) -> int:
    """Give users of a shared dequantize their own copy, the graph shape torchao's
    convert_pt2e also produces (this pass is qcore's own): each user carrying a
    quantization annotation (with
    ``annotated_users_only=False``, an FX graph, which has none: each user but the
    graph's output), shape queries aside; a dynamic quantization's dequantize
    stays shared. Inductor's int8 passes match ``dequantize -> op`` per op. The
    values are unchanged. Returns how many copies were made."""
    made = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in DEQUANTIZE_OPS:
            continue
        users = [u for u in node.users if u.op != "output" and not _is_shape_query(u)]
        if len(users) <= 1 or _dynamic_quantization(node):
            continue
        for user in users:
            if annotated_users_only and not _annotated(user):
                continue
            with gm.graph.inserting_after(node):
                copy = gm.graph.node_copy(node)
            user.replace_input_with(node, copy)
            made += 1
    if made:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return made


def _annotated(node: Node) -> bool:
    annotation = node.meta.get("quantization_annotation")
    return annotation is not None and bool(
        annotation.input_qspec_map or annotation.output_qspec is not None
    )


def _is_shape_query(node: Node) -> bool:
    return node.op == "call_function" and node.target == torch.ops.aten.sym_size.int


def _dynamic_quantization(dequantize: Node) -> bool:
    """``choose_qparams -> getitem -> quantize -> dequantize``: torchao keeps it shared."""
    quantize = dequantize.args[0]
    if not (isinstance(quantize, Node) and quantize.target in QUANTIZE_OPS):
        return False
    scale = quantize.args[1] if len(quantize.args) > 1 else None
    return (
        isinstance(scale, Node)
        and scale.target == operator.getitem
        and isinstance(scale.args[0], Node)
        and scale.args[0].target in (qd.choose_qparams.tensor, qd.choose_qparams_symmetric.tensor)
    )
