"""torchao's own quantizers through qcore's PT2E engine and through torchao's, on real
architectures: the same annotations must give the same model, bit for bit.

qcore.prepare_pt2e takes a torchao Quantizer by reading the annotations it writes
(issue 13 item 2). Where a real model's SQNR differs from torchao's, the comparison
in test_realmodels.py cannot say whether the recipe or the engine made the difference;
here the recipe is the same, so any difference is qcore's prepare/convert. The full
corpus is in FINDINGS.md 10 (every model that exports: identical).
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest

pytest.importorskip("transformers")
torchao_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import qcore  # noqa: E402

from .models import build  # noqa: E402


def _x86_inductor():
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq

    return xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config())


def _xnnpack_per_channel():
    from torchao.testing.pt2e import _xnnpack_quantizer as xq

    return xq.XNNPACKQuantizer().set_global(
        xq.get_symmetric_quantization_config(is_per_channel=True)
    )


QUANTIZERS = {"x86_inductor": _x86_inductor, "xnnpack_per_channel": _xnnpack_per_channel}


def _converted(case, prepare, convert, make_quantizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(copy.deepcopy(case.model), case.example_inputs).module()
        prepared = prepare(exported, make_quantizer())
        with torch.no_grad():
            for batch in case.calibration:
                prepared(*batch)
        return convert(prepared)


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
@pytest.mark.parametrize("name", ["resnet", "bert", "wav2vec2"])
def test_a_torchao_quantizer_gives_torchaos_model_bit_for_bit(name, quantizer):
    case = build(name)
    make = QUANTIZERS[quantizer]
    theirs = _converted(case, torchao_pt2e.prepare_pt2e, torchao_pt2e.convert_pt2e, make)
    ours = _converted(case, qcore.prepare_pt2e, qcore.convert_pt2e, make)
    with torch.no_grad():
        for batch in case.evaluation[:4]:
            expected, got = theirs(*batch), ours(*batch)
            assert not torch.equal(expected, case.model(*batch))  # quantized at all
            assert torch.equal(got, expected), float((got - expected).abs().max())
