"""qcore.ops against torch's quantized kernels, bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

from qcore import ops

QDTYPES = [
    (torch.quint8, torch.uint8, 0, 255),
    (torch.qint8, torch.int8, -128, 127),
    (torch.qint32, torch.int32, -(2**31), 2**31 - 1),
]


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


def _inputs(gen: torch.Generator, scale: float, n: int = 4001) -> torch.Tensor:
    """Random values plus values that land exactly on and next to rounding ties."""
    ties = (torch.randint(-300, 300, (n,), generator=gen).float() + 0.5) * scale
    above = torch.nextafter(ties, torch.full_like(ties, float("inf")))
    below = torch.nextafter(ties, torch.full_like(ties, float("-inf")))
    spread = torch.randn(n, generator=gen) * 300 * scale
    return torch.cat([torch.randn(n, generator=gen) * 4, ties, above, below, spread])


def _zero_point(gen, qmin, qmax):
    return int(torch.randint(max(qmin, -1000), min(qmax, 1000) + 1, (1,), generator=gen))


@pytest.mark.parametrize("qdtype,plain,qmin,qmax", QDTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_quantize_per_tensor_matches_torch(qdtype, plain, qmin, qmax, seed):
    gen = torch.Generator().manual_seed(seed)
    scale = float(torch.rand(1, generator=gen)) * 0.1 + 1e-4
    zp = _zero_point(gen, qmin, qmax)
    x = _inputs(gen, scale)
    expected = _quiet(torch.quantize_per_tensor, x, scale, zp, qdtype)
    for dtype in (qdtype, plain):
        q = ops.quantize_per_tensor(x, scale, zp, qmin, qmax, dtype)
        assert q.dtype == plain
        assert torch.equal(q, expected.int_repr())
    # tensor qparams, 0-d and 1-d
    q = ops.quantize_per_tensor(x, torch.tensor(scale), torch.tensor([zp]), qmin, qmax, qdtype)
    assert torch.equal(q, expected.int_repr())
    deq = ops.dequantize_per_tensor(q, scale, zp, qmin, qmax, qdtype)
    assert deq.dtype == torch.float32
    assert torch.equal(deq, expected.dequantize())


@pytest.mark.parametrize("qdtype,plain,qmin,qmax", QDTYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_quantize_per_channel_matches_torch(qdtype, plain, qmin, qmax, axis):
    gen = torch.Generator().manual_seed(axis + 7)
    x = torch.randn(5, 6, 7, generator=gen) * 3
    channels = x.shape[axis]
    scales = torch.rand(channels, dtype=torch.float64, generator=gen) * 0.05 + 1e-4
    zps = torch.randint(max(qmin, -1000), min(qmax, 1000), (channels,), generator=gen)
    # put some values exactly on ties
    shape = [1] * x.dim()
    shape[axis] = channels
    ties = (torch.randint(-100, 100, x.shape, generator=gen) + 0.5) * scales.float().reshape(shape)
    x = torch.where(torch.rand(x.shape, generator=gen) < 0.5, x, ties)
    expected = _quiet(torch.quantize_per_channel, x, scales, zps, axis % x.dim(), qdtype)
    q = ops.quantize_per_channel(x, scales, zps, axis, qmin, qmax, qdtype)
    assert q.dtype == plain
    assert torch.equal(q, expected.int_repr())
    deq = ops.dequantize_per_channel(q, scales, zps, axis, qmin, qmax, qdtype)
    assert torch.equal(deq, expected.dequantize())


def test_narrow_range_clamps_to_quant_min_max():
    x = torch.linspace(-10, 10, 101)
    q = ops.quantize_per_tensor(x, 0.01, 0, -127, 127, torch.qint8)
    assert int(q.min()) == -127 and int(q.max()) == 127
    q = ops.quantize_per_tensor(x, 0.1, 64, 0, 127, torch.quint8)
    assert int(q.max()) == 127


def test_storage_dtype_and_unknown_dtype():
    assert ops.storage_dtype(torch.quint8) is torch.uint8
    assert ops.storage_dtype(torch.qint8) is torch.int8
    assert ops.storage_dtype(torch.qint32) is torch.int32
    with pytest.raises(ValueError, match="float16"):
        ops.storage_dtype(torch.float16)


@pytest.mark.parametrize("seed", range(4))
def test_fake_quantize_per_tensor_matches_torch(seed):
    gen = torch.Generator().manual_seed(seed)
    scale = float(torch.rand(1, generator=gen)) * 0.1 + 1e-4
    zp = _zero_point(gen, 0, 255)
    x = _inputs(gen, scale).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out = ops.fake_quantize_per_tensor(x, scale, zp, 0, 255)
    ref = torch.fake_quantize_per_tensor_affine(x_ref, scale, zp, 0, 255)
    assert torch.equal(out, ref)
    grad = torch.randn(x.shape, generator=gen)
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("axis", [0, 1])
def test_fake_quantize_per_channel_matches_torch(axis):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 9, generator=gen) * 3).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    channels = x.shape[axis]
    scales = torch.rand(channels, generator=gen) * 0.05 + 1e-3
    zps = torch.randint(-128, 128, (channels,), generator=gen, dtype=torch.int32)
    out = ops.fake_quantize_per_channel(x, scales, zps, axis, -128, 127)
    ref = torch.fake_quantize_per_channel_affine(x_ref, scales, zps, axis, -128, 127)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_fake_quantize_per_channel_float_zero_points():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 10, generator=gen)
    scales = torch.rand(6, generator=gen) * 0.05 + 1e-3
    zps = torch.randn(6, generator=gen) * 20 + 100
    out = ops.fake_quantize_per_channel(x, scales, zps, 0, 0, 255)
    ref = torch.fake_quantize_per_channel_affine(x, scales, zps, 0, 0, 255)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize(
    "values",
    [
        lambda g: torch.randn(1000, generator=g) * 3,
        lambda g: torch.rand(1000, generator=g) * 5 + 1,  # all positive
        lambda g: -torch.rand(1000, generator=g) * 5 - 1,  # all negative
        lambda g: torch.randn(1000, generator=g) * 1e-4,  # small scale cut-off
        lambda g: torch.rand(1000, generator=g) * 1e-4,
        lambda g: torch.zeros(10),
    ],
)
def test_choose_qparams_matches_torch_dynamic(values, reduce_range):
    gen = torch.Generator().manual_seed(5)
    x = values(gen)
    expected = _quiet(torch.quantize_per_tensor_dynamic, x, torch.quint8, reduce_range)
    qmax = 127 if reduce_range else 255
    scale, zero_point = ops.choose_qparams_per_tensor(x, 0, qmax)
    assert float(scale) == expected.q_scale()
    assert int(zero_point) == expected.q_zero_point()
    q = ops.quantize_per_tensor(x, scale, zero_point, 0, 255, torch.quint8)
    assert torch.equal(q, expected.int_repr())
    fq = ops.fake_quantize_dynamic(x, 0, qmax, torch.quint8)
    assert torch.equal(fq, expected.dequantize())


def test_ops_as_fx_call_function_targets_and_compiled():
    graph = torch.fx.Graph()
    x_node = graph.placeholder("x")
    q = graph.call_function(ops.quantize_per_tensor, (x_node, 0.05, 3, 0, 255, torch.quint8))
    dq = graph.call_function(ops.dequantize_per_tensor, (q, 0.05, 3, 0, 255, torch.quint8))
    graph.output(dq)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x = torch.randn(64)
    expected = _quiet(torch.quantize_per_tensor, x, 0.05, 3, torch.quint8).dequantize()
    assert torch.equal(gm(x), expected)
    assert "ops.quantize_per_tensor" in gm.code or "quantize_per_tensor" in gm.code
    compiled = torch.compile(gm, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), expected)


_CHOOSE_CASES = [
    torch.randn(1000) * 3,
    torch.rand(1000) * 5 + 1,
    -torch.rand(1000) * 5 - 1,
    torch.randn(1000) * 1e-4,  # the small-scale cut-off
    torch.rand(1000) * 1e-4,
    -torch.rand(1000) * 1e-4,
    torch.zeros(10),
    torch.empty(0),
    torch.tensor([1e-42, 2e-42]),  # 1 / scale beyond float32: scale 0.1
    torch.tensor([-3e38, 3e38]),
]


@pytest.mark.parametrize("index", range(len(_CHOOSE_CASES)))
@pytest.mark.parametrize("qmax", [127, 255])
def test_ops_script_with_the_eager_numbers(index, qmax):
    """A converted model's graph calls these: torch.jit.script compiles them (the
    eager code's struct/try/dtype dict have scripted equivalents), bit for bit."""
    x = _CHOOSE_CASES[index]
    scripted = {name: torch.jit.script(getattr(ops, name)) for name in ops.__all__ if "_" in name}
    scripted.pop("STORAGE_DTYPES")
    eager_qparams = ops.choose_qparams_per_tensor(x, 0, qmax)
    script_qparams = scripted["choose_qparams_per_tensor"](x, 0, qmax)
    for eager, script in zip(eager_qparams, script_qparams, strict=True):
        assert eager.dtype == script.dtype and torch.equal(eager, script)
    assert torch.equal(
        ops.fake_quantize_dynamic(x, 0, qmax, torch.quint8),
        scripted["fake_quantize_dynamic"](x, 0, qmax, torch.quint8),
    )
    for dtype in (torch.quint8, torch.qint8, torch.qint32):
        lo, hi = (0, qmax) if dtype == torch.quint8 else (-128, 127)
        args = (x, 0.05, 3 if dtype == torch.quint8 else 0, lo, hi, dtype)
        q, script_q = ops.quantize_per_tensor(*args), scripted["quantize_per_tensor"](*args)
        assert q.dtype == script_q.dtype == ops.storage_dtype(dtype) and torch.equal(q, script_q)
        tensor_qparams = (x, torch.tensor(0.05), torch.tensor(1), lo, hi, dtype)
        assert torch.equal(
            ops.quantize_per_tensor(*tensor_qparams),
            scripted["quantize_per_tensor"](*tensor_qparams),
        )
        assert torch.equal(
            ops.dequantize_per_tensor(q, 0.05, 3, lo, hi, dtype, torch.float16),
            scripted["dequantize_per_tensor"](q, 0.05, 3, lo, hi, dtype, torch.float16),
        )
    assert torch.equal(
        ops.fake_quantize_per_tensor(x, 0.05, 3, 0, qmax),
        scripted["fake_quantize_per_tensor"](x, 0.05, 3, 0, qmax),
    )
    if x.numel() >= 2:
        rows = x[: (x.numel() // 2) * 2].reshape(2, -1)
        scales, zero_points = torch.tensor([0.05, 0.2]), torch.tensor([0, 3])
        per_channel = (rows, scales, zero_points, 0, 0, qmax, torch.quint8)
        q = ops.quantize_per_channel(*per_channel)
        assert torch.equal(q, scripted["quantize_per_channel"](*per_channel))
        assert torch.equal(
            ops.dequantize_per_channel(q, scales, zero_points, 0),
            scripted["dequantize_per_channel"](q, scales, zero_points, 0),
        )
        assert torch.equal(
            ops.fake_quantize_per_channel(rows, scales, zero_points, 0, 0, qmax),
            scripted["fake_quantize_per_channel"](rows, scales, zero_points, 0, 0, qmax),
        )


@pytest.mark.parametrize(
    "value",
    [
        0.1,
        6.1e-5,
        1e-46,
        -1e-46,
        3.4028234663852886e38,
        3.4028235677973245e38,
        3.4028235677973366e38,
        -3.4028235677973366e38,
        1e39,
        1e300,
        float("inf"),
        float("nan"),
    ],
)
def test_float32_rounding_scripts_with_the_eager_value(value):
    import math

    eager, script = ops._f32(value), torch.jit.script(ops._f32)(value)
    assert (math.isnan(eager) and math.isnan(script)) or eager == script
