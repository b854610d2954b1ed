"""transformer_block: a pre-norm transformer encoder block written out op by op.

No nn.MultiheadAttention and no nn.TransformerEncoderLayer: every matmul, the 1/sqrt(d)
scaling, the softmax and both residual adds are visible graph nodes. Input (batch, seq, dim).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qcore.examples._common import CALIBRATION_SEED, MODEL_SEED, ZooEntry, gaussian_batches, seeded

SEQ_LEN = 16
DIM = 64
HEADS = 4
FF_DIM = 128


class TransformerBlock(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS, ff_dim: int = FF_DIM):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.norm1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, ff_dim)
        self.gelu = nn.GELU()
        self.ff2 = nn.Linear(ff_dim, dim)

    def split_heads(self, x: torch.Tensor, batch, seq) -> torch.Tensor:
        # (batch, seq, dim) -> (batch, heads, seq, head_dim)
        return x.reshape(batch, seq, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        h = self.norm1(x)
        q = self.split_heads(self.q(h), batch, seq)
        k = self.split_heads(self.k(h), batch, seq)
        v = self.split_heads(self.v(h), batch, seq)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        attention = torch.softmax(scores, dim=-1)
        context = torch.matmul(attention, v).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.out(context)
        h = self.ff2(self.gelu(self.ff1(self.norm2(x))))
        return x + h


def make_model() -> nn.Module:
    with seeded(MODEL_SEED):
        return TransformerBlock().eval()


def example_inputs() -> tuple:
    return gaussian_batches((1, SEQ_LEN, DIM), 1, seed=CALIBRATION_SEED)[0]


def calibration_data(n: int, seed: int = CALIBRATION_SEED) -> list[tuple]:
    return gaussian_batches((2, SEQ_LEN, DIM), n, seed=seed)


ENTRY = ZooEntry(
    name="transformer_block",
    make_model=make_model,
    example_inputs=example_inputs,
    calibration_data=calibration_data,
    description="pre-norm encoder block, 4 heads, dim 64, ff 128, input (1, 16, 64)",
)
