"""Generated graphs on PT2E, quantized by qcore's x86 backend and by torchao (tox -e peers).

The models of ``test_properties_vs_torch_ao`` (each activation family in each of
its forms after a conv, modules called twice, residuals reused, sizes and lists,
bool masks, scalar arithmetic, in-place writes and views made before them),
exported, then quantized by ``prepare_pt2e(model, "x86")`` and by torchao's
X86InductorQuantizer with its default config. Where torchao runs, qcore runs, and
both its reference form and its lowered model are within 0.5 dB of torchao's SQNR
against float.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from test_properties_vs_torch_ao import FLOOR_DB, GENERATED, TOLERANCE_DB, float_case, models, sqnr

import qcore

pytest.importorskip("torchao")
pytest.importorskip("qcore_x86", reason="needs the x86 plugin")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e as ao_convert
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e as ao_prepare


def _exported(model: torch.nn.Module, data: list[torch.Tensor]) -> torch.fx.GraphModule:
    return torch.export.export(model, (data[0].clone(),)).module()


def _calibrated(prepared: torch.nn.Module, data: list[torch.Tensor]) -> torch.nn.Module:
    with torch.no_grad():
        for batch in data:
            prepared(batch.clone())
    return prepared


def _torchao(model: torch.nn.Module, data: list[torch.Tensor]) -> torch.Tensor | None:
    """torchao's output on data[0], or None where torchao fails."""
    quantizer = xiq.X86InductorQuantizer().set_global(
        xiq.get_default_x86_inductor_quantization_config()
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted = ao_convert(_calibrated(ao_prepare(_exported(model, data), quantizer), data))
            with torch.no_grad():
                return converted(data[0].clone())
    except Exception:  # noqa: BLE001 - torchao failing excuses qcore from this model
        return None


def _qcore(model: torch.nn.Module, data: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        prepared = _calibrated(qcore.prepare_pt2e(_exported(model, data), "x86"), data)
    reference = qcore.convert_pt2e(prepared, lower=False)
    lowered = qcore.convert_pt2e(prepared)
    with torch.no_grad():
        return reference(data[0].clone()), lowered(data[0].clone())


@GENERATED
@given(parts=models)
def test_generated_graphs_match_torchao_on_pt2e(parts):
    model, data, expected = float_case(parts)
    reference, lowered = _qcore(model, data)
    # against float too, as on FX: a fault torchao shared would pass the comparison
    assert min(sqnr(expected, reference), sqnr(expected, lowered)) > FLOOR_DB, parts
    peer = _torchao(model, data)
    if peer is None:
        return
    peer_db = sqnr(expected, peer)
    assert sqnr(expected, reference) >= peer_db - TOLERANCE_DB, (parts, peer_db)
    assert sqnr(expected, lowered) >= peer_db - TOLERANCE_DB, (parts, peer_db)
