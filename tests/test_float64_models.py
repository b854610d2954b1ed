"""A float64 model: the quantize ops take float32, bfloat16 and float16 values.
FX refused it and sent the user to PT2E, which then failed at convert with a bare
``AssertionError: Expecting input to have dtype torch.float32`` (torchao too)."""

from __future__ import annotations

import pytest
import torch
from backends import FIRST_PARTY, installed

import qcore


def _backend() -> str:
    for name in FIRST_PARTY:
        if installed(name):
            return name
    pytest.skip("needs a first-party backend")


def _model_and_input() -> tuple[torch.nn.Module, torch.Tensor]:
    return torch.nn.Sequential(torch.nn.Linear(8, 8)).eval().double(), torch.randn(4, 8).double()


def test_pt2e_names_the_float64_value_at_prepare():
    model, x = _model_and_input()
    exported = torch.export.export(model, (x,)).module()
    with pytest.raises(ValueError, match=r"node '\w+' computes in torch.float64 and would be"):
        qcore.prepare_pt2e(exported, _backend())


def test_fx_sends_float64_to_float32_not_to_pt2e():
    model, x = _model_and_input()
    with pytest.raises(ValueError, match=r"computes in torch.float64") as raised:
        qcore.prepare_fx(model, None, (x,), backend=_backend())
    assert "for a bfloat16 or float16 model, use prepare_pt2e" in str(raised.value)
