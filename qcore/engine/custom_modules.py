"""Custom module classes: torch.ao's float -> observed -> quantized swap.

A module class named in ``prepare_custom_config``'s float-to-observed mapping
is traced as a leaf and swapped for its observed class (``from_float``) at
prepare; its tensor inputs and output are observed with its QConfig's
activation. At convert the observed module becomes the class that
``convert_custom_config`` maps it to (``from_observed``, with its output
observer attached as ``activation_post_process``, as torch.ao does) and runs on
torch quantized tensors: lowered, it reads its producer's int8 output directly;
in reference form it is given ``torch.quantize_per_tensor`` of its input.

A custom module whose forward returns a tuple (torch.ao's static LSTM:
``(out, (h, c))``) is observed at its inputs only: the quantized module gives
each element its own qparams. Its users get the same structure with each
element dequantized, and a consumer that quantizes one element takes its int8
tensor as is, at those qparams (torch.ao's rule), so the numbers match torch.ao's.

Leaf modules of a dynamic mapping (torch.ao's ``"dynamic"`` key: a non-traceable
float module with a dynamic QConfig) are swapped at convert the same way; they
take and return float tensors.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import TensorMetadata

from qcore import ops
from qcore.config.errors import describe
from qcore.engine.backend_annotator import returns_container
from qcore.engine.boundaries import skip_requantize
from qcore.engine.custom_config import CustomConfig, UnsupportedSetting
from qcore.engine.observe import OBSERVER_PREFIX
from qcore.kernels.runtime import TORCH_QUANTIZED_DTYPE
from qcore.plugin.kernels import Kernel, KernelMatch, SameOp

__all__ = [
    "CustomCall",
    "custom_kernels",
    "quantize_inputs_for",
    "swap_observed",
    "swap_quantized",
    "tuple_output_qparams",
]


@dataclass(frozen=True)
class CustomCall:
    """A call of a custom (or non-traceable) module, by node name, with its QConfig."""

    node: str
    target: str
    qconfig: Any
    static: bool


def _set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


def _is_static(qconfig: Any) -> bool:
    if qconfig is None or qconfig.activation is None:
        return False
    observer = qconfig.activation()
    dtype = getattr(observer, "dtype", torch.float)
    return dtype in (torch.quint8, torch.qint8, torch.uint8, torch.int8, torch.qint32) and not bool(
        getattr(observer, "is_dynamic", False)
    )


def swap_observed(
    gm: GraphModule, qconfigs: dict[Node, Any], settings: CustomConfig
) -> dict[Node, CustomCall]:
    """Swap each custom module call with a static QConfig for its observed class.

    Returns the custom and non-traceable leaf calls that have a QConfig, which
    convert may swap (the static ones are also observed).
    """
    names = set(settings.non_traceable_module_names)
    leaf_classes = settings.non_traceable_module_classes
    calls: dict[Node, CustomCall] = {}
    swapped: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)  # (named_modules lists a shared one once)
        qconfig = qconfigs.get(node)
        observed_class = settings.float_to_observed.get(type(module))
        if qconfig is None:
            continue
        if node.target in swapped:  # the same module called again
            calls[node] = CustomCall(node.name, node.target, qconfig, static=True)
        elif observed_class is not None and _is_static(qconfig):
            _propagate_qconfig(module, qconfig)
            observed = observed_class.from_float(module)
            _set_module(gm, node.target, observed)
            swapped.add(node.target)
            calls[node] = CustomCall(node.name, node.target, qconfig, static=True)
        elif observed_class is not None or node.target in names or isinstance(module, leaf_classes):
            calls[node] = CustomCall(node.name, node.target, qconfig, static=False)
    return calls


def _propagate_qconfig(module: torch.nn.Module, qconfig: Any) -> None:
    """As torch.ao's propagate_qconfig_: from_float/from_observed read their parts' too."""
    for part in module.modules():
        part.qconfig = qconfig


def _output_observer(prepared: GraphModule, node_name: str) -> torch.nn.Module | None:
    node = next(n for n in prepared.graph.nodes if n.name == node_name)
    for user in node.users:
        if user.op == "call_module" and str(user.target).startswith(OBSERVER_PREFIX):
            return prepared.get_submodule(user.target)
    return None


def swap_quantized(
    prepared: GraphModule,
    converted: GraphModule,
    calls: tuple[CustomCall, ...],
    settings: CustomConfig,
) -> list[type]:
    """Swap the observed (static) and leaf (dynamic) modules of ``converted`` for their
    quantized classes; returns the static quantized classes (they run on int8)."""
    static_classes = []
    present = {node.name for node in converted.graph.nodes}
    done: set[str] = set()
    for call in calls:
        if call.node not in present or call.target in done:
            continue
        done.add(call.target)
        module = converted.get_submodule(call.target)
        quantized_class = settings.observed_to_quantized.get(type(module))
        if quantized_class is None:
            if call.static:
                raise UnsupportedSetting(
                    f"convert_custom_config.observed_to_quantized_mapping: no quantized class "
                    f"for {describe(type(module))} (module {call.target!r}); expected an entry "
                    "mapping the observed class to the quantized one"
                )
            continue
        _propagate_qconfig(module, call.qconfig)
        if call.static:
            observer = _output_observer(prepared, call.node)
            if observer is not None:
                module.activation_post_process = copy.deepcopy(observer)
            static_classes.append(quantized_class)
        _set_module(converted, call.target, quantized_class.from_observed(module))
    converted.recompile()
    return static_classes


def _runs_on_int8(match: KernelMatch) -> SameOp:
    if match.output is None or not match.inputs:
        raise ValueError("a quantized custom module takes and returns int8 tensors")
    return SameOp(match.output)


def custom_kernels(classes: list[type], engine: str) -> tuple[Kernel, ...]:
    """Kernels that let lowering feed quantized custom modules int8 tensors directly."""
    return tuple(
        Kernel(f"custom.{cls.__name__}", cls, engine, _runs_on_int8)
        for cls in dict.fromkeys(classes)
    )


def quantize_inputs_for(
    converted: GraphModule,
    classes: list[type],
    skip: set[str],
    leaves: dict[str, dict[tuple, LeafQParams]] | None = None,
) -> None:
    """Reference form: quantized custom modules (but the ``skip``ped, lowered ones) get
    torch quantized tensors, and give back float through ``dequantize`` (each element
    of a tuple output, see :func:`tuple_output_qparams` for ``leaves``)."""
    leaves = leaves or {}
    graph = converted.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or node.name in skip:
            continue
        if type(converted.get_submodule(node.target)) not in classes:
            continue
        for arg in node.all_input_nodes:
            if _is_kernel_dequantize(arg):  # a lowered producer's int8 output, as it is
                node.replace_input_with(arg, arg.args[0])
                continue
            if not _is_reference_dequantize(arg):
                continue
            _, scale, zero_point, _, _, dtype = arg.args
            with graph.inserting_before(node):
                quantized = graph.call_function(
                    torch.quantize_per_tensor, (arg, scale, zero_point, dtype)
                )
            node.replace_input_with(arg, quantized)
        if returns_container(node):
            meta = node.meta["tensor_meta"]
            _dequantize_elements(converted, node, meta, leaves.get(node.name, {}))
            continue
        users = list(node.users)
        with graph.inserting_after(node):
            dequantized = graph.call_method("dequantize", (node,))
        for user in users:
            user.replace_input_with(node, dequantized)
    graph.eliminate_dead_code()
    converted.recompile()


def _dequantize_elements(
    gm: GraphModule, node: Node, meta: tuple | list, leaves: dict[tuple, LeafQParams]
) -> None:
    """A tuple output's users get the same structure with each tensor dequantized (as
    torch.ao does for its LSTM); a user that reads one element gets that element,
    and one that quantizes it again to the qparams it has takes the int8 tensor."""
    graph = gm.graph
    users = list(node.users)
    last = [node]
    quantized_leaves: dict[tuple, Node] = {}

    def add(op: str, target: Any, args: tuple) -> Node:
        with graph.inserting_after(last[0]):
            last[0] = graph.create_node(op, target, args)
        return last[0]

    def build(value: Node, part: Any, path: tuple) -> Node:
        if isinstance(part, TensorMetadata):
            quantized_leaves[path] = value
            return add("call_method", "dequantize", (value,))
        if not isinstance(part, (tuple, list)):
            return value
        items = [
            build(add("call_function", operator.getitem, (value, i)), item, (*path, i))
            for i, item in enumerate(part)
        ]
        return add("call_function", tuple, (items,))

    dequantized = build(node, meta, ())
    for user in users:
        user.replace_input_with(node, dequantized)
    _take_elements_directly(graph)
    graph.eliminate_dead_code()
    for path, (scale, zero_point, dtype) in leaves.items():
        if path in quantized_leaves:
            skip_requantize(gm, quantized_leaves[path], scale, zero_point, dtype)


def _take_elements_directly(graph: torch.fx.Graph) -> None:
    """``tuple([a, b])[i]`` is the i-th item (torch.ao's reroute of tuple getitems)."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        source, index = node.args
        is_built = (
            isinstance(source, Node)
            and source.op == "call_function"
            and source.target is tuple
            and isinstance(index, int)
        )
        if is_built:
            node.replace_all_uses_with(source.args[0][index])


# (scale, zero_point, torch quantized dtype) of one element of a tuple output
LeafQParams = tuple[float, int, torch.dtype]


def tuple_output_qparams(
    converted: GraphModule, classes: list[type]
) -> dict[str, dict[tuple, LeafQParams]]:
    """The qparams of each int8 element of the quantized custom modules' tuple outputs,
    by path (``(1, 0)`` for LSTM's h), and the consumers of those elements made to
    quantize them to those qparams (torch.ao's rule: a consumer takes the module's
    int8 tensor as is). A quantized module's output qparams are its own constants,
    so one run on zeros at its input qparams reads them.
    """
    found: dict[str, dict[tuple, LeafQParams]] = {}
    for node in list(converted.graph.nodes):
        if node.op != "call_module" or not returns_container(node):
            continue
        module = converted.get_submodule(node.target)
        if type(module) not in classes:
            continue
        try:
            args = _probe(node.args)
        except _NoProbe:
            continue  # the consumers requantize with their own calibrated qparams
        with torch.no_grad():
            output = module(*args)
        leaves = dict(_quantized_leaves(output, ()))
        found[node.name] = leaves
        for path, qparams in leaves.items():
            leaf = _element(node, path)
            if leaf is not None:
                _quantize_consumers_to(leaf, qparams)
    return found


class _NoProbe(Exception):
    """An input's shape or qparams are not known: the module is not probed."""


def _probe(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_probe(item) for item in value)
    if not isinstance(value, Node):
        return value
    meta = _source_meta(value)
    if not _is_reference_dequantize(value):
        return torch.zeros(meta.shape, dtype=meta.dtype)
    _, scale, zero_point, _, _, dtype = value.args
    if isinstance(scale, Node) or dtype not in TORCH_QUANTIZED_DTYPE:
        raise _NoProbe
    zeros = torch.zeros(meta.shape)
    return torch.quantize_per_tensor(
        zeros, float(scale), int(zero_point), TORCH_QUANTIZED_DTYPE[dtype]
    )


def _source_meta(node: Node) -> TensorMetadata:
    """The shape of the float value a quantize/dequantize chain carries."""
    while isinstance(node, Node):
        meta = node.meta.get("tensor_meta")
        if isinstance(meta, TensorMetadata):
            return meta
        node = node.args[0] if node.args else None
    raise _NoProbe


def _quantized_leaves(value: Any, path: tuple):
    if isinstance(value, torch.Tensor):
        if value.is_quantized and value.qscheme() == torch.per_tensor_affine:
            yield path, (float(value.q_scale()), int(value.q_zero_point()), value.dtype)
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _quantized_leaves(item, (*path, index))


def _element(node: Node, path: tuple) -> Node | None:
    """The node that reads element ``path`` of ``node``'s output, if the graph has one."""
    for index in path:
        picks = [
            user
            for user in node.users
            if user.op == "call_function"
            and user.target is operator.getitem
            and user.args[1] == index
        ]
        if not picks:
            return None
        node = picks[0]
    return node


def _quantize_consumers_to(leaf: Node, qparams: LeafQParams) -> None:
    """The consumers' quantize -> dequantize pairs after ``leaf`` take its qparams."""
    scale, zero_point, dtype = qparams
    for user in list(leaf.users):
        if user.op != "call_function" or user.target is not ops.quantize_per_tensor:
            continue
        _, _, _, quant_min, quant_max, user_dtype = user.args
        full = torch.iinfo(ops.storage_dtype(dtype))
        same_kind = TORCH_QUANTIZED_DTYPE.get(user_dtype) == dtype
        if not same_kind or (quant_min, quant_max) != (full.min, full.max):
            continue  # another dtype or a narrower range: requantizing is the reference
        for pair in [user, *user.users]:
            if pair.op == "call_function" and pair.target in (
                ops.quantize_per_tensor,
                ops.dequantize_per_tensor,
            ):
                pair.args = (pair.args[0], scale, zero_point, *pair.args[3:])


def _is_kernel_dequantize(node: Node) -> bool:
    """``y.dequantize()`` after a kernel (not a float16 ``to``'s float32 copy)."""
    if node.op != "call_method" or node.target != "dequantize":
        return False
    source = node.args[0]
    return isinstance(source, Node) and not (source.op == "call_method" and source.target == "to")


def _is_reference_dequantize(node: Node) -> bool:
    return node.op == "call_function" and node.target is ops.dequantize_per_tensor
