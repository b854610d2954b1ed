"""What docs/plugin-guide.md tells a vendor about kernels holds (issue 16 §3): the
weight qparams are a public ``qcore.QParams`` with the fields the guide lists, a
plain layer's weight is ``"weight"`` and a fused module's ``"0.weight"``, and the
guide carries no internal wording."""

import dataclasses
import re
from pathlib import Path

import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.quantized.reference as nnqr
from torch import nn

import qcore
from qcore import BackendPatternConfig, DTypeConfig, Kernel, ObservationType

GUIDE = (Path(__file__).parent.parent / "docs" / "plugin-guide.md").read_text()

INT8 = DTypeConfig(
    input_dtype=torch.quint8,
    output_dtype=torch.quint8,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
)


def test_qparams_is_public_and_documented():
    from qcore.engine.reference import QParams
    from qcore.kernels import QParams as FromKernels

    assert qcore.QParams is QParams is FromKernels
    assert "QParams" in dir(qcore)
    for field in dataclasses.fields(QParams):
        assert f"`{field.name}`" in GUIDE, field.name


def test_the_guide_has_no_internal_wording():
    assert not re.search(r"\bseeds? ?\d{3}", GUIDE)
    assert "`engine`" in GUIDE and "plain torch" in GUIDE and '"0.weight"' in GUIDE


class _Recorder:
    """An in-process plugin whose kernels record what ``match.module`` holds, then
    refuse (the pattern stays in reference form)."""

    def __init__(self) -> None:
        self.seen: dict[str, dict] = {}

    @qcore.hookimpl
    def qcore_backend_pattern_configs(self, backend):
        different = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
        return [
            BackendPatternConfig(nn.Linear)
            .set_observation_type(different)
            .add_dtype_config(INT8)
            .set_root_module(nn.Linear)
            .set_reference_quantized_module(nnqr.Linear),
            BackendPatternConfig((nn.Conv2d, nn.ReLU))
            .set_fused_module(nni.ConvReLU2d)
            .set_fuser_method(lambda is_qat, conv, relu: nni.ConvReLU2d(conv, relu)),
            BackendPatternConfig(nni.ConvReLU2d)
            .set_observation_type(different)
            .add_dtype_config(INT8)
            .set_root_module(nn.Conv2d)
            .set_reference_quantized_module(nnqr.Conv2d),
        ]

    @qcore.hookimpl
    def qcore_backend_kernels(self, backend):
        def record(match):
            self.seen[match.module.original_type.__name__] = {
                name: (qparams, match.module.integer_weight(name))
                for name, qparams in match.module.weight_qparams.items()
            }
            raise ValueError("recorded")

        return [
            Kernel("guide.linear", nn.Linear, "guidechip", record),
            Kernel("guide.conv_relu", nni.ConvReLU2d, "guidechip", record),
        ]


def test_weight_names_and_integers_are_what_the_guide_says():
    recorder = _Recorder()
    qcore.register_plugin(recorder, name="guidechip")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5)).eval()
    x = torch.randn(2, 3, 6, 6)
    prepared = qcore.prepare_fx(model, None, (x,), "guidechip")
    prepared(x)
    qcore.convert_fx(prepared)
    assert list(recorder.seen["ConvReLU2d"]) == ["0.weight"]
    assert list(recorder.seen["Linear"]) == ["weight"]
    qparams, integers = recorder.seen["Linear"]["weight"]
    assert isinstance(qparams, qcore.QParams)
    # integer_weight is clamp(round(w * (1 / scale) + zero_point), quant_min, quant_max)
    scale = qparams.scale.reshape(-1, 1) if qparams.per_channel else qparams.scale
    zero_point = qparams.zero_point.reshape(-1, 1) if qparams.per_channel else qparams.zero_point
    expected = torch.clamp(
        torch.round(model[3].weight * (1.0 / scale) + zero_point),
        qparams.quant_min,
        qparams.quant_max,
    )
    assert torch.equal(integers.to(expected.dtype), expected)
