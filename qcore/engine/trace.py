"""Symbolic tracing for quantization, on a copy of the user's model.

Modules from torch.nn and torch.ao.nn stay leaves (call_module nodes), as do
the modules ``prepare_custom_config`` marks non-traceable and its custom module
classes. A model that cannot be traced gets an error naming the innermost
module whose forward failed.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Iterable

import torch
from torch.fx import GraphModule, Tracer

from qcore.config.errors import describe
from qcore.engine.custom_config import CustomConfig, as_custom_config
from qcore.engine.fidelity import probe, warn_if_unfaithful
from qcore.engine.hooks import hooked_modules, warn_of_hooks
from qcore.engine.in_place import make_traced_writes_visible

__all__ = [
    "CustomConfig",
    "TraceFailure",
    "as_custom_config",
    "copy_modes",
    "delete_unused_submodules",
    "modes_of",
    "set_modes",
    "trace",
]


class TraceFailure(RuntimeError):
    """symbolic tracing could not follow a module's forward; ``module_name`` is the
    innermost module whose forward failed, where one is known."""

    def __init__(self, message: str, module_name: str | None = None) -> None:
        super().__init__(message)
        self.module_name = module_name


class QuantizationTracer(Tracer):
    def __init__(self, skipped_names: Iterable[str], skipped_classes: Iterable[type]) -> None:
        super().__init__()
        # Each node keeps the line of the user's forward it came from, through
        # convert and lowering, so an error or a profile points at the user's code.
        self.record_stack_traces = True
        self.skipped_names = set(skipped_names)
        self.skipped_classes = tuple(skipped_classes)

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        if qualified_name in self.skipped_names or isinstance(module, self.skipped_classes):
            return True
        if module.__module__.startswith(("torch.nn", "torch.ao.nn")):
            return not isinstance(module, torch.nn.Sequential)
        return False


def _failing_module_name(model: torch.nn.Module, error: BaseException) -> tuple[str, type] | None:
    names = {id(module): name for name, module in model.named_modules()}
    found = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, torch.nn.Module) and id(candidate) in names:
            found = (names[id(candidate)] or "<root>", type(candidate))
    return found


def _without_float_functional_identities(model: torch.nn.Module) -> None:
    """torch.ao's FloatFunctional ends each op in an ``activation_post_process``
    Identity, which traced as an op of its own and got observers of its own. Its
    FX twin (torch.ao's own choice for FX) computes the same without it."""
    float_functional = torch.ao.nn.quantized.FloatFunctional
    fx_float_functional = torch.ao.nn.quantized.FXFloatFunctional
    for name, module in list(model.named_modules()):
        if type(module) is float_functional and name:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, fx_float_functional())


def trace(
    model: torch.nn.Module, custom_config: CustomConfig, example_inputs: tuple | None = None
) -> GraphModule:
    """Trace a deep copy of ``model``; the user's model is never touched.

    In-place writes are made visible to every later read (:mod:`qcore.engine.in_place`).
    Given example inputs, the traced graph is run against the copy's own forward, and
    a difference is warned about (:mod:`qcore.engine.fidelity`)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: got {describe(model)}; expected a torch.nn.Module")
    model = copy.deepcopy(model)
    _without_float_functional_identities(model)
    tracer = QuantizationTracer(custom_config.leaf_names, custom_config.leaf_classes)
    try:
        graph = tracer.trace(model)
    except Exception as error:
        where = _failing_module_name(model, error)
        if where is None:
            raise TraceFailure(
                f"symbolic tracing failed: {type(error).__name__}: {error}"
            ) from error
        name, cls = where
        raise TraceFailure(
            f"symbolic tracing failed in module {name!r} ({cls.__name__}): "
            f"{type(error).__name__}: {error}. Leave it unquantized and traced as a leaf with "
            f"prepare_custom_config={{'non_traceable_module_name': [{name!r}]}} "
            f"or {{'non_traceable_module_class': [{cls.__name__}]}}",
            name,
        ) from error
    gm = GraphModule(tracer.root, graph, type(model).__name__)
    copy_modes(tracer.root, gm)  # torch.fx makes the containers on a path anew
    hooked = hooked_modules(model)
    warn_of_hooks(hooked, {node.target for node in graph.find_nodes(op="call_module")})
    probed = probe(gm, tracer.root, example_inputs) if example_inputs is not None else None
    make_traced_writes_visible(gm, probed.storages if probed else None)
    if probed is not None:
        warn_if_unfaithful(gm, tracer.root, probed, example_inputs, hooked=bool(hooked))
    return gm


def modes_of(model: torch.nn.Module) -> dict[str, bool]:
    """Each module's train/eval mode, by name ("" is ``model``)."""
    return {name: module.training for name, module in model.named_modules()}


def set_modes(model: torch.nn.Module, modes: dict[str, bool]) -> None:
    """The modes :func:`modes_of` read, module by module, as torch.ao's convert
    keeps them: a frozen batch norm in a training model stays frozen. Modules
    ``modes`` does not name (kernels, fused modules) follow the top level."""
    model.train(modes[""])
    for name, module in model.named_modules():
        if name in modes:
            module.training = modes[name]


def copy_modes(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``source``'s modes on ``target`` (:func:`set_modes`); the two may share modules."""
    set_modes(target, modes_of(source))


def delete_unused_submodules(gm: GraphModule) -> None:
    """``GraphModule.delete_all_unused_submodules`` in linear time.

    torch's version checks each module name against a list of used names, which
    is quadratic in the number of modules (0.15 s per call at 1600 blocks).
    """
    used: set[str] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        parts = node.target.split(".")
        used.update(".".join(parts[: i + 1]) for i in range(len(parts)))
        if node.op == "call_module":
            try:
                module = gm.get_submodule(node.target)
            except AttributeError:
                continue
            used.update(f"{node.target}.{name}" for name, _ in module.named_modules() if name)
    # remove_duplicate=False: a shared observer lives under several names, and each
    # unused name must go (the deduplicated walk sees only the first).
    names = {name for name, _ in gm.named_modules(remove_duplicate=False) if name}
    for name in names - used:
        gm.delete_submodule(name)  # False, not an error, where its parent went first
