"""mlp: a Linear-ReLU stack without normalization, ending in a Linear without activation."""

from __future__ import annotations

import torch
from torch import nn

from qcore.examples._common import CALIBRATION_SEED, MODEL_SEED, ZooEntry, gaussian_batches, seeded

IN_FEATURES = 64
HIDDEN = (128, 128, 64)
NUM_CLASSES = 10


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        layers: list[nn.Module] = []
        in_features = IN_FEATURES
        for width in HIDDEN:
            layers += [nn.Linear(in_features, width), nn.ReLU()]
            in_features = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(in_features, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_model() -> nn.Module:
    with seeded(MODEL_SEED):
        return MLP().eval()


def example_inputs() -> tuple:
    return gaussian_batches((1, IN_FEATURES), 1, seed=CALIBRATION_SEED)[0]


def calibration_data(n: int, seed: int = CALIBRATION_SEED) -> list[tuple]:
    return gaussian_batches((16, IN_FEATURES), n, seed=seed)


ENTRY = ZooEntry(
    name="mlp",
    make_model=make_model,
    example_inputs=example_inputs,
    calibration_data=calibration_data,
    description="64-128-128-64-10 Linear-ReLU stack, last Linear bare",
)
