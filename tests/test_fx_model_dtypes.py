"""FX quantization takes float32 models: another floating dtype to be quantized
is an error at prepare, naming the node and the dtype. The converted bfloat16,
float16 or float64 model used to fail at its first call ("Quantize only works on
Float Tensor, got BFloat16"), after convert and explain had reported it quantized.
(prepare_pt2e keeps a bfloat16 model's dtype: tests/test_pt2e_torchao_quantizers.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params
from tiny_models import TwoLinears as Net

import qcore


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_model_in_another_float_dtype_is_refused_at_prepare(dtype, backend):
    model = Net().to(dtype).eval()
    with pytest.raises(ValueError, match=rf"node 'x' computes in {dtype} and would be quantized"):
        qcore.prepare_fx(model, None, (torch.randn(2, 16, dtype=dtype),), backend=backend)


class DoubleInside(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a float64 step no pattern quantizes: the model is float32 where it is quantized
        return self.fc2(torch.cumsum(F.relu(self.fc1(x)).double(), -1).float())


@pytest.mark.parametrize("backend", backend_params())
def test_a_float64_step_left_float_is_accepted(backend):
    model = DoubleInside().eval()
    x = torch.randn(4, 16)
    prepared = qcore.prepare_fx(model, None, (x,), backend=backend)
    prepared(x)
    converted = qcore.convert_fx(prepared)
    assert converted(x).dtype == torch.float32
    assert {e.node for e in qcore.explain(converted).entries if e.status.value == "quantized"} >= {
        "fc1",
        "fc2",
    }
