"""The FX front door: prepare_fx, convert_fx, quantize, explain.

A backend is chosen by name (``"fbgemm"``, ``"native"``, a third party's) or
given as a BackendConfig (qcore's or torch.ao's). A bare BackendConfig lowers
with the kernels of the installed backend of the same name if there is one,
else with those of ``"native"`` (the installed plugins' together): torch.ao
always lowers to fbgemm; qcore lowers to what is installed, and explain says
when nothing is.

Example::

    >>> prepared = qcore.prepare_fx(model, qconfig_mapping, example_inputs, backend="x86")
    >>> for batch in calibration_data:
    ...     prepared(*batch)
    >>> converted = qcore.convert_fx(prepared)
    >>> print(qcore.explain(converted))
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch.fx import GraphModule

from qcore.config import BackendConfig
from qcore.config.errors import QCoreWarning, describe
from qcore.config.qconfig import as_qconfig_mapping
from qcore.config.standard_ops import standard_fusion_config
from qcore.engine.boundaries import quantize_boundaries
from qcore.engine.collector import collector_paused
from qcore.engine.constants import observe_constants
from qcore.engine.convert import convert_to_reference, state_of
from qcore.engine.convert_mapping import with_convert_mapping
from qcore.engine.custom_config import (
    as_custom_config,
    copy_preserved,
    warn_unmatched_names,
)
from qcore.engine.custom_modules import custom_kernels, quantize_inputs_for, swap_quantized
from qcore.engine.custom_tuples import tuple_output_qparams
from qcore.engine.decomposed import to_decomposed
from qcore.engine.explain import (
    Entry,
    Report,
    Status,
    attach_report,
    report_of,
    with_load_notes,
)
from qcore.engine.float_islands import islands_from_any_float_op
from qcore.engine.fuse import fuse_graph
from qcore.engine.lower import lower, make_picklable
from qcore.engine.prepare import prepare
from qcore.engine.reference import ReferenceModule
from qcore.engine.scripting import keep_model_when_scripted
from qcore.engine.standalone import convert_standalone_modules, input_qparams
from qcore.engine.trace import copy_modes, trace
from qcore.observers.fake_quantize import fixed_qparams_module
from qcore.plugin import NATIVE, BackendLoadError, UnknownBackendError, get_backend, list_backends

__all__ = [
    "convert_fx",
    "convert_to_reference_fx",
    "explain",
    "fuse_fx",
    "get_default_qat_qconfig_mapping",
    "get_default_qconfig_mapping",
    "prepare_fx",
    "prepare_qat_fx",
    "quantize",
    "quantize_dynamic",
    "resolve_backend",
]


def _as_backend_config(value: Any) -> BackendConfig | None:
    if isinstance(value, BackendConfig):
        return value
    if type(value).__name__ == "BackendConfig" and hasattr(value, "configs"):
        from qcore.config.torch_ao import from_torch_ao

        return from_torch_ao(value)
    return None


def resolve_backend(
    backend: Any = None, backend_config: Any = None
) -> tuple[str, BackendConfig, tuple, Any]:
    """(name, BackendConfig, kernels, Backend or None) for what the user passed."""
    if backend is not None and backend_config is not None:
        raise TypeError("pass backend= or backend_config=, not both")
    chosen = backend if backend is not None else backend_config
    if chosen is None:
        chosen = NATIVE
    if isinstance(chosen, str):
        installed = get_backend(chosen)
        return installed.name, installed.config, installed.kernels, installed
    config = _as_backend_config(chosen)
    if config is None:
        raise TypeError(
            f"backend: got {describe(chosen)}; expected a backend name "
            f"(installed: {', '.join(list_backends())}) or a BackendConfig"
        )
    kernels: tuple = ()
    for source in (config.name, NATIVE):
        try:
            if source and source in list_backends():
                kernels = get_backend(source).kernels
                break
        except (UnknownBackendError, BackendLoadError):
            continue
    return config.name or "custom", config, kernels, None


def _default_mapping(installed: Any, is_qat: bool, name: str = "x86") -> Any:
    """The installed backend's mapping; else torch.ao's for a first-party style called
    ``name`` (qnnpack's 8-bit activations stay 8-bit without its plugin); else x86's."""
    mapping = installed.default_qconfig_mapping(is_qat=is_qat) if installed is not None else None
    if mapping is None:
        from qcore.config.qconfig import BACKEND_KINDS, default_qconfig_mapping

        mapping = default_qconfig_mapping(name if name in BACKEND_KINDS else "x86", is_qat=is_qat)
    return mapping


def _installed_or_none(backend: str) -> Any:
    try:
        return get_backend(backend)
    except UnknownBackendError:
        return None


def default_mapping_for(backend_name: str, is_qat: bool) -> Any:
    """The default mapping for a backend name given by a BackendConfig, which may be
    no installed backend's (a custom config): x86's style then."""
    return _default_mapping(_installed_or_none(backend_name), is_qat, backend_name)


def _named_backend_mapping(backend: str, is_qat: bool) -> Any:
    """A user's name: an installed backend or a first-party style; any other name is
    an error (a typo got x86's mapping, and 7-bit activations, without a word)."""
    from qcore.config.qconfig import BACKEND_KINDS

    installed = _installed_or_none(backend)
    if installed is None and backend not in BACKEND_KINDS:
        get_backend(backend)  # raises UnknownBackendError, with "Did you mean"
    return _default_mapping(installed, is_qat, backend)


def get_default_qconfig_mapping(backend: str = "x86") -> Any:
    """The default post-training QConfigMapping for ``backend``: its plugin's,
    or qcore's own for the first-party backend styles when none is installed.

    Example::

        >>> mapping = qcore.get_default_qconfig_mapping("fbgemm")
    """
    return _named_backend_mapping(backend, False)


def get_default_qat_qconfig_mapping(backend: str = "x86") -> Any:
    """The default QConfigMapping for quantization-aware training on ``backend``."""
    return _named_backend_mapping(backend, True)


def _check_inputs(example_inputs: Any) -> tuple:
    """The positional inputs as a tuple: a tuple as is, a list as its items, a tensor alone."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    raise TypeError(
        f"example_inputs: got {describe(example_inputs)}; expected a tuple of the model's "
        "positional inputs, e.g. (torch.rand(1, 3, 224, 224),), a list, or a single tensor"
    )


def _check_mapping(qconfig_mapping: Any, installed: Any, is_qat: bool) -> Any:
    """A QConfigMapping (qcore's or torch.ao's), or torch.ao's legacy qconfig dict."""
    if qconfig_mapping is None:
        return _default_mapping(installed, is_qat)
    if isinstance(qconfig_mapping, dict):
        return as_qconfig_mapping(qconfig_mapping)
    if not hasattr(qconfig_mapping, "object_type_qconfigs"):
        raise TypeError(
            f"qconfig_mapping: got {describe(qconfig_mapping)}; expected a QConfigMapping "
            "(qcore's or torch.ao's), a qconfig dict, or None for the backend's default"
        )
    return qconfig_mapping


def _is_custom_config(value: Any) -> bool:
    """torch.ao passes prepare_custom_config fourth, where qcore takes the backend."""
    return isinstance(value, dict) or hasattr(value, "non_traceable_module_names")


def _prepare(
    model: torch.nn.Module,
    qconfig_mapping: Any,
    example_inputs: tuple | None,
    backend: Any,
    prepare_custom_config: Any,
    backend_config: Any,
    is_qat: bool,
    inputs_optional: bool = False,
) -> GraphModule:
    """prepare_fx, prepare_qat_fx and quantize_dynamic; with ``inputs_optional``,
    ``example_inputs=None`` reads which values are tensors off the graph."""
    if _is_custom_config(backend) and prepare_custom_config is None:
        backend, prepare_custom_config = None, backend
    name, config, kernels, installed = resolve_backend(backend, backend_config)
    custom_config = as_custom_config(prepare_custom_config)
    prepared = prepare(
        model,
        _check_mapping(qconfig_mapping, installed, is_qat),
        None if inputs_optional and example_inputs is None else _check_inputs(example_inputs),
        name,
        config,
        kernels,
        is_qat=is_qat,
        custom_config=custom_config,
        make_fixed=partial(fixed_qparams_module, is_qat=is_qat),
        prepare_standalone=lambda module, settings, qconfig: _prepare(
            module,
            # torch.ao's defaults: the call's QConfig in the parent, the parent's backend
            settings.qconfig_mapping or {"": qconfig},
            settings.example_inputs,
            settings.backend_config or name,
            settings.prepare_custom_config,
            None,
            is_qat,
            inputs_optional=True,
        ),
    )
    warn_unmatched_names(model, custom_config)
    copy_preserved(model, prepared, custom_config.preserved_attributes)
    return prepared


def prepare_fx(
    model: torch.nn.Module,
    qconfig_mapping: Any,
    example_inputs: tuple,
    backend: Any = None,
    prepare_custom_config: Any = None,
    *,
    backend_config: Any = None,
) -> GraphModule:
    """Trace a copy of ``model``, fuse, and insert observers for post-training
    quantization on ``backend``. ``model`` itself is never modified.

    ``backend`` is a name or a BackendConfig (``backend_config=`` works too, as in
    torch.ao); ``qconfig_mapping=None`` takes the backend plugin's default.
    """
    return _prepare(
        model,
        qconfig_mapping,
        example_inputs,
        backend,
        prepare_custom_config,
        backend_config,
        False,
    )


def prepare_qat_fx(
    model: torch.nn.Module,
    qconfig_mapping: Any,
    example_inputs: tuple,
    backend: Any = None,
    prepare_custom_config: Any = None,
    *,
    backend_config: Any = None,
) -> GraphModule:
    """Like :func:`prepare_fx` for quantization-aware training: QAT modules are
    swapped in and activations are fake-quantized. Train it, then convert."""
    return _prepare(
        model, qconfig_mapping, example_inputs, backend, prepare_custom_config, backend_config, True
    )


def _check_same_backend(prepared: GraphModule, backend_config: Any) -> None:
    if backend_config is None:
        return
    state = state_of(prepared)
    config = _as_backend_config(backend_config)
    if config is None or config.name != state.backend_config.name:
        raise ValueError(
            f"convert_fx: backend_config {describe(backend_config)} differs from the backend "
            f"{state.backend_name!r} chosen at prepare; convert lowers with the prepare backend"
        )


@collector_paused()
def _convert(
    prepared: GraphModule,
    convert_custom_config: Any,
    remove_qconfig: bool,
    qconfig_mapping: Any,
    backend_config: Any,
    *,
    to_kernels: bool,
) -> GraphModule:
    """convert_fx and convert_to_reference_fx: the reference form, custom modules
    swapped, lowered to the backend's kernels when ``to_kernels``."""
    _check_same_backend(prepared, backend_config)
    settings = as_custom_config(convert_custom_config, "convert_custom_config")
    state_of(prepared)
    prepared = with_convert_mapping(prepared, qconfig_mapping)
    state = state_of(prepared)
    observe_constants(prepared)
    converted = convert_to_reference(prepared, for_lowering=to_kernels)
    custom = swap_quantized(prepared, converted, state.custom_calls, settings)
    leaves = tuple_output_qparams(converted, custom)
    standalone_qparams = input_qparams(converted, state.standalone_calls)
    lowered: set[str] = set()
    if to_kernels:
        kernels = state.kernels + custom_kernels(custom, state.backend_name)
        converted = lower(converted, kernels, state.backend_name)
        lowered = {entry.node for entry in explain(converted).quantized}
    quantize_inputs_for(converted, custom, skip=lowered, leaves=leaves)
    convert_standalone_modules(
        prepared,
        converted,
        state.standalone_calls,
        standalone_qparams,
        # its own state; the parent's custom module classes, not its preserved attributes
        lambda standalone: _convert(
            standalone,
            dataclasses.replace(settings, preserved_attributes=()),
            remove_qconfig,
            None,
            None,
            to_kernels=to_kernels,
        ),
    )
    quantize_boundaries(converted, state.quantized_inputs, state.quantized_outputs)
    if remove_qconfig:  # torch.ao's _remove_qconfig: the converted model carries none
        for module in converted.modules():
            module.__dict__.pop("qconfig", None)
    copy_preserved(prepared, converted, settings.preserved_attributes)
    if not to_kernels:
        to_decomposed(converted)
        make_picklable(converted)
    copy_modes(prepared, converted)  # a ported script calls no eval()
    return keep_model_when_scripted(converted)


def convert_fx(
    prepared: GraphModule,
    convert_custom_config: Any = None,
    _remove_qconfig: bool = True,
    qconfig_mapping: Any = None,
    backend_config: Any = None,
) -> GraphModule:
    """Convert a calibrated (or trained) prepared model and lower it to the
    kernels of the backend chosen at prepare. Returns a new module.

    The arguments are torch.ao's: ``convert_custom_config`` (preserved attributes,
    custom module classes), ``backend_config`` (must be the prepare backend).
    """
    return _convert(
        prepared,
        convert_custom_config,
        _remove_qconfig,
        qconfig_mapping,
        backend_config,
        to_kernels=True,
    )


def convert_to_reference_fx(
    prepared: GraphModule,
    convert_custom_config: Any = None,
    _remove_qconfig: bool = True,
    qconfig_mapping: Any = None,
    backend_config: Any = None,
) -> GraphModule:
    """Convert to the reference representation (quantize -> dequantize -> float op
    -> quantize) without lowering to kernels, in ``torch.ops.quantized_decomposed``
    ops (torchao's, ExecuTorch's and Inductor's form). Arguments as :func:`convert_fx`.

    Example::

        >>> reference = qcore.convert_to_reference_fx(prepared)
        >>> compiled = torch.compile(reference)
    """
    return _convert(
        prepared,
        convert_custom_config,
        _remove_qconfig,
        qconfig_mapping,
        backend_config,
        to_kernels=False,
    )


def fuse_fx(
    model: torch.nn.Module,
    backend: Any = None,
    fuse_custom_config: Any = None,
    *,
    backend_config: Any = None,
    is_qat: bool = False,
) -> GraphModule:
    """A traced copy of ``model`` with the backend's fusion rules applied; with no
    backend, the standard families' (conv/linear + batch norm + relu), as torch.ao's
    ``fuse_fx`` applies its native config's, whatever plugins are installed."""
    if _is_custom_config(backend) and fuse_custom_config is None:
        backend, fuse_custom_config = None, backend  # torch.ao's positional order
    if backend is None and backend_config is None:
        # Not native's union: a module fused for one backend (onednn's LinearTanh)
        # is one the others leave float (docs/architecture.md).
        config = standard_fusion_config()
    else:
        _, config, _, _ = resolve_backend(backend, backend_config)
    settings = as_custom_config(fuse_custom_config, "fuse_custom_config")
    gm = trace(model, settings)
    fuse_graph(gm, config, is_qat)
    copy_preserved(model, gm, settings.preserved_attributes)
    return gm


def quantize(
    model: torch.nn.Module,
    example_inputs: tuple,
    calibration_data: Iterable[Any],
    backend: Any = None,
    qconfig_mapping: Any = None,
    *,
    input_fn: Callable[[Any], Any] | None = None,
    keep_float_if_slower: bool = False,
    accuracy_budget: Any = None,
    algorithms: Any = None,
) -> torch.nn.Module:
    """Post-training quantization in one call: prepare, calibrate, convert.

    ``calibration_data`` is any iterable of batches (a list, a DataLoader). Each
    batch is one call of the model:

    * a tensor: the one input, ``model(batch)``;
    * a tuple or list: the positional inputs, in order; trailing items beyond the
      parameters ``model.forward`` takes (the labels of a DataLoader's ``(x, y)``)
      are dropped;
    * a dict: keyword arguments, ``model(**batch)``; each key a parameter of forward;
    * ``input_fn(batch)``, when given, gives the arguments instead (a tensor, a
      tuple of positional inputs taken as it is, or a dict of keyword arguments).

    A batch that does not fit ``model.forward`` is a TypeError naming its index,
    what it holds and forward's signature, raised before the model runs on it.

    ``keep_float_if_slower=True`` measures, on ``example_inputs``, the converted
    model against the same with each candidate in turn kept float (each conv/linear
    and quantized function call, as for ``accuracy_budget``), then all of them, and
    returns the fastest (``qcore.latency``); ``qcore.explain`` gives each one kept
    float with both timings. When int8 pays nowhere and the user's own model runs
    faster than a converted graph of float modules, that is returned: a copy of
    ``model``, its explain report saying why each layer is float. It converts once
    per candidate: opt-in, for deployment.

    ``accuracy_budget`` keeps the fewest candidates float that bring the model
    within a budget (``qcore.accuracy``); the candidates are the conv/linear
    layers and the quantized function calls (add, matmul, cat, ...). The budget
    is ``qcore.MinSQNR(db=30.0)`` (or just ``30.0``), SQNR against the float model
    on the calibration data or its ``eval_data``; or
    ``qcore.MetricBudget(metric, max_drop=0.01)`` with ``metric(model, eval_data)
    -> float`` as NNCF's ``validation_fn``. Candidates are ranked by how much
    keeping each alone float helps, kept float in that order until the budget is
    met, then each tried int8 again; a greedy search checks the answer: with N
    candidates and k kept float, at most kN + k² conversions (2N + 1 for k = 1,
    one when the budget is met as is).
    ``qcore.explain`` gives each kept one the measure with it float and int8.
    Where nothing meets the budget, it warns (``qcore.AccuracyBudgetNotMet``) and
    returns the closest model, as NNCF does.

    ``algorithms`` runs post-training algorithms on the prepared model, each at its
    stage (``qcore.algorithms.ALGORITHMS``: ``equalize`` before calibration,
    ``correct_bias`` after it): None (the default) runs none; ``"recommended"``
    runs what the backend's plugin recommends (``qcore_recommended_algorithms``);
    a list gives names, ``(name, options)`` pairs or ``qcore.AlgorithmStep``
    objects, run in that order within their stage. ``qcore.explain`` and
    ``qcore.algorithms.applied_algorithms(quantized)`` say what ran.

    Example::

        >>> loader = torch.utils.data.DataLoader(dataset, batch_size=8)  # yields [x, y]
        >>> quantized = qcore.quantize(model, (torch.randn(1, 16),), loader, backend="x86")
        >>> quantized = qcore.quantize(model, (x,), records, backend="x86",
        ...                            input_fn=lambda record: record["image"])
        >>> quantized = qcore.quantize(model, (x,), loader, backend="x86",
        ...                            accuracy_budget=qcore.MinSQNR(db=30.0))
        >>> quantized = qcore.quantize(model, (x,), loader, backend="qnnpack",
        ...                            algorithms=["equalize", "correct_bias"])
    """
    from qcore import accuracy
    from qcore.algorithms.recipes import (
        AFTER_CALIBRATION,
        BEFORE_CALIBRATION,
        record,
        resolve_algorithms,
        run_stage,
    )
    from qcore.calibration import calibrate, calibration_calls

    if not isinstance(keep_float_if_slower, bool):
        raise TypeError(
            f"keep_float_if_slower: got {describe(keep_float_if_slower)}; expected True or False"
        )
    budget = accuracy.as_budget(accuracy_budget)
    if budget is not None:
        if keep_float_if_slower:
            raise ValueError(
                "keep_float_if_slower=True and accuracy_budget: pass one of them; each "
                "chooses which layers stay float by its own measure"
            )
        calibration_data = list(calibration_data)  # iterated once per candidate
    steps = resolve_algorithms(algorithms, backend)
    if keep_float_if_slower or steps:
        calibration_data = list(calibration_data)  # iterated once per candidate or pass

    def build(mapping: Any) -> GraphModule:
        prepared = prepare_fx(model, mapping, example_inputs, backend)
        prepared, before = run_stage(
            prepared, steps, BEFORE_CALIBRATION, calibration_data, input_fn
        )
        calibrate(prepared, calibration_calls(model, calibration_data, input_fn))
        prepared, after = run_stage(prepared, steps, AFTER_CALIBRATION, calibration_data, input_fn)
        converted = convert_fx(prepared)
        if steps:  # each candidate its own: the last one built need not be the one chosen
            record(converted, before + after)
        return converted

    converted = build(qconfig_mapping)
    if not keep_float_if_slower and budget is None:
        return converted
    from qcore import keep_float, latency

    base = _check_mapping(qconfig_mapping, resolve_backend(backend)[3], False)

    # conv/linear layers and quantized function calls (add, matmul): a model whose
    # int8 form loses everywhere gets to all float, with no quantize left between
    found = keep_float.Candidates.of(model, converted)

    def build_keeping_float(names: frozenset[str]) -> GraphModule:
        if not names:
            return converted
        mapping = as_qconfig_mapping(base)
        mapping = keep_float.keep_float_mapping(mapping, names, found.ops, found.float_with)
        # the first conversion already said what stays float; a candidate repeating
        # it once per layer tried would bury that in copies
        with warnings.catch_warnings(), islands_from_any_float_op():
            warnings.simplefilter("ignore", QCoreWarning)
            return build(mapping)

    if budget is not None:
        chosen = accuracy.keep_float_for_budget(
            build_keeping_float,
            found.names,
            accuracy.gauge_for(budget, model, calibration_data, input_fn),
            found.float_with,
        )
    else:
        inputs = _check_inputs(example_inputs)
        chosen = latency.keep_faster(
            build_keeping_float, found.names, latency.measure_latency(inputs), float_model=model
        )
    return chosen


#: What ``quantize_dynamic`` quantizes by default: torch.ao's set, and F.linear.
DYNAMIC_DEFAULT_TYPES: tuple = (
    torch.nn.Linear,
    torch.nn.functional.linear,
    torch.nn.LSTM,
    torch.nn.GRU,
    torch.nn.LSTMCell,
    torch.nn.RNNCell,
    torch.nn.GRUCell,
)


def _dynamic_spec(qconfig_spec: Any, dtype: Any) -> dict:
    """torch.ao's quantize_dynamic ``qconfig_spec`` as a dict of QConfigs."""
    from qcore.config.qconfig import default_dynamic_qconfig, float16_dynamic_qconfig

    defaults = {torch.qint8: default_dynamic_qconfig, torch.float16: float16_dynamic_qconfig}
    if dtype not in defaults:
        raise ValueError(
            f"dtype: got {describe(dtype)}; expected torch.qint8 (int8 weights, activations "
            "quantized per batch) or torch.float16 (float16 weights). For weight-only "
            "embeddings use prepare_fx with float_qparams_weight_only_qconfig"
        )
    if qconfig_spec is None:
        qconfig_spec = DYNAMIC_DEFAULT_TYPES
    if isinstance(qconfig_spec, (set, frozenset, list, tuple)):
        qconfig_spec = dict.fromkeys(qconfig_spec, defaults[dtype])
    if not isinstance(qconfig_spec, dict):
        raise TypeError(
            f"qconfig_spec: got {describe(qconfig_spec)}; expected None (nn.Linear, F.linear, "
            "LSTM, GRU and the RNN cells), a set of module classes, functions or module "
            "names, or a dict mapping them to QConfigs"
        )
    return qconfig_spec


def _spec_inside(qconfig_spec: Any, dtype: Any, path: str) -> dict:
    """``qconfig_spec`` as seen from the submodule at ``path`` traced as a root of its
    own: names inside it made relative to it, and a name of it (or of a module
    around it) selecting everything in it, as torch.ao's qconfig propagation does."""
    spec = _dynamic_spec(qconfig_spec, dtype)
    inside = {key: qconfig for key, qconfig in spec.items() if not isinstance(key, str)}
    for key in sorted((k for k in spec if isinstance(k, str)), key=len):  # longest wins
        if key in ("", path) or path.startswith(key + "."):
            inside.update(dict.fromkeys(DYNAMIC_DEFAULT_TYPES, spec[key]))
        elif key.startswith(path + "."):
            inside[key[len(path) + 1 :]] = spec[key]
    return inside


def _dynamic_mapping(qconfig_spec: Any, dtype: Any) -> Any:
    """torch.ao's quantize_dynamic ``qconfig_spec`` as a QConfigMapping."""
    from qcore.config.qconfig import QConfigMapping

    mapping = QConfigMapping()
    for key, qconfig in _dynamic_spec(qconfig_spec, dtype).items():
        if isinstance(key, str):
            mapping.set_module_name(key, qconfig)
        elif callable(key):  # a module class or a function
            mapping.set_object_type(key, qconfig)
        else:
            raise TypeError(
                f"qconfig_spec: key {describe(key)}; expected a module class (nn.Linear), a "
                "function (F.linear) or a module name ('encoder.fc')"
            )
    return mapping


def quantize_dynamic(
    model: torch.nn.Module,
    qconfig_spec: Any = None,
    dtype: torch.dtype = torch.qint8,
    *,
    backend: Any = None,
    example_inputs: tuple | None = None,
) -> torch.nn.Module:
    """Dynamic quantization in one call: int8 (or float16) weights, activations
    quantized on the fly per batch, no calibration data. ``model`` is not modified.

    By default ``nn.Linear``, ``F.linear``, ``nn.LSTM``, ``nn.GRU`` and the RNN cells
    are quantized, each with a relu that follows it (``nn.ReLU``, ``F.relu``) fused
    in: ``F.relu(F.linear(x, w, b))`` runs as one linear_relu_dynamic kernel.
    ``qconfig_spec`` is torch.ao's: a set of module classes, functions or module
    names (quantized with ``dtype``'s default QConfig), or a dict mapping them to
    QConfigs. ``dtype`` is ``torch.qint8`` or
    ``torch.float16``. ``example_inputs`` are optional: given, prepare runs them once
    to learn which values are tensors; else that is read off the graph. A submodule
    torch.fx cannot trace (transformers' embeddings) stays a leaf, and its own
    layers are quantized each on its own, as torch.ao's module swapping quantizes
    them (explain lists the leaf; ``print(model)`` shows its kernels). A model whose
    own forward does not trace (it packs sequences) is returned as a copy of itself
    with its layers swapped so; one that does, as a converted GraphModule.

    Example::

        >>> quantized = qcore.quantize_dynamic(model, backend="x86")
        >>> print(qcore.explain(quantized))     # linear_dynamic, linear_relu_dynamic, ...
        >>> fp16 = qcore.quantize_dynamic(model, {torch.nn.Linear}, torch.float16, backend="x86")
    """
    _dynamic_mapping(qconfig_spec, dtype)  # a bad spec or dtype is named before any copy
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: got {describe(model)}; expected a torch.nn.Module")
    return _dynamic_where_it_traces(
        copy.deepcopy(model), example_inputs, backend, qconfig_spec, dtype, top=True
    )


def _dynamic_where_it_traces(
    model: torch.nn.Module,
    example_inputs: tuple | None,
    backend: Any,
    qconfig_spec: Any,
    dtype: torch.dtype,
    *,
    top: bool = False,
) -> torch.nn.Module:
    """quantize_dynamic on ``model`` (a copy, changed in place): a submodule torch.fx
    cannot trace is kept as a leaf and its own children are quantized each on its
    own, as torch.ao's module swapping quantizes every layer whatever its parent's
    code. Dynamic quantization needs no graph around a layer: each layer's kernel
    quantizes its input itself. Where the user's model itself does not trace
    (``top``), it is returned as it is, its layers swapped, with a report saying so."""
    from qcore.engine.trace import TraceFailure

    leaves: list[str] = []
    quantized_inside: dict[str, list[str]] = {}
    while True:
        custom = {"non_traceable_module_name": list(leaves)} if leaves else None
        mapping = _dynamic_mapping(qconfig_spec, dtype)  # a fresh one: prepare may keep it
        try:
            prepared = _prepare(model, mapping, example_inputs, backend, custom, None, False, True)
        except TraceFailure as failure:
            name = failure.module_name
            if name in leaves:
                raise
            if name in (None, "<root>"):  # the module's own forward does not trace
                if isinstance(model, _CallsLayer):
                    raise  # its layer is no leaf torch.fx can call: it stays float
                if not any(True for _ in model.children()):  # a layer: nn.LSTM's forward
                    quantized = _dynamic_layer(model, backend, qconfig_spec, dtype)
                    inside = [] if quantized is model else [""]
                else:
                    quantized = model
                    inside = _dynamic_children(model, backend, qconfig_spec, dtype)
                if top:  # the user's model: explain says what became of it
                    _explain_untraced(model, quantized, backend, inside, failure)
                return quantized
            leaves.append(name)
            quantized_inside[name] = _dynamic_children(
                model.get_submodule(name), backend, _spec_inside(qconfig_spec, dtype, name), dtype
            )
            continue
        return _explain_leaves(convert_fx(prepared), quantized_inside)


def _explain_leaves(converted: GraphModule, quantized_inside: dict[str, list[str]]) -> GraphModule:
    """Say in explain which layers inside each leaf that does not trace were quantized."""
    node_of = {n.target: n.name for n in converted.graph.find_nodes(op="call_module")}
    reasons = {}
    for leaf, inside in quantized_inside.items():
        layers = f"its layers quantized on their own: {', '.join(inside)}"
        reasons[node_of.get(leaf)] = (
            f"does not trace: kept as a leaf, {layers if inside else 'nothing in it quantized'}"
        )
    report = report_of(converted)
    if report is not None and reasons:
        entries = [
            dataclasses.replace(e, reason=reasons[e.node]) if e.node in reasons else e
            for e in report.entries
        ]
        attach_report(converted, Report(report.backend, entries, report.algorithms))
    return converted


def _explain_untraced(
    model: torch.nn.Module,
    quantized: torch.nn.Module,
    backend: Any,
    quantized_inside: list[str],
    failure: Exception,
) -> None:
    """The report of a model whose own forward does not trace, quantized layer by
    layer (or swapped whole, a bare nn.LSTM), as torch.ao's module swapping does."""
    error = failure.__cause__ or failure  # not TraceFailure's advice, which is prepare_fx's
    op, cause = (
        type(model).__name__,
        f"its forward does not trace ({type(error).__name__}: {error})",
    )
    if quantized_inside == [""]:
        entry = Entry("", op, Status.QUANTIZED, f"swapped as a layer: {cause}")
    else:
        layers = ", ".join(quantized_inside) or "none"
        entry = Entry("", op, Status.FLOAT, f"its layers quantized on their own: {layers}; {cause}")
    attach_report(quantized, Report(resolve_backend(backend, None)[0], [entry]))


class _CallsLayer(torch.nn.Module):
    """A traceable root around one layer: traced, the layer is a leaf call, as it
    is inside any traced model."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Any) -> Any:
        return self.layer(x)


def _dynamic_layer(layer: torch.nn.Module, backend: Any, qconfig_spec: Any, dtype) -> Any:
    """A layer whose own forward does not trace (nn.LSTM, nn.GRUCell) as the kernel
    it lowers to when called in a traced graph; the layer itself if none takes it."""
    from qcore.engine.trace import TraceFailure

    try:
        converted = _dynamic_where_it_traces(_CallsLayer(layer), None, backend, qconfig_spec, dtype)
    except TraceFailure:
        return layer
    (call,) = converted.graph.find_nodes(op="call_module")
    kernel = converted.get_submodule(call.target)
    return layer if isinstance(kernel, (type(layer), ReferenceModule)) else kernel


def _dynamic_children(module: torch.nn.Module, backend: Any, qconfig_spec: Any, dtype) -> list[str]:
    """Each child of ``module`` quantized on its own (containers: their children);
    returns the names of those that were."""
    replaced = []
    for name, child in module.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            inside = _dynamic_children(
                child, backend, _spec_inside(qconfig_spec, dtype, name), dtype
            )
            replaced += [f"{name}.{path}" for path in inside]
            continue
        with warnings.catch_warnings():
            # what stays float in a dropout or a norm is no news: the model's own
            # prepare already said which module does not trace
            warnings.simplefilter("ignore", QCoreWarning)
            spec = _spec_inside(qconfig_spec, dtype, name)
            quantized = _dynamic_where_it_traces(child, None, backend, spec, dtype)
        if quantized is child:
            continue
        if report_of(quantized) is None or any(True for _ in explain(quantized).quantized):
            setattr(module, name, quantized)
            replaced.append(name)
    return replaced


def explain(model: torch.nn.Module) -> Report:
    """Why each node of a prepared or converted model is (not) quantized. For a
    model from :func:`qcore.compile`, the report of the reference form it compiled.

    ``print(report)`` keeps every line within 100 columns, shortening long reasons;
    ``report.details(node)`` and ``report.format(verbose=True)`` give them in full.

    Example::

        >>> report = qcore.explain(quantized)
        >>> print(report)
        >>> print(report.details("softmax"))
    """
    report = report_of(model) if isinstance(model, torch.nn.Module) else None
    if report is None:
        raise TypeError(
            f"model: got {type(model).__name__}; expected a model returned by "
            "qcore.prepare_fx, prepare_qat_fx, convert_fx, quantize or compile"
        )
    return with_load_notes(model, report)
