"""QAT of a model fine-tuned with frozen batch norms (``model.train(); bn.eval()``).

prepare_qat_fx put the whole traced model in training mode, so each frozen batch
norm, fused into a QAT ConvBn or left on its own, went back to normalizing with
batch statistics and updating its running ones: training data whose statistics
differ from the model's (small or shifted batches, the reason to freeze) silently
rewrote them: on this test's model the converted model gave 18.2-18.8 dB against
the float model the user froze, 29.7-31.8 dB with them kept frozen. torch.ao's
prepare_qat_fx refuses such a model ("Conv and BN both must be in the same mode");
qcore keeps each frozen batch norm frozen, as prepare_fx and
convert_fx keep each module's mode (docs/user-guide.md): a QAT ConvBn holding one
gets torch.ao's ``freeze_bn_stats()``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params
from torch import nn
from torch.ao.quantization import get_default_qat_qconfig_mapping

import qcore
from qcore.accuracy import sqnr


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(3)  # on the input: nothing to fuse it into
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.bn(self.conv(self.norm(x)))))


def _model() -> Net:
    torch.manual_seed(0)
    model = Net()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # running statistics of the data the model was trained on
        for batch_norm in (model.norm, model.bn):
            batch_norm.momentum = None
        for _ in range(20):
            model(torch.randn(16, 3, 8, 8, generator=generator))
    model.train()
    model.norm.eval()
    model.bn.eval()
    return model


def _running_statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: value.clone()
        for name, value in model.state_dict().items()
        if "running_" in name or "num_batches_tracked" in name
    }


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "qnnpack", "x86")))
def test_qat_keeps_frozen_batch_norms_frozen(backend):
    model = _model()
    generator = torch.Generator().manual_seed(2)
    # fine-tuning data on another scale than the frozen statistics describe
    shifted = [torch.randn(16, 3, 8, 8, generator=generator) * 1.5 + 0.5 for _ in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_qat_fx(
            copy.deepcopy(model), get_default_qat_qconfig_mapping(backend), (shifted[0],), backend
        )
    assert prepared.training
    before = _running_statistics(prepared)
    assert before, "the prepared model holds the batch norms' running statistics"
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.0)  # observers only
    for batch in shifted:
        loss = prepared(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = _running_statistics(prepared)
    assert all(torch.equal(before[name], after[name]) for name in before), [
        name for name in before if not torch.equal(before[name], after[name])
    ]
    prepared.eval()
    with torch.no_grad():
        x = shifted[-1]
        converted = qcore.convert_fx(prepared)
        expected = model.eval()(x)
        assert sqnr(expected, converted(x)) > 27


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.relu(self.fc1(x))))


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "qnnpack", "x86")))
def test_qat_keeps_a_dropout_switched_off_off(backend):
    """``model.train(); model.drop.eval()``: torch.ao's prepared model trains without
    dropping (it keeps each module's mode); qcore's dropped half the activations."""
    torch.manual_seed(0)
    model = WithDropout().train()
    model.drop.eval()
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_qat_fx(
            model, get_default_qat_qconfig_mapping(backend), (x,), backend
        )
    for _ in range(3):
        prepared(x)  # observers see the activations' ranges
    prepared.apply(torch.ao.quantization.disable_observer)
    assert prepared.training and not prepared.drop.training
    torch.testing.assert_close(prepared(x), prepared(x), rtol=0, atol=0)
