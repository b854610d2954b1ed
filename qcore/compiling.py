"""``qcore.compile``: a calibrated model, converted and compiled as its backend says.

A backend plugin answers ``qcore_compile_recipe`` with a :class:`qcore.CompileRecipe`
(x86 and onednn: Inductor with its int8 passes and frozen weights). qcore converts
the prepared model to its reference form, the standard ``quantized_decomposed``
quantize/dequantize graph those passes match, and hands it to ``torch.compile``
with the recipe. A backend without a recipe runs fastest on its eager kernels:
the lowered model is returned, as ``convert_fx``/``convert_pt2e`` give it. An FX
model's reference modules are first rewritten into int8 weights behind dequantize
ops (``qcore.engine.decomposed.weights_in_graph``), the graph PT2E gives.

Example::

    >>> prepared = qcore.prepare_pt2e(exported, "x86")
    >>> for batch in calibration_data:
    ...     prepared(*batch)
    >>> fast = qcore.compile(prepared)     # compiles on its first call
    >>> fast(*example_inputs)
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.fx import GraphModule

from qcore.config.errors import describe
from qcore.engine.concat_linears import concat_sibling_linears
from qcore.engine.constants import RANDOM_WORDS, attribute, written_buffers
from qcore.engine.explain import _REPORT_ATTRIBUTE, report_of
from qcore.plugin import CompileRecipe, UnknownBackendError, get_backend
from qcore.plugin.recipes import check_compile_mode
from qcore.pt2e.train_eval import draws_dropout

__all__ = ["CompiledModel", "compile"]


class CompiledModel(torch.nn.Module):
    """A reference-form model and its ``torch.compile`` wrapper, run per the recipe.

    ``reference`` is the eager reference form (its outputs are the specification
    the compiled kernels approximate; the first call on each new input signature
    is checked against it), ``compiled_form`` the graph handed to the compiler (the
    reference form, or its twin with the recipe's graph passes applied, sharing its
    tensors), ``recipe`` the backend's :class:`qcore.CompileRecipe`.
    ``qcore.explain`` returns the reference form's report. Compilation happens on
    the first call, for the shapes it is given.
    """

    def __init__(
        self,
        reference: GraphModule,
        recipe: CompileRecipe,
        backend: str,
        compiled_form: GraphModule | None = None,
    ) -> None:
        super().__init__()
        self.reference = reference
        self.recipe = recipe
        self.backend = backend
        options = dict(recipe.options) or None
        compiled_form = compiled_form if compiled_form is not None else reference
        # Not a submodule either: its tensors are the reference form's.
        object.__setattr__(self, "compiled_form", compiled_form)
        compiled = torch.compile(
            compiled_form,
            backend=recipe.compiler,
            options=options,
            dynamic=recipe.dynamic,
        )
        # Not a submodule: it wraps ``reference``, whose parameters are counted once.
        object.__setattr__(self, "_compiled", compiled)
        # signature -> the inputs (positions, keyword names) the compiled graph writes into
        object.__setattr__(self, "_compiled_for", {})
        object.__setattr__(self, "_written", sorted(written_buffers(reference)))
        object.__setattr__(self, "_deterministic", not _draws_random_numbers(reference))
        report = report_of(reference)
        if report is not None:
            object.__setattr__(self, _REPORT_ATTRIBUTE, report)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # under the caller's no_grad or inference_mode, no context of its own (about
        # 1.5 us a call, of a small model's tens)
        needs_no_grad = self.recipe.no_grad and torch.is_grad_enabled()
        grad = torch.no_grad() if needs_no_grad else nullcontext()
        signature = _signature(args, kwargs)
        written = self._compiled_for.get(signature)
        if written is not None:
            call_args, call_kwargs = _copied(written, args, kwargs)
            try:
                with grad:
                    return self._compiled(*call_args, **call_kwargs)
            except Exception:
                # dynamo compiled again without the recipe's options (its caches were
                # reset, or a guard qcore's signature does not see failed), which for
                # frozen int8 weights fails inside Inductor: once more, with them set.
                # A model's own error is raised again by that call.
                del self._compiled_for[signature]
        # New input shapes: dynamo traces (again), and some recipe options are read
        # while it traces (Inductor's freezing decides whether weights become
        # constants), not only by Inductor after it: they are set for the call and
        # restored. Calls on shapes already compiled skip that (tens of us a call).
        # The call runs on copies of the inputs: Inductor may fuse an add of a graph
        # input into a kernel that sums in place into it (oneDNN's qlinear "sum"
        # post-op on ``x + linear(norm(x))``; torchao's compiled model does the same).
        # Inputs it writes are copied on every later call, so the caller's are not.
        every_tensor = _tensor_keys(args, kwargs)
        copies = _copied(every_tensor, args, kwargs)
        state_before = self._state()
        with self._inductor_options(), grad, warnings.catch_warnings():
            # Inductor's oneDNN lowering copies a tensor with torch.tensor() while it
            # compiles (torch 2.13): torch's own, at compile time, nothing to act on.
            warnings.filterwarnings(
                "ignore", "To copy construct from a tensor", UserWarning, "torch._inductor"
            )
            outputs = self._compiled(*copies[0], **copies[1])
        # Checked once per compiled signature, not on every call (the recipe may turn
        # the compiler's own per-call checks off: x86's Inductor size asserts cost 5%
        # of a conv net's latency): a graph lowered wrongly gives garbage, not noise.
        # The reference runs from the state the compiled call started from (buffers
        # the forward writes), which is then set back to the compiled call's result.
        state_after = self._state()
        if self._deterministic:
            fresh_args, fresh_kwargs = _copied(every_tensor, args, kwargs)
            self._restore(state_before)
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                expected = self.reference(*fresh_args, **fresh_kwargs)
            self._restore(state_after)
            _check_agreement(outputs, expected, self.recipe)
        self._compiled_for[signature] = _written(every_tensor, (args, kwargs), copies, outputs)
        return outputs

    def _state(self) -> dict[str, torch.Tensor]:
        """Copies of the buffers the reference form's forward writes."""
        return {name: attribute(self.reference, name).clone() for name in self._written}

    def _restore(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in state.items():
                attribute(self.reference, name).copy_(value)

    def _inductor_options(self) -> AbstractContextManager:
        if self.recipe.compiler != "inductor" or not self.recipe.options:
            return nullcontext()
        return _options_set(self.recipe.options)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, recipe={self.recipe.describe()}"


#: Below this SQNR (dB) against the reference form, a compiled output is not int8
#: rounding (30-50 dB on the zoo's models) but a graph the compiler got wrong.
AGREEMENT_DB = 10.0


def _check_agreement(outputs: Any, expected: Any, recipe: CompileRecipe) -> None:
    """A RuntimeError naming the output where the compiled model's first call
    disagrees with the reference form's: another structure, shape or dtype,
    non-finite values where the reference has finite ones, or an SQNR below
    AGREEMENT_DB. An output a hundred times smaller than the largest (a mean of
    normalized values, about 0) is measured against 1% of that one's size: its own
    is rounding."""
    ours = torch.utils._pytree.tree_leaves(outputs)
    theirs = torch.utils._pytree.tree_leaves(expected)
    if len(ours) != len(theirs):
        problem = f"{len(ours)} outputs where the reference form gives {len(theirs)}"
    else:
        floats = [t for t in theirs if isinstance(t, torch.Tensor) and t.is_floating_point()]
        largest = max((_power(t) for t in floats), default=0.0)
        found = (
            _disagreement(got, want, floor=largest * 1e-4)
            for got, want in zip(ours, theirs, strict=True)
        )
        problem = next(
            (f"output {index}: {text}" for index, text in enumerate(found) if text), None
        )
    if problem is not None:
        raise RuntimeError(
            f"qcore.compile: the compiled model's first call on these inputs disagrees "
            f"with its reference form ({problem}): {recipe.describe()} lowered the graph "
            "wrongly. Run the reference form (compiled.reference) or the backend's eager "
            "kernels (qcore.convert_pt2e / convert_fx of the prepared model) instead, and "
            "report it with the recipe"
        )


def _power(tensor: torch.Tensor) -> float:
    """Mean square of the finite values."""
    finite = tensor[torch.isfinite(tensor)].double()
    return finite.pow(2).mean().item() if finite.numel() else 0.0


def _disagreement(got: Any, want: Any, floor: float) -> str | None:
    if not isinstance(want, torch.Tensor) or not want.is_floating_point():
        return None
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        shown = (tuple(got.shape), got.dtype) if isinstance(got, torch.Tensor) else type(got)
        return f"{shown} where the reference form gives {(tuple(want.shape), want.dtype)}"
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite):
        return "non-finite values where the reference form has finite ones, or the reverse"
    if not finite.any():
        return None
    got, want = got[finite].double(), want[finite].double()
    noise, signal = (got - want).pow(2).mean().item(), want.pow(2).mean().item()
    if noise > max(signal, floor) * 10 ** (-AGREEMENT_DB / 10):
        sqnr = 10 * math.log10(signal / noise) if signal > 0 else float("-inf")
        return f"SQNR {sqnr:.1f} dB against it, below {AGREEMENT_DB:g}"
    return None


def _draws_random_numbers(gm: GraphModule) -> bool:
    """Whether ``gm``'s forward draws random numbers (random ops, a dropout in
    training mode, attention with a dropout probability): its compiled form's
    numbers are not its reference form's, so the first call is not compared."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if draws_dropout(node):
            return True
        name = str(node.target)
        if "dropout" not in name and any(word in name for word in RANDOM_WORDS):
            return True
    return False


def _tensor_keys(args: tuple, kwargs: dict) -> frozenset:
    keys = [i for i, value in enumerate(args) if isinstance(value, torch.Tensor)]
    keys += [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)]
    return frozenset(keys)


def _copied(keys: frozenset, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) with the tensors at ``keys`` (positions, keyword names) cloned."""
    if not keys:
        return args, kwargs
    args = tuple(value.clone() if i in keys else value for i, value in enumerate(args))
    kwargs = {name: value.clone() if name in keys else value for name, value in kwargs.items()}
    return args, kwargs


def _written(keys: frozenset, originals: tuple, copies: tuple, outputs: Any) -> frozenset:
    """The inputs at ``keys`` the call wrote into: their copies changed, or an output
    lives in a copy's storage (a write that happened to leave the values as they were)."""
    storages = {
        t.untyped_storage().data_ptr()
        for t in torch.utils._pytree.tree_leaves(outputs)
        if isinstance(t, torch.Tensor)
    }

    def value(pair: tuple, key: Any) -> torch.Tensor:
        return pair[0][key] if isinstance(key, int) else pair[1][key]

    return frozenset(
        key
        for key in keys
        if value(copies, key).untyped_storage().data_ptr() in storages
        or not torch.equal(value(originals, key), value(copies, key))
        and not torch.allclose(value(originals, key), value(copies, key), 0, 0, equal_nan=True)
    )


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What decides whether dynamo compiles again: each tensor's shape, strides, dtype
    and device, each scalar's value, the type of anything else (a miss only means a
    call that sets the recipe's options again). Computed on every call: a compiled
    small model runs in tens of microseconds, so it is kept to plain loops."""
    key = tuple(map(_key, args))
    if kwargs:
        key += tuple((name, _key(value)) for name, value in sorted(kwargs.items()))
    return key


def _key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype, value.device)
    if isinstance(value, (int, float, bool, str, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(map(_key, value)))
    return type(value)


@contextmanager
def _options_set(options: Mapping[str, Any]) -> Iterator[None]:
    """Inductor's config ``options`` set for the block and restored after it. Only
    the keys whose value differs are touched: a compiled small model runs in tens
    of microseconds, and ``inductor_config.patch`` took about 16 of them per call."""
    import torch._inductor.config as inductor_config

    changed = {}
    for key, value in options.items():
        current = getattr(inductor_config, key)
        if current != value:
            changed[key] = current
            setattr(inductor_config, key, value)
    try:
        yield
    finally:
        for key, value in changed.items():
            setattr(inductor_config, key, value)


def _path_and_backend(model: Any) -> tuple[str, str]:
    """("fx" or "pt2e", the backend) of a model qcore prepared; a clear error otherwise."""
    from qcore.engine.explain import report_of
    from qcore.engine.prepare import STATE_KEY
    from qcore.pt2e.prepare import PT2E_STATE_KEY

    meta = getattr(model, "meta", {}) if isinstance(model, GraphModule) else {}
    if STATE_KEY in meta:
        return "fx", meta[STATE_KEY].backend_name
    if PT2E_STATE_KEY not in meta and report_of(model) is not None:
        raise TypeError(
            f"model: got {describe(model)}, a model qcore already converted; qcore.compile "
            "takes the calibrated model before convert (it converts it itself, to the form "
            "the compiler's int8 passes match): pass the model prepare_fx or prepare_pt2e "
            "returned, after calibration"
        )
    if PT2E_STATE_KEY not in meta:
        raise TypeError(
            f"model: got {describe(model)}; expected a calibrated model returned by "
            "qcore.prepare_fx, prepare_qat_fx, prepare_pt2e or prepare_qat_pt2e "
            "(qcore.compile converts it)"
        )
    state = meta[PT2E_STATE_KEY]
    if state.foreign:
        raise ValueError(
            f"model: prepared with a torchao Quantizer ({state.backend_name}), which names "
            "no backend to ask for a compile recipe; convert it with "
            "qcore.convert_pt2e(prepared, lower=False) and torch.compile it yourself"
        )
    return "pt2e", state.backend_name


def _reference_form(model: GraphModule, path: str) -> GraphModule:
    """The reference form compilers match: int8 weights behind quantized_decomposed
    dequantize ops (the FX form's reference modules are rewritten into that)."""
    import qcore
    from qcore.engine.compile_traps import float_weights_where_padding_only
    from qcore.engine.decomposed import weights_in_graph
    from qcore.pt2e.qdq import duplicate_dequantize

    if path == "pt2e":
        reference = qcore.convert_pt2e(model, lower=False)
    else:
        reference = qcore.convert_to_reference_fx(model)
        weights_in_graph(reference)
        # as PT2E's reference form (and torchao's) has it; FX nodes carry no annotations
        duplicate_dequantize(reference, annotated_users_only=False)
    float_weights_where_padding_only(reference)  # out of reach of oneDNN's int8 conv
    return reference


def _with_concatenated_linears(reference: GraphModule) -> GraphModule | None:
    """A twin of ``reference`` whose sibling linears are merged (its tensors shared,
    its graph its own), or None where none are: ``reference`` stays the unmerged
    form the first call is checked against."""
    with warnings.catch_warnings():
        # copying an exported graph's pytree codegen: torch's own deprecation notice
        warnings.simplefilter("ignore", FutureWarning)
        twin = GraphModule(reference, copy.deepcopy(reference.graph))
    return twin if concat_sibling_linears(twin) else None


def _backend_recipe(backend_name: str, mode: str) -> CompileRecipe | None:
    try:
        backend = get_backend(backend_name)
    except UnknownBackendError:  # a BackendConfig of a name no plugin serves
        return None
    return backend.compile_recipe(mode)


def compile(  # noqa: A001
    model: GraphModule, *, mode: str = "default", recipe: CompileRecipe | None = None
) -> torch.nn.Module:
    """Convert a calibrated prepared model and run it as its backend runs fastest.

    ``model`` comes from ``prepare_fx``/``prepare_pt2e`` (or their QAT forms),
    after calibration or training; it is not changed. The backend's plugins are asked
    for a :class:`qcore.CompileRecipe` for ``mode`` (``recipe=`` overrides them).
    ``mode`` is named as ``torch.compile``'s: ``"default"`` keeps compile time close
    to torchao's own recipe; ``"reduce-overhead"`` takes a longer compile for less
    time per call (x86: Inductor's C++ wrapper, several seconds more to compile,
    15-30% less latency on small models; benchmarks/PT2E.md). With one, the
    result is a :class:`CompiledModel`: the reference form under ``torch.compile``,
    compiled on its first call for the shapes it gets. Without one (qnnpack,
    fbgemm, native), the result is the model lowered to the backend's eager kernels.

    Example::

        >>> fast = qcore.compile(prepared)            # x86: Inductor, frozen int8 weights
        >>> fast(*example_inputs)
        >>> qcore.explain(fast).backend
        'x86'
        >>> faster = qcore.compile(prepared, mode="reduce-overhead")  # + C++ wrapper
    """
    import qcore

    path, backend_name = _path_and_backend(model)
    check_compile_mode(mode)
    if recipe is not None and not isinstance(recipe, CompileRecipe):
        raise TypeError(f"recipe: got {describe(recipe)}; expected a qcore.CompileRecipe or None")
    if recipe is not None and mode != "default":
        raise ValueError(
            f"mode: got {mode!r} with recipe={recipe.describe()}; a recipe fixes the "
            "compiler's options itself: give mode or recipe, not both"
        )
    if recipe is None:
        recipe = _backend_recipe(backend_name, mode)
    if recipe is None:
        return qcore.convert_fx(model) if path == "fx" else qcore.convert_pt2e(model, lower=True)
    reference = _reference_form(model, path)
    compiled_form = _with_concatenated_linears(reference) if recipe.concat_linears else None
    return CompiledModel(reference, recipe, backend_name, compiled_form)
