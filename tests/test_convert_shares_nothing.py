"""convert copies the prepared model sharing its observers for speed (issue 15 §5);
the converted model must still share no module or tensor with the prepared one, so
calibrating the prepared model again never changes a model already converted, and
convert leaves the prepared model's modules in their modes."""

from __future__ import annotations

import pytest
import torch
from backends import backend_params
from zoo import ZOO

import qcore


def _tensors(module: torch.nn.Module) -> dict[int, str]:
    found = {}
    for name, value in list(module.named_parameters()) + list(module.named_buffers()):
        found[id(value)] = name
    return found


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", ["resnet18_like", "transformer_block"])
def test_converted_model_shares_nothing_with_the_prepared_one(backend: str, name: str) -> None:
    entry = ZOO[name]
    prepared = qcore.prepare_fx(entry.make_model(), None, entry.example_inputs(), backend=backend)
    with torch.no_grad():
        for batch in entry.calibration_data(2):
            prepared(*batch)
    for convert in (qcore.convert_fx, qcore.convert_to_reference_fx):
        prepared_state = {k: v.clone() for k, v in prepared.state_dict().items()}
        prepared_modes = {n: m.training for n, m in prepared.named_modules()}
        converted = convert(prepared)
        # its observers went to eval mode (they are shared while convert reads them)
        assert {n: m.training for n, m in prepared.named_modules()} == prepared_modes
        assert not any(m.training for m in converted.modules())
        after_convert = prepared.state_dict()
        assert list(after_convert) == list(prepared_state)  # convert removed nothing from it
        assert all(torch.equal(after_convert[k], v) for k, v in prepared_state.items())
        prepared_modules = {id(m) for m in prepared.modules()}
        shared = [n for n, m in converted.named_modules() if n and id(m) in prepared_modules]
        assert shared == []
        shared_tensors = set(_tensors(prepared)) & set(_tensors(converted))
        assert [_tensors(converted)[i] for i in shared_tensors] == []

        inputs = entry.example_inputs()
        with torch.no_grad():
            before = converted(*inputs)
            for batch in entry.calibration_data(2, seed=7):
                prepared(*(10 * x for x in batch))  # ranges ten times wider
            after = converted(*inputs)
        assert torch.equal(before, after)
