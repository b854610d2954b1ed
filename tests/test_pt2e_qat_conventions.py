"""PT2E quantization-aware training as torchao's users run it.

* torch.ao's and torchao's QAT toggles (``model.apply(disable_observer)``, ...)
  reach qcore's fake quants: torchao's tested its own abstract base, and did
  nothing to them, silently (the observers went on moving).
* A converted model does not change its own state when it runs: the training
  graph's ``num_batches_tracked.add_(1)`` stayed in it, counting every inference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from backends import backend_params
from torch import nn

import qcore


class ConvBnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _prepared(backend: str) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    exported = torch.export.export(ConvBnNet().train(), (x,)).module()
    prepared = qcore.prepare_qat_pt2e(exported, backend)
    prepared(x)
    return prepared, x


def _fake_quants(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if hasattr(module, "observer_enabled")]


@pytest.mark.parametrize("backend", backend_params())
def test_a_converted_qat_model_keeps_its_state_when_it_runs(backend):
    prepared, x = _prepared(backend)
    converted = qcore.convert_pt2e(prepared)
    before = copy.deepcopy(converted.state_dict())
    with torch.no_grad():
        first = converted(x)
        for _ in range(3):
            last = converted(x)
    torch.testing.assert_close(last, first, rtol=0, atol=0)
    after = converted.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)


@pytest.mark.parametrize("library", ["torch.ao.quantization", "torchao.quantization.pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_the_peers_qat_toggles_reach_qcores_fake_quants(library, backend):
    toggles = pytest.importorskip(library)
    prepared, x = _prepared(backend)
    assert _fake_quants(prepared)
    prepared.apply(toggles.disable_observer)
    prepared.apply(toggles.disable_fake_quant)
    assert {
        (int(f.observer_enabled[0]), int(f.fake_quant_enabled[0])) for f in _fake_quants(prepared)
    } == {(0, 0)}
    scales = [f.scale.clone() for f in _fake_quants(prepared)]
    prepared(x * 10)  # frozen observers do not move
    assert all(torch.equal(s, f.scale) for s, f in zip(scales, _fake_quants(prepared), strict=True))
    prepared.apply(toggles.enable_observer)
    prepared(x * 10)
    assert any(
        not torch.equal(s, f.scale) for s, f in zip(scales, _fake_quants(prepared), strict=True)
    )
