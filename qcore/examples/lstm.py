"""lstm: Linear input projection, a 2-layer nn.LSTM, Linear head on the last step.

Meant for dynamic quantization (weights int8, activations quantized on the fly), the way
torch.ao quantizes recurrent models.
"""

from __future__ import annotations

import torch
from torch import nn

from qcore.examples._common import CALIBRATION_SEED, MODEL_SEED, ZooEntry, gaussian_batches, seeded

SEQ_LEN = 12
IN_FEATURES = 32
HIDDEN = 64
NUM_CLASSES = 10


class LSTMModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(IN_FEATURES, HIDDEN)
        self.lstm = nn.LSTM(HIDDEN, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, features)
        output = self.lstm(self.proj(x))[0]
        return self.head(output[:, -1, :])


def make_model() -> nn.Module:
    with seeded(MODEL_SEED):
        return LSTMModel().eval()


def example_inputs() -> tuple:
    return gaussian_batches((1, SEQ_LEN, IN_FEATURES), 1, seed=CALIBRATION_SEED)[0]


def calibration_data(n: int, seed: int = CALIBRATION_SEED) -> list[tuple]:
    return gaussian_batches((4, SEQ_LEN, IN_FEATURES), n, seed=seed)


ENTRY = ZooEntry(
    name="lstm",
    make_model=make_model,
    example_inputs=example_inputs,
    calibration_data=calibration_data,
    dynamic=True,
    description="Linear 32->64, 2-layer LSTM(64), Linear head; input (1, 12, 32); dynamic",
)
