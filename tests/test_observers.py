"""qcore's observers against torch.ao's: same qparams, state and interface."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.ao.quantization import fake_quantize as ao_fq
from torch.ao.quantization import observer as ao

from qcore import observers as qc

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _data(seed: int, shape=(4, 8, 5)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * (1 + i) + 0.3 * i for i in range(3)]


def _assert_same_qparams(ours, theirs):
    (s1, z1), (s2, z2) = ours.calculate_qparams(), theirs.calculate_qparams()
    assert torch.equal(s1, s2), (s1, s2)
    assert torch.equal(z1, z2), (z1, z2)
    assert s1.dtype == s2.dtype and z1.dtype == z2.dtype


PER_TENSOR_ARGS = [
    {},
    {"reduce_range": True},
    {"dtype": torch.qint8},
    {"dtype": torch.qint8, "reduce_range": True},
    {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
    {"dtype": torch.quint8, "qscheme": torch.per_tensor_symmetric},
    {
        "dtype": torch.quint8,
        "qscheme": torch.per_tensor_symmetric,
        "quant_min": 0,
        "quant_max": 100,
    },
    {"dtype": torch.qint32},
    {"dtype": torch.qint8, "quant_min": -127, "quant_max": 127, "eps": 2**-12},
    {"quant_min": 0, "quant_max": 127},
    {"quant_min": 0, "quant_max": 255, "reduce_range": True},
    {"dtype": torch.qint8, "quant_min": -8, "quant_max": 7},
]


@pytest.mark.parametrize("kwargs", PER_TENSOR_ARGS, ids=str)
@pytest.mark.parametrize("name", ["MinMaxObserver", "MovingAverageMinMaxObserver"])
@pytest.mark.parametrize("seed", range(3))
def test_per_tensor_observers_match_torch_ao(name, kwargs, seed):
    ours, theirs = getattr(qc, name)(**kwargs), getattr(ao, name)(**kwargs)
    for x in _data(seed):
        assert ours(x) is x
        theirs(x)
    assert (ours.quant_min, ours.quant_max) == (theirs.quant_min, theirs.quant_max)
    for attr in ("dtype", "qscheme", "reduce_range", "is_dynamic", "has_customized_qrange"):
        assert getattr(ours, attr) == getattr(theirs, attr)
    assert torch.equal(ours.eps, theirs.eps)
    assert torch.equal(ours.min_val, theirs.min_val) and torch.equal(ours.max_val, theirs.max_val)
    _assert_same_qparams(ours, theirs)


PER_CHANNEL_ARGS = [
    {},
    {"ch_axis": 1},
    {"ch_axis": -1, "dtype": torch.qint8, "qscheme": torch.per_channel_symmetric},
    {"dtype": torch.qint8, "qscheme": torch.per_channel_symmetric, "reduce_range": True},
    {"qscheme": torch.per_channel_affine_float_qparams},
    {"dtype": torch.qint8, "quant_min": -127, "quant_max": 127, "eps": 2**-12},
    {"reduce_range": True},
]


@pytest.mark.parametrize("kwargs", PER_CHANNEL_ARGS, ids=str)
@pytest.mark.parametrize(
    "name", ["PerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"]
)
def test_per_channel_observers_match_torch_ao(name, kwargs):
    ours, theirs = getattr(qc, name)(**kwargs), getattr(ao, name)(**kwargs)
    for x in _data(11):
        ours(x)
        theirs(x)
    assert torch.equal(ours.min_val, theirs.min_val) and torch.equal(ours.max_val, theirs.max_val)
    _assert_same_qparams(ours, theirs)


def test_constant_input_and_unobserved_defaults():
    for name in ("MinMaxObserver", "HistogramObserver"):
        ours, theirs = getattr(qc, name)(), getattr(ao, name)()
        _assert_same_qparams(ours, theirs)  # never observed: (1.0, 0)
        for obs in (ours, theirs):
            obs(torch.full((10,), 2.5))
        _assert_same_qparams(ours, theirs)
    with pytest.warns(UserWarning, match="before it observed"):
        qc.PerChannelMinMaxObserver().calculate_qparams()


def test_interface_errors():
    with pytest.raises(NotImplementedError, match="per_tensor"):
        qc.MinMaxObserver(qscheme=torch.per_channel_affine)
    with pytest.raises(NotImplementedError, match="quint8"):
        qc.MinMaxObserver(qscheme=torch.per_tensor_symmetric, reduce_range=True)
    with pytest.raises(ValueError, match="include 0"):
        qc.MinMaxObserver(quant_min=1, quant_max=10)
    with pytest.raises(ValueError, match="float16"):
        qc.MinMaxObserver(dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="is_dynamic"):
        qc.PerChannelMinMaxObserver(is_dynamic=True)


def test_with_args_and_callable_args():
    ctor = qc.MinMaxObserver.with_args(dtype=torch.qint8).with_args(quant_min=-5, quant_max=5)
    a, b = ctor(), ctor()
    assert a is not b and a.dtype == torch.qint8 and a.quant_max == 5
    assert repr(ctor).startswith(
        "functools.partial(<class 'qcore.observers.minmax.MinMaxObserver'>"
    )
    assert repr(ctor).endswith("{}")
    assert ctor.p.keywords == {"dtype": torch.qint8, "quant_min": -5, "quant_max": 5}
    calls = []

    def make_eps():
        calls.append(1)
        return 2.0**-10

    ctor = qc.MinMaxObserver.with_callable_args(eps=make_eps).with_args(dtype=torch.qint8)
    assert float(ctor().eps) == 2.0**-10 and len(calls) == 1
    ctor()
    assert len(calls) == 2


@pytest.mark.parametrize("cls", ["MinMaxObserver", "PerChannelMinMaxObserver", "HistogramObserver"])
def test_state_dict_round_trip_and_torch_ao_keys(cls):
    ours, theirs = getattr(qc, cls)(), getattr(ao, cls)()
    for x in _data(3):
        ours(x)
        theirs(x)
    state = ours.state_dict()
    assert set(state) == set(theirs.state_dict())
    fresh = getattr(qc, cls)()
    fresh.load_state_dict(state)
    _assert_same_qparams(fresh, ours)
    # torch.ao's state loads into qcore's observer
    fresh = getattr(qc, cls)()
    fresh.load_state_dict(theirs.state_dict())
    _assert_same_qparams(fresh, theirs)


def test_fixed_qparams_and_placeholder():
    ours = qc.default_fixed_qparams_range_neg1to1_observer()
    theirs = ao.default_fixed_qparams_range_neg1to1_observer()
    x = torch.randn(4)
    assert ours(x) is x
    _assert_same_qparams(ours, theirs)
    assert (ours.quant_min, ours.quant_max, ours.dtype) == (0, 255, torch.quint8)
    dyn = qc.default_dynamic_quant_observer()
    assert (
        dyn.is_dynamic and dyn.dtype == torch.quint8 and (dyn.quant_min, dyn.quant_max) == (0, 255)
    )
    with pytest.raises(RuntimeError, match="dtype"):
        dyn.calculate_qparams()
    assert qc.PlaceholderObserver(dtype=torch.float16).dtype == torch.float16


# -- HistogramObserver ---------------------------------------------------------------


def _histogram_streams():
    gen = torch.Generator().manual_seed(0)
    t = torch.distributions.StudentT(torch.tensor(1.3))
    n = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    yield "gaussian", [n(2000) for _ in range(3)]
    yield "relu", [torch.relu(n(3000)) for _ in range(3)]
    yield "growing range", [n(1000) * (1 + 3 * i) + i for i in range(4)]
    yield "lognormal", [n(4000).exp()]
    yield "student-t", [t.sample((4000,))]
    yield "outliers", [torch.cat([n(3000), torch.tensor([80.0, -40.0])])]
    yield "skewed", [torch.rand(3000, generator=gen) ** 6 * 20 - 1]
    yield "two values", [torch.tensor([0.0, 1.0])]
    yield "one then range", [torch.full((5,), 0.5), n(500)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"reduce_range": True},
        {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
        {"bins": 256},
        {"quant_min": 0, "quant_max": 127},
    ],
    ids=str,
)
def test_histogram_observer_matches_torch_ao(kwargs):
    for name, stream in _histogram_streams():
        ours, theirs = qc.HistogramObserver(**kwargs), ao.HistogramObserver(**kwargs)
        for x in stream:
            ours(x)
            theirs(x)
        assert torch.equal(ours.histogram, theirs.histogram), name
        assert torch.equal(ours.min_val, theirs.min_val), name
        assert torch.equal(ours.max_val, theirs.max_val), name
        new_ours = ours._non_linear_param_search()
        new_theirs = theirs._non_linear_param_search()
        assert torch.equal(new_ours[0], new_theirs[0]) and torch.equal(
            new_ours[1], new_theirs[1]
        ), (
            name,
            new_ours,
            new_theirs,
        )
        _assert_same_qparams(ours, theirs)


def test_histogram_merge_equals_sequential_observation():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen) * 4 + 2
    sequential = qc.HistogramObserver()
    sequential(a)
    sequential(b)
    first, second = qc.HistogramObserver(), qc.HistogramObserver()
    first(a)
    second(b)
    first.merge(second)
    assert torch.equal(first.min_val, sequential.min_val)
    assert torch.equal(first.max_val, sequential.max_val)
    assert torch.isclose(first.histogram.sum(), sequential.histogram.sum())
    # re-binned histograms differ slightly; the chosen ranges stay close
    s1, _ = first.calculate_qparams()
    s2, _ = sequential.calculate_qparams()
    assert torch.allclose(s1, s2, rtol=0.05)
    empty = qc.HistogramObserver()
    empty.merge(second)
    assert torch.equal(empty.histogram, second.histogram)
    with pytest.raises(ValueError, match="bin"):
        first.merge(qc.HistogramObserver(bins=16))


# -- fake quants -----------------------------------------------------------------------

FAKE_QUANTS = [
    "default_fake_quant",
    "default_weight_fake_quant",
    "default_per_channel_weight_fake_quant",
    "default_embedding_fake_quant",
    "default_histogram_fake_quant",
    "default_fused_act_fake_quant",
    "default_fused_wt_fake_quant",
    "default_fused_per_channel_wt_fake_quant",
    "default_fixed_qparams_range_0to1_fake_quant",
    "default_fixed_qparams_range_neg1to1_fake_quant",
]


@pytest.mark.parametrize("name", FAKE_QUANTS)
def test_fake_quants_match_torch_ao(name):
    ours, theirs = getattr(qc, name)(), getattr(ao_fq, name)()
    assert type(ours).__name__ == type(theirs).__name__
    assert (
        type(ours.activation_post_process).__name__ == type(theirs.activation_post_process).__name__
    )
    for attr in ("quant_min", "quant_max", "dtype", "qscheme", "ch_axis", "is_per_channel"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(6, 10, generator=gen) * (step + 1)
        out, ref = ours(x), theirs(x)
        torch.testing.assert_close(out, ref, rtol=0, atol=float(ours.scale.max()) * 1.01)
        if "fused" in name:  # torch's fused kernel rounds its qparams differently
            torch.testing.assert_close(ours.scale, theirs.scale, rtol=1e-2, atol=0)
            continue
        assert torch.equal(ours.scale, theirs.scale)
        assert torch.equal(ours.zero_point, theirs.zero_point.to(ours.zero_point.dtype))
    assert set(ours.state_dict()) == set(theirs.state_dict())


def test_fake_quantize_switches_and_gradient():
    fq = qc.default_fake_quant()
    x = torch.randn(20, requires_grad=True)
    fq(x).sum().backward()
    assert x.grad is not None
    fq.disable_fake_quant()
    y = torch.randn(5)
    assert torch.equal(fq(y), y)
    scale = fq.scale.clone()
    fq.disable_observer()
    fq(torch.randn(5) * 100)
    assert torch.equal(fq.scale, scale)
    model = torch.nn.Sequential(qc.default_fake_quant(), qc.default_weight_fake_quant())
    model.apply(qc.disable_fake_quant)
    assert all(int(m.fake_quant_enabled) == 0 for m in model)
    model.apply(qc.enable_observer)
    assert all(int(m.observer_enabled) == 1 for m in model)
    with pytest.raises(TypeError, match="FixedQParamsObserver"):
        qc.FixedQParamsFakeQuantize(observer=qc.MinMaxObserver)


def test_fake_quantize_state_dict_round_trip():
    fq = qc.default_per_channel_weight_fake_quant()
    fq(torch.randn(4, 3))
    fresh = qc.default_per_channel_weight_fake_quant()
    fresh.load_state_dict(fq.state_dict())
    assert torch.equal(fresh.scale, fq.scale) and torch.equal(fresh.zero_point, fq.zero_point)


DEFAULT_OBSERVERS = [
    "default_observer",
    "default_weight_observer",
    "default_per_channel_weight_observer",
    "default_histogram_observer",
    "default_dynamic_quant_observer",
    "default_placeholder_observer",
    "default_float_qparams_observer",
    "default_fixed_qparams_range_0to1_observer",
    "default_fixed_qparams_range_neg1to1_observer",
    "weight_observer_range_neg_127_to_127",
    "per_channel_weight_observer_range_neg_127_to_127",
]


@pytest.mark.parametrize("name", DEFAULT_OBSERVERS)
def test_default_observers_mirror_torch_ao(name):
    ours, theirs = getattr(qc, name), getattr(ao, name)
    if hasattr(theirs, "p"):
        assert ours.p.func.__name__ == theirs.p.func.__name__
        assert ours.p.keywords == theirs.p.keywords
    else:
        assert ours.__name__ == theirs.__name__
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = ours(), theirs()
    for attr in ("dtype", "qscheme", "quant_min", "quant_max", "is_dynamic"):
        assert getattr(a, attr, None) == getattr(b, attr, None), attr


def test_merging_many_histograms_at_once_equals_merging_one_by_one():
    """qcore.sync_observers merges rows together (histogram_merge.merge_rows); the
    result is HistogramObserver.merge's, row by row, unobserved rows included."""
    from qcore.observers import HistogramObserver
    from qcore.observers.histogram_merge import merge_rows

    generator = torch.Generator().manual_seed(5)
    pairs = []
    for index in range(12):
        mine, theirs = HistogramObserver(bins=64), HistogramObserver(bins=64)
        if index % 4 != 1:  # row 1, 5, 9: never observed here
            mine(torch.randn(50, generator=generator) * (index + 1))
        if index % 4 != 2:  # row 2, 6, 10: never observed there
            theirs(torch.randn(50, generator=generator) * 2 + index)
        if index % 4 == 3:  # one value seen
            theirs = HistogramObserver(bins=64)
            theirs(torch.full((5,), float(index)))
        pairs.append((mine, theirs))

    def stacked(observers):
        return (
            torch.stack([o.histogram for o in observers]),
            torch.stack([o.min_val for o in observers]),
            torch.stack([o.max_val for o in observers]),
        )

    together = merge_rows(*stacked([m for m, _ in pairs]), *stacked([t for _, t in pairs]), rate=16)
    for row, (mine, theirs) in enumerate(pairs):
        mine.merge(theirs)
        torch.testing.assert_close(together[0][row], mine.histogram)
        assert together[1][row] == mine.min_val and together[2][row] == mine.max_val
