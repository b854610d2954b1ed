"""Pass-through ops (reshape, transpose, max_pool) fed by float and read by float stay
float: quantizing them only adds a quantize/dequantize (time and rounding error).
By default where torch.ao leaves them float (after a float reuse-input op), inside
qcore's own searches after any float op.

Found measuring keep_float_if_slower (issue 15 §3): with every linear of the
transformer block kept float, its reshapes and transposes were still quantized,
and the "all float" model ran 25% slower than the user's float model.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.ao.quantization.quantize_fx as torch_ao_fx
from backends import backend_params

import qcore
from qcore.accuracy import sqnr
from qcore.engine.explain import Status
from qcore.engine.float_islands import (
    FLOAT_ISLAND_REASON,
    REUSES_FLOAT_REASON,
    islands_from_any_float_op,
)

QUANTIZE_OPS = {
    torch.quantize_per_tensor,
    torch.ops.quantized_decomposed.quantize_per_tensor.default,
}


def _quantize_calls(model: torch.fx.GraphModule) -> int:
    return sum(1 for n in model.graph.nodes if n.op == "call_function" and n.target in QUANTIZE_OPS)


class Heads(torch.nn.Module):
    """An attention-style split: linear -> reshape -> transpose -> matmul."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.q(x).reshape(2, 4, 4, 4).transpose(1, 2)
        scores = torch.matmul(heads, heads.transpose(-2, -1))
        return self.out(torch.matmul(scores, heads).transpose(1, 2).reshape(2, 4, 16))


class ToGraphOutput(torch.nn.Module):
    def __init__(self, pool: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(8, 8)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool:
            return torch.nn.functional.max_pool1d(self.q(x), 2)
        return x.reshape(2, 4, 8).transpose(1, 2)


class IntoInt8Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(8, 8)
        self.o = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.flatten(self.q(x), 1).reshape(2, 4, 8))


def _convert(model, backend, x, float_modules=("q",), float_ops=()):
    mapping = qcore.get_default_qconfig_mapping(backend)
    for name in float_modules:
        mapping.set_module_name(name, None)
    for op in float_ops:
        mapping.set_object_type(op, None)
    prepared = qcore.prepare_fx(model, mapping, (x,), backend=backend)
    prepared(x)
    return qcore.convert_fx(prepared)


def _torch_ao_convert(model, backend, x, float_modules=("q",), float_ops=()):
    mapping = torch.ao.quantization.get_default_qconfig_mapping(backend)
    for name in float_modules:
        mapping.set_module_name(name, None)
    for op in float_ops:
        mapping.set_object_type(op, None)
    prepared = torch_ao_fx.prepare_fx(model, mapping, (x,))
    prepared(x)
    return torch_ao_fx.convert_fx(prepared)


@pytest.mark.parametrize("backend", backend_params())
def test_shape_ops_after_a_float_reshape_stay_float_as_in_torch_ao(backend):
    """torch.ao's mapping gives reshape a reuse-input QConfig: after a float linear
    it stays float, and so do the transposes it alone feeds."""
    model, x = Heads().eval(), torch.randn(2, 4, 16)
    args = (model, backend, x, ("q", "out"), (torch.matmul,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", qcore.QCoreWarning)  # nothing the user asked is lost
        converted = _convert(*args)
    report = qcore.explain(converted)
    assert report["reshape"].status is Status.FLOAT
    assert report["reshape"].reason == REUSES_FLOAT_REASON
    for name in ("transpose", "transpose_1"):
        assert report[name].status is Status.FLOAT
        assert report[name].reason == FLOAT_ISLAND_REASON
    # the transpose after the float matmul is quantized, as torch.ao quantizes it
    assert report["transpose_2"].status is Status.QUANTIZED
    assert _quantize_calls(converted) == _quantize_calls(_torch_ao_convert(*args)) == 1


@pytest.mark.parametrize("backend", backend_params())
def test_inside_qcore_searches_every_float_op_starts_an_island(backend):
    """What keep_float_if_slower builds when int8 loses everywhere: no quantize left."""
    model, x = Heads().eval(), torch.randn(2, 4, 16)
    with islands_from_any_float_op():
        converted = _convert(model, backend, x, ("q", "out"), (torch.matmul,))
    assert _quantize_calls(converted) == 0
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=0)
    assert qcore.explain(converted)["transpose_2"].reason == FLOAT_ISLAND_REASON


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("pool", [False, True], ids=["input-reshape-transpose", "linear-maxpool"])
def test_a_float_fed_chain_to_the_float_output(backend, pool):
    model, x = ToGraphOutput(pool).eval(), torch.randn(2, 4, 8)
    converted = _convert(model, backend, x)
    # torch.ao: a reshape of the input reuses its (float) input; a pool after a
    # float linear gets a quantize and a dequantize
    assert _quantize_calls(converted) == _quantize_calls(_torch_ao_convert(model, backend, x))
    with islands_from_any_float_op():
        converted = _convert(model, backend, x)
    assert _quantize_calls(converted) == 0
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("any_float_op", [False, True], ids=["default", "search"])
def test_a_chain_that_feeds_an_int8_layer_is_still_quantized(backend, any_float_op):
    """flatten/reshape before a quantized linear: quantized where they start, as torch.ao."""
    model, x = IntoInt8Linear().eval(), torch.randn(2, 4, 8)
    with islands_from_any_float_op() if any_float_op else contextlib.nullcontext():
        converted = _convert(model, backend, x)
    report = qcore.explain(converted)
    assert report["o"].status is Status.QUANTIZED
    assert report["flatten"].status is Status.QUANTIZED
    assert _quantize_calls(converted) == 1  # once, before flatten
    expected = model(x)
    peer = _torch_ao_convert(model, backend, x)
    assert sqnr(expected, converted(x)) >= sqnr(expected, peer(x)) - 0.5
