"""A picklable stand-in for the input guard of ``torch.export``'s module().

``ExportedProgram.module()`` checks the inputs' shapes in a ``_guards_fn``
submodule whose forward is code generated at run time, which torch.save cannot
pickle. qcore's prepare swaps it for :class:`InputShapeGuard`, built from the
shapes the graph was exported for, so prepared and converted models pickle and
still reject inputs the graph was specialised away from.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

__all__ = ["ExportedCodeTracer", "InputShapeGuard", "replace_export_guard", "run_guard_first"]

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

    def __init__(
        self,
        names: tuple[str, ...],
        shapes: tuple[tuple[DimSpec, ...] | None, ...],
        ranges: dict[str, tuple[int, int | None]] | None = None,
        dtypes: dict[str, torch.dtype] | None = None,
    ):
        super().__init__()
        self.names = names
        self.shapes = shapes
        self.ranges = dict(ranges or {})
        """A dynamic dimension's (min, max) where export bounds it: ``Dim("batch",
        max=8)``, or a branch on the size the graph took (``if x.shape[0] <= 8``)."""
        self.dtypes = dict(dtypes or {})
        """The dtype of each floating-point input. The graph was specialised to it,
        and the quantize op met first in the converted graph takes no other (its own
        error names neither the input nor the dtype)."""

    # Each message is formatted only when its check fails: formatting a size makes
    # torch.compile specialise the graph to it, recompiling at every batch size.
    def forward(self, *inputs: object) -> None:
        symbols: dict[str, tuple[str, int]] = {}
        for name, shape, value in zip(self.names, self.shapes, inputs, strict=False):
            if shape is None or not isinstance(value, torch.Tensor):
                continue
            self._check_dtype(name, value)
            if value.dim() != len(shape):
                raise AssertionError(
                    f"input {name!r} has {value.dim()} dimensions; the model was exported "
                    f"for {len(shape)}"
                )
            for dim, expected in enumerate(shape):
                size = value.size(dim)
                if isinstance(expected, int):
                    if size != expected:
                        raise AssertionError(
                            f"input {name!r}: dimension {dim} is {size}; the model was "
                            f"exported for {expected} (export with dynamic_shapes to let it vary)"
                        )
                elif expected in symbols:
                    first, first_size = symbols[expected]
                    if size != first_size:
                        raise AssertionError(
                            f"input {name!r}: dimension {dim} is {size} but {first} is "
                            f"{first_size}; the model was exported with both equal"
                        )
                else:
                    symbols[expected] = (f"{name!r} dimension {dim}", size)
                    self._check_range(name, dim, size, expected)

    def _check_dtype(self, name: str, value: torch.Tensor) -> None:
        expected = getattr(self, "dtypes", {}).get(name)  # older pickles: none
        if expected is not None and value.dtype != expected:
            raise AssertionError(
                f"input {name!r} is {value.dtype}; the model was exported for {expected} "
                f"(cast it with .to({expected}))"
            )

    def _check_range(self, name: str, dim: int, size: int, symbol: str) -> None:
        low, high = getattr(self, "ranges", {}).get(symbol, (0, None))  # older pickles: none
        if size < low or (high is not None and size > high):
            raise AssertionError(
                f"input {name!r}: dimension {dim} is {size}; the model was exported for "
                f"{low} to {'any size' if high is None else high} (its graph may depend on it)"
            )

    def extra_repr(self) -> str:
        shapes = ", ".join(
            f"{n}: {list(s) if s else s}" for n, s in zip(self.names, self.shapes, strict=True)
        )
        ranges = getattr(self, "ranges", {})
        dtypes = getattr(self, "dtypes", {})
        shapes = f"{shapes}, ranges: {ranges}" if ranges else shapes
        return f"{shapes}, dtypes: {dtypes}" if dtypes else shapes


def _shape_of(node: Node) -> tuple[DimSpec, ...] | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(int(d) if isinstance(d, int) else str(d.node.expr) for d in value.shape)


# torch.export specialises sizes 0 and 1 and records a free dimension from 2, yet its
# guard lets 0 and 1 through; a larger minimum is the user's (Dim("b", min=3))
_EXPORT_MINIMUM = 2


def _finite(bound: object) -> int | None:
    """A bound as an int; None where it is infinite (sympy's or torch's int_oo)."""
    try:
        return int(bound)  # type: ignore[call-overload]
    except (OverflowError, TypeError, ValueError, AttributeError):
        return None


def _ranges_of(node: Node) -> dict[str, tuple[int, int | None]]:
    """The bounds export recorded for ``node``'s dynamic dimensions, by symbol."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return {}
    found = {}
    for size in value.shape:
        if isinstance(size, int):
            continue
        expr = size.node.expr
        bounds = size.node.shape_env.var_to_range.get(expr)
        if bounds is None:
            continue  # a derived size (2 * s0): its symbol's own bounds hold it
        low, high = _finite(bounds.lower), _finite(bounds.upper)
        low = low if low is not None and low > _EXPORT_MINIMUM else 0
        if low or high is not None:
            found[str(expr)] = (low, high)
    return found


def _dtype_of(node: Node) -> torch.dtype | None:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.dtype
    return None  # integer inputs (token ids) take other widths, as export's graph does


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
        guarded = [_the_input(arg) for arg in node.args if isinstance(arg, Node)]
        gm._guards_fn = InputShapeGuard(
            tuple(str(arg.target) for arg in guarded),  # the user's argument names
            tuple(_shape_of(arg) for arg in guarded),
            {symbol: bounds for arg in guarded for symbol, bounds in _ranges_of(arg).items()},
            {str(arg.target): _dtype_of(arg) for arg in guarded if _dtype_of(arg) is not None},
        )
    run_guard_first(gm)
    gm.graph._tracer_cls = ExportedCodeTracer  # deep copies take the graph's
    gm._tracer_cls = ExportedCodeTracer
    gm.recompile()


def run_guard_first(gm: GraphModule) -> None:
    """Move ``gm``'s input guard before everything its inputs feed (observers, and
    the quantize ops convert puts in their place), so bad inputs meet it first."""
    for node in gm.graph.find_nodes(op="call_module", target="_guards_fn"):
        *_, last_input = gm.graph.find_nodes(op="placeholder")
        # it reads the user's inputs themselves, not the observers (or quantize
        # ops) a quantizer annotating a graph input put between
        node.args = tuple(_the_input(arg) for arg in node.args)
        last_input.append(node)
        gm.recompile()


def _the_input(arg: Any) -> Any:
    while isinstance(arg, Node) and arg.op != "placeholder" and arg.args:
        arg = arg.args[0]
    return arg
