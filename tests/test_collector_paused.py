"""prepare and convert pause Python's garbage collector for speed (issue 15 §5) and
must leave it as they found it, on success and on error."""

from __future__ import annotations

import gc

import pytest
import torch
from backends import FIRST_PARTY, installed

import qcore
from qcore.engine.collector import collector_paused


def _backend() -> str:
    for name in FIRST_PARTY:
        if installed(name):
            return name
    pytest.skip("needs a first-party backend plugin")


@pytest.fixture
def collector_restored():
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


def test_paused_inside_and_restored_after(collector_restored) -> None:
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_left_disabled_when_the_caller_had_disabled_it(collector_restored) -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


class Untraceable(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x  # data-dependent: symbolic tracing fails


def test_restored_when_prepare_raises(collector_restored) -> None:
    gc.enable()
    with pytest.raises(RuntimeError, match="symbolic tracing failed"):
        qcore.prepare_fx(Untraceable(), None, (torch.randn(1),), backend=_backend())
    assert gc.isenabled()


def test_prepare_and_convert_leave_the_collector_on(collector_restored) -> None:
    gc.enable()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    prepared = qcore.prepare_fx(model, None, (torch.randn(2, 4),), backend=_backend())
    assert gc.isenabled()
    prepared(torch.randn(2, 4))
    qcore.convert_fx(prepared)
    assert gc.isenabled()
