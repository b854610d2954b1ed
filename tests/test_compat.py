"""QConfig vs DTypeConfig: each constraint field gives its reason; accepted
cases give []."""

from collections import namedtuple

import pytest
import torch
from backends import requires_fbgemm
from torch.ao.quantization import (
    FixedQParamsFakeQuantize,
    FixedQParamsObserver,
    MinMaxObserver,
    PlaceholderObserver,
    QConfig,
    default_dynamic_qconfig,
    default_fake_quant,
    default_weight_fake_quant,
    default_weight_observer,
    float16_static_qconfig,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
)

import qcore
from qcore import (
    BackendConfig,
    BackendPatternConfig,
    ConfigError,
    DTypeConfig,
    DTypeWithConstraints,
)
from qcore.config.compat import (
    accepts,
    find_accepting_dtype_config,
    observer_facts,
    qconfig_dtypes,
    reasons_rejected,
    rejection_reasons,
)
from qcore.config.errors import describe
from qcore.config.qconfig import QConfigMapping


def act(**kwargs):
    return MinMaxObserver.with_args(**kwargs)


def qconfig(activation=None, weight=default_weight_observer):
    return QConfig(activation=activation or act(), weight=weight)


def static_config(constraints=None, **kwargs):
    activation = constraints or torch.quint8
    return DTypeConfig(
        input_dtype=activation,
        output_dtype=activation,
        weight_dtype=kwargs.pop("weight_dtype", torch.qint8),
        bias_dtype=kwargs.pop("bias_dtype", torch.float),
        **kwargs,
    )


def constrained(**kwargs):
    return DTypeWithConstraints(dtype=kwargs.pop("dtype", torch.quint8), **kwargs)


# -- accepted -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype_config, qc",
    [
        (static_config(), qconfig()),
        (
            static_config(
                constrained(
                    quant_min_lower_bound=0, quant_max_upper_bound=255, scale_min_lower_bound=2**-12
                )
            ),
            qconfig(act(quant_min=0, quant_max=127, eps=2**-12)),
        ),
        (static_config(constrained(scale_max_upper_bound=1.0)), qconfig()),
        (
            DTypeConfig(
                input_dtype=torch.quint8,
                output_dtype=torch.float,
                weight_dtype=torch.qint8,
                bias_dtype=torch.float,
                is_dynamic=True,
            ),
            default_dynamic_qconfig,
        ),
        (
            DTypeConfig(
                input_dtype=torch.float16,
                output_dtype=torch.float16,
                weight_dtype=torch.float16,
                bias_dtype=torch.float16,
            ),
            float16_static_qconfig,
        ),
        (DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8), qconfig()),
        (DTypeConfig(), qconfig()),
    ],
)
def test_accepted(dtype_config, qc):
    assert reasons_rejected(dtype_config, qc) == []


def test_fixed_qparams_accepted_as_torch_ao_default_mapping_sets_them():
    fixed = constrained(
        quant_min_lower_bound=0,
        quant_max_upper_bound=255,
        scale_exact_match=1.0 / 256.0,
        zero_point_exact_match=0,
    )
    dtype_config = DTypeConfig(input_dtype=fixed, output_dtype=fixed)
    sigmoid_qconfig = get_default_qconfig_mapping().object_type_qconfigs[torch.nn.Sigmoid]
    assert reasons_rejected(dtype_config, sigmoid_qconfig) == []
    qat_sigmoid = get_default_qat_qconfig_mapping().object_type_qconfigs[torch.nn.Sigmoid]
    assert reasons_rejected(dtype_config, qat_sigmoid, is_qat=True) == []


# -- each field's reason ------------------------------------------------------------


def test_activation_dtype():
    reasons = reasons_rejected(static_config(), qconfig(act(dtype=torch.qint8)))
    assert reasons == ["activation dtype is torch.qint8 but the backend accepts torch.quint8"]


def test_input_and_output_dtypes_reported_separately_when_they_differ():
    dtype_config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.qint8)
    reasons = reasons_rejected(dtype_config, qconfig(act(dtype=torch.qint32)))
    assert reasons == [
        "input activation dtype is torch.qint32 but the backend accepts torch.quint8",
        "output activation dtype is torch.qint32 but the backend accepts torch.qint8",
    ]


def test_weight_dtype():
    reasons = reasons_rejected(
        static_config(weight_dtype=torch.float16), qconfig(weight=default_weight_observer)
    )
    assert reasons == ["weight dtype is torch.qint8 but the backend accepts torch.float16"]


def test_bias_dtype():
    reasons = reasons_rejected(static_config(bias_dtype=torch.float16), qconfig())
    assert len(reasons) == 1
    assert reasons[0].startswith("bias dtype is torch.float32")
    assert "the backend accepts torch.float16" in reasons[0]


def test_is_dynamic_both_ways():
    dynamic = DTypeConfig(
        input_dtype=torch.quint8,
        output_dtype=torch.float,
        weight_dtype=torch.qint8,
        is_dynamic=True,
    )
    reasons = reasons_rejected(dynamic, qconfig())
    assert reasons[0].startswith(
        "input activation is statically quantized but the backend expects dynamic quantization"
    )
    assert (
        "output activation dtype is torch.quint8 but the backend accepts torch.float32"
        in (reasons[1])
    )
    reasons = reasons_rejected(static_config(), default_dynamic_qconfig)
    assert any("float32 (dynamic quantization keeps the output in float)" in r for r in reasons)


def test_quant_min_lower_bound():
    dtype_config = static_config(constrained(dtype=torch.qint8, quant_min_lower_bound=-127))
    reasons = reasons_rejected(dtype_config, qconfig(act(dtype=torch.qint8)))
    assert reasons == [
        "activation quant_min -128 is below the bound -127; "
        "pass quant_min=-127 or more to the observer"
    ]


def test_quant_max_upper_bound():
    dtype_config = static_config(constrained(quant_max_upper_bound=127))
    reasons = reasons_rejected(dtype_config, qconfig(act(quant_min=0, quant_max=255)))
    assert len(reasons) == 1
    assert "quant_max 255 exceeds the bound 127" in reasons[0]


def test_torch_ao_checks_both_bounds_together_qcore_each_alone():
    dtype_config = static_config(constrained(quant_min_lower_bound=0, quant_max_upper_bound=127))
    reasons = reasons_rejected(dtype_config, qconfig(act(quant_min=0, quant_max=255)))
    assert reasons == [
        "activation quant_max 255 exceeds the bound 127; pass quant_max=127 or less to the observer"
    ]


def test_scale_min_lower_bound():
    dtype_config = static_config(constrained(scale_min_lower_bound=2**-12))
    reasons = reasons_rejected(dtype_config, qconfig())
    assert len(reasons) == 1
    assert (
        "eps 1.1920928955078125e-07 is below scale_min_lower_bound 0.000244140625 (2**-12)"
        in reasons[0]
    )
    assert "pass eps=0.000244140625 or more to the observer" in reasons[0]


def test_scale_max_upper_bound():
    dtype_config = static_config(constrained(scale_max_upper_bound=0.01))
    reasons = reasons_rejected(dtype_config, qconfig(act(eps=0.5)))
    assert reasons == ["activation eps 0.5 exceeds scale_max_upper_bound 0.01"]
    fixed = FixedQParamsObserver.with_args(scale=0.5, zero_point=0)
    reasons = reasons_rejected(dtype_config, qconfig(fixed))
    assert reasons == ["activation fixed scale 0.5 exceeds scale_max_upper_bound 0.01"]


def test_scale_exact_match():
    fixed = constrained(scale_exact_match=1.0 / 256.0, zero_point_exact_match=0)
    dtype_config = DTypeConfig(input_dtype=fixed, output_dtype=fixed)
    tanh_qconfig = qconfig(FixedQParamsObserver.with_args(scale=2.0 / 256.0, zero_point=0))
    reasons = reasons_rejected(dtype_config, tanh_qconfig)
    assert reasons == [
        "activation fixed scale 0.0078125 does not match scale_exact_match 0.00390625 (2**-8)"
    ]


def test_zero_point_exact_match():
    fixed = constrained(scale_exact_match=2.0 / 256.0, zero_point_exact_match=128)
    dtype_config = DTypeConfig(input_dtype=fixed, output_dtype=fixed)
    reasons = reasons_rejected(
        dtype_config, qconfig(FixedQParamsObserver.with_args(scale=2.0 / 256.0, zero_point=0))
    )
    assert reasons == ["activation fixed zero_point 0 does not match zero_point_exact_match 128"]


def test_fixed_qparams_required():
    fixed = constrained(scale_exact_match=1.0 / 256.0, zero_point_exact_match=0)
    dtype_config = DTypeConfig(input_dtype=fixed, output_dtype=fixed)
    reasons = reasons_rejected(dtype_config, qconfig())
    assert len(reasons) == 1
    assert "activation observer is not a fixed-qparams one" in reasons[0]
    assert "scale=0.00390625, zero_point=0" in reasons[0]
    reasons = reasons_rejected(
        dtype_config,
        QConfig(activation=default_fake_quant, weight=default_weight_fake_quant),
        is_qat=True,
    )
    assert "activation fake-quant is not a fixed-qparams one" in reasons[0]


@pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max")
def test_fixed_qparams_fake_quant_is_recognised():
    facts = observer_facts(
        FixedQParamsFakeQuantize(FixedQParamsObserver.with_args(scale=1 / 256, zero_point=0))
    )
    assert facts.is_fixed_qparams
    assert (facts.fixed_scale, facts.fixed_zero_point) == (1 / 256, 0)
    # an ordinary fake quant has scale/zero_point buffers but is not fixed
    assert not observer_facts(default_fake_quant()).is_fixed_qparams


def test_weight_constraints():
    weight = constrained(
        dtype=torch.qint8,
        quant_min_lower_bound=-127,
        quant_max_upper_bound=127,
        scale_min_lower_bound=2**-12,
    )
    dtype_config = static_config(weight_dtype=weight)
    reasons = reasons_rejected(dtype_config, qconfig())
    assert reasons == [
        "weight quant_min -128 is below the bound -127; "
        "pass quant_min=-127 or more to the observer",
        "weight eps 1.1920928955078125e-07 is below scale_min_lower_bound 0.000244140625 (2**-12); "
        "pass eps=0.000244140625 or more to the observer",
    ]
    good_weight = MinMaxObserver.with_args(
        dtype=torch.qint8,
        qscheme=torch.per_tensor_symmetric,
        quant_min=-127,
        quant_max=127,
        eps=2**-12,
    )
    assert reasons_rejected(dtype_config, qconfig(weight=good_weight)) == []


def test_several_failures_all_reported():
    dtype_config = static_config(
        constrained(quant_max_upper_bound=127, scale_min_lower_bound=2**-12)
    )
    reasons = reasons_rejected(dtype_config, qconfig(act(quant_min=0, quant_max=255)))
    assert len(reasons) == 2
    assert "quant_max 255 exceeds the bound 127" in reasons[0]
    assert "is below scale_min_lower_bound" in reasons[1]


def test_constraints_only_checked_when_dtype_matches():
    # as torch.ao: a dtype mismatch is the reason; the bounds are not looked at
    dtype_config = static_config(constrained(quant_max_upper_bound=127))
    reasons = reasons_rejected(dtype_config, qconfig(act(dtype=torch.qint8)))
    assert reasons == ["activation dtype is torch.qint8 but the backend accepts torch.quint8"]


# -- duck-typed observers --------------------------------------------------------------


class DuckObserver:
    def __init__(self, dtype=torch.quint8, **attributes):
        self.dtype = dtype
        for name, value in attributes.items():
            setattr(self, name, value)


DuckQConfig = namedtuple("DuckQConfig", ["activation", "weight"])


def duck(**attributes):
    return DuckQConfig(
        activation=lambda: DuckObserver(**attributes),
        weight=lambda: DuckObserver(dtype=torch.qint8),
    )


def test_duck_typed_observers():
    dtype_config = static_config(
        constrained(quant_min_lower_bound=0, quant_max_upper_bound=255, scale_min_lower_bound=0.01)
    )
    assert reasons_rejected(dtype_config, duck(quant_min=0, quant_max=255, eps=0.01)) == []
    reasons = reasons_rejected(dtype_config, duck())
    assert reasons == [
        "activation observer has no quant_min; the backend requires quant_min >= 0",
        "activation observer has no quant_max; the backend requires quant_max <= 255",
        "activation observer has no eps, so its smallest scale is unknown; the backend requires "
        "scale_min_lower_bound 0.01 (use an observer with eps)",
    ]
    # a fixed-qparams duck observer
    fixed = constrained(scale_exact_match=0.5, zero_point_exact_match=3)
    assert reasons_rejected(DTypeConfig(input_dtype=fixed), duck(scale=0.5, zero_point=3)) == []
    assert qconfig_dtypes(duck(is_dynamic=True)) == (torch.quint8, torch.qint8, True)


def test_placeholder_observer_without_range():
    dtype_config = DTypeConfig(
        input_dtype=constrained(dtype=torch.float16, quant_max_upper_bound=1)
    )
    qc = qconfig(PlaceholderObserver.with_args(dtype=torch.float16))
    assert reasons_rejected(dtype_config, qc) == [
        "input activation observer has no quant_max; the backend requires quant_max <= 1"
    ]


def test_no_qconfig_and_broken_qconfig():
    assert reasons_rejected(static_config(), None) == [
        "no QConfig is set, so the pattern is left in float"
    ]

    def broken():
        raise RuntimeError("boom")

    with pytest.raises(ConfigError, match=r"qconfig.activation.*RuntimeError: boom"):
        reasons_rejected(static_config(), DuckQConfig(activation=broken, weight=broken))
    with pytest.raises(ConfigError, match="qconfig.weight"):
        reasons_rejected(static_config(), DuckQConfig(activation=act(), weight=3))
    with pytest.raises(ConfigError, match="expected a DTypeConfig"):
        reasons_rejected("dtype config", qconfig())


def _builds_three():
    return 3


@pytest.mark.parametrize("constructor", [_builds_three, torch.nn.Identity])
def test_a_qconfig_building_no_observer_is_refused_naming_what_it_built(constructor):
    """Its facts read as all None, so every op stayed float, the reason blaming dtypes."""
    with pytest.raises(ConfigError) as refused:
        reasons_rejected(static_config(), DuckQConfig(activation=constructor, weight=act()))
    assert str(refused.value) == (
        f"qconfig.activation: got {describe(constructor)}, which built "
        f"{describe(constructor())}; expected an observer or fake quant (an object with a "
        "dtype)"
    )


@requires_fbgemm
def test_prepare_refuses_a_qconfig_building_no_observer():
    mapping = QConfigMapping().set_global(QConfig(activation=_builds_three, weight=_builds_three))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    expected = r"^qconfig\.activation: got .*_builds_three, which built 3 \(int\); expected an"
    with pytest.raises(ConfigError, match=expected):
        qcore.prepare_fx(model, mapping, (torch.randn(2, 4),), "fbgemm")


# -- pattern and backend level ---------------------------------------------------------------


def test_find_accepting_dtype_config_reports_each_rejection():
    int8 = static_config(constrained(scale_min_lower_bound=2**-12))
    fp16 = DTypeConfig(input_dtype=torch.float16, output_dtype=torch.float16)
    pattern_config = BackendPatternConfig(torch.nn.Linear).set_dtype_configs([fp16, int8])
    accepted, rejected = find_accepting_dtype_config(pattern_config, qconfig(act(eps=2**-12)))
    assert accepted is int8
    assert len(rejected) == 1 and rejected[0].startswith("DTypeConfig(input_dtype=torch.float16")
    assert "activation dtype is torch.quint8 but the backend accepts torch.float16" in rejected[0]

    accepted, rejected = find_accepting_dtype_config(pattern_config, qconfig())
    assert accepted is None and len(rejected) == 2
    assert "below scale_min_lower_bound" in rejected[1]

    accepted, rejected = find_accepting_dtype_config(BackendPatternConfig("relu"), qconfig())
    assert accepted is None and "has no DTypeConfig" in rejected[0]
    with pytest.raises(ConfigError):
        find_accepting_dtype_config(static_config(), qconfig())


def test_accepts_simple_form_patterns():
    backend_config = BackendConfig("b").set_backend_pattern_configs(
        [
            BackendPatternConfig((torch.nn.Conv2d, torch.nn.ReLU)).add_dtype_config(
                static_config()
            ),
            BackendPatternConfig(
                (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.ReLU)
            ).add_dtype_config(static_config()),
        ]
    )
    assert accepts(backend_config, (torch.nn.Conv2d, torch.nn.ReLU), qconfig())
    assert accepts(
        backend_config, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.ReLU), qconfig()
    )
    assert not accepts(
        backend_config, (torch.nn.Conv2d, torch.nn.ReLU), qconfig(act(dtype=torch.qint8))
    )
    assert rejection_reasons(backend_config, torch.nn.Linear, qconfig()) == [
        "no pattern Linear in backend 'b'"
    ]
    with pytest.raises(ConfigError, match="expected a BackendConfig"):
        accepts({}, torch.nn.Linear, qconfig())


def test_torch_ao_native_configs_accept_their_default_qconfigs():
    from qcore.config.torch_ao import from_torch_ao, import_torch_ao_backend_config

    ao = import_torch_ao_backend_config()
    for getter, engine in (
        (ao.get_fbgemm_backend_config, "fbgemm"),
        (ao.get_qnnpack_backend_config, "qnnpack"),
    ):
        config = from_torch_ao(getter())
        mapping = get_default_qconfig_mapping(engine)
        for module in (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Sigmoid):
            qc = mapping.object_type_qconfigs.get(module, mapping.global_qconfig)
            assert rejection_reasons(config, module, qc) == [], (engine, module)
