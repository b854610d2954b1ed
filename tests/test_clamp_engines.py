"""QuantizedClamp (relu6, hardtanh, clamp) gives the reference's values under every
global engine, eager and scripted, on contiguous and channels-last inputs, and
keeps the input's layout. torch's clamp on a channels-last input is exact and
keeps the layout, except qnnpack's (run while the global engine is qnnpack), which
reads that memory as if it were contiguous and returns a contiguous tensor. The
kernel clamps directly and checks its output's layout: a contiguous result means
qnnpack's clamp ran, and it clamps the input's NHWC view instead (contiguous, so
exact on every engine). The output never depends on the global, even when another
thread switches it between the kernel's calls; eager kernels read it only to go
straight to the NHWC view, scripted ones always take the check.
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


@pytest.mark.skipif("qnnpack" not in ENGINES, reason="torch built without qnnpack")
def test_clamp_is_the_reference_when_the_engine_turns_qnnpack_after_the_kernel_read_it(
    monkeypatch,
):
    """Another thread sets the engine to qnnpack between the kernel's look at the global
    and torch's clamp: torch's qnnpack clamp runs on the channels-last input, and the
    kernel sees that from the result and clamps the NHWC view instead."""
    kernel = QuantizedClamp(-1.0, 2.0, None)
    monkeypatch.setattr(kernel, "_qnnpack_engine_is_set", lambda: False)
    checked = 0
    for x, _ in _inputs():
        if not x.is_contiguous(memory_format=torch.channels_last) or x.is_contiguous():
            continue
        expected = torch.quantize_per_tensor(
            torch.clamp(x.dequantize(), -1.0, 2.0), x.q_scale(), x.q_zero_point(), x.dtype
        )
        with using_engine("qnnpack"):
            assert not torch.equal(_int(torch.clamp(x, -1.0, 2.0)), _int(expected))
            got = kernel(x)
        assert torch.equal(_int(got), _int(expected)), (tuple(x.shape), x.stride())
        assert got.is_contiguous(memory_format=torch.channels_last)
        checked += 1
    assert checked > 10
