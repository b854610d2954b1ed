"""A kernel qcore's own suites do not test is run once at convert before it is used.

qcore's kernels and its first-party plugins' are tested against the reference
form in CI. A third party's kernel is tested by its vendor (``qcore check``), and
one that returns the wrong shape would otherwise pass convert and fail, or
broadcast silently, in the user's forward. Lowering runs such a kernel on
inputs of the shapes and qparams prepare recorded and refuses it (the pattern
stays in reference form, and convert warns) unless its output has the recorded
shape, the kind of tensor its class promises (int8, or float where it sets
``returns_quantized = False``) and, when int8, the dtype and qparams lowering
recorded for its output: the next op reads the integers at those, so a kernel
requantizing at another scale or to another dtype computes garbage downstream
whatever its own values. Values are ``qcore check``'s job: random inputs say
nothing about whether an output is right.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
from torch.fx import GraphModule, Node

from qcore import ops
from qcore.plugin.kernels import ActivationQParams, Kernel

__all__ = [
    "OUTPUT_QPARAMS_KEY",
    "TESTED_PACKAGES",
    "is_tested",
    "recorded",
    "sample_input",
    "wrong_output",
    "wrong_qparams",
]

TESTED_PACKAGES = frozenset({"qcore", "qcore_fbgemm", "qcore_qnnpack", "qcore_x86"})
"""The packages whose kernels qcore's own CI tests against the reference form."""

OUTPUT_QPARAMS_KEY = "qcore_kernel_output_qparams"
"""Node meta key: the ActivationQParams lowering recorded for a kernel module's int8
output (``KernelMatch.output``), for ``qcore check`` to hold the kernel to."""

# q_scale() is a double; a kernel may have kept the scale in float32 on the way.
SCALE_RELATIVE_TOLERANCE = 1e-6

# What stands between a value and the op reading it, in a graph being lowered.
_DECOMPOSED = torch.ops.quantized_decomposed
_TRAVERSED = (
    ops.quantize_per_tensor,
    ops.dequantize_per_tensor,
    ops.fake_quantize_dynamic,
    torch.quantize_per_tensor,
    torch.clamp,
    # the reference form's (qcore.compile's graph): no recorded shape of their own
    _DECOMPOSED.quantize_per_tensor.default,
    _DECOMPOSED.dequantize_per_tensor.default,
    _DECOMPOSED.quantize_per_tensor.tensor,
    _DECOMPOSED.dequantize_per_tensor.tensor,
)


def is_tested(kernel: Kernel) -> bool:
    """Whether ``kernel``'s lowering is qcore's or a first-party plugin's."""
    lower = kernel.lower
    while isinstance(lower, functools.partial):
        lower = lower.func
    module = getattr(lower, "__module__", None) or ""
    return module.split(".")[0] in TESTED_PACKAGES


def recorded(
    node: Any, gm: GraphModule | None = None, *, example_sizes: bool = False
) -> tuple[torch.Size, torch.dtype] | None:
    """The (shape, dtype) prepare recorded for the value ``node`` carries, through
    the quantize/dequantize ops around it; None where none was recorded (or the
    value is a constant and no ``gm`` holding it is given). A dynamic dimension
    has no size, unless ``example_sizes``: then it is the size export saw."""
    meta = _recorded_meta(node, gm)
    if meta is None:
        return None
    sizes = tuple(_size(size, example_sizes) for size in meta.shape)
    if not all(isinstance(size, int) for size in sizes):
        return None  # a dynamic (symbolic) size
    return torch.Size(sizes), meta.dtype


def dynamic_dims(node: Any, gm: GraphModule | None = None) -> set[int]:
    """The dimensions of ``node``'s recorded value that export left dynamic."""
    meta = _recorded_meta(node, gm)
    shape = meta.shape if meta is not None else ()
    return {dim for dim, size in enumerate(shape) if isinstance(size, torch.SymInt)}


def _recorded_meta(node: Any, gm: GraphModule | None) -> Any:
    """What prepare recorded for ``node``'s value (anything with .shape and .dtype)."""
    while isinstance(node, Node):
        # FX's probe records tensor_meta; torch.export records a fake tensor as val
        meta = node.meta.get("tensor_meta", node.meta.get("val"))
        if meta is not None and hasattr(meta, "shape"):
            return meta
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            return value if isinstance(value, torch.Tensor) else None
        traversed = (node.op == "call_function" and node.target in _TRAVERSED) or (
            node.op == "call_method" and node.target == "dequantize"
        )
        if not traversed or not node.args:
            return None
        node = node.args[0]
    return None


def _size(size: Any, example_sizes: bool) -> Any:
    if isinstance(size, torch.SymInt) and example_sizes:
        hint = size.node.hint
        return int(hint) if hint is not None else size
    return size


def sample_input(
    shape: torch.Size, dtype: torch.dtype, qparams: ActivationQParams | None
) -> torch.Tensor:
    """A value of ``shape``: torch int8 at ``qparams``; else random floats, or zeros
    of an integer dtype (indices)."""
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    value = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    if qparams is None:
        return value
    return torch.quantize_per_tensor(value, qparams.scale, qparams.zero_point, qparams.dtype)


def wrong_output(
    output: Any,
    expected: torch.Size,
    returns_quantized: bool,
    qparams: ActivationQParams | None = None,
) -> str | None:
    """What is wrong with a kernel's ``output`` on inputs of the recorded shapes, or None.
    ``qparams``: what lowering recorded for the output (``KernelMatch.output``)."""
    if not isinstance(output, torch.Tensor):
        return f"it returned {type(output).__name__}, not a tensor"
    if output.is_quantized != returns_quantized:
        kind = "an int8 (torch quantized)" if returns_quantized else "a float"
        found = "int8" if output.is_quantized else str(output.dtype).removeprefix("torch.")
        return f"it returned a {found} tensor where its class promises {kind} one"
    if output.shape != expected:
        return (
            f"it returned shape {tuple(output.shape)} where the reference gives {tuple(expected)}"
        )
    if output.is_quantized and qparams is not None:
        return wrong_qparams(output, qparams)
    return None


def wrong_qparams(output: torch.Tensor, expected: ActivationQParams) -> str | None:
    """How a kernel's int8 ``output`` departs from the dtype and per-tensor qparams
    lowering recorded for it, or None."""
    if output.qscheme() not in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        got = f"{_dtype_name(output.dtype)} with {output.qscheme()} qparams"
    else:
        scale, zero_point = output.q_scale(), output.q_zero_point()
        same = (
            output.dtype == expected.dtype
            and math.isclose(scale, expected.scale, rel_tol=SCALE_RELATIVE_TOLERANCE)
            and zero_point == expected.zero_point
        )
        if same:
            return None
        got = f"{_dtype_name(output.dtype)}, scale {scale:.6g}, zero point {zero_point}"
    return (
        f"it returned {got}; lowering recorded {_dtype_name(expected.dtype)}, "
        f"scale {expected.scale:.6g}, zero point {expected.zero_point}"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
