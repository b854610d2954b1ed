"""QConfig and QConfigMapping: which observers quantize which part of a model.

API-compatible with ``torch.ao.quantization.QConfig`` / ``QConfigMapping``
(same attribute names, setters, ``to_dict``/``from_dict``), built on qcore's
own observers. The mapping resolves torch.ao's QConfig objects too, and
:func:`as_qconfig_mapping` converts a torch.ao mapping into a qcore one.

Precedence, lowest to highest: global, object type, module name regex (the
first registered regex that matches), module name (the nearest named
ancestor counts too), (module name, object type, call index).
"""

from __future__ import annotations

import re
from collections import OrderedDict, namedtuple
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qcore import observers as obs
from qcore.config.errors import describe

__all__ = [
    "QConfig",
    "QConfigMapping",
    "as_qconfig_mapping",
    "default_dynamic_qconfig",
    "default_qconfig",
    "default_qconfig_mapping",
    "default_quint8_weight_qconfig",
    "default_reuse_input_qconfig",
    "float16_dynamic_qconfig",
    "float_qparams_weight_only_qconfig",
    "get_default_qat_qconfig",
    "get_default_qconfig",
]

BACKEND_KINDS = ("fbgemm", "x86", "qnnpack", "onednn")


class QConfig(namedtuple("QConfig", ["activation", "weight"])):
    """How to observe a node: ``activation`` and ``weight`` are observer (or
    fake-quant) constructors, e.g. ``MinMaxObserver.with_args(dtype=torch.qint8)``,
    never instances (each node needs its own)."""

    __slots__ = ()

    def __new__(cls, activation: Callable[..., Any], weight: Callable[..., Any]) -> QConfig:
        for field, value in (("activation", activation), ("weight", weight)):
            if isinstance(value, nn.Module):
                raise ValueError(
                    f"QConfig.{field} must be an observer constructor, not the instance "
                    f"{value!r}; pass the class, or Class.with_args(...) to bind arguments"
                )
            if value is not None and not callable(value):
                raise ValueError(
                    f"QConfig.{field} must be an observer constructor (a class or "
                    f"Class.with_args(...)), got {value!r} of type {type(value).__name__}"
                )
        return super().__new__(cls, activation, weight)


def _is_qconfig(value: Any) -> bool:
    """qcore's QConfig, torch.ao's, or None (do not quantize)."""
    return value is None or (
        isinstance(value, tuple) and hasattr(value, "activation") and hasattr(value, "weight")
    )


def _check_key(valid: bool, where: str, value: Any, expected: str) -> None:
    if not valid:
        raise TypeError(f"{where}: got {describe(value)}; expected {expected}")


def _check_object_type(object_type: Any, where: str) -> None:
    # a module instance is callable, and would be a key no op ever looks up
    valid = isinstance(object_type, (type, str)) or (
        callable(object_type) and not isinstance(object_type, nn.Module)
    )
    _check_key(
        valid,
        where,
        object_type,
        "a module class (nn.Linear), a function (torch.sigmoid) or a method name ('sigmoid')",
    )


def _check(value: Any, where: str) -> Any:
    if not _is_qconfig(value):
        raise TypeError(
            f"{where}: expected a QConfig (qcore's or torch.ao's) or None, got {value!r}"
        )
    return value


_GLOBAL, _OBJECT_TYPE, _REGEX, _NAME, _ORDER = (
    "",
    "object_type",
    "module_name_regex",
    "module_name",
    "module_name_object_type_order",
)
_STYLES = (
    "global_qconfig",
    "object_type_qconfigs",
    "module_name_regex_qconfigs",
    "module_name_qconfigs",
    "module_name_object_type_order_qconfigs",
)


class QConfigMapping:
    """Module types, functions, method names and module paths -> QConfig."""

    def __init__(self) -> None:
        self.global_qconfig: Any = None
        self.object_type_qconfigs: OrderedDict[Any, Any] = OrderedDict()
        self.module_name_regex_qconfigs: OrderedDict[str, Any] = OrderedDict()
        self.module_name_qconfigs: OrderedDict[str, Any] = OrderedDict()
        self.module_name_object_type_order_qconfigs: OrderedDict[tuple, Any] = OrderedDict()

    def copy(self) -> QConfigMapping:
        """A new mapping with the same entries (the QConfigs themselves shared)."""
        result = QConfigMapping()
        result.global_qconfig = self.global_qconfig
        for style in _STYLES[1:]:
            getattr(result, style).update(getattr(self, style))
        return result

    def set_global(self, global_qconfig: Any) -> QConfigMapping:
        """The QConfig of everything no other entry covers."""
        self.global_qconfig = _check(global_qconfig, "set_global")
        return self

    def set_object_type(self, object_type: Any, qconfig: Any) -> QConfigMapping:
        """For a module class, a function (``torch.sigmoid``) or a method name (``"sigmoid"``)."""
        _check_object_type(object_type, "set_object_type(object_type)")
        self.object_type_qconfigs[object_type] = _check(
            qconfig, f"set_object_type({object_type!r})"
        )
        return self

    def set_module_name_regex(self, module_name_regex: str, qconfig: Any) -> QConfigMapping:
        """For modules whose path matches (``re.match``); earlier regexes win."""
        _check_key(
            isinstance(module_name_regex, (str, re.Pattern)),
            "set_module_name_regex(module_name_regex)",
            module_name_regex,
            "a regex (str) matched against module names",
        )
        try:
            re.compile(module_name_regex)
        except re.error as error:
            raise ValueError(
                f"set_module_name_regex: {module_name_regex!r} is not a valid regex: {error}"
            ) from None
        where = f"set_module_name_regex({module_name_regex!r})"
        self.module_name_regex_qconfigs[module_name_regex] = _check(qconfig, where)
        return self

    def set_module_name(self, module_name: str, qconfig: Any) -> QConfigMapping:
        """For the module at this path and everything inside it."""
        _check_key(
            isinstance(module_name, str),
            "set_module_name(module_name)",
            module_name,
            "a module name (str) such as 'encoder.fc'",
        )
        where = f"set_module_name({module_name!r})"
        self.module_name_qconfigs[module_name] = _check(qconfig, where)
        return self

    def set_module_name_object_type_order(
        self, module_name: str, object_type: Any, index: int, qconfig: Any
    ) -> QConfigMapping:
        """For the ``index``-th call of ``object_type`` inside module ``module_name``."""
        setter = "set_module_name_object_type_order"
        _check_key(
            isinstance(module_name, str),
            f"{setter}(module_name)",
            module_name,
            "a module name (str) such as 'encoder'",
        )
        _check_object_type(object_type, f"{setter}(object_type)")
        _check_key(
            type(index) is int and index >= 0,
            f"{setter}(index)",
            index,
            "a call index, an int >= 0",
        )
        where = f"set_module_name_object_type_order({module_name!r}, {object_type!r}, {index})"
        self.module_name_object_type_order_qconfigs[(module_name, object_type, index)] = _check(
            qconfig, where
        )
        return self

    # -- resolution --------------------------------------------------------------

    def _by_module_name(self, module_name: str, fallback: Any) -> Any:
        name = module_name
        while True:
            if name in self.module_name_qconfigs:
                return self.module_name_qconfigs[name]
            if not name:
                return fallback
            name = name.rpartition(".")[0]

    def qconfig_for(
        self, module_name: str = "", object_type: Any = None, index: int | None = None
    ) -> Any:
        """The QConfig (or None) for the ``index``-th call of ``object_type`` made in the
        module at ``module_name`` ("" for the root), by torch.ao's precedence.

        For a module itself, pass its path and its class (and no index).
        """
        qconfig = self.object_type_qconfigs.get(object_type, self.global_qconfig)
        for regex, regex_qconfig in self.module_name_regex_qconfigs.items():
            if re.match(regex, module_name):
                qconfig = regex_qconfig
                break
        qconfig = self._by_module_name(module_name, qconfig)
        if index is not None:
            key = (module_name, object_type, index)
            qconfig = self.module_name_object_type_order_qconfigs.get(key, qconfig)
        return qconfig

    # -- dict form -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """torch.ao's qconfig_dict form: ``""`` -> global, the others -> lists of tuples."""
        return {
            _GLOBAL: self.global_qconfig,
            _OBJECT_TYPE: list(self.object_type_qconfigs.items()),
            _REGEX: list(self.module_name_regex_qconfigs.items()),
            _NAME: list(self.module_name_qconfigs.items()),
            _ORDER: [(*k, v) for k, v in self.module_name_object_type_order_qconfigs.items()],
        }

    @classmethod
    def from_dict(cls, qconfig_dict: dict[str, Any]) -> QConfigMapping:
        where = "QConfigMapping.from_dict"
        if not isinstance(qconfig_dict, dict):
            raise TypeError(
                f"{where}: got {describe(qconfig_dict)}; expected a dict (torch.ao's "
                "qconfig_dict form)"
            )
        unknown = set(qconfig_dict) - {_GLOBAL, _OBJECT_TYPE, _REGEX, _NAME, _ORDER}
        if unknown:
            raise ValueError(
                f"{where}: unknown keys {sorted(unknown, key=repr)}; expected "
                f"{[_GLOBAL, _OBJECT_TYPE, _REGEX, _NAME, _ORDER]}"
            )
        mapping = cls()
        if _GLOBAL in qconfig_dict:
            mapping.set_global(qconfig_dict[_GLOBAL])
        setters = (
            (_OBJECT_TYPE, mapping.set_object_type, "pair", "(object_type, qconfig)"),
            (_REGEX, mapping.set_module_name_regex, "pair", "(module_name_regex, qconfig)"),
            (_NAME, mapping.set_module_name, "pair", "(module_name, qconfig)"),
            (
                _ORDER,
                mapping.set_module_name_object_type_order,
                "tuple",
                "(module_name, object_type, index, qconfig)",
            ),
        )
        for key, setter, kind, fields in setters:
            entries = qconfig_dict.get(key, [])
            if not isinstance(entries, (list, tuple)):
                raise TypeError(
                    f"{where}[{key!r}]: got {describe(entries)}; expected a list of "
                    f"{kind}s {fields}"
                )
            for i, entry in enumerate(entries):
                if not isinstance(entry, (list, tuple)) or len(entry) != fields.count(",") + 1:
                    raise TypeError(
                        f"{where}[{key!r}][{i}]: got {describe(entry)}; expected a {kind} {fields}"
                    )
                try:
                    setter(*entry)
                except (TypeError, ValueError) as error:
                    # the setter names its argument; this names the entry it came from
                    raise type(error)(f"{where}[{key!r}][{i}]: {error}") from None
        return mapping

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for style in _STYLES:
            lines.append(f" {style}")
            entries = getattr(self, style)
            if isinstance(entries, OrderedDict) and entries:
                lines += [f"  {key}: {qconfig}" for key, qconfig in entries.items()]
            else:
                lines.append(f"  {entries}")
        return "\n".join(lines) + "\n)"


def as_qconfig_mapping(mapping: Any) -> QConfigMapping:
    """A qcore QConfigMapping with the same entries as ``mapping`` (qcore's, returned
    as is; torch.ao's; or a torch.ao qconfig_dict). QConfig objects are kept as given."""
    if isinstance(mapping, QConfigMapping):
        return mapping
    if isinstance(mapping, dict):
        return QConfigMapping.from_dict(mapping)
    if all(hasattr(mapping, style) for style in _STYLES):
        result = QConfigMapping()
        result.set_global(mapping.global_qconfig)
        for style in _STYLES[1:]:
            for key, qconfig in getattr(mapping, style).items():
                getattr(result, style)[key] = _check(qconfig, f"{style}[{key!r}]")
        return result
    raise TypeError(
        f"as_qconfig_mapping: expected a QConfigMapping (qcore's or torch.ao's) or a "
        f"qconfig dict, got {type(mapping).__name__}"
    )


# -- ready-made QConfigs --------------------------------------------------------------

default_qconfig = QConfig(activation=obs.default_observer, weight=obs.default_weight_observer)
default_dynamic_qconfig = QConfig(
    activation=obs.default_dynamic_quant_observer, weight=obs.default_weight_observer
)
float16_dynamic_qconfig = QConfig(
    activation=obs.PlaceholderObserver.with_args(dtype=torch.float16, is_dynamic=True),
    weight=obs.PlaceholderObserver.with_args(dtype=torch.float16),
)
float_qparams_weight_only_qconfig = QConfig(
    activation=obs.default_placeholder_observer, weight=obs.default_float_qparams_observer
)
default_reuse_input_qconfig = QConfig(activation=obs.ReuseInputObserver, weight=obs.NoopObserver)
default_quint8_weight_qconfig = QConfig(activation=obs.HistogramObserver, weight=obs.MinMaxObserver)


def _check_kind(kind: str) -> None:
    if kind not in BACKEND_KINDS:
        raise ValueError(f"unknown backend kind {kind!r}; expected one of {list(BACKEND_KINDS)}")


def _reduce_range(kind: str, reduce_range: bool | None) -> bool:
    """torch.ao's choice for ``kind`` (fbgemm and x86 reduce), unless told otherwise."""
    return kind in ("fbgemm", "x86") if reduce_range is None else reduce_range


def get_default_qconfig(kind: str = "x86", *, reduce_range: bool | None = None) -> QConfig:
    """torch.ao's default post-training QConfig for ``kind``: histogram activations
    (reduce_range on fbgemm/x86, or as given) and per-channel symmetric weights
    (per-tensor on qnnpack)."""
    _check_kind(kind)
    per_channel = kind != "qnnpack"
    return QConfig(
        activation=obs.HistogramObserver.with_args(reduce_range=_reduce_range(kind, reduce_range)),
        weight=obs.default_per_channel_weight_observer
        if per_channel
        else obs.default_weight_observer,
    )


def get_default_qat_qconfig(
    kind: str = "x86", version: int = 1, *, reduce_range: bool | None = None
) -> QConfig:
    """torch.ao's default QAT QConfig for ``kind`` (version 1: the fused fake quants;
    version 0: FakeQuantize); ``reduce_range`` as in :func:`get_default_qconfig`."""
    _check_kind(kind)
    if version not in (0, 1):
        raise ValueError(f"get_default_qat_qconfig: version must be 0 or 1, not {version}")
    fused = version == 1
    cls = obs.FusedMovingAvgObsFakeQuantize if fused else obs.FakeQuantize
    kwargs: dict[str, Any] = {"observer": obs.MovingAverageMinMaxObserver}
    kwargs.update(quant_min=0, quant_max=255)
    if kind != "onednn" or reduce_range is not None:
        kwargs["reduce_range"] = _reduce_range(kind, reduce_range)
    if kind == "qnnpack":
        weight = obs.default_fused_wt_fake_quant if fused else obs.default_weight_fake_quant
    else:
        weight = (
            obs.default_fused_per_channel_wt_fake_quant
            if fused
            else obs.default_per_channel_weight_fake_quant
        )
    return QConfig(activation=cls.with_args(**kwargs), weight=weight)


# ops whose output range is known: they get fixed qparams
FIXED_QPARAMS_OPS: dict[Any, Any] = {
    nn.Hardsigmoid: obs.default_fixed_qparams_range_0to1_observer,
    torch.nn.functional.hardsigmoid: obs.default_fixed_qparams_range_0to1_observer,
    "hardsigmoid": obs.default_fixed_qparams_range_0to1_observer,
    "hardsigmoid_": obs.default_fixed_qparams_range_0to1_observer,
    nn.Sigmoid: obs.default_fixed_qparams_range_0to1_observer,
    torch.sigmoid: obs.default_fixed_qparams_range_0to1_observer,
    "sigmoid": obs.default_fixed_qparams_range_0to1_observer,
    "sigmoid_": obs.default_fixed_qparams_range_0to1_observer,
    nn.Softmax: obs.default_fixed_qparams_range_0to1_observer,
    nn.Tanh: obs.default_fixed_qparams_range_neg1to1_observer,
    torch.tanh: obs.default_fixed_qparams_range_neg1to1_observer,
    "tanh": obs.default_fixed_qparams_range_neg1to1_observer,
    "tanh_": obs.default_fixed_qparams_range_neg1to1_observer,
}


def default_qconfig_mapping(
    kind: str = "x86", is_qat: bool = False, *, reduce_range: bool | None = None
) -> QConfigMapping:
    """The structure of torch.ao's ``get_default_qconfig_mapping(kind)`` (or the QAT
    one), with qcore's observers; ``reduce_range`` as in :func:`get_default_qconfig`."""
    if is_qat:
        qconfig = get_default_qat_qconfig(kind, reduce_range=reduce_range)
    else:
        qconfig = get_default_qconfig(kind, reduce_range=reduce_range)
    default_weight = obs.default_weight_fake_quant if is_qat else obs.default_weight_observer
    # fbgemm/x86 quantize transposed convs' weights per tensor (pytorch issue 47535)
    if kind in ("fbgemm", "x86"):
        transpose = QConfig(activation=qconfig.activation, weight=default_weight)
    else:
        transpose = qconfig
    layernorm = QConfig(activation=qconfig.activation, weight=obs.default_placeholder_observer)
    mapping = (
        QConfigMapping()
        .set_global(qconfig)
        .set_object_type("reshape", default_reuse_input_qconfig)
        .set_object_type(nn.ConvTranspose1d, transpose)
        .set_object_type(nn.ConvTranspose2d, transpose)
        .set_object_type(nn.ConvTranspose3d, transpose)
        .set_object_type(torch.nn.functional.conv_transpose1d, transpose)
        .set_object_type(torch.nn.functional.conv_transpose2d, transpose)
        .set_object_type(torch.nn.functional.conv_transpose3d, transpose)
        .set_object_type(torch.nn.functional.layer_norm, layernorm)
        .set_object_type(nn.LayerNorm, layernorm)
        .set_object_type(nn.PReLU, default_quint8_weight_qconfig)
    )
    fixed: dict[Any, QConfig] = {}
    for op, observer in FIXED_QPARAMS_OPS.items():
        if observer not in fixed:
            activation = (
                obs.FixedQParamsFakeQuantize.with_args(observer=observer) if is_qat else observer
            )
            fixed[observer] = QConfig(activation=activation, weight=default_weight)
        mapping.set_object_type(op, fixed[observer])
    return mapping
