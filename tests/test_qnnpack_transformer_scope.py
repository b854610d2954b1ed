"""The user guide's advice for transformers on qnnpack ("Transformers on
qnnpack"): its residual adds left float, as x86's Quantizer and NNCF's
transformer preset leave them, lift the bundled transformer block by 10 dB."""

import operator

import pytest
import torch
from backends import installed
from zoo import ZOO

import qcore
from qcore.accuracy import sqnr


@pytest.mark.skipif(not installed("qnnpack"), reason="needs the qnnpack plugin")
def test_residual_adds_left_float_on_qnnpack() -> None:
    entry = ZOO["transformer_block"]
    model, example = entry.make_model().eval(), entry.example_inputs()
    calibration, held_out = entry.calibration_data(8, seed=1), entry.calibration_data(4, seed=2)
    mapping = qcore.get_default_qconfig_mapping("qnnpack")
    for add in (operator.add, torch.add):
        mapping.set_object_type(add, None)

    def held_out_sqnr(quantized: torch.nn.Module) -> float:
        with torch.no_grad():
            return sum(sqnr(model(*b), quantized(*b)) for b in held_out) / len(held_out)

    default = qcore.quantize(model, example, calibration, backend="qnnpack")
    scoped = qcore.quantize(model, example, calibration, backend="qnnpack", qconfig_mapping=mapping)
    report = qcore.explain(scoped)
    assert [e.status.value for e in report.entries if e.node.startswith("add")] == ["float"] * 2
    assert held_out_sqnr(scoped) > held_out_sqnr(default) + 8  # 46.3 against 35.6 dB
