"""qcore's observers and fake quants, interchangeable with torch.ao's.

Same classes, constructor arguments, attributes, buffers (state_dict keys) and
qparams as ``torch.ao.quantization.observer`` / ``fake_quantize``; the
HistogramObserver's range search is vectorized. Where torch.ao's observers fail
or give NaN and infinite scales, on NaN, ±inf and huge calibration values,
qcore's skip and clamp them and convert warns once (:mod:`qcore.observers.nonfinite`).
"""

import sys
from typing import Union

import torch.ao.quantization

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

ObserverOrFakeQuantize = Union[ObserverBase, FakeQuantizeBase]  # noqa: UP007 (torch.ao's alias)
"""What a DerivedQuantizationSpec's ``derive_qparams_fn`` gets a list of."""

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
    "ObserverOrFakeQuantize",
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

# torch.ao's utilities (get_observer_state_dict, load_observer_state_dict, its
# _is_activation_post_process) know observers by torch.ao's abstract bases; qcore's
# have the same interface and state_dict keys, so they register as their subclasses.
torch.ao.quantization.ObserverBase.register(ObserverBase)
torch.ao.quantization.FakeQuantizeBase.register(FakeQuantizeBase)


def register_with_torchao() -> None:
    """The same with torchao's bases, where torchao is imported: its QAT toggles
    (``model.apply(torchao.quantization.pt2e.disable_observer)``) test them and did
    nothing to qcore's fake quants. qcore does not import torchao (a peer, not a
    dependency): this runs at import and at each PT2E prepare."""
    fake_quantize = sys.modules.get("torchao.quantization.pt2e.fake_quantize")
    observer = sys.modules.get("torchao.quantization.pt2e.observer")
    if fake_quantize is not None:
        fake_quantize.FakeQuantizeBase.register(FakeQuantizeBase)
    if observer is not None:
        observer.ObserverBase.register(ObserverBase)


register_with_torchao()
