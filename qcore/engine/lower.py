"""Lowering: the backend's kernels replace the reference patterns they support.

The reference graph marks every quantized edge with ``quantize -> dequantize``
(``qcore.ops``, plain integer tensors). Walking it in order, each op whose
inputs come through such a pair (or through a dynamic fake-quantize, or which
is a ``ReferenceModule``) is offered to the backend's kernels. A kernel whose
pattern matches (a module class, a function, a method name, or a forward chain
of them like ``add -> relu``) gets a :class:`~qcore.plugin.kernels.KernelMatch`
and returns a module or :class:`~qcore.plugin.kernels.SameOp`.

The lowered op then takes torch quantized tensors: its input is quantized once
(``torch.quantize_per_tensor``) or taken straight from a preceding kernel with
the same qparams, so between consecutive kernels the data stays int8. Its
float users get one ``dequantize``, which dead-code elimination drops when
every user is a kernel. What no kernel takes stays in reference form, and
explain says why.
"""

from __future__ import annotations

import operator
import warnings
from collections import Counter
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from qcore import ops
from qcore.config.errors import QCoreWarning, caller_stacklevel
from qcore.engine.explain import (
    POST_OPS_KEY,
    UNLOWERABLE_KEY,
    Entry,
    Report,
    Status,
    attach_report,
    report_of,
)
from qcore.engine.float_islands import float_input_reason
from qcore.engine.in_place import eliminate_dead_code_keeping_state_writes
from qcore.engine.kernel_check import (
    OUTPUT_QPARAMS_KEY,
    is_tested,
    recorded,
    sample_input,
    wrong_output,
)
from qcore.engine.reference import ReferenceModule
from qcore.kernels.runtime import (
    EXACT_ENGINE,
    PAIR_SUMS_OVERFLOW,
    TORCH_QUANTIZED_DTYPE,
    pair_sums_overflow_here,
    quiet_quantized_tensors,
)
from qcore.plugin.isolation import call_isolated
from qcore.plugin.kernels import (
    ActivationQParams,
    DynamicInput,
    KernelMatch,
    KernelUnavailable,
    SameOp,
)

__all__ = ["lower", "quantize_float32"]

_8BIT = {torch.quint8: (0, 255), torch.qint8: (-128, 127)}
_SKIPPED_FUNCTIONS = (
    ops.quantize_per_tensor,
    ops.dequantize_per_tensor,
    ops.quantize_per_channel,
    ops.dequantize_per_channel,
    ops.fake_quantize_dynamic,
    operator.getitem,
    getattr,
)


_PREPARE_STATE_KEYS = ("qcore_state", "qcore_pt2e_state")

# The qparams of torch's fixed-qparams ops' quint8 outputs (sigmoid, hardsigmoid,
# softmax: [0, 1); tanh: [-1, 1)): always the whole 0..255.
_FIXED_QPARAMS = ((1.0 / 256, 0), (2.0 / 256, 128))
ON_EXACT_ENGINE = f"runs on {EXACT_ENGINE}'s kernel: {PAIR_SUMS_OVERFLOW}"
SATURATING_SUMS = (
    "left in reference form: its input uses all 8 bits, this CPU sums pairs of int8 "
    f"products in 16 bits (no VNNI), which its weights overflow, and {EXACT_ENGINE} "
    "cannot run this kernel"
)


class _Refused(Exception):
    """A kernel cannot take this match; the message is explain's reason. A kernel
    that matched and says it does not exist on its engine (``KernelUnavailable``:
    qnnpack has no fp16 linear) is the reason a user needs first, before the
    refusals of kernels for other forms of the pattern."""

    def __init__(self, message: str, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


def _is_call(node: Any, function: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is function


def _qparams(node: Node) -> ActivationQParams:
    """The qparams of a qcore quantize/dequantize node, checked to be torch's 8-bit ones."""
    _, scale, zero_point, quant_min, quant_max, dtype = node.args
    if isinstance(scale, Node) or isinstance(zero_point, Node):
        raise _Refused("its qparams are not constants")
    torch_dtype = TORCH_QUANTIZED_DTYPE.get(dtype)
    if torch_dtype not in _8BIT:
        raise _Refused(f"torch's int8 kernels take 8-bit activations, not {dtype}")
    full_range = _8BIT[torch_dtype]
    quant_range = None if (quant_min, quant_max) == full_range else (quant_min, quant_max)
    return ActivationQParams(float(scale), int(zero_point), torch_dtype, quant_range)


def _check_output_range(output: ActivationQParams | None, honored: bool) -> None:
    if output is not None and output.quant_range is not None and not honored:
        low, high = output.quant_range
        raise _Refused(
            f"output range [{low}, {high}] is narrower than {output.dtype}'s; "
            "torch's int8 ops clamp to the full range"
        )


def _element_matches(element: Any, node: Node, modules: dict) -> bool:
    if isinstance(element, type):
        if node.op != "call_module":
            return False
        module = modules.get(node.target)
        kind = module.original_type if isinstance(module, ReferenceModule) else type(module)
        return kind is element
    if isinstance(element, str):
        return node.op == "call_method" and node.target == element
    return node.op == "call_function" and node.target is element


def _match_chain(chain: tuple, root: Node, modules: dict) -> list[Node] | None:
    """The nodes matching ``chain`` (forward order) from ``root``, each feeding the next."""
    if not _element_matches(chain[0], root, modules):
        return None
    nodes = [root]
    for element in chain[1:]:
        users = list(nodes[-1].users)
        if len(users) != 1 or not _element_matches(element, users[0], modules):
            return None
        following = users[0]
        others = [n for n in following.all_input_nodes if n is not nodes[-1]]
        if others or not following.args or following.args[0] is not nodes[-1]:
            return None
        nodes.append(following)
    return nodes


def _operands(node: Node) -> list[Node]:
    """The nodes ``node`` takes, in argument order, once per use: ``x + x`` has two
    operands (``all_input_nodes`` would give one)."""
    found: list[Node] = []
    map_arg((node.args, node.kwargs), found.append)
    return found


_SHAPE_ATTRIBUTES = ("shape", "ndim")
_SHAPE_METHODS = ("size", "dim", "numel")


def _is_shape_query(user: Node, tensor: Node) -> bool:
    """``tensor.shape``/``.ndim``/``.size()``/``.dim()``/``.numel()``: the same on int8."""
    if user.op == "call_function" and user.target is getattr:
        return user.args[0] is tensor and user.args[1] in _SHAPE_ATTRIBUTES
    if user.op == "call_method" and user.target in _SHAPE_METHODS:
        return user.args[0] is tensor and all(a is not tensor for a in user.args[1:])
    return False


def _check_activation_dtypes(kernel: Any, match: KernelMatch) -> None:
    """Refuse a match whose quantized activations the kernel does not take."""
    accepted = {ops.storage_dtype(dtype) for dtype in getattr(kernel, "activation_dtypes", ())}
    if not accepted:
        return
    boundary = [("input", q) for q in match.inputs] + [("output", match.output)]
    for where, qparams in boundary:
        if qparams is not None and ops.storage_dtype(qparams.dtype) not in accepted:
            names = ", ".join(
                sorted(str(d).removeprefix("torch.") for d in kernel.activation_dtypes)
            )
            raise _Refused(
                f"its {where} is {str(qparams.dtype).removeprefix('torch.')}; the kernel takes "
                f"{names} activations only"
            )


def _passes_7_bits(activation: Any) -> bool:
    """Whether the observers ``activation`` builds quantize over more than 0..127."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's notice on reduce_range
            observer = activation()
    except Exception:  # noqa: BLE001 - an observer that needs arguments: cannot tell
        return False
    low, high = getattr(observer, "quant_min", None), getattr(observer, "quant_max", None)
    return isinstance(low, int) and isinstance(high, int) and high - low > 127


class _Lowering:
    def __init__(
        self, gm: GraphModule, kernels: tuple, backend: str, observed_ranges: bool = False
    ) -> None:
        self.gm, self.graph, self.kernels, self.backend = gm, gm.graph, kernels, backend
        self.observed_ranges = observed_ranges
        self.modules = dict(gm.named_modules(remove_duplicate=False))
        self._calls_per_module = Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
        # float node (a dequantize qcore inserted) -> (quantized node, its qparams)
        self.float_of: dict[Node, tuple[Node, ActivationQParams]] = {}
        self.quantized: dict[tuple, Node] = {}  # (float node, qparams) -> quantize node
        self.inserted: set[Node] = set()
        self.buffers: list[str] = []  # the buffers lowering registered, by name
        # Only what the backend's config quantized is lowered; float ops stay float.
        self.quantized_ops = {e.node for e in report_of(gm).reference}
        self.lowered: dict[str, str] = {}  # node name -> kernel name
        self.fused_into: dict[str, str] = {}  # erased chain node name -> its root's name
        self.unlowered: dict[str, str] = {}  # node name -> reason
        self.notes: dict[str, str] = {}  # lowered node name -> what explain should say
        self.faulty: list[str] = []  # untested kernels refused on their trial run
        state = gm.meta.get("qcore_state")
        self.accepted = {a.root_name: a for a in getattr(state, "accepted", ())}
        # id of a QConfig's activation constructor -> (it, whether its range passes 7 bits)
        self._wide_activation: dict[int, tuple[Any, bool]] = {}

    # ------------------------------------------------------------------ walking

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.graph is not self.graph or node in self.inserted:
                continue  # erased as part of a fused chain, or inserted by lowering
            if node.op not in ("call_module", "call_function", "call_method"):
                continue
            if node.op == "call_function" and node.target in _SKIPPED_FUNCTIONS:
                continue
            if self._is_candidate(node):
                self._lower_node(node)

    def _is_quantized_input(self, node: Any) -> bool:
        return node in self.float_of or _is_call(node, ops.dequantize_per_tensor)

    def _is_candidate(self, node: Node) -> bool:
        if node.name not in self.quantized_ops:
            return False
        if node.op == "call_module" and isinstance(self.modules.get(node.target), ReferenceModule):
            return True
        return any(
            self._is_quantized_input(n) or _is_call(n, ops.fake_quantize_dynamic)
            for n in node.all_input_nodes
        )

    def _lower_node(self, node: Node) -> None:
        reasons = []
        for kernel in self.kernels:
            if kernel.lower is None:
                continue
            chain = _match_chain(kernel.chain, node, self.modules)
            if chain is None:
                continue
            try:
                self._apply(kernel, chain)
            except _Refused as refused:
                reasons.append((not refused.unavailable, f"kernel {kernel.name}: {refused}"))
                continue
            for matched in chain:
                self.lowered[matched.name] = kernel.name
                self.unlowered.pop(matched.name, None)
                if matched is not node:
                    self.fused_into[matched.name] = node.name
            return
        if reasons:
            reasons.sort(key=lambda reason: reason[0])  # stable: the kernels' order otherwise
            text = "; ".join(reason for _, reason in reasons)
            self.unlowered[node.name] = text + " (left in reference form)"

    # ------------------------------------------------------------------ one match

    def _describe(self, kernel: Any, chain: list[Node]) -> tuple[KernelMatch, Node | None]:
        root, last = chain[0], chain[-1]
        inputs, dynamic, float_inputs = [], [], 0
        for arg in _operands(root):
            if arg in self.float_of:
                inputs.append(self.float_of[arg][1])
            elif _is_call(arg, ops.dequantize_per_tensor):
                inputs.append(_qparams(arg))
            elif _is_call(arg, ops.fake_quantize_dynamic):
                _, quant_min, quant_max, dtype = arg.args
                dynamic.append(DynamicInput(int(quant_min), int(quant_max), dtype))
            elif "tensor_meta" in arg.meta:  # a float tensor (not a size or other value)
                float_inputs += 1
        if any(n.name not in self.quantized_ops for n in chain):
            raise _Refused("part of the pattern is left in float by the backend's config")
        users = list(last.users)
        quantize = (
            users[0] if len(users) == 1 and _is_call(users[0], ops.quantize_per_tensor) else None
        )
        if quantize is None and any(_is_call(u, ops.quantize_per_tensor) for u in users):
            raise _Refused("its output is used both quantized and in float")
        if quantize is not None and not all(
            _is_call(u, ops.dequantize_per_tensor) for u in quantize.users
        ):
            raise _Refused("its quantized output is used other than dequantized")
        output = _qparams(quantize) if quantize is not None else None
        modules = tuple(
            self.modules.get(n.target) if n.op == "call_module" else None for n in chain
        )
        match = KernelMatch(
            nodes=tuple(chain),
            modules=modules,
            inputs=tuple(inputs),
            output=output,
            dynamic=tuple(dynamic),
            float_inputs=float_inputs,
            engine=kernel.engine,
        )
        return match, quantize

    def _apply(self, kernel: Any, chain: list[Node]) -> None:
        match, quantize = self._describe(kernel, chain)
        _check_activation_dtypes(kernel, match)
        # A kernel that cannot take this instance leaves it as is; one raising
        # SystemExit too: a plugin never ends the user's process.
        result, error = call_isolated(lambda: kernel.lower(match))
        if error is not None:
            raise _Refused(_refusal(error), isinstance(error, KernelUnavailable)) from error
        root = chain[0]
        if isinstance(result, SameOp):
            if len(chain) != 1 or quantize is None:
                raise _Refused("SameOp needs one op with a quantized output")
            _check_output_range(match.output, honored=result.produces == match.output)
            self._wire_inputs(root)
            produced = root
            if result.produces != match.output:
                produced = self._requantize(root, match.output)
            self._publish(produced, quantize, match.output)
            return
        if not isinstance(result, torch.nn.Module):
            raise _Refused(f"lower returned {type(result).__name__}, not a module or SameOp")
        returns_quantized = getattr(result, "returns_quantized", True)
        if returns_quantized and quantize is None:
            raise _Refused("the kernel returns int8 but the reference keeps the output float")
        _check_output_range(match.output, getattr(result, "honors_quant_range", False))
        if not is_tested(kernel):
            self._try_once(kernel, result, match, returns_quantized)
        if getattr(result, "sums_uint8_products", False):
            result.input_max = self._input_max(match, root)
        if pair_sums_overflow_here(result):
            if not result.can_move_to(EXACT_ENGINE):
                raise _Refused(SATURATING_SUMS)
            result.move_to(EXACT_ENGINE)
            self.notes[root.name] = ON_EXACT_ENGINE
        note = result.__dict__.pop("lowering_note", "")  # what the kernel chose, and why
        if note:
            self.notes[root.name] = note
        self._install(root, result)
        self._collapse(chain)
        self._wire_inputs(root)
        if returns_quantized:
            root.meta[OUTPUT_QPARAMS_KEY] = match.output  # what `qcore check` holds it to
            self._publish(root, quantize, match.output)

    def _try_once(
        self, kernel: Any, module: torch.nn.Module, match: KernelMatch, returns_quantized: bool
    ) -> None:
        """Run a kernel qcore does not test on inputs of the recorded shapes; refuse
        it unless its output has the recorded shape and promised kind, and an int8
        output the recorded dtype and qparams (:mod:`qcore.engine.kernel_check`)."""
        expected = recorded(match.nodes[-1], self.gm, example_sizes=True)
        call = self._sample_call(match.root)
        if expected is None or call is None:
            return  # a size or other value with no recorded shape: nothing to try
        args, kwargs = call

        def problem_of_one_run() -> str | None:
            with torch.no_grad():
                output = module(*args, **kwargs)
            return wrong_output(output, expected[0], returns_quantized, match.output)

        problem, error = call_isolated(problem_of_one_run)  # SystemExit too
        if error is not None:
            problem = f"it raised {type(error).__name__} on inputs of the recorded shapes: {error}"
        if problem is not None:
            self.faulty.append(f"{match.root.name} ({kernel.name}): {problem}")
            raise _Refused(problem)

    def _sample_call(self, root: Node) -> tuple[tuple, dict] | None:
        """The root's arguments as sample values, or None where one has no recorded shape."""
        unknown: list[Node] = []

        def sample(arg: Node) -> Any:
            found = recorded(arg, self.gm, example_sizes=True)
            if found is None:
                unknown.append(arg)
                return None
            qparams = None
            if arg in self.float_of:
                qparams = self.float_of[arg][1]
            elif _is_call(arg, ops.dequantize_per_tensor):
                qparams = _qparams(arg)
            return sample_input(*found, qparams)

        args, kwargs = map_arg(root.args, sample), map_arg(root.kwargs, sample)
        return None if unknown else (args, kwargs)

    def _input_max(self, match: KernelMatch, root: Node) -> int | None:
        """The largest uint8 value multiplying the weights where the first input may
        use the 8th bit, else None: what decides, here and on the CPU that loads the
        model, whether the kernel's 16-bit pair sums may overflow
        (:func:`qcore.kernels.runtime.pair_sums_overflow_here`)."""
        if not self._input_uses_8_bits(match, root):
            return None
        x = match.inputs[0]
        return x.quant_range[1] if x.quant_range is not None else 255

    def _input_uses_8_bits(self, match: KernelMatch, root: Node) -> bool:
        """Whether the values multiplying the weights (the first input) may use the 8th
        bit of uint8: a narrowed range in the graph says no (a Quantizer's 0..127);
        fixed qparams (sigmoid, softmax, tanh) use all of 0..255. A full range in the
        graph is the observer's own where ``observed_ranges`` (a PT2E Quantizer's);
        under QConfig semantics it is the whole dtype, as torch.ao does, whatever the
        observer's range, so there the QConfig's observer tells (7 bits with
        ``reduce_range``, fbgemm's and x86's defaults). A PT2E graph prepared from
        QConfigs keeps no QConfig here: left as it is."""
        x = match.inputs[0] if match.inputs else None
        if x is None or x.dtype != torch.quint8:
            return False
        if x.quant_range is not None:
            return x.quant_range[1] - x.quant_range[0] > 127
        if self.observed_ranges:
            return True
        if any(
            abs(x.scale - scale) < 1e-12 and x.zero_point == zero_point
            for scale, zero_point in _FIXED_QPARAMS
        ):
            return True
        accepted = self.accepted.get(root.name)
        activation = getattr(getattr(accepted, "qconfig", None), "activation", None)
        if activation is None:
            return False
        # A model's QConfigs share a few constructors; building torch.ao's histogram
        # observer once per kernel was 1/6 of an 800-block convert.
        cached = self._wide_activation.get(id(activation))
        if cached is None or cached[0] is not activation:
            cached = (activation, _passes_7_bits(activation))
            self._wide_activation[id(activation)] = cached
        return cached[1]

    # ------------------------------------------------------------------ graph edits

    def _install(self, root: Node, module: torch.nn.Module) -> None:
        # A module called twice keeps its reference form for its other call.
        if root.op == "call_module" and not self._called_elsewhere(root):
            name = root.target
        else:
            base, index, name = root.name, 0, root.name
            while hasattr(self.gm, name) or name in self.modules:
                index += 1
                name = f"{base}_{index}"
        parent_name, _, attr = name.rpartition(".")
        parent = self.gm.get_submodule(parent_name) if parent_name else self.gm
        module.train(parent.training)  # a kernel made in training mode joins an eval model
        setattr(parent, attr, module)
        self.modules[name] = module
        root.op, root.target = "call_module", name

    def _called_elsewhere(self, root: Node) -> bool:
        if self._calls_per_module[root.target] > 1:
            self._calls_per_module[root.target] -= 1  # this call moves to a module of its own
            return True
        return False

    def _collapse(self, chain: list[Node]) -> None:
        """The root takes the place of the whole chain."""
        if len(chain) == 1:
            return
        chain[-1].replace_all_uses_with(chain[0])
        for node in reversed(chain[1:]):
            self.graph.erase_node(node)
            self.inserted.discard(node)

    def _wire_inputs(self, root: Node) -> None:
        def replace(arg: Node) -> Node:
            if self._is_quantized_input(arg):
                return self._as_quantized(arg)
            if _is_call(arg, ops.fake_quantize_dynamic):
                return arg.args[0]  # the dynamic kernel quantizes its input itself
            return arg

        root.args = map_arg(root.args, replace)
        root.kwargs = map_arg(root.kwargs, replace)

    def _as_quantized(self, node: Node) -> Node:
        """The torch quantized tensor a quantized edge (a dequantize node) carries."""
        if node in self.float_of:
            return self.float_of[node][0]
        qparams = _qparams(node)
        anchor = node.args[0]  # the quantize, or a constant's integers convert folded
        if anchor.op == "get_attr":
            # quantizing the constant's dequantized value again with the same qparams
            # gives back its integers
            source, anchor = node, node.next
        else:
            source = anchor.args[0]
        if source in self.float_of and self.float_of[source][1] == qparams:
            return self.float_of[source][0]  # int8 straight from the previous kernel
        key = (source, qparams)
        if key not in self.quantized:
            with self.graph.inserting_before(anchor):
                scale, zero_point = self._qparams_attrs(f"{source.name}_input", qparams)
                value = source
                if qparams.quant_range is not None:  # torch quantizes to the full range
                    bounds = self._tensors_for(
                        f"{source.name}_input",
                        low=(qparams.quant_range[0] - qparams.zero_point) * qparams.scale,
                        high=(qparams.quant_range[1] - qparams.zero_point) * qparams.scale,
                    )
                    value = self.graph.call_function(torch.clamp, (source, *bounds))
                    self.inserted.add(value)
                new = self.graph.call_function(
                    torch.quantize_per_tensor, (value, scale, zero_point, qparams.dtype)
                )
            self.inserted.add(new)
            self.quantized[key] = new
        return self.quantized[key]

    def round_trips_in_torch(self) -> None:
        """A quantize -> dequantize pair left for a float op (one kept in reference form,
        or a float value a kernel never reads) runs as ``torch.quantize_per_tensor`` and
        ``.dequantize()``: the same numbers (``qcore.ops`` follows torch's kernels bit
        for bit) in two fused passes over the tensor, where ``qcore.ops`` takes seven
        (its float64 multiply-add, round, clamp, casts). Constants' integers, other
        bit widths and dequantizes to another dtype than float32 stay as they are."""
        for node in list(self.graph.nodes):
            if not _is_call(node, ops.dequantize_per_tensor) or node.kwargs or len(node.args) > 6:
                continue
            if not _is_call(node.args[0], ops.quantize_per_tensor):
                continue  # a folded constant's integers: no quantize at run time
            try:
                quantized = self._as_quantized(node)
            except _Refused:
                continue
            with self.graph.inserting_after(quantized):
                dequantized = self.graph.call_method("dequantize", (quantized,))
            self.inserted.add(dequantized)
            node.replace_all_uses_with(dequantized)
            self.graph.erase_node(node)

    def _qparams_attrs(self, hint: str, qparams: ActivationQParams) -> tuple[Node, Node]:
        """get_attr nodes of new buffers holding ``qparams``: in the state_dict, like
        torch.ao's, so a loaded state_dict brings its calibration along."""
        return self._buffers_for(hint, qparams.scale, qparams.zero_point)

    def _buffers_for(self, hint: str, scale: float, zero_point: int) -> tuple[Node, Node]:
        return self._tensors_for(
            hint,
            scale=torch.tensor(scale, dtype=torch.float64),
            zero_point=torch.tensor(zero_point, dtype=torch.long),
        )

    def _tensors_for(self, hint: str, **values: Any) -> tuple[Node, ...]:
        """get_attr nodes of new buffers ``{hint}_{key}`` holding ``values``."""
        names = []
        for suffix, value in values.items():
            name, index = f"{hint}_{suffix}", 0
            while hasattr(self.gm, name):
                index += 1
                name = f"{hint}_{suffix}_{index}"
            self.gm.register_buffer(name, torch.as_tensor(value))
            self.buffers.append(name)
            names.append(name)
        nodes = tuple(self.graph.get_attr(name) for name in names)
        self.inserted.update(nodes)
        return nodes

    def drop_unread_buffers(self) -> None:
        """Delete the buffers lowering registered that no node reads any more (those of
        a dequantize that dead-code elimination removed with its readers): each one
        was a state_dict entry, saved and loaded (mobilenetv2_like fbgemm: 51 pairs,
        180 -> 282 entries, +29 KiB)."""
        read = {node.target for node in self.graph.nodes if node.op == "get_attr"}
        for name in self.buffers:
            if name not in read:
                delattr(self.gm, name)

    def qparams_to_buffers(self) -> None:
        """What stays in reference form keeps its qparams in buffers too."""
        for node in list(self.graph.nodes):
            if not (
                _is_call(node, ops.quantize_per_tensor) or _is_call(node, ops.dequantize_per_tensor)
            ):
                continue
            source, scale, zero_point, *rest = node.args
            if isinstance(scale, Node) or isinstance(zero_point, Node):
                continue
            with self.graph.inserting_before(node):
                scale_node, zero_point_node = self._buffers_for(node.name, scale, zero_point)
            node.args = (source, scale_node, zero_point_node, *rest)

    def _requantize(self, node: Node, qparams: ActivationQParams) -> Node:
        with self.graph.inserting_after(node):
            dequantized = self.graph.call_method("dequantize", (node,))
        # inserting_before the next node keeps the new nodes in creation order (the
        # qparams' get_attr nodes before the quantize that reads them).
        with self.graph.inserting_before(dequantized.next):
            scale, zero_point = self._qparams_attrs(f"{node.name}_output", qparams)
            requantized = self.graph.call_function(
                torch.quantize_per_tensor, (dequantized, scale, zero_point, qparams.dtype)
            )
        self.inserted.update((dequantized, requantized))
        return requantized

    def read_shapes_from_int8(self) -> None:
        """A shape query on a kernel's output reads the int8 tensor: the float copy
        a ``dequantize`` would make only for it is never computed."""
        for dequantized, (quantized, _) in self.float_of.items():
            for user in list(dequantized.users):
                if _is_shape_query(user, dequantized):
                    user.replace_input_with(dequantized, quantized)

    def _publish(self, node: Node, quantize: Node, qparams: ActivationQParams) -> None:
        """``node`` (a torch quantized tensor) replaces the reference's quantize/dequantize."""
        with self.graph.inserting_after(node):
            dequantized = self.graph.call_method("dequantize", (node,))
        self.inserted.add(dequantized)
        self.float_of[dequantized] = (node, qparams)
        for user in list(quantize.users):
            user.replace_all_uses_with(dequantized)


def lower(
    gm: GraphModule, kernels: tuple, backend: str, *, observed_ranges: bool = False
) -> GraphModule:
    """Lower ``gm`` (reference form, modified in place) with ``kernels``.

    ``observed_ranges``: the graph's quantize ranges are the observers' own (a PT2E
    Quantizer's), rather than the dtype's whatever the observer (QConfig semantics).
    """
    quiet_quantized_tensors()
    lowering = _Lowering(gm, kernels, backend, observed_ranges)
    lowering.run()
    lowering.round_trips_in_torch()
    if lowering.faulty:
        warnings.warn(
            f"{len(lowering.faulty)} op(s) left in reference form because a kernel qcore "
            "does not test failed its trial run at convert: "
            + "; ".join(lowering.faulty)
            + ". Report it to the plugin's authors; `qcore check <backend>` runs their "
            "kernels against the reference form.",
            QCoreWarning,
            stacklevel=caller_stacklevel(),
        )
    _select_on_float16(gm)
    _fp16_weight_kernels_read_float32(gm)
    _views_as_reshapes(gm)
    lowering.read_shapes_from_int8()
    eliminate_dead_code_keeping_state_writes(gm)
    lowering.qparams_to_buffers()
    lowering.drop_unread_buffers()
    for node in gm.graph.nodes:
        if isinstance(node.type, str):  # `from __future__ import annotations` in the
            node.type = None  # user's model: torch.fx cannot pickle a string annotation
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    make_picklable(gm)
    _update_report(gm, lowering)
    return gm


def make_picklable(gm: GraphModule) -> None:
    """Ready a converted model (lowered or reference form) for ``torch.save``, and
    recompile it.

    The prepare-time decisions (backend config with its fuser functions, kernels,
    patterns naming torch's functionals) are spent: a converted model keeps only
    its explain report. Unpickling traces the generated code again, with the
    recorded tracer class (qcore's needs prepare-time arguments, torch.fx's plain
    one does not) and through every function the graph calls: a ``qcore.ops``
    function left in it (an op kept in reference form) is marked as torch.fx marks
    its own wrapped functions, so the code registers it with ``torch.fx.wrap`` and
    the trace keeps it as one call (``choose_qparams_per_tensor``'s data-dependent
    branch failed there)."""
    for key in _PREPARE_STATE_KEYS:
        gm.meta.pop(key, None)
    gm._tracer_cls = gm.graph._tracer_cls = None  # a deep copy takes the graph's
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__module__", "") == ops.__name__:
            node.meta["is_wrapped"] = True
        if isinstance(node.type, str):
            # a string annotation (``from __future__ import annotations``) became a
            # global of the generated code that pickling cannot name
            node.type = None
    gm.recompile()


def _is_method(node: Any, name: str) -> bool:
    return isinstance(node, Node) and node.op == "call_method" and node.target == name


def _is_float32_for_sure(node: Node) -> bool:
    """A model input (the PT2E guard, or the FX trace, fixes its dtype) or a
    ``dequantize``'s result: no autocast region changes them."""
    return node.op == "placeholder" or _is_method(node, "dequantize")


def quantize_float32(gm: GraphModule) -> None:
    """``torch.quantize_per_tensor`` of a float op's output reads it as float32: under
    ``torch.autocast`` that output is bfloat16, which the quantize refuses ("Quantize
    only works on Float Tensor"). ``.float()`` of a float32 tensor is the tensor
    itself. Run last, once every rewrite that matches ``dequantize -> quantize``
    (a requantize to skip) has run; explain lists each cast before its quantize."""
    report = report_of(gm)
    added: dict[str, list[Entry]] = {}
    for node in list(gm.graph.nodes):
        if not _is_call(node, torch.quantize_per_tensor) or not isinstance(node.args[0], Node):
            continue
        reader = node.args[0] if _is_call(node.args[0], torch.clamp) else node
        source = reader.args[0]  # a clamp to the observer's range may sit between them
        if not isinstance(source, Node) or _is_float32_for_sure(source):
            continue
        with gm.graph.inserting_before(reader):
            cast = gm.graph.call_method("float", (source,))
        reader.replace_input_with(source, cast)
        added.setdefault(reader.name, []).append(
            Entry(cast.name, "quantize/dequantize", Status.NOT_AN_OP)
        )
    if not added:
        return
    if report is not None:
        entries = []
        for entry in report.entries:
            entries.extend(added.get(entry.node, ()))
            entries.append(entry)
        attach_report(gm, Report(report.backend, entries))
    gm.recompile()


def _is_to_float16(node: Any) -> bool:
    return _is_method(node, "to") and len(node.args) == 2 and node.args[1] == torch.float16


def _selects_values(node: Node, modules: dict) -> bool:
    from qcore.kernels.shape import SELECTING_PATTERNS

    if node.op == "call_module":
        return type(modules.get(node.target)) in SELECTING_PATTERNS
    return node.op in ("call_function", "call_method") and node.target in SELECTING_PATTERNS


_RESHAPE_OF = {
    ("call_method", "view"): "reshape",
    ("call_method", "view_as"): "reshape_as",
    ("call_function", torch.ops.aten.view.default): torch.ops.aten.reshape.default,
}


def _views_as_reshapes(gm: GraphModule) -> None:
    """Every ``view`` to a shape becomes ``reshape``.

    torch's int8 convolutions return channels-last tensors, on which ``view(n, -1)``
    fails ("view size is not compatible with input tensor's size and stride"):
    ``conv -> add -> view`` crashed on every backend, as it does on torch.ao.
    ``reshape`` is the same view wherever one exists and copies where none does;
    the copy cannot hide a write, since in-place writes through views were made
    explicit before quantizing (:mod:`qcore.engine.aliasing`).
    """
    for node in gm.graph.nodes:
        reshape = _RESHAPE_OF.get((node.op, node.target))
        if reshape is None:
            continue
        if any(isinstance(arg, torch.dtype) for arg in node.args[1:]):
            continue  # view(dtype) reinterprets bits; it has no reshape
        node.target = reshape


def _select_on_float16(gm: GraphModule) -> None:
    """``to(float16) -> dequantize -> op -> to(float16) -> dequantize`` becomes
    ``to(float16) -> op -> dequantize`` for ops that only select or move values
    (reshape, max pooling, ...; ``qcore.kernels.shape.SELECTING_PATTERNS``): on values
    already float16 their float32 result rounds to itself, so the numbers are the
    same and the tensor stays float16 between such ops, as torch.ao's lowering does."""
    modules = dict(gm.named_modules())
    halves: set[Node] = set()  # ops rewritten to run on float16
    for node in list(gm.graph.nodes):
        if not node.args or not _selects_values(node, modules):
            continue
        dequantized = node.args[0]
        if not _is_method(dequantized, "dequantize"):
            continue
        if not (_is_to_float16(dequantized.args[0]) or dequantized.args[0] in halves):
            continue
        others = [arg for arg in node.all_input_nodes if arg is not dequantized]
        if others or len(node.users) != 1:
            continue
        (half,) = node.users
        if not _is_to_float16(half) or half.args[0] is not node:
            continue
        node.replace_input_with(dequantized, dequantized.args[0])
        half.replace_all_uses_with(node)
        gm.graph.erase_node(half)
        halves.add(node)


def _fp16_weight_kernels_read_float32(gm: GraphModule) -> None:
    """A kernel with float16 weights (dynamic linear, LSTM, cells) takes its float32
    input as is: the reference form's ``to(float16) -> dequantize`` before it, which
    rounds the activation as well, is skipped for the kernel, as torch.ao's lowering
    does (linears 63.8 dB against float with it, 67.4 without; torch.ao 67.4)."""
    for node in gm.graph.nodes:
        if node.op != "call_module" or not node.args:
            continue
        if getattr(gm.get_submodule(node.target), "fp16", False) is not True:
            continue
        dequantized = node.args[0]
        if _is_method(dequantized, "dequantize") and _is_to_float16(dequantized.args[0]):
            node.replace_input_with(dequantized, dequantized.args[0].args[0])


def _update_report(gm: GraphModule, lowering: _Lowering) -> None:
    """Explain entries in graph order; a fused chain's nodes follow its root."""
    report: Report = report_of(gm)
    by_name = {entry.node: entry for entry in report.entries}
    fused: dict[str, list[str]] = {}
    for name, root in lowering.fused_into.items():
        fused.setdefault(root, []).append(name)
    for node in gm.graph.nodes:
        fused.setdefault(node.name, []).extend(node.meta.get(POST_OPS_KEY, ()))
    entries = []
    for node in gm.graph.nodes:
        for name in [node.name, *fused.get(node.name, [])]:
            entry = by_name.get(name)
            if entry is None:
                entries.append(Entry(name, "quantize/dequantize", Status.NOT_AN_OP))
            else:
                entries.append(_updated(entry, lowering, report.backend, node, by_name))
    attach_report(gm, Report(report.backend, entries))


def _is_dequantize(node: Node) -> bool:
    """A dequantize of a lowered graph: torch's method (an int8 value lowering made
    float), or qcore's ops (a reference-form activation or weight left unlowered)."""
    return (
        _is_method(node, "dequantize")
        or _is_call(node, ops.dequantize_per_tensor)
        or _is_call(node, ops.dequantize_per_channel)
    )


def _float_producer(node: Node) -> Node | None:
    """The op feeding ``node`` in float, where ``node`` is a function or method that
    reads no int8 value at all (no input comes out of a dequantize): the
    annotation quantized its output for the op after it, not its input."""
    if node.op not in ("call_function", "call_method"):
        return None
    inputs = node.all_input_nodes
    if not inputs or any(_is_dequantize(arg) for arg in inputs):
        return None
    return next((arg for arg in inputs if arg.op != "get_attr"), None)


def _refusal(error: BaseException) -> str:
    """A kernel's reason for not taking a match: a ValueError or KernelUnavailable is
    a documented way to refuse, so its message alone; any other error is named (a
    kernel's bug)."""
    documented = type(error) is ValueError or isinstance(error, KernelUnavailable)
    return str(error) if documented else f"{type(error).__name__}: {error}"


def _op_and_pattern(entry: Entry) -> str:
    """``matmul``; ``aten.bmm (pattern matmul)`` where the op is a variant of the
    pattern it was annotated under, which a kernel for the pattern need not take."""
    if not entry.pattern or entry.op.lower().endswith(entry.pattern.lower()):
        return entry.pattern or entry.op
    return f"{entry.op} (pattern {entry.pattern})"


def _updated(
    entry: Entry, lowering: _Lowering, backend: str, node: Node, entries: dict[str, Entry]
) -> Entry:
    name = entry.node
    if name in lowering.lowered:
        note = lowering.notes.get(name, "")
        return Entry(name, entry.op, Status.QUANTIZED, note, entry.pattern, lowering.lowered[name])
    if name in lowering.unlowered:
        return entry.with_status(Status.REFERENCE, lowering.unlowered[name])
    if name in node.meta.get(POST_OPS_KEY, ()):  # a post-op: where its op went, it went
        if node.name in lowering.lowered:
            note = f"a post-op in {node.name}'s kernel"
            return Entry(
                name, entry.op, Status.QUANTIZED, note, entry.pattern, lowering.lowered[node.name]
            )
        return entry
    producer = _float_producer(node) if entry.status is Status.REFERENCE else None
    if producer is not None and producer.op != "placeholder":
        source = entries.get(producer.name)
        reason = source.reason if source is not None and source.reason else "not quantized"
        return entry.with_status(Status.FLOAT, float_input_reason(producer.name, reason))
    if entry.status is Status.REFERENCE and UNLOWERABLE_KEY in node.meta:
        return entry.with_status(Status.REFERENCE, node.meta[UNLOWERABLE_KEY])
    if entry.status is Status.REFERENCE:
        return entry.with_status(
            Status.REFERENCE,
            f"no kernel for {_op_and_pattern(entry)} in backend {backend!r} "
            "(left in reference form)",
        )
    return entry
