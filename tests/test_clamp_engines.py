"""QuantizedClamp (relu6, hardtanh, clamp) gives the reference's values under every
global engine, eager and scripted, on contiguous and channels-last inputs, and
keeps the input's layout: it clamps a contiguous view of the input's memory,
because qnnpack's clamp misreads channels-last input. (A faster path that read
the global engine at run time was tried and withdrawn: it needed a process-wide
lock on every call, and no kernel reads the global while a model runs.)
"""

from __future__ import annotations

import random

import pytest
import torch

from qcore.kernels.activations import QuantizedClamp
from qcore.kernels.runtime import using_engine

ENGINES = [
    e
    for e in ("fbgemm", "x86", "onednn", "qnnpack")
    if e in torch.backends.quantized.supported_engines
]


def _inputs(count: int = 60):
    rng = random.Random(0)
    torch.manual_seed(0)
    for _ in range(count):
        shape = rng.choice([(1, 32, 16, 16), (2, 5, 7, 9), (3, 17), (4, 8, 3, 3)])
        scale, zero_point = 10 ** rng.uniform(-3, 0), rng.randint(0, 255)
        x = torch.randn(shape) * rng.uniform(0.1, 20)
        q = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
        if len(shape) == 4 and rng.random() < 0.6:  # every int8 conv's output layout
            q = q.contiguous(memory_format=torch.channels_last)
        yield q, (10 ** rng.uniform(-3, 0), rng.randint(0, 255))


def _int(q: torch.Tensor) -> torch.Tensor:
    return q.int_repr().to(torch.int32)


@pytest.mark.parametrize("engine", ENGINES)
def test_clamp_is_the_reference_under_every_engine(engine):
    kernel = QuantizedClamp(0.0, 6.0, None)
    scripted = torch.jit.script(QuantizedClamp(0.0, 6.0, None))
    for x, _ in _inputs():
        expected = torch.quantize_per_tensor(
            torch.clamp(x.dequantize(), 0.0, 6.0), x.q_scale(), x.q_zero_point(), x.dtype
        )
        with using_engine(engine):
            got, got_scripted = kernel(x), scripted(x)
        assert torch.equal(_int(got), _int(expected)), (engine, tuple(x.shape), x.stride())
        assert torch.equal(_int(got_scripted), _int(expected))
        assert got.is_contiguous(memory_format=torch.channels_last) == x.is_contiguous(
            memory_format=torch.channels_last
        )  # the next conv gets the layout it wants, no copy
