"""qcore's QConfig / QConfigMapping against torch.ao's."""

from __future__ import annotations

import warnings

import pytest
import torch
from backends import installed
from torch.ao.quantization import QConfig as AOQConfig
from torch.ao.quantization import QConfigMapping as AOQConfigMapping
from torch.ao.quantization import get_default_qat_qconfig_mapping, get_default_qconfig_mapping
from torch.ao.quantization.qconfig import get_default_qat_qconfig as ao_qat_qconfig
from torch.ao.quantization.qconfig import get_default_qconfig as ao_qconfig

from qcore import observers as qc
from qcore.config.errors import describe as describe_value
from qcore.config.qconfig import (
    QConfig,
    QConfigMapping,
    as_qconfig_mapping,
    default_qconfig,
    default_qconfig_mapping,
    get_default_qat_qconfig,
    get_default_qconfig,
)

KINDS = ["fbgemm", "x86", "qnnpack", "onednn"]


def describe(ctor):
    """A constructor as (class name, bound arguments), nested ones described too."""
    if ctor is None:
        return None
    if hasattr(ctor, "p"):
        keywords = {k: describe(v) if callable(v) else v for k, v in ctor.p.keywords.items()}
        return (ctor.p.func.__name__, tuple(sorted(keywords.items(), key=lambda kv: kv[0])))
    return (ctor.__name__, ())


def describe_qconfig(qconfig):
    if qconfig is None:
        return None
    return (describe(qconfig.activation), describe(qconfig.weight))


def key_name(key):
    return key if isinstance(key, str) else f"{key.__module__}.{key.__name__}"


@pytest.mark.parametrize("kind", KINDS)
def test_default_qconfigs_mirror_torch_ao(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert describe_qconfig(get_default_qconfig(kind)) == describe_qconfig(ao_qconfig(kind))
        for version in (0, 1):
            ours = get_default_qat_qconfig(kind, version)
            assert describe_qconfig(ours) == describe_qconfig(ao_qat_qconfig(kind, version))


@pytest.mark.parametrize("is_qat", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_default_qconfig_mapping_has_torch_ao_structure(kind, is_qat):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = (get_default_qat_qconfig_mapping if is_qat else get_default_qconfig_mapping)(kind)
    ours = default_qconfig_mapping(kind, is_qat=is_qat)
    assert describe_qconfig(ours.global_qconfig) == describe_qconfig(theirs.global_qconfig)
    assert [key_name(k) for k in ours.object_type_qconfigs] == [
        key_name(k) for k in theirs.object_type_qconfigs
    ]
    for (key, q1), q2 in zip(
        ours.object_type_qconfigs.items(), theirs.object_type_qconfigs.values(), strict=True
    ):
        assert describe_qconfig(q1) == describe_qconfig(q2), key
    for style in ("module_name_regex_qconfigs", "module_name_qconfigs"):
        assert not getattr(ours, style) and not getattr(theirs, style)
    # fixed-qparams ops
    sigmoid = ours.object_type_qconfigs[torch.nn.Sigmoid]
    observer = sigmoid.activation()
    if is_qat:
        observer = observer.activation_post_process
    assert isinstance(observer, qc.FixedQParamsObserver)
    assert float(observer.scale) == 1.0 / 256.0


def test_qconfigs_build_qcore_observers():
    qconfig = get_default_qconfig("x86")
    assert isinstance(qconfig.activation(), qc.HistogramObserver)
    assert qconfig.activation().reduce_range
    assert isinstance(qconfig.weight(), qc.PerChannelMinMaxObserver)
    assert isinstance(get_default_qconfig("qnnpack").weight(), qc.MinMaxObserver)
    qat = get_default_qat_qconfig("x86")
    assert isinstance(qat.activation(), qc.FusedMovingAvgObsFakeQuantize)


def test_qconfig_validation_messages():
    with pytest.raises(ValueError, match=r"QConfig\.activation .*instance .*with_args"):
        QConfig(activation=qc.MinMaxObserver(), weight=qc.default_weight_observer)
    with pytest.raises(ValueError, match=r"QConfig\.weight .*got 3 of type int"):
        QConfig(activation=qc.MinMaxObserver, weight=3)
    with pytest.raises(ValueError, match="unknown backend kind 'tpu'"):
        get_default_qconfig("tpu")
    with pytest.raises(TypeError, match=r"set_object_type\(.*Linear.*expected a QConfig"):
        QConfigMapping().set_object_type(torch.nn.Linear, "int8")
    with pytest.raises(ValueError, match="not a valid regex"):
        QConfigMapping().set_module_name_regex("(", default_qconfig)
    with pytest.raises(ValueError, match="unknown keys"):
        QConfigMapping.from_dict({"modul_name": []})
    with pytest.raises(TypeError, match="as_qconfig_mapping"):
        as_qconfig_mapping(42)


def _q(n):
    return QConfig(activation=qc.MinMaxObserver.with_args(quant_min=0, quant_max=n), weight=None)


def _mapping(cls):
    return (
        cls()
        .set_global(_q(1))
        .set_object_type(torch.nn.Linear, _q(2))
        .set_object_type(torch.add, _q(2))
        .set_module_name_regex("block.*", _q(3))
        .set_module_name_regex("block1.*", _q(30))
        .set_module_name("block1", _q(4))
        .set_module_name("block1.skip", None)
        .set_module_name_object_type_order("block1.sub", torch.add, 1, _q(5))
    )


def test_precedence_resolution():
    m = _mapping(QConfigMapping)

    def n(q):
        return None if q is None else q.activation.p.keywords["quant_max"]

    assert n(m.qconfig_for("", torch.nn.Conv2d)) == 1  # global
    assert n(m.qconfig_for("head", torch.nn.Linear)) == 2  # object type
    assert n(m.qconfig_for("block2.fc", torch.nn.Linear)) == 3  # first matching regex
    assert n(m.qconfig_for("block1.fc", torch.nn.Linear)) == 4  # module name, via parent
    assert n(m.qconfig_for("block1.skip.fc", torch.nn.Linear)) is None  # nearest ancestor
    assert n(m.qconfig_for("block1.sub", torch.add, 0)) == 4
    assert n(m.qconfig_for("block1.sub", torch.add, 1)) == 5  # (name, type, index)
    assert n(m.qconfig_for("other", torch.add, 1)) == 2


def test_precedence_matches_the_engine_rules_for_torch_ao_mappings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = as_qconfig_mapping(_mapping(AOQConfigMapping))
    ours = _mapping(QConfigMapping)
    for args in [
        ("", torch.nn.Conv2d),
        ("head", torch.nn.Linear),
        ("block2.fc", torch.nn.Linear),
        ("block1.fc", torch.nn.Linear),
        ("block1.skip.fc", torch.nn.Linear),
        ("block1.sub", torch.add, 1),
    ]:
        assert describe_qconfig(ours.qconfig_for(*args)) == describe_qconfig(
            theirs.qconfig_for(*args)
        )


def test_torch_ao_qconfig_objects_are_accepted_and_converted():
    ao_qconfig_obj = AOQConfig(activation=qc.MinMaxObserver, weight=qc.default_weight_observer)
    mapping = QConfigMapping().set_global(ao_qconfig_obj)
    assert mapping.qconfig_for("x", torch.nn.Linear) is ao_qconfig_obj
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao_mapping = get_default_qconfig_mapping("fbgemm")
    converted = as_qconfig_mapping(ao_mapping)
    assert isinstance(converted, QConfigMapping)
    assert list(converted.object_type_qconfigs) == list(ao_mapping.object_type_qconfigs)
    assert converted.global_qconfig is ao_mapping.global_qconfig
    assert as_qconfig_mapping(converted) is converted


def test_dict_round_trip_and_torch_ao_dict_form():
    m = _mapping(QConfigMapping)
    again = QConfigMapping.from_dict(m.to_dict())
    assert again.to_dict() == m.to_dict()
    ao_dict = _mapping(AOQConfigMapping).to_dict()
    assert set(ao_dict) == set(m.to_dict())
    assert [k for k, _ in ao_dict["object_type"]] == [k for k, _ in m.to_dict()["object_type"]]
    assert as_qconfig_mapping(ao_dict).to_dict().keys() == m.to_dict().keys()
    assert "QConfigMapping (" in repr(m) and "module_name_object_type_order_qconfigs" in repr(m)


@pytest.mark.skipif(not installed("fbgemm"), reason="needs the fbgemm plugin")
def test_fused_modules_with_different_qconfigs_are_explained():
    """torch.ao raises here; qcore keeps the fused conv-relu float and says why."""
    import qcore

    class ConvReLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.relu = torch.nn.ReLU()

        def forward(self, x):
            return self.relu(self.conv(x))

    per_channel = QConfig(
        activation=qc.HistogramObserver,
        weight=qc.PerChannelMinMaxObserver.with_args(
            dtype=torch.qint8, qscheme=torch.per_channel_symmetric
        ),
    )
    mapping = default_qconfig_mapping("fbgemm").set_object_type(torch.nn.Conv2d, per_channel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        prepared = qcore.prepare_fx(
            ConvReLU().eval(), mapping, (torch.randn(1, 3, 8, 8),), backend="fbgemm"
        )
    entry = qcore.explain(prepared)["conv"]
    assert entry.status.value == "float"
    assert "conv, relu" in entry.reason and "different QConfigs" in entry.reason


# onednn's plugin (x86's) takes 7-bit activations on CPUs without VNNI, unlike torch.ao
@pytest.mark.parametrize("kind", ["fbgemm", "x86", "qnnpack"])
def test_each_backends_default_mapping_keeps_its_activation_range(kind):
    """qcore.get_default_qconfig_mapping(kind) is the plugin's where installed, else
    torch.ao's for that kind: never another backend's (qnnpack's 8-bit activations
    once came back as x86's 7-bit ones where the qnnpack plugin was not installed)."""
    import qcore

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mapping, peer in (
            (qcore.get_default_qconfig_mapping(kind), get_default_qconfig_mapping(kind)),
            (qcore.get_default_qat_qconfig_mapping(kind), get_default_qat_qconfig_mapping(kind)),
        ):
            ours, theirs = mapping.global_qconfig.activation(), peer.global_qconfig.activation()
            assert (ours.quant_min, ours.quant_max) == (theirs.quant_min, theirs.quant_max), kind


@pytest.mark.parametrize("typo", ["qnnpak", "fbgem", "X86"])
@pytest.mark.parametrize("is_qat", [False, True])
def test_an_unknown_backend_name_for_the_default_mapping_is_an_error(typo, is_qat):
    # It used to return x86's mapping (7-bit activations): qnnpack models lost 5 dB
    # without a word. torch.ao refuses the name too.
    import qcore

    get = qcore.get_default_qat_qconfig_mapping if is_qat else qcore.get_default_qconfig_mapping
    with pytest.raises(qcore.UnknownBackendError, match=f"unknown backend '{typo}'"):
        get(typo)


def test_a_module_name_that_names_no_module_is_warned_about():
    # torch.ao ignores it: the layer the user meant to keep float is quantized, silently.
    import torch.nn.functional as F
    from torch.ao.quantization.backend_config import get_native_backend_config

    import qcore
    from qcore.config.errors import QCoreWarning

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.head(F.relu(self.block(x)))

    mapping = (
        qcore.QConfigMapping()
        .set_global(default_qconfig)
        .set_module_name("block.0", None)  # exists
        .set_module_name("haed", None)
        .set_module_name_regex(r"blok\..*", None)
        .set_module_name_regex(r"block\..*", None)  # matches
        .set_module_name_object_type_order("", F.relu, 0, None)  # the model itself
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qcore.prepare_fx(
            Net().eval(), mapping, (torch.randn(2, 8),), backend_config=get_native_backend_config()
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, QCoreWarning)]
    named = [m for m in messages if "names no module" in m]
    assert len(named) == 1, messages
    assert "module name 'haed'; module name regex 'blok\\\\..*'" in named[0]
    assert "'block" not in named[0]


_OBJECT_TYPES = (
    "a module class (nn.Linear), a function (torch.sigmoid) or a method name ('sigmoid')"
)


@pytest.mark.parametrize(
    ("set_entry", "field", "value", "expected"),
    [
        # re.compile's own "first argument must be string or compiled pattern"
        (
            lambda m, v: m.set_module_name_regex(v, None),
            "set_module_name_regex(module_name_regex)",
            3,
            "a regex (str) matched against module names",
        ),
        # the rest were stored as keys no module or op ever looks up
        (
            lambda m, v: m.set_module_name(v, None),
            "set_module_name(module_name)",
            3,
            "a module name (str) such as 'encoder.fc'",
        ),
        (
            lambda m, v: m.set_object_type(v, None),
            "set_object_type(object_type)",
            torch.nn.Linear(2, 2),
            _OBJECT_TYPES,
        ),
        (lambda m, v: m.set_object_type(v, None), "set_object_type(object_type)", 3, _OBJECT_TYPES),
        (
            lambda m, v: m.set_module_name_object_type_order("fc", torch.nn.Linear, v, None),
            "set_module_name_object_type_order(index)",
            "0",
            "a call index, an int >= 0",
        ),
        (
            lambda m, v: m.set_module_name_object_type_order(v, torch.add, 0, None),
            "set_module_name_object_type_order(module_name)",
            None,
            "a module name (str) such as 'encoder'",
        ),
    ],
)
def test_a_mapping_key_of_the_wrong_kind_is_refused_naming_the_argument(
    set_entry, field, value, expected
):
    mapping = QConfigMapping()
    with pytest.raises(TypeError) as refused:
        set_entry(mapping, value)
    assert str(refused.value) == f"{field}: got {describe_value(value)}; expected {expected}"
    assert mapping.to_dict() == QConfigMapping().to_dict()


@pytest.mark.parametrize(
    ("qconfig_dict", "field", "value", "expected"),
    [
        # each raised Python's own unpacking error, naming neither key nor entry
        (
            {"object_type": torch.nn.Linear},
            "['object_type']",
            torch.nn.Linear,
            "a list of pairs (object_type, qconfig)",
        ),
        (
            {"object_type": [(torch.nn.Linear,)]},
            "['object_type'][0]",
            (torch.nn.Linear,),
            "a pair (object_type, qconfig)",
        ),
        (
            {"object_type": {torch.nn.Linear: default_qconfig}},
            "['object_type']",
            {torch.nn.Linear: default_qconfig},
            "a list of pairs (object_type, qconfig)",
        ),
        (
            {"module_name": {"fc": default_qconfig}},
            "['module_name']",
            {"fc": default_qconfig},
            "a list of pairs (module_name, qconfig)",
        ),
        (
            {"module_name_object_type_order": [("fc", torch.nn.Linear, default_qconfig)]},
            "['module_name_object_type_order'][0]",
            ("fc", torch.nn.Linear, default_qconfig),
            "a tuple (module_name, object_type, index, qconfig)",
        ),
        (None, "", None, "a dict (torch.ao's qconfig_dict form)"),
    ],
)
def test_a_qconfig_dict_of_the_wrong_shape_is_refused_naming_the_entry(
    qconfig_dict, field, value, expected
):
    with pytest.raises(TypeError) as refused:
        QConfigMapping.from_dict(qconfig_dict)
    assert str(refused.value) == (
        f"QConfigMapping.from_dict{field}: got {describe_value(value)}; expected {expected}"
    )


def test_a_qconfig_dict_entry_a_setter_refuses_names_the_entry():
    qconfig_dict = {"module_name": [("fc", None), (3, None)]}
    with pytest.raises(TypeError) as refused:
        as_qconfig_mapping(qconfig_dict)  # as prepare_fx reads a legacy qconfig dict
    assert str(refused.value) == (
        "QConfigMapping.from_dict['module_name'][1]: set_module_name(module_name): got 3 "
        "(int); expected a module name (str) such as 'encoder.fc'"
    )
