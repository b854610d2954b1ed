"""The Quantizer a backend name stands for on PT2E: what every plugin contributes.

``prepare_pt2e(model, name)`` resolves the name (:func:`quantizer_for_backend`):

* ``"native"``: the Quantizer compiled from the union of every installed
  backend's config (:class:`BackendQuantizer`), never a plugin's hand-written
  Quantizer, which knows its own backend only; no plugin hook is called with
  ``backend="native"``;
* a backend none of whose plugins gives a Quantizer: the one compiled from its
  united config, which holds every plugin's patterns;
* a backend whose plugin gives its own Quantizer (x86's ``X86Quantizer``) and
  that no other distribution extends: that Quantizer;
* the same, extended by another distribution (a vendor adding a pattern or a
  kernel to x86): an :class:`ExtendedQuantizer`. The own Quantizer annotates
  first, unchanged; then each extension's pattern configs, compiled, annotate
  what it left float. What an extension adds but cannot be used is explained on
  the node: its pattern on a node the own Quantizer annotated (the backend's own
  recipe takes precedence over its extensions), or its kernel on an op that
  stays float.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import GraphModule, Node

from qcore.config import BackendConfig
from qcore.plugin.union import unite
from qcore.pt2e.backend_quantizer import REASON_KEY, BackendQuantizer
from qcore.pt2e.patterns import aten_pattern, packet
from qcore.quantizer.quantizer import ANNOTATION_KEY, Quantizer

if TYPE_CHECKING:
    from qcore.plugin import Backend, Kernel

__all__ = ["ExtendedQuantizer", "quantizer_for_backend"]


def quantizer_for_backend(backend: Backend, is_qat: bool = False) -> Quantizer:
    """The Quantizer ``prepare_pt2e(model, backend.name)`` uses (see the module docstring)."""
    found = backend.own_quantizer(is_qat)
    if found is None:
        return BackendQuantizer(backend.config, is_qat=is_qat, backend_name=backend.name)
    own, owner = found
    distributions = {plugin.name: plugin.spec.distribution for plugin in backend.plugins}
    extensions = []
    for name, configs, kernels in backend.contributions:
        if name == owner.name or not (configs or kernels):
            continue
        config, _ = unite(backend.name, [(name, configs)])
        extensions.append((distributions.get(name, name), config, tuple(kernels)))
    if not extensions:
        return own
    return ExtendedQuantizer(own, owner.spec.distribution, backend.name, extensions, is_qat=is_qat)


class ExtendedQuantizer(Quantizer):
    """A backend's own Quantizer, then the patterns other distributions add to it.

    ``extensions`` are (distribution, BackendConfig, kernels), in the order the
    backend's plugins rank. Each config is compiled into a :class:`BackendQuantizer`
    (with ``qconfig_mapping``, by default the backend's) that annotates only
    nodes left unannotated. Observers are built as the own Quantizer's are
    (``full_range`` is the own Quantizer's).

    Example::

        >>> quantizer = quantizer_for_backend(qcore.get_backend("x86"))
        >>> type(quantizer).__name__       # a vendor extends x86 here
        'ExtendedQuantizer'
    """

    def __init__(
        self,
        own: Quantizer,
        own_source: str,
        backend_name: str,
        extensions: Sequence[tuple[str, BackendConfig, tuple[Kernel, ...]]],
        *,
        is_qat: bool = False,
        qconfig_mapping: Any = None,
    ) -> None:
        self.own = own
        self.own_label = f"{type(own).__name__} ({own_source})"
        self.backend_name = backend_name
        self.is_qat = is_qat
        self.full_range = bool(getattr(own, "full_range", False))
        self.extensions = [
            (
                source,
                BackendQuantizer(
                    config,
                    qconfig_mapping,
                    is_qat=is_qat,
                    backend_name=backend_name,
                    only_unannotated=True,
                ),
                kernels,
            )
            for source, config, kernels in extensions
        ]

    @property
    def quantizers(self) -> list[Quantizer]:
        return [self.own] + [quantizer for _, quantizer, _ in self.extensions]

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        for quantizer in self.quantizers:
            model = quantizer.transform_for_annotation(model)
        return model

    def annotate(self, model: GraphModule) -> GraphModule:
        model = self.own.annotate(model)
        for source, quantizer, _ in self.extensions:
            model = quantizer.annotate(model)
            shadowed: dict[Node, list[str]] = {}
            for node, pattern in quantizer.shadowed:
                shadowed.setdefault(node, [])
                if pattern not in shadowed[node]:
                    shadowed[node].append(pattern)
            for node, patterns in shadowed.items():
                _note(
                    node,
                    f"annotated by {self.own_label}; {source}'s pattern "
                    f"{', '.join(patterns)} for {self.backend_name} is not used here "
                    "(a backend's own Quantizer takes precedence over its extensions)",
                )
            for node, reason in quantizer.rejected:
                _note(node, f"{source}'s pattern for {self.backend_name}: {reason}")
        self._explain_unused_kernels(model)
        return model

    def _explain_unused_kernels(self, model: GraphModule) -> None:
        for node in model.graph.nodes:
            if node.op != "call_function" or node.meta.get(ANNOTATION_KEY) is not None:
                continue
            op = packet(node)
            for source, _, kernels in self.extensions:
                unused = [kernel.name for kernel in kernels if op in kernel_ops(kernel)]
                if unused:
                    _note(
                        node,
                        f"{source}'s kernel {', '.join(dict.fromkeys(unused))} for "
                        f"{self.backend_name} is not used: the op stays float",
                    )

    def validate(self, model: GraphModule) -> None:
        for quantizer in self.quantizers:
            quantizer.validate(model)

    def prepare_obs_or_fq_callback(self, model: GraphModule, edge_or_node_to_obs_or_fq) -> None:
        for quantizer in self.quantizers:
            quantizer.prepare_obs_or_fq_callback(model, edge_or_node_to_obs_or_fq)


def _note(node: Node, text: str) -> None:
    """Add ``text`` to what explain says about ``node``."""
    existing = node.meta.get(REASON_KEY)
    if existing and text in existing:
        return
    node.meta[REASON_KEY] = f"{existing}; {text}" if existing else text


def kernel_ops(kernel: Kernel) -> frozenset:
    """The aten op packets a kernel's pattern stands for on a torch.export graph."""
    found: set = set()
    for op in kernel.chain:
        if isinstance(op, torch._ops.OpOverload):
            found.add(op.overloadpacket)
        elif isinstance(op, torch._ops.OpOverloadPacket):
            found.add(op)
        else:
            found |= _packets(aten_pattern(op))
    return frozenset(found)


def _packets(pattern: Any) -> set:
    if isinstance(pattern, frozenset):
        return set(pattern)
    if isinstance(pattern, tuple):
        return set().union(*(_packets(item) for item in pattern))
    return set()
