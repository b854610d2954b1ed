"""Custom module classes: torch.ao's float -> observed -> quantized swap.

A module class named in ``prepare_custom_config``'s float-to-observed mapping
is traced as a leaf and swapped for its observed class (``from_float``) at
prepare; its tensor inputs and output are observed with its QConfig's
activation. At convert the observed module becomes the class that
``convert_custom_config`` maps it to (``from_observed``, with its output
observer attached as ``activation_post_process``, as torch.ao does) and runs on
torch quantized tensors: lowered, it reads its producer's int8 output directly;
in reference form it is given ``torch.quantize_per_tensor`` of its input.

A custom module whose forward returns a tuple (torch.ao's static LSTM) is
observed at its inputs only; ``qcore.engine.custom_tuples`` gives its users
their elements.

Leaf modules of a dynamic mapping (torch.ao's ``"dynamic"`` key: a non-traceable
float module with a dynamic QConfig) are swapped at convert the same way; they
take and return float tensors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.config.errors import describe
from qcore.engine.backend_annotator import returns_container
from qcore.engine.custom_config import CustomConfig, UnsupportedSetting
from qcore.engine.custom_tuples import LeafQParams, dequantize_elements, is_reference_dequantize
from qcore.engine.observe import OBSERVER_PREFIX
from qcore.plugin.kernels import Kernel, KernelMatch, SameOp

__all__ = [
    "CustomCall",
    "custom_kernels",
    "quantize_inputs_for",
    "swap_observed",
    "swap_quantized",
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
    return static_classes  # modules swapped, graph unchanged: its code stays valid


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
    if not classes:
        return
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
            if not is_reference_dequantize(arg):
                continue
            _, scale, zero_point, _, _, dtype = arg.args
            with graph.inserting_before(node):
                quantized = graph.call_function(
                    torch.quantize_per_tensor, (arg, scale, zero_point, dtype)
                )
            node.replace_input_with(arg, quantized)
        if returns_container(node):
            meta = node.meta["tensor_meta"]
            dequantize_elements(converted, node, meta, leaves.get(node.name, {}))
            continue
        users = list(node.users)
        with graph.inserting_after(node):
            dequantized = graph.call_method("dequantize", (node,))
        for user in users:
            user.replace_input_with(node, dequantized)
    graph.eliminate_dead_code()
    converted.recompile()


def _is_kernel_dequantize(node: Node) -> bool:
    """``y.dequantize()`` after a kernel (not a float16 ``to``'s float32 copy)."""
    if node.op != "call_method" or node.target != "dequantize":
        return False
    source = node.args[0]
    return isinstance(source, Node) and not (source.op == "call_method" and source.target == "to")
