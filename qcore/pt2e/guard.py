"""A picklable stand-in for the input guard of ``torch.export``'s module().

``ExportedProgram.module()`` checks the inputs' shapes in a ``_guards_fn``
submodule whose forward is code generated at run time, which torch.save cannot
pickle. qcore's prepare swaps it for :class:`InputShapeGuard`, built from the
shapes the graph was exported for, so prepared and converted models pickle and
still reject inputs the graph was specialised away from.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

__all__ = ["ExportedCodeTracer", "InputShapeGuard", "replace_export_guard"]

# One entry per dimension: its size if static, else the name of its symbol.
DimSpec = int | str


class InputShapeGuard(torch.nn.Module):
    """Asserts each input has the rank and static sizes the graph was exported for.

    A dimension exported as dynamic is left free, but two dimensions exported
    with the same symbol must agree. Failures raise AssertionError, as
    torch.export's own guard does, naming the input, the dimension and both sizes.
    """

    # The call has no users; without this, dead-code elimination would drop it.
    _is_impure = True

    def __init__(self, names: tuple[str, ...], shapes: tuple[tuple[DimSpec, ...] | None, ...]):
        super().__init__()
        self.names = names
        self.shapes = shapes

    def forward(self, *inputs: object) -> None:
        symbols: dict[str, tuple[str, int]] = {}
        for name, shape, value in zip(self.names, self.shapes, inputs, strict=False):
            if shape is None or not isinstance(value, torch.Tensor):
                continue
            torch._assert(
                value.dim() == len(shape),
                f"input {name!r} has {value.dim()} dimensions; the model was exported "
                f"for {len(shape)}",
            )
            for dim, expected in enumerate(shape):
                size = value.size(dim)
                if isinstance(expected, int):
                    torch._assert(
                        size == expected,
                        f"input {name!r}: dimension {dim} is {size}; the model was exported "
                        f"for {expected} (export with dynamic_shapes to let it vary)",
                    )
                elif expected in symbols:
                    first, first_size = symbols[expected]
                    torch._assert(
                        size == first_size,
                        f"input {name!r}: dimension {dim} is {size} but {first} is "
                        f"{first_size}; the model was exported with both equal",
                    )
                else:
                    symbols[expected] = (f"{name!r} dimension {dim}", size)

    def extra_repr(self) -> str:
        return ", ".join(
            f"{n}: {list(s) if s else s}" for n, s in zip(self.names, self.shapes, strict=True)
        )


def _shape_of(node: Node) -> tuple[DimSpec, ...] | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(int(d) if isinstance(d, int) else str(d.node.expr) for d in value.shape)


def _holds_proxy(value: object) -> bool:
    if isinstance(value, torch.fx.Proxy):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_proxy(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_proxy(item) for item in value.values())
    return False


class ExportedCodeTracer(torch.fx.Tracer):
    """The tracer torch.load re-traces a PT2E model's generated code with.

    Graphs exported with a free dimension call aten ops with symbolic sizes inside
    lists (``aten.zeros([2, sym_size, 64])``, ``aten.view(x, [sym_size, -1])``);
    torch.fx's plain tracer hands those ops a Proxy where the op's schema wants an
    int, which they refuse. This tracer records such a call as a graph node instead.
    """

    def trace(self, root, concrete_args=None):  # type: ignore[override]
        overload = torch._ops.OpOverload
        original = overload.__call__
        tracer = self

        def call(op, /, *args, **kwargs):
            if _holds_proxy(args) or _holds_proxy(kwargs):
                return tracer.create_proxy("call_function", op, args, kwargs)
            return original(op, *args, **kwargs)

        overload.__call__ = call  # only while this trace runs
        try:
            return super().trace(root, concrete_args)
        finally:
            overload.__call__ = original


def replace_export_guard(gm: GraphModule) -> None:
    """Swap torch.export's generated guard of ``gm`` for an :class:`InputShapeGuard`.

    Also replaces the graph's tracer class: torch.load re-traces a GraphModule's
    code with it, and export's tracer cannot be built without arguments
    (:class:`ExportedCodeTracer` can, and takes symbolic sizes).
    """
    for node in gm.graph.find_nodes(op="call_module", target="_guards_fn"):
        guarded = [arg for arg in node.args if isinstance(arg, Node)]
        gm._guards_fn = InputShapeGuard(
            tuple(arg.name for arg in guarded), tuple(_shape_of(arg) for arg in guarded)
        )
    gm.graph._tracer_cls = ExportedCodeTracer  # deep copies take the graph's
    gm._tracer_cls = ExportedCodeTracer
    gm.recompile()
