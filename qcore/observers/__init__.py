"""qcore's observers and fake quants, interchangeable with torch.ao's.

Same classes, constructor arguments, attributes, buffers (state_dict keys) and
qparams as ``torch.ao.quantization.observer`` / ``fake_quantize``; the
HistogramObserver's range search is vectorized. Where torch.ao's observers fail
or give NaN and infinite scales, on NaN, ±inf and huge calibration values,
qcore's skip and clamp them and convert warns once (:mod:`qcore.observers.nonfinite`).
"""

from qcore.observers.base import ObserverBase, PartialConstructor, UniformQuantizationObserverBase
from qcore.observers.defaults import *  # noqa: F403
from qcore.observers.defaults import __all__ as _defaults
from qcore.observers.fake_quantize import (
    FakeQuantize,
    FakeQuantizeBase,
    FixedQParamsFakeQuantize,
    FusedMovingAvgObsFakeQuantize,
    disable_fake_quant,
    disable_observer,
    enable_fake_quant,
    enable_observer,
)
from qcore.observers.fixed import (
    FixedQParamsObserver,
    NoopObserver,
    PlaceholderObserver,
    ReuseInputObserver,
)
from qcore.observers.histogram import HistogramObserver
from qcore.observers.minmax import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)
from qcore.observers.nonfinite import (
    RANGE_LIMIT,
    NonFiniteStatisticsError,
    NonFiniteValuesWarning,
)

__all__ = [
    "FakeQuantize",
    "FakeQuantizeBase",
    "FixedQParamsFakeQuantize",
    "FixedQParamsObserver",
    "FusedMovingAvgObsFakeQuantize",
    "HistogramObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "NonFiniteStatisticsError",
    "NonFiniteValuesWarning",
    "NoopObserver",
    "ObserverBase",
    "PartialConstructor",
    "PerChannelMinMaxObserver",
    "PlaceholderObserver",
    "RANGE_LIMIT",
    "ReuseInputObserver",
    "UniformQuantizationObserverBase",
    "disable_fake_quant",
    "disable_observer",
    "enable_fake_quant",
    "enable_observer",
    *_defaults,
]
