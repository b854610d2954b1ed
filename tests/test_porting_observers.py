"""Porting users get qcore's speed too (issue 15 section 4).

torch.ao's HistogramObserver in a QConfig (torch.ao's ``get_default_qconfig_mapping``)
is built as qcore's HistogramObserver, with the same arguments: differentially,
the two give equal histograms, ranges and qparams on the same data (qcore's
histogram.py promises the same chosen range, so equality is exact). Exact class
only: a subclass, a constructor qcore cannot see through, and torch.ao's other
observers stay as given (qcore.observers.substitute says why).
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from backends import installed
from torch import nn
from torch.ao.quantization import observer as ao

import qcore
from qcore import observers as qc
from qcore.engine import observe
from qcore.observers.nonfinite import NonFiniteValuesWarning
from qcore.observers.substitute import fast_constructor
from qcore.pt2e import BackendQuantizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
requires_x86 = pytest.mark.skipif(not installed("x86"), reason="needs the x86 plugin")
requires_a_plugin = pytest.mark.skipif(not installed("native"), reason="needs a backend plugin")


def _streams():
    """(name, batches): shapes and distributions activations have."""
    gen = torch.Generator().manual_seed(15)
    n = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    student = torch.distributions.StudentT(torch.tensor(1.5))
    torch.manual_seed(4)
    yield "conv-bn-relu 1x4x8x8", [torch.relu(n(1, 4, 8, 8)) for _ in range(2)]
    yield "gaussian 2x3x17", [n(2, 3, 17) for _ in range(3)]
    yield "gaussian 4000", [n(4000)]
    yield "uniform 64x1", [u(64, 1) * 6 - 2 for _ in range(3)]
    yield "growing range 8x128", [n(8, 128) * (1 + 2 * i) + i for i in range(4)]
    yield "shrinking range 1000", [n(1000) * (4 - i) for i in range(3)]
    yield "lognormal 3x3x40", [n(3, 3, 40).exp()]
    yield "student-t 5000", [student.sample((5000,))]
    yield "outliers 2000", [torch.cat([n(2000), torch.tensor([60.0, -25.0])])]
    yield "sparse relu 16x16x4", [torch.relu(n(16, 16, 4) - 1.5) for _ in range(2)]
    yield "negative only 300", [-u(300) * 3 - 0.5]
    yield "integers 500", [torch.randint(-20, 21, (500,), generator=gen).float()]
    yield "tiny range 200", [1.0 + u(200) * 1e-6]
    yield "constant then range", [torch.full((7,), 0.25), n(300)]
    yield "two values", [torch.tensor([0.0, 1.0])]
    yield "one element batches", [torch.tensor([v]) for v in (0.3, -1.2, 2.5)]


KWARGS = [
    {"dtype": dtype, "qscheme": qscheme, "reduce_range": reduce_range}
    for dtype in (torch.quint8, torch.qint8)
    for qscheme in (torch.per_tensor_affine, torch.per_tensor_symmetric)
    for reduce_range in (False, True)
]
KWARGS += [
    {"bins": 256, "reduce_range": True},
    {"quant_min": 0, "quant_max": 127},
    {"dtype": torch.qint8, "quant_min": -64, "quant_max": 63, "eps": 2**-10},
]


def _pair(ctr):
    """torch.ao's observer from ``ctr`` and qcore's from its substitute."""
    theirs, ours = ctr(), fast_constructor(ctr)()
    assert type(theirs) is ao.HistogramObserver
    assert type(ours) is qc.HistogramObserver
    return theirs, ours


def _assert_same_observer(theirs, ours, where):
    for attr in ("bins", "dtype", "qscheme", "reduce_range", "quant_min", "quant_max"):
        assert getattr(ours, attr) == getattr(theirs, attr), (where, attr)
    assert torch.equal(ours.eps, theirs.eps), where
    assert ours.has_customized_qrange == theirs.has_customized_qrange, where


def _assert_same_qparams(theirs, ours, where):
    assert torch.equal(ours.histogram, theirs.histogram), where
    assert torch.equal(ours.min_val, theirs.min_val), where
    assert torch.equal(ours.max_val, theirs.max_val), where
    (s1, z1), (s2, z2) = ours.calculate_qparams(), theirs.calculate_qparams()
    assert torch.equal(s1, s2), (where, s1, s2)
    assert torch.equal(z1, z2), (where, z1, z2)
    assert (s1.dtype, z1.dtype) == (s2.dtype, z2.dtype), where


@pytest.mark.parametrize("kwargs", KWARGS, ids=str)
def test_substitute_gives_torch_ao_qparams(kwargs):
    """Same data through torch.ao's observer and qcore's substitute: equal
    histogram, min/max, scale and zero point (exact, as histogram.py promises)."""
    ctr = ao.HistogramObserver.with_args(**kwargs)
    for name, batches in _streams():
        theirs, ours = _pair(ctr)
        _assert_same_observer(theirs, ours, name)
        for x in batches:
            assert ours(x) is x
            theirs(x)
        _assert_same_qparams(theirs, ours, name)


def _constructors():
    """torch.ao's HistogramObserver behind the wrappers users write."""
    hist = ao.HistogramObserver
    yield "class", hist, {}
    yield "with_args", hist.with_args(reduce_range=True), {"reduce_range": True}
    yield (
        "with_args twice",
        hist.with_args(dtype=torch.qint8).with_args(qscheme=torch.per_tensor_symmetric),
        {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
    )
    yield (
        "with_args overridden",
        hist.with_args(reduce_range=False).with_args(reduce_range=True),
        {"reduce_range": True},
    )
    yield (
        "with_callable_args",
        hist.with_args(bins=128).with_callable_args(eps=lambda: 2**-8),
        {"bins": 128, "eps": 2**-8},
    )
    yield "functools.partial", functools.partial(hist, bins=512), {"bins": 512}
    yield (
        "qcore's PartialConstructor",
        qc.PartialConstructor(functools.partial(hist, reduce_range=True)),
        {"reduce_range": True},
    )
    yield "torch.quantization alias", torch.quantization.HistogramObserver, {}


@pytest.mark.parametrize(
    ("name", "ctr", "bound"), list(_constructors()), ids=lambda v: v if isinstance(v, str) else None
)
def test_every_bound_argument_is_kept(name, ctr, bound):
    theirs, ours = _pair(ctr)
    reference = ao.HistogramObserver(**bound)
    _assert_same_observer(reference, ours, name)
    _assert_same_observer(theirs, ours, name)
    # call-time arguments (what prepare passes) still reach the substitute
    ours = fast_constructor(ctr)(dtype=torch.qint8)
    assert type(ours) is qc.HistogramObserver and ours.dtype == torch.qint8


@pytest.mark.parametrize(
    "kwargs",
    [
        {"qscheme": torch.per_channel_affine},
        {"is_dynamic": True},
        {"quant_min": 1, "quant_max": 100},
        {"dtype": torch.float16},
        {"no_such_argument": 1},
    ],
    ids=str,
)
def test_refused_arguments_are_refused_by_both(kwargs):
    """Refused by both (qcore raises ValueError where torch.ao asserts); an unknown
    keyword is a TypeError in both, which prepare's fallback relies on."""
    ctr = ao.HistogramObserver.with_args(**kwargs)
    with pytest.raises(Exception) as torch_ao_error:
        ctr()
    expected = TypeError if isinstance(torch_ao_error.value, TypeError) else Exception
    with pytest.raises(expected):
        fast_constructor(ctr)()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quant_min": 0, "quant_max": 300},
        {"quant_min": 0},
        {"dtype": torch.qint32},
        {"dtype": torch.uint8},
        {"dtype": torch.int8, "quant_min": -128, "quant_max": 127},
    ],
    ids=str,
)
def test_unusual_arguments_are_taken_alike(kwargs):
    theirs, ours = _pair(ao.HistogramObserver.with_args(**kwargs))
    _assert_same_observer(theirs, ours, str(kwargs))


def test_state_dicts_are_interchangeable():
    theirs, ours = _pair(ao.HistogramObserver.with_args(reduce_range=True))
    x = torch.randn(500, generator=torch.Generator().manual_seed(3))
    theirs(x)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    _assert_same_qparams(theirs, ours, "loaded")


class _MyHistogram(ao.HistogramObserver):
    """A user's subclass: it keeps its own class (it may override anything)."""


@pytest.mark.parametrize(
    "ctr",
    [
        _MyHistogram,
        _MyHistogram.with_args(reduce_range=True),
        lambda **kwargs: ao.HistogramObserver(**kwargs),  # opaque to qcore: kept
        ao.MinMaxObserver,
        ao.PerChannelMinMaxObserver.with_args(dtype=torch.qint8),
        ao.MovingAverageMinMaxObserver,
        qc.HistogramObserver.with_args(reduce_range=True),
        None,
    ],
    ids=[
        "subclass",
        "subclass with_args",
        "lambda",
        "minmax",
        "per-channel",
        "moving",
        "qcore",
        "none",
    ],
)
def test_only_torch_ao_histogram_itself_is_substituted(ctr):
    assert fast_constructor(ctr) is ctr


# -- through prepare and convert ----------------------------------------------------------


class Blocks(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()]
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + x


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = Blocks().eval()
    for module in model.modules():  # BatchNorm statistics that are not the identity
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(2, 4, 8, 8, generator=gen) * (1 + i) for i in range(3)]


def _observers(module: nn.Module) -> dict[str, nn.Module]:
    return {
        name: child
        for name, child in module.named_modules()
        if "activation_post_process" in name or name.endswith("_fake_quant")
    }


def _prepare_fx(mapping, substitute: bool, monkeypatch):
    if not substitute:
        monkeypatch.setattr(observe, "fast_constructor", lambda ctr: ctr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(_model(), mapping, (_batches()[0],), backend="x86")
    monkeypatch.undo()
    with torch.no_grad():
        for x in _batches():
            prepared(x)
    return prepared


@requires_x86
@pytest.mark.parametrize("kind", ["x86", "fbgemm", "qnnpack"])
def test_fx_with_torch_ao_mapping_builds_qcore_histograms_with_torch_ao_qparams(kind, monkeypatch):
    mapping = tq.get_default_qconfig_mapping(kind)
    fast = _prepare_fx(mapping, True, monkeypatch)
    slow = _prepare_fx(mapping, False, monkeypatch)
    fast_obs, slow_obs = _observers(fast), _observers(slow)
    assert fast_obs.keys() == slow_obs.keys() and fast_obs
    histograms = 0
    for name, observer in fast_obs.items():
        original = slow_obs[name]
        if type(original) is ao.HistogramObserver:
            assert type(observer) is qc.HistogramObserver, name
            _assert_same_observer(original, observer, name)  # reduce_range's 0..127 too
            histograms += 1
        else:  # weights (per-channel MinMax) and the rest: torch.ao's, as given
            assert type(observer) is type(original), name
        for ours, theirs in zip(
            observer.calculate_qparams(), original.calculate_qparams(), strict=True
        ):
            assert torch.equal(ours, theirs), name
    assert histograms >= 4  # the input, each block's output and the add
    x = _batches()[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(qcore.convert_fx(fast)(x), qcore.convert_fx(slow)(x))


@requires_x86
def test_fx_keeps_a_users_subclass():
    qconfig = tq.QConfig(
        activation=_MyHistogram.with_args(reduce_range=True),
        weight=tq.default_per_channel_weight_observer,
    )
    mapping = tq.QConfigMapping().set_global(qconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(_model(), mapping, (_batches()[0],), backend="x86")
    kinds = {type(m) for m in _observers(prepared).values()}
    assert _MyHistogram in kinds and qc.HistogramObserver not in kinds


@requires_x86
def test_pt2e_with_torch_ao_mapping_builds_qcore_histograms(monkeypatch):
    mapping = tq.get_default_qconfig_mapping("x86")
    x = _batches()[0]

    def prepare(substitute: bool):
        if not substitute:
            monkeypatch.setattr(observe, "fast_constructor", lambda ctr: ctr)
        exported = torch.export.export(_model(), (x,)).module()
        quantizer = BackendQuantizer.for_backend("x86", mapping)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = qcore.prepare_pt2e(exported, quantizer)
        monkeypatch.undo()
        for batch in _batches():
            prepared(batch)
        return prepared

    fast, slow = prepare(True), prepare(False)
    fast_obs, slow_obs = _observers(fast), _observers(slow)
    assert fast_obs.keys() == slow_obs.keys()
    kinds = {type(m) for m in fast_obs.values()}
    assert qc.HistogramObserver in kinds and ao.HistogramObserver not in kinds
    assert ao.HistogramObserver in {type(m) for m in slow_obs.values()}
    for name, observer in fast_obs.items():
        for ours, theirs in zip(
            observer.calculate_qparams(), slow_obs[name].calculate_qparams(), strict=True
        ):
            assert torch.equal(ours, theirs), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(qcore.convert_pt2e(fast)(x), qcore.convert_pt2e(slow)(x))


@requires_x86
def test_nan_in_calibration_is_skipped_where_torch_ao_failed():
    """The substitute is qcore's observer: a NaN is skipped and counted (convert warns)
    where torch.ao's HistogramObserver failed in torch.histc."""
    x = _batches()[0].clone()
    x[0, 0, 0, 0] = math.nan
    with pytest.raises(RuntimeError, match="not finite"):
        ao.HistogramObserver()(x)
    mapping = tq.get_default_qconfig_mapping("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(_model(), mapping, (_batches()[1],), backend="x86")
    prepared(_batches()[1])
    prepared(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = qcore.convert_fx(prepared)
    assert any(issubclass(w.category, NonFiniteValuesWarning) for w in caught)
    assert torch.isfinite(converted(_batches()[2])).all()


# -- non-tensor arguments stay unobserved ------------------------------------------------
#
# The peer suite's _test_dtype_propagation (get_default_qconfig("fbgemm")) finds
# observers with torch.ao's _is_activation_post_process, an isinstance of torch.ao's
# ObserverBase; qcore's observers pass it as virtual subclasses (qcore.observers
# registers them), so those tests see the substituted HistogramObservers. The same
# property here, whichever observer classes the prepared graph holds.


def _is_observer(module: nn.Module) -> bool:
    kinds = (qc.ObserverBase, qc.FakeQuantizeBase, ao.ObserverBase, tq.FakeQuantizeBase)
    return isinstance(module, kinds)


class _NonTensorArgs(nn.Module):
    """The peer suite's _NonReferenceTestModel: ``func(x, y, z)`` with int/None/bool y, z."""

    def __init__(self, func, lin_in: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.lin = nn.Linear(lin_in, 1)
        self.func = func

    def forward(self, x, y, z):
        x = self.pool(torch.relu(self.conv1(x)))
        x = torch.flatten(x, 1)
        return self.lin(self.func(x, y, z))


NON_TENSOR_CASES = {
    "masked_fill": (lambda x, y, z: x.masked_fill(y, z), 1176, "mask", 0.1),
    "permute": (lambda x, y, z: x.permute(y, z), 1176, 0, 1),
    "repeat": (lambda x, y, z: x.repeat(y, z), 1176, 2, 1),
    "reshape": (lambda x, y, z: x.reshape(-1, y), 5, 5, None),
    "size": (lambda x, y, z: x.reshape((-1, x.size(y))), 5, 0, None),
    "transpose": (lambda x, y, z: x.transpose(y, z), 5, 0, 1),
    "unsqueeze": (lambda x, y, z: x.unsqueeze(y), 1176, 1, None),
    "view": (lambda x, y, z: x.view(-1, y), 5, 5, None),
    "reshape list": (lambda x, y, z: x.reshape([y, z]), 5, -1, 5),
}


@requires_a_plugin
@pytest.mark.parametrize("case", list(NON_TENSOR_CASES))
def test_non_tensor_args_not_observed_with_torch_ao_qconfig(case):
    func, lin_in, y, z = NON_TENSOR_CASES[case]
    if y == "mask":
        y = torch.randn(lin_in) > 0
    x = torch.randn(5, 3, 32, 32)
    qconfig_dict = {"": tq.get_default_qconfig("fbgemm")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(_NonTensorArgs(func, lin_in).eval(), qconfig_dict, (x, y, z))
    calls = [
        (node.args[0], prepared.get_submodule(node.target))
        for node in prepared.graph.nodes
        if node.op == "call_module"
    ]
    observed = [arg for arg, module in calls if _is_observer(module)]
    assert any(type(module) is qc.HistogramObserver for _, module in calls)
    for arg in observed:
        assert arg.name not in ("y", "z"), (case, arg.name)
        assert not (arg.op == "call_method" and arg.target == "size"), case
    prepared(x, y, z)
