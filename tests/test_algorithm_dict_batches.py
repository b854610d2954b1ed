"""Calibration batches as dicts of keyword arguments (``input_ids=...,
attention_mask=...``, the usual way to calibrate a transformers model) reach the
passes that run the graph on data: correct_bias, smooth_quant and adaround
refused them ("runs the graph on positional inputs"), though quantize and
equalize take them."""

from __future__ import annotations

import copy

import pytest
import torch
from backends import FIRST_PARTY, installed

import qcore


class TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(8)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(self.norm(x)))) + y


def _backend() -> str:
    for name in FIRST_PARTY:
        if installed(name):
            return name
    pytest.skip("needs a first-party backend")


def _batches() -> tuple[list[tuple], list[dict]]:
    generator = torch.Generator().manual_seed(1)
    pairs = [(torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator))]
    pairs += [tuple(torch.randn(4, 8, generator=generator) for _ in range(2)) for _ in range(3)]
    return pairs, [{"y": y, "x": x} for x, y in pairs]  # keyword order need not match


ALGORITHMS = [
    ["correct_bias"],
    [("correct_bias", {"method": "empirical"})],
    [("smooth_quant", {"alpha": 0.5})],
    [("adaround", {"iterations": 5})],
]


@pytest.mark.parametrize("algorithms", ALGORITHMS, ids=lambda a: str(a[0]))
def test_dict_batches_give_what_tuple_batches_give(algorithms):
    model, backend = TwoInputs().eval(), _backend()
    tuples, dicts = _batches()
    from_tuples = qcore.quantize(model, tuples[0], tuples, backend, algorithms=algorithms)
    from_dicts = qcore.quantize(model, tuples[0], dicts, backend, algorithms=algorithms)
    assert qcore.algorithms.applied_algorithms(from_dicts)[0].changed
    with torch.no_grad():
        assert torch.equal(from_tuples(*tuples[0]), from_dicts(*tuples[0]))


def test_a_pt2e_model_takes_dict_batches_too():
    model, backend = TwoInputs().eval(), _backend()
    tuples, dicts = _batches()
    exported = torch.export.export(model, tuples[0]).module()
    results = []
    for batches in (tuples, dicts):
        prepared = qcore.prepare_pt2e(copy.deepcopy(exported), backend)
        with torch.no_grad():
            for x, y in tuples:
                prepared(x, y)
        corrected = qcore.correct_bias(prepared, batches)
        results.append(qcore.convert_pt2e(corrected)(*tuples[0]))
    assert torch.equal(*results)


def test_a_batch_that_fits_no_parameter_is_named():
    model, backend = TwoInputs().eval(), _backend()
    tuples, _ = _batches()
    prepared = qcore.prepare_fx(model, None, tuples[0], backend=backend)
    with pytest.raises(TypeError, match=r"batch 0: .*forward takes no parameter named 'z'"):
        qcore.smooth_quant(prepared, [{"x": tuples[0][0], "z": tuples[0][1]}])
