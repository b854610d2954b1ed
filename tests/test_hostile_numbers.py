"""Hostile calibration numbers (issue 14, section 5): NaN, ±inf and huge activations.

qcore's choice: observers skip NaN and ±inf, count them, and convert warns once
(``NonFiniteValuesWarning``) naming the observers and how many values each
skipped; magnitudes beyond ``RANGE_LIMIT`` (1.7e38) are recorded as ±RANGE_LIMIT,
so every scale is finite and positive. Statistics that are NaN anyway (torch.ao's
observers propagate NaN) are an error at convert naming the node and the observer.
The distributed cases are in tests/test_distributed.py.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import qcore
from qcore import observers as qc
from qcore.observers import NonFiniteStatisticsError, NonFiniteValuesWarning

pytest.importorskip("qcore_fbgemm", reason="needs the fbgemm plugin")

HUGE = 3e38  # finite float32, more than half its largest value
LIMIT = qc.RANGE_LIMIT


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4 * 5 * 5, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.relu(self.conv(x)), 1))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return Net().eval()


def clean(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(seed))


def with_nan() -> torch.Tensor:
    x = clean(1)
    x[0, 0, 1, 1] = math.nan
    x[1, 2, 0, 3] = math.nan
    return x


def with_huge() -> torch.Tensor:
    x = clean(1)
    x[0, 0, 1, 1] = HUGE
    x[1, 2, 0, 3] = -HUGE
    return x


def minmax_mapping(activation=qc.MinMaxObserver, weight=qc.default_per_channel_weight_observer):
    return qcore.QConfigMapping().set_global(qcore.QConfig(activation=activation, weight=weight))


MAPPINGS = {
    "minmax": lambda backend: minmax_mapping(),
    "moving": lambda backend: minmax_mapping(
        qc.MovingAverageMinMaxObserver.with_args(averaging_constant=0.5)
    ),
    "histogram": lambda backend: qcore.get_default_qconfig_mapping(backend),
}


def prepare_fx(mapping_kind: str = "minmax", backend: str = "fbgemm") -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)  # ops left in float
        return qcore.prepare_fx(
            make_net(), MAPPINGS[mapping_kind](backend), (clean(),), backend=backend
        )


def prepare_pt2e(backend: str) -> nn.Module:
    from qcore.examples import export_batch_free

    return qcore.prepare_pt2e(export_batch_free(make_net(), (clean(),)), backend)


def calibrate(prepared: nn.Module, *batches: torch.Tensor) -> nn.Module:
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    return prepared


def convert(prepared: nn.Module, pt2e: bool = False, **kwargs) -> tuple[nn.Module, list]:
    """The converted model and the qcore warnings convert gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = qcore.convert_pt2e(prepared, **kwargs) if pt2e else qcore.convert_fx(prepared)
    return converted, [w for w in caught if issubclass(w.category, qcore.QCoreWarning)]


def scales(model: nn.Module) -> list[tuple[str, float]]:
    """Every scale in a converted model: quantize/dequantize arguments in the graph,
    kernels' output scales, reference modules' weight scales, scale buffers."""
    found = []
    for node in model.graph.nodes:
        if "quantize" in str(node.target) and len(node.args) > 1:
            scale = node.args[1]
            if isinstance(scale, (int, float)):
                found.append((node.name, float(scale)))
    for name, module in model.named_modules():
        for attr in ("scale", "output_scale"):
            value = getattr(module, attr, None)
            if isinstance(value, (float, torch.Tensor)) and not isinstance(value, nn.Module):
                found += [(f"{name}.{attr}", float(v)) for v in torch.as_tensor(value).reshape(-1)]
        for qparams in getattr(module, "weight_qparams", {}).values():
            found += [(f"{name}.weight", float(v)) for v in qparams.scale.reshape(-1)]
    for name, buffer in model.named_buffers():
        if name.endswith("scale") and buffer.is_floating_point():
            found += [(name, float(v)) for v in buffer.reshape(-1)]
    return found


def assert_sound(model: nn.Module) -> None:
    """Finite positive scales; on clean data a finite output, and no warning."""
    found = scales(model)
    assert found, "no scale found: the scan is broken"
    bad = [(name, value) for name, value in found if not (math.isfinite(value) and value > 0)]
    assert not bad, f"scales not finite and positive: {bad[:5]}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a converted model's forward prints nothing
        out = model(clean(5))
    assert torch.isfinite(out).all()


# -- NaN in calibration data -----------------------------------------------------------------


@pytest.mark.parametrize("kind", list(MAPPINGS))
def test_nan_batch_is_skipped_with_one_warning_naming_the_observers(kind):
    """torch.ao's MinMaxObserver propagates the NaN (NaN scales, NaN outputs); its
    HistogramObserver fails ("torch.histc: range of [nan, nan] is not finite")."""
    prepared = calibrate(prepare_fx(kind), clean(0), with_nan(), clean(2))
    converted, caught = convert(prepared)
    nonfinite = [w for w in caught if issubclass(w.category, NonFiniteValuesWarning)]
    assert len(nonfinite) == 1, [str(w.message) for w in caught]
    message = str(nonfinite[0].message)
    # the input's observer skipped exactly the two NaN; later ones what they spread to
    assert "activation_post_process_0 (of 'x'): 2" in message
    assert "NaN or infinite value(s)" in message and "filterwarnings('error'" in message
    assert nonfinite[0].filename == __file__  # points at the convert call
    assert_sound(converted)


def test_skipping_gives_the_qparams_of_the_finite_values():
    for name in ("MinMaxObserver", "MovingAverageMinMaxObserver", "HistogramObserver"):
        skipping, reference = getattr(qc, name)(), getattr(qc, name)()
        for x in (clean(0), with_nan(), clean(2)):
            skipping(x)
            finite = x[torch.isfinite(x)]
            reference(finite)
        assert skipping.nonfinite_skipped == 2
        assert not hasattr(reference, "nonfinite_skipped")
        for ours, theirs in zip(
            skipping.calculate_qparams(), reference.calculate_qparams(), strict=True
        ):
            assert torch.equal(ours, theirs), name


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_per_channel_observers_skip_per_channel(value):
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    poisoned = x.clone()
    poisoned[1, 3] = value
    poisoned[2, :] = value  # a channel with no finite value this time
    for name in ("PerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"):
        observer = getattr(qc, name)(ch_axis=0)
        observer(x)
        observer(poisoned)
        assert observer.nonfinite_skipped == 17
        assert torch.isfinite(observer.min_val).all() and torch.isfinite(observer.max_val).all()
        # channel 2 kept its range, channel 1 took its finite values'
        reference = getattr(qc, name)(ch_axis=0)
        reference(x)
        reference(torch.stack([x[0], x[1].where(torch.arange(16) != 3, x[1, 0]), x[2]]))
        assert torch.equal(observer.max_val[2], reference.max_val[2])
        scale, _ = observer.calculate_qparams()
        assert torch.isfinite(scale).all() and (scale > 0).all()


def test_a_channel_never_finite_gets_the_qparams_of_zeros():
    observer = qc.PerChannelMinMaxObserver(ch_axis=0)
    x = torch.randn(2, 8)
    x[1] = math.nan
    observer(x)
    scale, zero_point = observer.calculate_qparams()
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert scale[1] == observer.eps and zero_point[1] == 0


def test_all_non_finite_tensor_is_not_a_batch():
    observer = qc.MovingAverageMinMaxObserver()
    observer(torch.full((4,), math.nan))
    assert int(observer.batches_observed) == 0 and observer.nonfinite_skipped == 4
    assert observer.min_val == math.inf  # still unobserved
    observer(torch.tensor([1.0, 2.0, math.inf]))
    assert int(observer.batches_observed) == 1
    assert (observer.min_val, observer.max_val) == (1.0, 2.0)


def test_the_warning_can_be_made_an_error():
    prepared = calibrate(prepare_fx("minmax"), clean(0), with_nan())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=NonFiniteValuesWarning)
        with pytest.raises(NonFiniteValuesWarning, match="activation_post_process_0"):
            qcore.convert_fx(prepared)


def test_clean_calibration_gives_no_warning():
    prepared = calibrate(prepare_fx("histogram"), clean(0), clean(1))
    _, caught = convert(prepared)
    assert not [w for w in caught if issubclass(w.category, NonFiniteValuesWarning)]


def test_nan_from_a_torch_ao_observer_is_an_error_naming_node_and_observer():
    """torch.ao's MinMaxObserver records NaN: convert used to give NaN scales."""
    mapping = minmax_mapping(tq.MinMaxObserver, tq.default_per_channel_weight_observer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(make_net(), mapping, (clean(),), backend="fbgemm")
    calibrate(prepared, clean(0), with_nan())
    with pytest.raises(NonFiniteStatisticsError) as caught:
        qcore.convert_fx(prepared)
    message = str(caught.value)
    assert "observer 'activation_post_process_0'" in message
    assert "torch.ao.quantization.observer.MinMaxObserver" in message
    assert "of node 'x'" in message and "min_val=nan" in message
    assert "expected the finite range" in message


def test_nan_statistics_loaded_into_a_qcore_observer_are_an_error_not_a_nan_scale():
    observer = qc.MinMaxObserver()
    observer.load_state_dict(
        {"eps": observer.eps, "min_val": torch.tensor(math.nan), "max_val": torch.tensor(1.0)}
    )
    with pytest.raises(ValueError, match=r"MinMaxObserver: min_val=nan, max_val=1.0 hold NaN"):
        observer.calculate_qparams()


@pytest.mark.parametrize("eps", [0.0, -1.0, math.nan, math.inf])
def test_eps_must_be_finite_and_positive(eps):
    with pytest.raises(ValueError, match=r"eps=.*expected a finite positive number"):
        qc.MinMaxObserver(eps=eps)


@pytest.mark.parametrize("backend", ["fbgemm", "x86", "qnnpack"])
def test_nan_batch_pt2e(backend):
    pytest.importorskip(f"qcore_{backend}")
    prepared = calibrate(prepare_pt2e(backend), clean(0), with_nan())
    converted, caught = convert(prepared, pt2e=True)
    nonfinite = [w for w in caught if issubclass(w.category, NonFiniteValuesWarning)]
    assert len(nonfinite) == 1 and "convert_pt2e:" in str(nonfinite[0].message)
    assert_sound(converted)
    reference, _ = convert(prepared, pt2e=True, lower=False)
    assert torch.isfinite(reference(clean(5))).all()


# -- huge activations ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(MAPPINGS))
@pytest.mark.parametrize("backend", ["fbgemm", "x86", "qnnpack"])
def test_huge_activations_give_finite_scales(backend, kind):
    """Before: fbgemm and x86 converted to infinite scales silently, qnnpack failed at
    run time ("requantization scale must be finite and positive")."""
    pytest.importorskip(f"qcore_{backend}")
    prepared = calibrate(prepare_fx(kind, backend), clean(0), with_huge())
    converted, caught = convert(prepared)
    assert not [w for w in caught if issubclass(w.category, NonFiniteValuesWarning)]
    assert_sound(converted)


@pytest.mark.parametrize("backend", ["fbgemm", "x86", "qnnpack"])
def test_huge_activations_pt2e(backend):
    """Before: PT2E's output was not finite (and qnnpack failed at run time)."""
    pytest.importorskip(f"qcore_{backend}")
    prepared = calibrate(prepare_pt2e(backend), clean(0), with_huge())
    converted, _ = convert(prepared, pt2e=True)
    assert_sound(converted)
    reference, _ = convert(prepared, pt2e=True, lower=False)
    assert torch.isfinite(reference(clean(5))).all()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"dtype": torch.qint8},
        {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
        {"quant_min": 0, "quant_max": 1},
    ],
    ids=str,
)
@pytest.mark.parametrize("name", ["MinMaxObserver", "HistogramObserver"])
def test_huge_range_saturates_at_the_limit(name, kwargs):
    observer = getattr(qc, name)(**kwargs)
    observer(torch.tensor([-HUGE, -1.0, 0.0, 1.0, HUGE]))
    assert observer.min_val == -LIMIT and observer.max_val == LIMIT
    scale, zero_point = observer.calculate_qparams()
    assert math.isfinite(scale) and scale > 0
    # every value dequantized with it is finite: the extremes saturate, finitely
    dtype = observer.dtype
    q = qcore.ops.quantize_per_tensor(
        torch.tensor([-HUGE, HUGE, -math.inf, math.inf]),
        scale,
        zero_point,
        observer.quant_min,
        observer.quant_max,
        dtype,
    )
    back = qcore.ops.dequantize_per_tensor(q, scale, zero_point)
    assert torch.isfinite(back).all()


def test_huge_range_histogram_is_counted_where_the_values_are():
    """torch.histc over a range wider than 1.7e35 (2048 bins) put every value in the
    first bin; the histogram's range search then chose a range of nothing."""
    values = torch.linspace(-1e36, 1e36, 10001)
    observer = qc.HistogramObserver()
    observer(values)
    counts = observer.histogram
    assert counts.sum() == values.numel()
    assert counts.max() < 10 * values.numel() / observer.bins  # spread, not in one bin
    lo, hi = observer._non_linear_param_search()
    assert float(lo) < -5e35 and float(hi) > 5e35  # uniform data: nearly the whole range
    scale, _ = observer.calculate_qparams()
    assert math.isfinite(scale) and scale > 0


def test_huge_value_in_a_torch_ao_observer_is_an_error_naming_node_and_observer():
    mapping = minmax_mapping(tq.MinMaxObserver, tq.default_per_channel_weight_observer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(make_net(), mapping, (clean(),), backend="fbgemm")
    calibrate(prepared, clean(0), with_huge())
    with pytest.raises(NonFiniteStatisticsError, match=r"of node 'x' holds min_val=-3\.0000"):
        qcore.convert_fx(prepared)


def test_moving_average_of_huge_values_stays_finite():
    """min + c * (x - min) of values of opposite signs beyond 1.7e38 overflowed to inf,
    after which the average stayed inf, then NaN."""
    observer = qc.MovingAverageMinMaxObserver(averaging_constant=0.5)
    for x in (torch.tensor([-HUGE, -0.9 * HUGE]), torch.tensor([0.9 * HUGE, HUGE])):
        observer(x)
    assert torch.isfinite(observer.min_val) and torch.isfinite(observer.max_val)
    scale, _ = observer.calculate_qparams()
    assert math.isfinite(scale) and scale > 0


def test_qat_fake_quant_skips_nan_batches():
    fake_quant = qc.FakeQuantize()
    fake_quant(clean(0))
    fake_quant(with_nan())
    assert torch.isfinite(fake_quant.scale).all() and (fake_quant.scale > 0).all()
    assert fake_quant.activation_post_process.nonfinite_skipped == 2


def test_a_weight_holding_nan_is_named_at_convert():
    """convert warned of NaN calibration values, naming the activations that met
    them but not the weight they came from (torch.ao fails in histc)."""
    import math
    import warnings

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    with torch.no_grad():
        model[0].weight[3, 0, 0, 0] = math.nan
    x = torch.randn(2, 3, 6, 6)
    prepared = qcore.prepare_fx(model, None, (x,), backend="native")
    prepared(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qcore.convert_fx(prepared)
    named = [str(w.message) for w in caught if "weights hold NaN or inf" in str(w.message)]
    assert len(named) == 1 and "0.weight (1 of 216)" in named[0]


def test_a_weight_holding_nan_is_named_at_pt2e_convert():
    """PT2E's weight observers see the weight at calibration: convert said
    "calibration gave 1 NaN ... (of '_0_weight')" as if data had met it."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with torch.no_grad():
        model[2].weight[1, 3] = math.nan
    x = torch.randn(4, 8)
    prepared = qcore.prepare_pt2e(torch.export.export(model.eval(), (x,)).module(), "fbgemm")
    prepared(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qcore.convert_pt2e(prepared)
    messages = [str(w.message) for w in caught]
    named = [m for m in messages if "weights hold NaN or inf" in m]
    assert len(named) == 1 and "2.weight (1 of 32)" in named[0], messages
    # the activations the NaN reached are the calibration warning's; the weight not
    assert not any("calibration gave" in m and "weight" in m for m in messages), messages
