"""What a backend recommends: compiling its quantized models (``qcore_compile_recipe``)
and the post-training algorithms worth running for it (``qcore_recommended_algorithms``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from qcore.config.errors import describe

__all__ = ["COMPILE_MODES", "AlgorithmStep", "CompileRecipe", "check_compile_mode"]

#: What ``qcore.compile(mode=...)`` accepts, as ``torch.compile``'s modes: "default"
#: weighs compile time with latency; "reduce-overhead" takes a longer compile to cut
#: the per-call overhead (on CPU: Inductor's C++ wrapper in place of its Python one).
COMPILE_MODES = ("default", "reduce-overhead")


def check_compile_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`COMPILE_MODES`; a ValueError naming it otherwise."""
    if not isinstance(mode, str) or mode not in COMPILE_MODES:
        raise ValueError(
            f"mode: got {describe(mode)}; expected one of {', '.join(map(repr, COMPILE_MODES))}"
        )
    return mode


def _check_options(field_name: str, options: Any, keys: str) -> None:
    if not isinstance(options, Mapping) or not all(isinstance(key, str) for key in options):
        raise TypeError(
            f"{field_name}: got {describe(options)}; expected a mapping with string keys ({keys})"
        )


@dataclass(frozen=True)
class CompileRecipe:
    """How ``torch.compile`` runs a backend's quantized models fastest.

    :func:`qcore.compile` applies it to the model's reference form (quantize and
    dequantize as ``torch.ops.quantized_decomposed`` ops around float ops, the
    graph torchao's PT2E flow hands to Inductor)::

        torch.compile(reference, backend=recipe.compiler, options=recipe.options,
                      dynamic=recipe.dynamic)

    ``compiler`` is a ``torch.compile`` backend: a registered name (``"inductor"``)
    or a callable. ``options`` go to it (for Inductor, its config keys: ``freezing``
    folds the int8 weights into packed constants); they apply while compiling only,
    never process-wide. ``no_grad`` runs each call under ``torch.no_grad()``, which
    Inductor's freezing needs. ``concat_linears`` first merges the linears that read
    one quantized input (q/k/v projections) into one, their per-channel int8 weights
    concatenated: the same numbers, one GEMM where there were several
    (:mod:`qcore.engine.concat_linears`). ``summary`` is the line ``qcore.explain``
    prints.

    Example::

        >>> CompileRecipe("inductor", {"freezing": True},
        ...               summary="Inductor, x86 int8 passes, frozen weights")
    """

    compiler: str | Callable[..., Any] = "inductor"
    options: Mapping[str, Any] = field(default_factory=dict)
    dynamic: bool | None = None
    no_grad: bool = True
    summary: str = ""
    concat_linears: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.compiler, str) and self.compiler) and not callable(self.compiler):
            raise TypeError(
                f"CompileRecipe.compiler: got {describe(self.compiler)}; expected a "
                "torch.compile backend name (such as 'inductor') or a callable"
            )
        _check_options("CompileRecipe.options", self.options, "the compiler's option names")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise TypeError(
                f"CompileRecipe.dynamic: got {describe(self.dynamic)}; expected True, False or None"
            )
        if not isinstance(self.no_grad, bool):
            raise TypeError(
                f"CompileRecipe.no_grad: got {describe(self.no_grad)}; expected True or False"
            )
        if not isinstance(self.concat_linears, bool):
            raise TypeError(
                f"CompileRecipe.concat_linears: got {describe(self.concat_linears)}; "
                "expected True or False"
            )
        if not isinstance(self.summary, str):
            raise TypeError(
                f"CompileRecipe.summary: got {describe(self.summary)}; expected a string"
            )
        # A frozen recipe keeps its own copy: the plugin's dict may change later.
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def __reduce__(self) -> tuple:
        return _rebuilt(self)

    def describe(self) -> str:
        """One line: the compiler, its options and the summary."""
        name = self.compiler if isinstance(self.compiler, str) else describe(self.compiler)
        options = ", ".join(f"{key}={value!r}" for key, value in self.options.items())
        text = f"torch.compile(backend={name}" + (f", {options})" if options else ")")
        if self.concat_linears:
            text = f"linears reading one input concatenated, then {text}"
        return f"{self.summary} ({text})" if self.summary else text


@dataclass(frozen=True)
class AlgorithmStep:
    """One post-training algorithm to run, by name, with its options.

    ``name`` is a name of ``qcore.algorithms.ALGORITHMS`` (``"equalize"``,
    ``"correct_bias"``, ...); ``options`` are that pass's keyword arguments
    (``qcore.equalize``'s ``iterations``, ``relu6_to_relu``). ``reason`` says why
    a backend recommends it: ``qcore.explain`` prints it. :func:`qcore.quantize`
    (``algorithms=``) runs each step at its stage, before or after calibration.

    Example::

        >>> AlgorithmStep("equalize", {"relu6_to_relu": False},
        ...               reason="depthwise convs: per-tensor activations waste levels")
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(
                f"AlgorithmStep.name: got {describe(self.name)}; expected an algorithm's "
                "name (a non-empty string, such as 'equalize')"
            )
        _check_options("AlgorithmStep.options", self.options, "the algorithm's keyword arguments")
        if not isinstance(self.reason, str):
            raise TypeError(f"AlgorithmStep.reason: got {describe(self.reason)}; expected a string")
        # A frozen step keeps its own copy: the plugin's dict may change later.
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def __reduce__(self) -> tuple:
        return _rebuilt(self)

    def describe(self) -> str:
        """The step as a call: ``smooth_quant(alpha=0.5)``, ``equalize()``."""
        options = ", ".join(f"{key}={value!r}" for key, value in self.options.items())
        return f"{self.name}({options})"


def _rebuilt(value: Any) -> tuple:
    """``__reduce__`` of a frozen dataclass holding read-only ``options``: built
    again from its fields, the options as a dict (a mappingproxy does not pickle,
    so neither a deep copy nor torch.save of a model whose report holds one ran)."""
    arguments = (getattr(value, item.name) for item in fields(value))
    return type(value), tuple(
        dict(argument) if isinstance(argument, MappingProxyType) else argument
        for argument in arguments
    )
