"""FX: a BatchNorm that no fusion can take stays a BatchNorm, the conv before it is
quantized alone (as qcore's PT2E route does), instead of prepare failing.

A BatchNorm built with ``track_running_stats=False`` normalizes every batch by its
own statistics, in eval mode too: there is nothing to fold into the conv's weight,
and a QAT ConvBn trains against running statistics it does not have. One with
``affine=False`` has no weight for a QAT ConvBn to scale by. qcore's fusers refused
both (prepare_fx raised a ConfigError wrapping "bn.running_mean and bn.running_var
must not be None"; prepare_qat_fx a FusionError), as torch.ao's do, while
``qcore.prepare_pt2e`` / ``prepare_qat_pt2e`` quantize the same models.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params
from torch import nn
from torch.ao.quantization import get_default_qat_qconfig_mapping, get_default_qconfig_mapping

import qcore
from qcore.accuracy import sqnr
from qcore.engine.explain import Status


class ConvBnReLU(nn.Module):
    def __init__(self, **bn_options: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8, **bn_options)
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.bn(self.conv(x))))


def _batches(count: int = 6) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(8, 3, 8, 8, generator=generator) for _ in range(count)]


def _statuses(model: torch.nn.Module) -> dict[str, Status]:
    return {entry.node: entry.status for entry in qcore.explain(model)}


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "qnnpack", "x86")))
def test_post_training_batch_norm_without_running_stats(backend):
    torch.manual_seed(0)
    model = ConvBnReLU(track_running_stats=False).eval()
    data = _batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(
            model, get_default_qconfig_mapping(backend), (data[0],), backend=backend
        )
    with torch.no_grad():
        for batch in data[:-1]:
            prepared(batch)
        converted = qcore.convert_fx(prepared)
        x = data[-1]
        assert sqnr(model(x), converted(x)) > 28
        # the batch norm still normalizes by the batch it is given (not folded):
        # two samples alone get their own statistics
        assert sqnr(model(x[:2]), converted(x[:2])) > 28
    statuses = _statuses(converted)
    assert statuses["out"] is Status.QUANTIZED
    assert statuses["conv"] in (Status.QUANTIZED, Status.REFERENCE)  # its weight int8
    assert isinstance(converted.bn, nn.BatchNorm2d)


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "qnnpack", "x86")))
@pytest.mark.parametrize(
    "bn_options",
    [{"track_running_stats": False}, {"affine": False}],
    ids=["no_running_stats", "no_affine"],
)
def test_qat_batch_norm_that_cannot_fuse(backend, bn_options):
    torch.manual_seed(0)
    model = ConvBnReLU(**bn_options)
    data = _batches(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_qat_fx(
            copy.deepcopy(model).train(),
            get_default_qat_qconfig_mapping(backend),
            (data[0],),
            backend=backend,
        )
    optimizer = torch.optim.SGD(prepared.parameters(), lr=1e-3)
    for batch in data[:-1]:
        loss = F.mse_loss(prepared(batch), model.eval()(batch).detach())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    prepared.eval()
    with torch.no_grad():
        x = data[-1]
        trained = prepared(x)
        converted = qcore.convert_fx(prepared)
        assert sqnr(trained, converted(x)) > 28
    statuses = _statuses(converted)
    assert statuses["out"] is Status.QUANTIZED
    assert statuses["conv"] in (Status.QUANTIZED, Status.REFERENCE)
