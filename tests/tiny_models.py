"""Small models several test modules build the same way."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TwoLinears(nn.Module):
    """fc1 (16 -> 32) -> relu -> fc2 (32 -> 8), seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))
