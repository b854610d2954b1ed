"""prepare's probe leaves torch's process-wide RNG alone where the model draws
nothing from it. It seeded the RNG for both runs of every model (so that random ops
in the traced graph and in forward draw alike), and a thread drawing meanwhile got
the same numbers again: 10,162 repeats in 494,340 draws over five prepares."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params, installed
from torch import nn

import qcore


class Deterministic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
        self.dropout = nn.Dropout(0.5)  # eval: draws nothing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.dropout(F.relu(self.fc1(x)), 0.1, training=self.training)
        return self.fc2(self.dropout(hidden))


class Noisy(Deterministic):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)) + 0.01 * torch.randn_like(self.fc1(x)))


@pytest.mark.parametrize("backend", backend_params())
def test_a_thread_drawing_while_a_deterministic_model_is_prepared_gets_no_repeats(backend):
    model = Deterministic().eval()
    x = torch.randn(4, 16)
    draws: list[torch.Tensor] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            draws.append(torch.rand(64, dtype=torch.float64))

    thread = threading.Thread(target=sampler)
    thread.start()
    try:
        for _ in range(3):
            qcore.prepare_fx(model, None, (x,), backend=backend)
    finally:
        stop.set()
        thread.join()
    values = torch.cat(draws)
    assert values.numel() > 0
    assert values.unique().numel() == values.numel()


@pytest.mark.parametrize("backend", backend_params())
def test_a_model_that_draws_is_still_probed_with_equal_draws(backend):
    # both runs of the probe draw the same numbers: no false "does not compute" warning,
    # and the caller's RNG stream is as it was
    torch.manual_seed(7)
    model = Noisy().eval()
    x = torch.randn(4, 16)
    state = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qcore.prepare_fx(model, None, (x,), backend=backend)
    assert not [w for w in caught if "does not compute" in str(w.message)]
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.skipif(not installed("x86"), reason="needs the x86 plugin")
@pytest.mark.parametrize("lower", [True, False])
def test_pt2e_prepare_and_convert_draw_nothing_from_the_rng(lower):
    # convert built each float conv/linear with random initialization, then
    # overwrote its weights: the user's random stream moved (torchao's moves too)
    model = Deterministic().eval()
    x = torch.randn(4, 16)
    state = torch.get_rng_state()
    prepared = qcore.prepare_pt2e(torch.export.export(model, (x,)).module(), "x86")
    prepared(x)
    qcore.convert_pt2e(prepared, lower=lower)
    assert torch.equal(torch.get_rng_state(), state)
