"""The traced graph against the model's own forward, on the example inputs.

A quantized model is made from the traced graph, so it can be no closer to the
model than that graph is. torch.fx records ``a += b`` as ``a + b`` (a Proxy has no
``__iadd__``): a view of ``a`` taken before it then misses the write, and the
traced *float* graph is already wrong, 1.87 off on a range of 1.99 on a
four-conv test (torch.ao's int8 model of it too, silently). :func:`probe` runs
both on copies of the example inputs (random ops drawing the same numbers), and
:func:`warn_if_unfaithful` names the first output and the first module whose
values differ. The same run records where each value lives, which tells the
in-place pass (:mod:`qcore.engine.in_place`) which nodes are views, and each
node's shape and dtype, as ``ShapeProp`` would (prepare's probe reads them).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils._pytree import tree_flatten, tree_map

from qcore.config.errors import QCoreWarning, caller_stacklevel
from qcore.engine.in_place import ProbedStorages

__all__ = ["Probe", "cloned", "probe", "record_shapes", "warn_if_unfaithful"]

_SEED = 0


@dataclass(frozen=True)
class Probe:
    """One run of the model's forward and of its traced graph on the same inputs."""

    storages: ProbedStorages
    eager_output: Any
    traced_output: Any


def _storages(value: Any) -> frozenset[int]:
    if isinstance(value, torch.Tensor):  # most nodes: no pytree walk
        pointer = value.untyped_storage().data_ptr() if value.layout == torch.strided else 0
        return frozenset((pointer,)) if pointer else frozenset()
    leaves, _ = tree_flatten(value)
    found = set()
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
            pointer = leaf.untyped_storage().data_ptr()
            if pointer:
                found.add(pointer)
    return frozenset(found)


class _RecordingInterpreter(Interpreter):
    """Records where each node's result lives (and, asked to, each module's outputs)."""

    def __init__(self, gm: GraphModule, *, keep_module_outputs: bool = False) -> None:
        super().__init__(gm)
        self.storages: dict[Node, frozenset[int]] = {}
        self.tensors: set[Node] = set()
        self.returns_input: set[Node] = set()
        self.module_outputs: dict[str, list[Any]] | None = {} if keep_module_outputs else None

    def run_node(self, node: Node) -> Any:
        result = super().run_node(node)
        _record_shapes(node, result)
        # read now: the node's first argument is alive, so no fresh tensor can sit
        # in its memory (values are freed after their last use)
        self.storages[node] = _storages(result)
        if isinstance(result, torch.Tensor):
            self.tensors.add(node)
        if node.op == "call_module":
            first = node.args[0] if node.args and isinstance(node.args[0], Node) else None
            if first is not None and result is self.env.get(first):
                self.returns_input.add(node)
            if self.module_outputs is not None:
                self.module_outputs.setdefault(node.target, []).append(cloned(result))
        return result


def _record_shapes(node: Node, result: Any) -> None:
    """What ``ShapeProp`` records (prepare reads it instead of probing again)."""
    found = False

    def tensor_meta(value: Any) -> Any:
        nonlocal found
        if isinstance(value, torch.Tensor):
            found = True
            return _extract_tensor_metadata(value)
        return value

    meta = map_aggregate(result, tensor_meta)
    if found:
        node.meta["tensor_meta"] = meta
    node.meta["type"] = type(result)


class _ShapeRecorder(Interpreter):
    def run_node(self, node: Node) -> Any:
        result = super().run_node(node)
        _record_shapes(node, result)
        return result


def record_shapes(gm: GraphModule, *inputs: Any) -> None:
    """Run ``gm`` and record each node's shape and dtype, as ``ShapeProp`` does, without
    its printing a traceback to stderr where the run fails (the error is raised)."""
    _ShapeRecorder(gm).run(*inputs)


def cloned(value: Any) -> Any:
    """``value`` with every tensor in it detached and copied: a run on it, or a record
    of it, shares no memory with the caller's tensors or the model's."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, value)


@contextlib.contextmanager
def _leaving_no_trace(gm: GraphModule) -> Iterator[Callable[[], None]]:
    """No autograd, the global RNG as before where ``gm`` may draw from it, and
    ``gm``'s buffers (batch-norm statistics in training mode, a running sum the
    forward updates; the eager module shares them) as before, once the block ends.
    Yields a function putting the buffers back, for the run after the first: the
    traced graph must start from the state the eager run started from."""
    buffers = {name: buffer.clone() for name, buffer in gm.named_buffers()}

    def rewind() -> None:
        with torch.no_grad():
            for name, buffer in gm.named_buffers():
                if name in buffers and buffer.shape == buffers[name].shape:
                    buffer.copy_(buffers[name])

    rng = torch.random.fork_rng(devices=[]) if _may_draw(gm) else contextlib.nullcontext()
    try:
        with torch.no_grad(), rng:
            yield rewind
    finally:
        rewind()


def _seeded_run(gm: GraphModule, function: Callable[..., Any], inputs: tuple) -> Any:
    """``function`` on copies of ``inputs``, its random ops drawing the same numbers as
    every other seeded run's. The seed is process-wide (another thread drawing then
    gets the same numbers again): only a graph that may draw sets it."""
    if _may_draw(gm):
        torch.manual_seed(_SEED)
    return function(*cloned(inputs))


#: What draws random numbers in a traced graph, by function or method name.
_DRAWS = frozenset(
    "rand randn randint rand_like randn_like randint_like randperm bernoulli bernoulli_ "
    "multinomial normal normal_ poisson rrelu rrelu_ uniform_ random_ exponential_ "
    "cauchy_ log_normal_ geometric_".split()
)


def _may_draw(gm: GraphModule) -> bool:
    """Whether running ``gm`` may draw from torch's RNG: an op drawing by name, a
    dropout not fixed to eval, or a module outside torch.nn (its code is unseen)."""
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = modules[node.target]
            if not type(module).__module__.startswith("torch.") or (
                module.training and isinstance(module, _DROPOUT_MODULES)
            ):
                return True
        elif node.op in ("call_function", "call_method"):
            name = node.target if isinstance(node.target, str) else _name(node.target)
            if name in _DRAWS or ("dropout" in name and _training_argument(node)):
                return True
    return False


_DROPOUT_MODULES = (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU)


def _name(function: Any) -> str:
    return getattr(function, "__name__", str(function))


def _training_argument(node: Node) -> bool:
    """A functional dropout's ``training`` (default True), unless traced as False."""
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return training is not False


def probe(gm: GraphModule, eager: torch.nn.Module, example_inputs: tuple) -> Probe | None:
    """Run ``eager`` (the module ``gm`` was traced from, sharing its submodules) and
    ``gm`` on copies of ``example_inputs``; None if either fails to run."""
    recorder = _RecordingInterpreter(gm)
    try:
        with _leaving_no_trace(gm) as rewind:
            eager_output = _seeded_run(gm, eager, example_inputs)
            rewind()
            traced_output = _seeded_run(gm, recorder.run, example_inputs)
    except Exception:  # noqa: BLE001 - the user's forward: prepare's own probe says why
        return None
    storages = ProbedStorages(
        recorder.storages, frozenset(recorder.tensors), frozenset(recorder.returns_input)
    )
    return Probe(storages, eager_output, traced_output)


def _difference(traced: Any, eager: Any) -> tuple[float, float] | None:
    """(largest difference, largest eager magnitude) where two outputs differ beyond
    float rounding, else None."""
    if not (isinstance(traced, torch.Tensor) and isinstance(eager, torch.Tensor)):
        return None
    if not (traced.is_floating_point() and eager.is_floating_point()):
        return None if torch.equal(traced, eager) else (float("inf"), 0.0)
    if traced.shape != eager.shape:
        return (float("inf"), 0.0)
    scale = float(eager.abs().nan_to_num(0.0, 0.0, 0.0).max()) if eager.numel() else 0.0
    if torch.allclose(traced, eager, rtol=1e-4, atol=1e-5 * max(scale, 1.0), equal_nan=True):
        return None
    return float((traced - eager).abs().nan_to_num(float("inf")).max()), scale


def _first_differing_module(gm: GraphModule, eager: torch.nn.Module, inputs: tuple) -> str | None:
    """The first leaf module (in graph order) whose output differs between the runs,
    found by running both again (only once a difference is known)."""
    recorded: dict[str, list[Any]] = {}
    recorder = _RecordingInterpreter(gm, keep_module_outputs=True)

    def keep(name: str) -> Any:
        return lambda _, __, out: recorded.setdefault(name, []).append(cloned(out))

    called = {node.target for node in gm.graph.nodes if node.op == "call_module"}
    try:
        with _leaving_no_trace(gm) as rewind:
            # the hooks sit on modules the traced graph calls too: off before it runs
            handles = [
                eager.get_submodule(name).register_forward_hook(keep(name)) for name in called
            ]
            try:
                _seeded_run(gm, eager, inputs)
            finally:
                for handle in handles:
                    handle.remove()
            rewind()
            _seeded_run(gm, recorder.run, inputs)
    except Exception:  # noqa: BLE001 - they ran once already; nothing more to learn
        return None
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        index = calls[node.target] = calls.get(node.target, -1) + 1
        mine = recorder.module_outputs[node.target][index]
        theirs = recorded.get(node.target, [])
        if index >= len(theirs):
            return node.target
        pairs = zip(tree_flatten(mine)[0], tree_flatten(theirs[index])[0], strict=False)
        if any(_difference(a, b) is not None for a, b in pairs):
            return node.target
    return None


def warn_if_unfaithful(
    gm: GraphModule,
    eager: torch.nn.Module,
    probed: Probe,
    example_inputs: tuple,
    *,
    hooked: bool = False,
) -> None:
    """A QCoreWarning naming the first output, and the first leaf module, where the
    traced graph's values differ from the model's forward on the example inputs
    (``hooked``: the model has forward hooks, the likeliest cause)."""
    traced, _ = tree_flatten(probed.traced_output)
    expected, _ = tree_flatten(probed.eager_output)
    if len(traced) != len(expected):
        return
    for index, (mine, theirs) in enumerate(zip(traced, expected, strict=True)):
        found = _difference(mine, theirs)
        if found is None:
            continue
        module = _first_differing_module(gm, eager, example_inputs)
        where = (
            f"; the first module whose output differs is {module!r}, so the difference "
            "arises in the code that feeds it"
            if module
            else ""
        )
        hooks = (
            " The model has forward hooks (named in the warning before), which the traced "
            "graph does not run: the likeliest cause."
            if hooked
            else ""
        )
        warnings.warn(
            f"prepare: the traced graph does not compute what the model's forward does on "
            f"the example inputs: output {index} differs by up to {found[0]:.3g} (values "
            f"reach {found[1]:.3g}){where}. The quantized model is made from the traced "
            f"graph and would carry the difference.{hooks} torch.fx traces an augmented assignment "
            "on a tensor (a += b) as a + b, so a view of a taken before it misses the write: "
            "write a.add_(b), which keeps the meaning and which qcore follows. It also "
            "freezes Python values (flags, random draws outside torch) at their traced "
            "values. Or keep the code in float with "
            "prepare_custom_config={'non_traceable_module_name': [...]}.",
            QCoreWarning,
            stacklevel=caller_stacklevel(),
        )
        return
