"""Helpers the kernel families share: reading a match, checking it, SameOp policies."""

from __future__ import annotations

import inspect
from typing import Any

from torch.fx import Node

from qcore.kernels.packed import OutputQParamsState
from qcore.plugin.kernels import ActivationQParams, KernelMatch, SameOp

__all__ = [
    "OutputKernel",
    "bound_arguments",
    "one_quantized_input",
    "require",
    "same_as_input",
    "same_averaging",
]


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless ``condition``: the kernel refuses the match."""
    if not condition:
        raise ValueError(message)


def bound_arguments(match: KernelMatch, signature_of: Any, skip: int = 1) -> dict[str, Any]:
    """The root call's arguments bound to ``signature_of``'s parameters, defaults applied.

    The first ``skip`` (tensor) arguments are left out; any other argument that
    is a graph value rather than a constant is refused.
    """
    node = match.root
    bound = inspect.signature(signature_of).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    arguments = dict(list(bound.arguments.items())[skip:])
    for name, value in arguments.items():
        require(
            not isinstance(value, Node),
            f"argument {name!r} is computed in the graph, not a constant",
        )
    return arguments


def same_as_input(match: KernelMatch) -> SameOp:
    """SameOp for an op that only selects or moves values (exact on int8: any
    output qparams are reached by an exact requantization)."""
    require(
        len(match.inputs) >= 1 and match.output is not None, "needs a quantized input and output"
    )
    require(match.float_inputs == 0, "an input tensor is float, not quantized")
    require(
        all(q == match.inputs[0] for q in match.inputs),
        "its inputs have different qparams; torch's op needs one",
    )
    return SameOp(match.inputs[0])


def same_averaging(match: KernelMatch) -> SameOp:
    """SameOp for an op that averages: torch's int8 op keeps the input's qparams
    and rounds once, so it is taken only when the reference's output qparams are
    the input's."""
    same = same_as_input(match)
    require(
        match.output == same.produces,
        f"output qparams {_short(match.output)} differ from the input's "
        f"{_short(same.produces)}; torch's int8 kernel keeps the input's",
    )
    return same


def _short(qparams: ActivationQParams | None) -> str:
    if qparams is None:
        return "float"
    return f"(scale={qparams.scale:.6g}, zero_point={qparams.zero_point})"


class OutputKernel(OutputQParamsState):
    """A kernel without weights that quantizes its output to fixed qparams."""

    returns_quantized = True

    def __init__(self, output: ActivationQParams) -> None:
        super().__init__()
        self.scale, self.zero_point = output.scale, output.zero_point

    def extra_repr(self) -> str:
        return f"scale={self.scale}, zero_point={self.zero_point}"


def one_quantized_input(match: KernelMatch) -> ActivationQParams:
    """The single quantized input's qparams (with a quantized output), else refuse."""
    require(
        len(match.inputs) == 1 and match.float_inputs == 0 and not match.dynamic,
        "needs exactly one quantized input",
    )
    require(match.output is not None, "its output is not quantized")
    return match.inputs[0]
