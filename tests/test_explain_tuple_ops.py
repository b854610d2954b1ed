"""Ops returning several tensors are float ops in explain, not "not an op": an
LSTM on PT2E and an nn.MultiheadAttention on FX ran in float and were left out of
every count, the table and report.float (the LSTM zoo model's report named its
zeros and getitems as what stayed float, but not the LSTM)."""

from __future__ import annotations

import pytest
import torch
from backends import FIRST_PARTY, installed

import qcore
from qcore.engine.explain import Status


def _backend() -> str:
    for name in FIRST_PARTY:
        if installed(name):
            return name
    pytest.skip("needs a first-party backend")


class LinearLstm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.lstm = torch.nn.Linear(8, 8), torch.nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.fc(x))[0]


class LinearAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return self.head(self.mha(y, y, y)[0])


def _entry(report, op: str):
    (entry,) = [e for e in report.entries if e.op == op]
    return entry


def test_a_pt2e_lstm_is_a_float_op():
    x = torch.randn(2, 5, 8)
    exported = torch.export.export(LinearLstm().eval(), (x,)).module()
    prepared = qcore.prepare_pt2e(exported, _backend())
    prepared(x)
    for model in (prepared, qcore.convert_pt2e(prepared)):
        report = qcore.explain(model)
        lstm = _entry(report, "aten.lstm")
        assert lstm.status is Status.FLOAT and lstm in report.float
        assert lstm.node in str(report)


def test_an_fx_multihead_attention_is_a_float_op_with_a_true_reason():
    x = torch.randn(2, 5, 8)
    prepared = qcore.prepare_fx(LinearAttention().eval(), None, (x,), backend=_backend())
    prepared(x)
    report = qcore.explain(qcore.convert_fx(prepared))
    mha = _entry(report, "MultiheadAttention")
    assert mha.status is Status.FLOAT and mha in report.float
    assert "returns several tensors" in mha.reason and "passes a tuple" not in mha.reason
