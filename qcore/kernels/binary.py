"""Kernels for add and mul (with relu, with a tensor or a scalar), cat and matmul.

``dq(a), dq(b) -> add [-> relu] -> q`` becomes one ``torch.ops.quantized.add``
(``add_relu``, ``mul``, ``mul_relu``) call on the int8 inputs. With a Python
number for one operand it becomes ``add_scalar``/``mul_scalar`` (``_relu``):
torch picks those outputs' qparams itself (mul: the input's scale times the
scalar, exact; add: the zero point shifted by round(scalar / scale), off by up
to half a step), so the kernel requantizes to the reference's qparams when
they differ.
"""

from __future__ import annotations

import numbers
from typing import Any, Union

import torch

from qcore.kernels.common import OutputKernel, require
from qcore.plugin.kernels import ActivationQParams, KernelMatch

__all__ = ["QuantizedBinary", "QuantizedCat", "QuantizedMatmul", "QuantizedScalarBinary"]

# torch's ops, bound once: a lookup through torch.ops costs about as much as the
# Python around a kernel call. TorchScript compiles them as the ops themselves.
_add = torch.ops.quantized.add
_add_relu = torch.ops.quantized.add_relu
_mul = torch.ops.quantized.mul
_mul_relu = torch.ops.quantized.mul_relu
_add_scalar = torch.ops.quantized.add_scalar
_add_scalar_relu = torch.ops.quantized.add_scalar_relu
_mul_scalar = torch.ops.quantized.mul_scalar
_mul_scalar_relu = torch.ops.quantized.mul_scalar_relu
_cat = torch.ops.quantized.cat
_matmul = torch.ops.quantized.matmul


def _broadcast_first(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of an add or mul (both commute) with the one already of the
    output's shape first: torch's kernels make the output in the first one's shape
    and resize it, printing a warning at every call. Expanded where neither is."""
    shape = _broadcast_shape(list(a.shape), list(b.shape))
    if b.dim() >= a.dim() and list(b.shape) == shape:
        return b, a
    if list(a.shape) == shape:
        return a, b
    expanded = torch.broadcast_tensors(a, b)
    return expanded[0], expanded[1]


def _broadcast_shape(a: list[int], b: list[int]) -> list[int]:
    """``torch.broadcast_shapes(a, b)`` in plain Python: 1 us where torch's takes 15
    (asked twice per call, that was three times a squeeze-excite gate's int8 mul)."""
    rank = max(len(a), len(b))
    shape: list[int] = []
    for i in range(rank):
        i_a, i_b = i - rank + len(a), i - rank + len(b)
        size_a = a[i_a] if i_a >= 0 else 1
        size_b = b[i_b] if i_b >= 0 else 1
        if size_a != size_b and size_a != 1 and size_b != 1:
            raise RuntimeError(f"shapes {a} and {b} do not broadcast")
        shape.append(size_b if size_a == 1 else size_a)
    return shape


def _qnnpack_adds(ratio: float) -> bool:
    """Whether qnnpack's add accepts this input-to-output scale ratio: [2**-14, 2**8)."""
    return 2.0**-14 <= ratio < 2.0**8


def _check_binary(match: KernelMatch) -> None:
    require(match.output is not None, "its output is not quantized")
    require(match.float_inputs == 0 and not match.dynamic, "an operand is a float tensor")
    extra = {k: v for k, v in match.root.kwargs.items() if k != "out"}
    require(not extra and len(match.root.args) == 2, f"takes two operands, got {match.root}")


class QuantizedBinary(OutputKernel):
    """``torch.ops.quantized.{add,mul}[_relu]`` of two int8 tensors."""

    def __init__(self, op: str, relu: bool, output: ActivationQParams) -> None:
        super().__init__(output)
        self.op, self.relu = op, relu
        self.op_name = f"{op}_relu" if relu else op

    def forward(self, a: torch.Tensor, b: torch.Tensor, out: Any = None) -> torch.Tensor:
        op = self.op_name
        if a.shape != b.shape:
            a, b = _broadcast_first(a, b)
        if op in ("add", "add_relu") and not (
            _qnnpack_adds(a.q_scale() / self.scale) and _qnnpack_adds(b.q_scale() / self.scale)
        ):
            # torch runs qnnpack's add when the global engine is qnnpack, and it refuses
            # such scales (an internal assert): a ConvNeXt layer scale of 1e-6 has them.
            # The reference's computation reads no engine.
            total = a.dequantize() + b.dequantize()
            if self.relu:
                total = torch.relu(total)
            return torch.quantize_per_tensor(total, self.scale, self.zero_point, a.dtype)
        if op == "add":
            return _add(a, b, self.scale, self.zero_point)
        if op == "add_relu":
            return _add_relu(a, b, self.scale, self.zero_point)
        if op == "mul":
            return _mul(a, b, self.scale, self.zero_point)
        return _mul_relu(a, b, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return f"{self.op}{'_relu' if self.relu else ''}, {super().extra_repr()}"


class QuantizedScalarBinary(OutputKernel):
    """``torch.ops.quantized.{add,mul}_scalar[_relu]``, requantized to the output's qparams."""

    def __init__(self, op: str, relu: bool, output: ActivationQParams) -> None:
        super().__init__(output)
        self.op, self.relu, self.dtype = op, relu, output.dtype
        self.op_name = f"{op}_scalar_relu" if relu else f"{op}_scalar"

    def forward(
        self,
        a: Union[torch.Tensor, float, int],  # noqa: UP007 (TorchScript reads typing.Union)
        b: Union[torch.Tensor, float, int],  # noqa: UP007
        out: Any = None,
    ) -> torch.Tensor:
        if isinstance(a, torch.Tensor):
            tensor, scalar = a, _number(b)
        else:
            assert isinstance(b, torch.Tensor)
            tensor, scalar = b, _number(a)
        result = self._apply(tensor, scalar)
        if self.op == "add" and result.q_scale() != tensor.q_scale():
            # torch's add_scalar widened its range (the shifted zero point left the
            # dtype's): that cost resolution. Compute as the reference does.
            exact = tensor.dequantize() + scalar
            if self.relu:
                exact = torch.relu(exact)
            return torch.quantize_per_tensor(exact, self.scale, self.zero_point, self.dtype)
        if result.q_scale() != self.scale or result.q_zero_point() != self.zero_point:
            result = torch.quantize_per_tensor(
                result.dequantize(), self.scale, self.zero_point, self.dtype
            )
        return result

    def _apply(self, tensor: torch.Tensor, scalar: float) -> torch.Tensor:
        if self.op_name == "add_scalar":
            return _add_scalar(tensor, scalar)
        if self.op_name == "add_scalar_relu":
            return _add_scalar_relu(tensor, scalar)
        if self.op_name == "mul_scalar":
            return _mul_scalar(tensor, scalar)
        return _mul_scalar_relu(tensor, scalar)

    def extra_repr(self) -> str:
        return f"{self.op}_scalar{'_relu' if self.relu else ''}, {super().extra_repr()}"


def _number(value: Union[torch.Tensor, float, int]) -> float:  # noqa: UP007
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        return float(value)
    raise ValueError("expected a quantized tensor and a Python number")


IN_PLACE = (torch.ops.aten.add_.Tensor, torch.ops.aten.mul_.Tensor)


def _check_in_place(match: KernelMatch) -> None:
    """An exported ``x.add_(y)`` (``x += y``) writes into its first operand. In the
    reference graph that is a dequantize's fresh float tensor; when the add is its
    only reader, nothing sees the write, and the kernel's new int8 tensor (nothing
    written in place) gives the same values."""
    if match.root.target not in IN_PLACE:
        return
    written = match.root.args[0]
    require(
        hasattr(written, "users") and set(written.users) == {match.root},
        f"{match.root.target.overloadpacket.__name__} writes into "
        f"{getattr(written, 'name', written)!r}, which is read elsewhere too",
    )


def lower_binary(match: KernelMatch, op: str, relu: bool = False):
    """add/mul of two quantized tensors, or of one and a Python number."""
    _check_binary(match)
    _check_in_place(match)
    if len(match.inputs) == 2:
        return QuantizedBinary(op, relu, match.output)
    require(len(match.inputs) == 1, "needs a quantized operand")
    other = [a for a in match.root.args if not hasattr(a, "op")]
    require(
        len(other) == 1 and isinstance(other[0], numbers.Number) and not isinstance(other[0], bool),
        "the other operand is neither a quantized tensor nor a Python number",
    )
    return QuantizedScalarBinary(op, relu, match.output)


class QuantizedCat(OutputKernel):
    """``torch.ops.quantized.cat``: inputs of any qparams, requantized into the output's."""

    def forward(self, tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return _cat(tensors, dim, self.scale, self.zero_point)


def lower_cat(match: KernelMatch):
    require(match.output is not None, "its output is not quantized")
    require(match.float_inputs == 0 and match.inputs, "an input tensor is float, not quantized")
    require(set(match.root.kwargs) <= {"dim"}, f"unexpected arguments {dict(match.root.kwargs)}")
    dtypes = {q.dtype for q in match.inputs} | {match.output.dtype}
    require(len(dtypes) == 1, f"inputs and output mix dtypes {sorted(map(str, dtypes))}")
    kernel = QuantizedCat(match.output)
    # Inputs in the output's own qparams are copied, never out of its range.
    kernel.honors_quant_range = all(q == match.output for q in match.inputs)
    return kernel


class QuantizedMatmul(OutputKernel):
    """``torch.ops.quantized.matmul`` of two int8 tensors."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, out: Any = None) -> torch.Tensor:
        if not torch.jit.is_scripting() and self._under_autocast():
            # torch's int8 matmul computes in float inside, which autocast makes
            # bfloat16, and then fails to quantize it: compute as the reference does
            product = torch.matmul(a.dequantize(), b.dequantize()).float()
            return torch.quantize_per_tensor(product, self.scale, self.zero_point, a.dtype)
        return _matmul(a, b, self.scale, self.zero_point)

    @torch.jit.unused
    def _under_autocast(self) -> bool:
        return torch.is_autocast_enabled("cpu")

    # TorchScript reads this (never run) method's signature, and cannot resolve the
    # string annotation ``from __future__ import annotations`` makes of bool
    _under_autocast.__annotations__["return"] = bool


def lower_matmul(match: KernelMatch):
    _check_binary(match)
    require(len(match.inputs) == 2, "needs two quantized operands")
    return QuantizedMatmul(match.output)
