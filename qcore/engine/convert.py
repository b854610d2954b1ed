"""convert: from a calibrated prepared model to the reference representation.

Each observer becomes quantize -> dequantize on plain integer tensors
(``qcore.ops``), with its qparams as constants; each quantized weighted
module becomes a :class:`ReferenceModule`; QAT modules return to float first.
Lowering to kernels is a separate pass (``qcore.engine.lower``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.nn.utils import parametrize

from qcore import ops
from qcore.engine.backend_annotator import is_quantized_dtype
from qcore.engine.constants import Constants, attribute, free_name, unobserved
from qcore.engine.explain import Entry, Report, Status, attach_report, report_of
from qcore.engine.in_place import eliminate_dead_code_keeping_state_writes
from qcore.engine.observe import DerivedObserver
from qcore.engine.prepare import STATE_KEY, PreparedState
from qcore.engine.reference import QParams, ReferenceModule, qparams_of, weight_names
from qcore.engine.trace import delete_unused_submodules
from qcore.observers.nonfinite import check_observers, warn_of_nonfinite_weights

__all__ = ["convert_to_reference", "state_of"]


def state_of(gm: Any) -> PreparedState:
    state = getattr(gm, "meta", {}).get(STATE_KEY) if isinstance(gm, GraphModule) else None
    if state is None:
        raise TypeError(
            f"model: got {type(gm).__name__}; expected a model returned by qcore.prepare_fx "
            "or qcore.prepare_qat_fx (it carries the backend and the decisions convert needs)"
        )
    return state


def _set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


def _remove_parametrizations(module: torch.nn.Module) -> None:
    """Turns parametrized weights (weight_norm, spectral_norm, ``parametrize``) into
    plain parameters holding their present values, the weights that get quantized.
    ``module`` is convert's own copy."""
    for owner in module.modules():
        if parametrize.is_parametrized(owner):
            # torch's removal deletes each property from the module's class, which a
            # deep copy shares with the user's module: that one gets a class of its own.
            shared = owner.__class__
            own = {k: v for k, v in vars(shared).items() if k not in ("__dict__", "__weakref__")}
            owner.__class__ = type(shared.__name__, shared.__bases__, own)
            for name in list(owner.parametrizations):
                parametrize.remove_parametrizations(owner, name, leave_parametrized=True)
            _drop_weight_norm_hooks(owner)


def _drop_weight_norm_hooks(owner: torch.nn.Module) -> None:
    """weight_norm leaves a load_state_dict pre-hook on its module (to read old
    checkpoints' weight_g/weight_v) that removing the parametrization keeps: the
    plain module holds a hook qcore.save refuses (hooks are code) and needs none."""
    hooks = owner._load_state_dict_pre_hooks
    for key, hook in list(hooks.items()):
        if "weight_norm" in getattr(getattr(hook, "hook", hook), "__qualname__", ""):
            del hooks[key]


def _float_and_weight_qparams(
    module: torch.nn.Module, qconfig: Any
) -> tuple[torch.nn.Module, dict]:
    """The float module to keep and the qparams of each of its weights."""
    if hasattr(module, "weight_fake_quant"):  # a QAT module: its fake-quant saw the weights
        observer = module.weight_fake_quant
        float_module = module.to_float()
        names = weight_names(float_module)
        return float_module, {names[0]: qparams_of(observer, full_range=True)}
    weights = {}
    for name in weight_names(module):
        observer = qconfig.weight()
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        observer(getattr(owner, attr).detach())
        weights[name] = qparams_of(observer, full_range=True)
    return module, weights


def _swap_reference_modules(gm: GraphModule, state: PreparedState) -> None:
    modules = dict(gm.named_modules(remove_duplicate=False))
    swapped: set[str] = set()
    _warn_of_nonfinite_weights(modules, state)
    for accepted in state.accepted:
        if accepted.root_op != "call_module" or accepted.qconfig.weight is None:
            continue
        if accepted.root_target in swapped:
            continue  # a module called twice: one ReferenceModule serves both calls
        swapped.add(accepted.root_target)
        if not is_quantized_dtype(accepted.dtype_config.weight_dtype):
            continue
        module = modules[accepted.root_target]
        _remove_parametrizations(module)
        original_type = accepted.config.pattern_complex_format
        original_type = original_type if isinstance(original_type, type) else type(module)
        float_module, weight_qparams = _float_and_weight_qparams(module, accepted.qconfig)
        if not weight_qparams:
            continue
        if float_module is not module:
            # A QAT module returned to float: ConvBnReLU2d folds its batch norm
            # and becomes a ConvReLU2d, the class kernels know it by.
            original_type = type(float_module)
        reference = ReferenceModule(float_module, weight_qparams, original_type)
        _set_module(gm, accepted.root_target, reference)


def _warn_of_nonfinite_weights(modules: dict[str, torch.nn.Module], state: PreparedState) -> None:
    """Each weight to be quantized that holds NaN or inf, named (the calibration
    warning names only the activations that met it; torch.ao fails in histc)."""
    weights = []
    for accepted in state.accepted:
        module = modules.get(accepted.root_target) if accepted.root_op == "call_module" else None
        if module is None:
            continue
        # a QAT module (ConvBnReLU2d) holds its weight itself, not in children
        names = ["weight"] if hasattr(module, "weight_fake_quant") else weight_names(module)
        for name in names:
            owner_name, _, attr = name.rpartition(".")
            weight = getattr(module.get_submodule(owner_name) if owner_name else module, attr)
            if isinstance(weight, torch.Tensor):
                shown = name.removeprefix("0.")  # a fused module's conv or linear: the user's
                weights.append((f"{accepted.root_target}.{shown}", weight))
    warn_of_nonfinite_weights(weights, "convert")


_FUNCTIONAL_WEIGHTED: dict[Any, type[torch.nn.Module]] = {
    torch.nn.functional.linear: torch.nn.Linear,
    torch.nn.functional.conv1d: torch.nn.Conv1d,
    torch.nn.functional.conv2d: torch.nn.Conv2d,
    torch.nn.functional.conv3d: torch.nn.Conv3d,
}
#: Arguments of ``F.convNd`` after input, weight and bias, in order, with defaults.
_CONV_SETTINGS = (("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))


def _float_weighted_module(node: Node, weight: torch.Tensor, bias: torch.Tensor | None):
    """The float module computing ``node`` (``F.linear``/``F.convNd``) on constants, or
    None where its settings are not constants."""
    cls = _FUNCTIONAL_WEIGHTED[node.target]
    if cls is torch.nn.Linear:
        if weight.dim() != 2:
            return None
        module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    else:
        settings = dict(_CONV_SETTINGS)
        for (key, _), value in zip(_CONV_SETTINGS, node.args[3:], strict=False):
            settings[key] = value
        settings.update({k: v for k, v in node.kwargs.items() if k in settings})
        if any(isinstance(value, Node) for value in settings.values()):
            return None
        groups = settings["groups"]
        in_channels, out_channels = weight.shape[1] * groups, weight.shape[0]
        module = cls(
            in_channels, out_channels, tuple(weight.shape[2:]), bias=bias is not None, **settings
        )
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias is not None:
            module.bias.copy_(bias)
    return module


def _functional_weighted_to_modules(gm: GraphModule, state: PreparedState) -> None:
    """``F.linear``/``F.convNd`` on constant weights becomes a ReferenceModule around an
    ``nn.Linear``/``nn.ConvNd``, so the backend's kernels take it as they take the
    module (an ``nn.Linear`` subclass whose forward calls ``F.linear``, BiT's
    weight-standardized ``Conv2d``, trace this way), as torch.ao lowers them."""
    accepted = {a.root_name for a in state.accepted if a.root_op == "call_function"}
    modules = dict(gm.named_modules(remove_duplicate=False))
    constants: Constants | None = None  # a graph walk, only for a model with such ops
    for node in list(gm.graph.nodes):
        if node.name not in accepted or node.target not in _FUNCTIONAL_WEIGHTED:
            continue
        args = list(node.args) + [None] * (3 - len(node.args))
        x, observed_weight, bias_node = args[0], args[1], node.kwargs.get("bias", args[2])
        observer = modules.get(getattr(observed_weight, "target", None))
        bias_observer = modules.get(getattr(bias_node, "target", None))
        if bias_observer is not None:  # a float bias may be observed (not quantized)
            if is_quantized_dtype(getattr(bias_observer, "dtype", torch.float)):
                continue
            bias_node = bias_node.args[0]
        if observer is None:
            continue
        input_observer = modules.get(getattr(x, "target", None))
        if getattr(observer, "dtype", None) == torch.float16 and not getattr(
            input_observer, "is_dynamic", False
        ):
            continue  # static float16: torch has no such kernel; F.linear as torch.ao keeps it
        weight_node = observed_weight.args[0] if observed_weight.args else None
        constants = constants or Constants(gm)
        if weight_node not in constants or (bias_node is not None and bias_node not in constants):
            continue
        weight = constants.value(weight_node)
        bias = None if bias_node is None else constants.value(bias_node)
        module = _float_weighted_module(node, weight, bias)
        if module is None:
            continue
        if unobserved(observer):  # a computed weight, never run through (dynamic)
            with torch.no_grad():
                observer(weight)
        qparams = qparams_of(observer, full_range=True)
        kind = type(module)
        name = free_name(gm, f"{node.name}_{kind.__name__.lower()}")
        gm.add_submodule(name, ReferenceModule(module, {"weight": qparams}, kind))
        node.op, node.target, node.args, node.kwargs = "call_module", name, (x,), {}


#: What a model may read off a parameter or buffer that convert is about to replace
#: (``x.to(self.conv.weight.dtype)``, SigLIP's and CLIP's patch embeddings).
_METADATA = ("dtype", "device", "shape", "ndim")


def _freeze_tensor_metadata(gm: GraphModule) -> None:
    """Reads of a constant's dtype, device, shape or rank become the values they read.

    The float weight is gone once its module is swapped for a reference module or a
    kernel (its integers replace it); what forward asked of it does not change."""
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        for user in list(node.users):
            if (
                user.op == "call_function"
                and user.target is getattr
                and user.args[0] is node
                and user.args[1] in _METADATA
            ):
                value = getattr(attribute(gm, node.target), user.args[1])
                for reader in list(user.users):
                    reader.args = torch.fx.node.map_arg(
                        reader.args, lambda n, u=user, v=value: v if n is u else n
                    )
                    reader.kwargs = torch.fx.node.map_arg(
                        reader.kwargs, lambda n, u=user, v=value: v if n is u else n
                    )
                gm.graph.erase_node(user)
        if not node.users:
            gm.graph.erase_node(node)


def _qparams_constants(qparams: QParams) -> tuple:
    scale = float(qparams.scale.reshape(-1)[0]) if qparams.scale.numel() == 1 else qparams.scale
    zero_point = (
        int(qparams.zero_point.reshape(-1)[0])
        if qparams.zero_point.numel() == 1
        else qparams.zero_point
    )
    return scale, zero_point


def _replace_observer(gm: GraphModule, node: Node, observer: Any, full_range: bool) -> None:
    graph = gm.graph
    source = node.args[0]
    dtype = getattr(observer, "dtype", torch.float32)
    replacement: Node | Any = source
    with graph.inserting_before(node):
        if type(observer).__name__ == "ReuseInputObserver":
            pass  # torch.ao's marker for ops that keep their input's quantization
        elif dtype == torch.float16:
            # torch.ao's pair: a float16 tensor's dequantize() is its float32 copy
            half = graph.call_method("to", (source, torch.float16))
            replacement = graph.call_method("dequantize", (half,))
        elif is_quantized_dtype(dtype) and getattr(observer, "is_dynamic", False):
            replacement = graph.call_function(
                ops.fake_quantize_dynamic, (source, observer.quant_min, observer.quant_max, dtype)
            )
        elif is_quantized_dtype(dtype):
            if isinstance(observer, DerivedObserver):
                scale, zero_point = observer.derive(gm)
                qparams = QParams(scale, zero_point, dtype, observer.quant_min, observer.quant_max)
            else:
                qparams = qparams_of(observer, full_range=full_range)
            scale, zero_point = _qparams_constants(qparams)
            if qparams.per_channel:
                gm.register_buffer(f"{node.target}_scale", qparams.scale)
                gm.register_buffer(f"{node.target}_zero_point", qparams.zero_point)
                scale = graph.get_attr(f"{node.target}_scale")
                zero_point = graph.get_attr(f"{node.target}_zero_point")
                args = (
                    scale,
                    zero_point,
                    qparams.axis,
                    qparams.quant_min,
                    qparams.quant_max,
                    dtype,
                )
                quantized = graph.call_function(ops.quantize_per_channel, (source, *args))
                replacement = graph.call_function(ops.dequantize_per_channel, (quantized, *args))
            else:
                args = (scale, zero_point, qparams.quant_min, qparams.quant_max, dtype)
                quantized = graph.call_function(ops.quantize_per_tensor, (source, *args))
                replacement = graph.call_function(ops.dequantize_per_tensor, (quantized, *args))
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


def _copy_without_observers(prepared: GraphModule, observer_names: tuple[str, ...]) -> GraphModule:
    """A deep copy of ``prepared`` sharing its observers, which convert only reads
    and then replaces: copying their histograms was most of a large model's copy."""
    memo: dict[int, Any] = {}
    for name in observer_names:
        observer = prepared.get_submodule(name)
        memo[id(observer)] = observer
    return copy.deepcopy(prepared, memo)


def _release_observers(
    gm: GraphModule, prepared: GraphModule, observer_names: tuple[str, ...]
) -> None:
    """Drop the shared observers the graph no longer calls and copy any it still
    calls, so the converted model shares nothing with the prepared one (and later
    passes, deleting unused submodules, never reach into the prepared model's)."""
    called = {node.target for node in gm.graph.nodes if node.op == "call_module"}
    for name in observer_names:
        parent_name, _, attr = name.rpartition(".")
        parent = gm.get_submodule(parent_name) if parent_name else gm
        if not hasattr(parent, attr):
            continue  # a name the graph calls twice, released already
        if name in called:
            setattr(parent, attr, copy.deepcopy(prepared.get_submodule(name)).eval())
        else:
            delattr(parent, attr)


def convert_to_reference(
    prepared: GraphModule, *, full_range: bool = True, for_lowering: bool = True
) -> GraphModule:
    """A converted copy of ``prepared`` in reference form; ``prepared`` is left as is.

    ``for_lowering=False`` (``convert_to_reference_fx``) keeps a functional linear
    as torch.ao's reference form does, ``F.linear`` on its dequantized weight; for
    lowering it becomes a ReferenceModule, the form the linear kernels take.
    """
    state = state_of(prepared)
    # NaN statistics are an error naming the node; skipped NaN/inf one warning
    check_observers(("", prepared, state.observer_names))
    gm = _copy_without_observers(prepared, state.observer_names)
    shared_modes = [(o, o.training) for o in map(prepared.get_submodule, state.observer_names)]
    gm.eval()
    for observer, training in shared_modes:  # the prepared model's own: left as they were
        observer.train(training)
    _freeze_tensor_metadata(gm)
    _swap_reference_modules(gm, state)
    if for_lowering:
        _functional_weighted_to_modules(gm, state)
    modules = dict(gm.named_modules(remove_duplicate=False))
    observer_names = set(state.observer_names)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target in observer_names:
            _replace_observer(gm, node, modules[node.target], full_range)
    eliminate_dead_code_keeping_state_writes(gm)
    _release_observers(gm, prepared, state.observer_names)
    delete_unused_submodules(gm)
    gm.recompile()
    report: Report = report_of(gm)
    names = {node.name for node in gm.graph.nodes}
    entries = []
    for entry in report.entries:
        if entry.node not in names:
            continue
        if entry.status is Status.QUANTIZED:
            entry = entry.with_status(
                Status.REFERENCE, "reference form (convert_to_reference_fx does not lower)"
            )
        entries.append(entry)
    attach_report(gm, Report(report.backend, _with_inserted(entries, gm)))
    # the user's QConfigs were for convert's check only: a converted model holds none
    gm.meta[STATE_KEY] = dataclasses.replace(state, qconfig_mapping=None)
    return gm


def _with_inserted(entries: list, gm: GraphModule) -> list:
    """Entries in graph order; quantize/dequantize nodes qcore inserted are not ops."""
    by_name = {entry.node: entry for entry in entries}
    ordered = []
    for node in gm.graph.nodes:
        entry = by_name.get(node.name) or Entry(node.name, "quantize/dequantize", Status.NOT_AN_OP)
        ordered.append(entry)
    return ordered
