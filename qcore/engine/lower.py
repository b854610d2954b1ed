"""Lowering: the backend's kernels replace the reference patterns they support.

A reference pattern is ``dequantize -> ReferenceModule -> quantize``. A kernel
whose pattern is the module's original class replaces it with one module
taking and returning torch quantized tensors. Its input is quantized once
(or taken straight from a preceding kernel), its float users get one
dequantize: between consecutive kernels the data stays int8. What no kernel
takes stays in reference form, and explain says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore import ops
from qcore.engine.explain import REPORT_KEY, Entry, Report, Status
from qcore.engine.reference import ReferenceModule
from qcore.kernels.runtime import TORCH_QUANTIZED_DTYPE, quiet_quantized_tensors
from qcore.kernels.weighted import ActivationQParams

__all__ = ["lower"]


def _is_call(node: Any, function: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is function


def _activation_qparams(node: Node) -> ActivationQParams:
    _, scale, zero_point, _, _, dtype = node.args
    return ActivationQParams(float(scale), int(zero_point), dtype)


def _find_kernel(kernels: tuple, reference: ReferenceModule) -> Any:
    for kernel in kernels:
        if kernel.pattern is reference.original_type and kernel.lower is not None:
            return kernel
    return None


class _Lowering:
    def __init__(self, gm: GraphModule, kernels: tuple, backend: str) -> None:
        self.gm, self.graph, self.kernels, self.backend = gm, gm.graph, kernels, backend
        self.modules = dict(gm.named_modules())
        self.kernel_of: dict[Node, ActivationQParams] = {}  # kernel node -> output qparams
        self.dequantized: dict[Node, Node] = {}  # kernel node -> its dequantize node
        self.quantized: dict[tuple, Node] = {}  # (float node, qparams) -> quantize node
        self.lowered: dict[str, str] = {}  # reference node name -> kernel name
        self.unlowered: dict[str, str] = {}  # reference node name -> reason

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "call_module" and isinstance(
                self.modules.get(node.target), ReferenceModule
            ):
                self._lower_one(node)

    def _lower_one(self, node: Node) -> None:
        reference = self.modules[node.target]
        kernel = _find_kernel(self.kernels, reference)
        pattern = reference.original_type.__name__
        if kernel is None:
            self.unlowered[node.name] = (
                f"no kernel for {pattern} in backend {self.backend!r} (left in reference form)"
            )
            return
        dq_in = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        users = list(node.users)
        q_out = users[0] if len(users) == 1 else None
        from_kernel = self.dequantized.get(dq_in)
        if from_kernel is None and not _is_call(dq_in, ops.dequantize_per_tensor):
            dq_in = None
        if dq_in is None or not _is_call(q_out, ops.quantize_per_tensor):
            self.unlowered[node.name] = (
                f"kernel {kernel.name} needs a per-tensor quantized input and output around "
                f"{pattern} (left in reference form)"
            )
            return
        inputs = self.kernel_of[from_kernel] if from_kernel else _activation_qparams(dq_in)
        output = _activation_qparams(q_out)
        if inputs.dtype not in TORCH_QUANTIZED_DTYPE or output.dtype not in TORCH_QUANTIZED_DTYPE:
            self.unlowered[node.name] = f"kernel {kernel.name} takes 8-bit activations only"
            return
        try:
            module = kernel.lower(reference, inputs, output)
        except Exception as error:  # a kernel that cannot take this instance leaves it as is
            self.unlowered[node.name] = (
                f"kernel {kernel.name} refused {pattern}: {type(error).__name__}: {error}"
            )
            return
        name = node.target
        parent_name, _, attr = name.rpartition(".")
        setattr(self.gm.get_submodule(parent_name) if parent_name else self.gm, attr, module)
        # The reference node itself becomes the kernel's node, keeping its name.
        node.args = (from_kernel or self._quantized_input(dq_in, inputs),)
        with self.graph.inserting_after(node):
            dequantize = self.graph.call_method("dequantize", (node,))
        for dq_out in list(q_out.users):
            dq_out.replace_all_uses_with(dequantize)
        self.kernel_of[node] = output
        self.dequantized[dequantize] = node
        self.lowered[node.name] = kernel.name

    def _quantized_input(self, dq_in: Node, qparams: ActivationQParams) -> Node:
        q_in = dq_in.args[0]
        source = q_in.args[0]
        producer = self.dequantized.get(source)
        if producer is not None and self.kernel_of[producer] == qparams:
            return producer  # int8 straight from the previous kernel
        key = (source, qparams)
        if key not in self.quantized:
            with self.graph.inserting_before(q_in):
                self.quantized[key] = self.graph.call_function(
                    torch.quantize_per_tensor,
                    (
                        source,
                        qparams.scale,
                        qparams.zero_point,
                        TORCH_QUANTIZED_DTYPE[qparams.dtype],
                    ),
                )
        return self.quantized[key]


def lower(gm: GraphModule, kernels: tuple, backend: str) -> GraphModule:
    """Lower ``gm`` (reference form, modified in place) with ``kernels``."""
    quiet_quantized_tensors()
    lowering = _Lowering(gm, kernels, backend)
    lowering.run()
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    _update_report(gm, lowering)
    return gm


def _update_report(gm: GraphModule, lowering: _Lowering) -> None:
    report: Report = gm.meta[REPORT_KEY]
    by_name = {entry.node: entry for entry in report.entries}
    entries = []
    for node in gm.graph.nodes:
        reference_name = node.name
        entry = by_name.get(reference_name)
        if entry is None:
            entries.append(Entry(node.name, "quantize/dequantize", Status.NOT_AN_OP))
            continue
        if reference_name in lowering.lowered:
            entry = Entry(
                node.name,
                entry.op,
                Status.QUANTIZED,
                "",
                entry.pattern,
                lowering.lowered[reference_name],
            )
        elif reference_name in lowering.unlowered:
            entry = entry.with_status(Status.REFERENCE, lowering.unlowered[reference_name])
        elif entry.status is Status.REFERENCE:
            entry = entry.with_status(
                Status.REFERENCE,
                f"no kernel for {entry.pattern or entry.op} in backend {report.backend!r} "
                "(left in reference form)",
            )
        entries.append(entry)
    gm.meta[REPORT_KEY] = Report(report.backend, entries)
