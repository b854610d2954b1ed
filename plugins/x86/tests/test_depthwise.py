"""x86 depthwise convs with 8-bit activations (no reduce_range) agree with the reference.

torch 2.13's x86 engine sends convs with more than 100 groups to fbgemm, whose
depthwise kernel saturates 16-bit sums of u8*s8 products even on CPUs with VNNI;
qcore packs those convs for oneDNN instead.
"""

import pytest
import torch
from torch import nn

import qcore
from qcore.config.qconfig import QConfig
from qcore.kernels.runtime import int8_products_saturate
from qcore.observers import MinMaxObserver, PerChannelMinMaxObserver


def _full_range_mapping():
    activation = MinMaxObserver.with_args(dtype=torch.quint8)  # 0..255
    weight = PerChannelMinMaxObserver.with_args(
        dtype=torch.qint8, qscheme=torch.per_channel_symmetric
    )
    return qcore.get_default_qconfig_mapping("x86").set_global(QConfig(activation, weight))


@pytest.mark.skipif(
    int8_products_saturate(),
    reason="this CPU has no VNNI: every int8 engine saturates 8-bit activations here",
)
@pytest.mark.parametrize("channels", [96, 144, 256])
def test_depthwise_conv_with_8bit_activations_is_within_a_step_of_reference(channels):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, groups=channels)).eval()
    batches = [torch.rand(2, channels, 10, 10) * 6 for _ in range(4)]
    prepared = qcore.prepare_fx(model, _full_range_mapping(), (batches[0],), backend="x86")
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    reference = qcore.convert_to_reference_fx(prepared)
    lowered = qcore.convert_fx(prepared)
    kernels = [e.kernel for e in qcore.explain(lowered).quantized if e.kernel]
    assert kernels == ["x86.conv2d"], kernels
    with torch.no_grad():
        expected, actual = reference(batches[0]), lowered(batches[0])
    # one step of the output's quantization (its scale was observed over all batches,
    # so it can exceed this batch's range / 255)
    step = float(lowered.get_submodule("0").scale)
    assert (expected - actual).abs().max() <= 1.01 * step
