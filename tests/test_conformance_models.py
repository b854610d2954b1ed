"""The conformance suite's kernel models (issue 16 §3): every kernel a first-party
backend registers either gets a model built from its pattern or declares why not,
and the kernel check fails a kernel that does neither, naming it once."""

import pytest
import torch
from backends import backend_params
from torch import nn

import qcore
from qcore.conformance import ConformanceFailure, check_kernels_match_reference, describe_op
from qcore.conformance_models import model_for
from qcore.kernels.library import NO_TENSOR_METHOD, QAT_ONLY, kernels_for, no_model_reason
from qcore.plugin.kernels import Kernel

aten = torch.ops.aten


@pytest.mark.parametrize("name", backend_params(("fbgemm", "qnnpack", "x86", "onednn")))
def test_every_kernel_has_a_model_or_a_reason(name):
    """Before issue 16, 216 of x86's 236 kernels had no model and passed unnoticed."""
    kernels = qcore.get_backend(name).kernels
    without = [describe_op(k.pattern) for k in kernels if model_for(k.pattern) is None]
    unexplained = [
        f"{k.name}: {describe_op(k.pattern)}"
        for k in kernels
        if model_for(k.pattern) is None and not k.no_model_reason
    ]
    assert unexplained == []
    # most are generated: the reasons cover QAT modules and unreachable names only
    assert len(without) < len(kernels) / 8, without


@pytest.mark.parametrize(
    "pattern",
    [
        nn.Linear,
        (nn.Conv2d, nn.ReLU),
        torch.add,
        "reshape",
        aten.relu.default,
        (aten.add.Tensor, aten.relu.default),
        nn.Embedding,
        nn.LSTM,
    ],
)
def test_models_run_and_say_their_path(pattern):
    built = model_for(pattern, seed=3)
    assert built is not None
    with torch.no_grad():
        built.model(*built.inputs)
    chain = pattern if isinstance(pattern, tuple) else (pattern,)
    exported = any(isinstance(op, torch._ops.OpOverload) for op in chain)
    assert built.path == ("pt2e" if exported else "fx")
    produced = model_for(pattern, seed=3, produced=True)
    if produced is not None:  # each input first through a 1x1 conv or a linear layer
        assert len(produced.model.producers) == len(built.inputs)


def test_library_reasons():
    import torch.ao.nn.intrinsic.qat as nniqat

    assert no_model_reason(nniqat.ConvBn2d) == QAT_ONLY
    assert no_model_reason("hardsigmoid") == NO_TENSOR_METHOD
    assert no_model_reason(nn.Linear) == ""
    assert all(k.no_model_reason == "" for k in kernels_for("fbgemm") if k.pattern is nn.Linear)


def test_kernel_without_model_or_reason_fails_once(monkeypatch):
    """A kernel of a class no model can be built for fails the check, named once with its
    patterns; declaring a reason lists it as not checked instead."""

    class Block(nn.Module):
        pass

    def refuse(match):
        raise NotImplementedError

    kernels = [
        Kernel("chip.block", Block, "chip", refuse),
        Kernel("chip.block", (Block, nn.ReLU), "chip", refuse),
    ]

    class Fake:
        def __init__(self, kernels):
            self.kernels = kernels

    monkeypatch.setattr(qcore, "get_backend", lambda name: Fake(kernels))
    with pytest.raises(ConformanceFailure) as failure:
        check_kernels_match_reference("chip")
    message = str(failure.value)
    assert (
        "no generated model and no declared reason (Kernel.no_model_reason) for 2 kernel patterns:"
        in message
    )
    assert message.count("chip.block") == 1
    assert "Block" in message and "nn.ReLU" in message  # each pattern, to act on
    declared = [
        Kernel("chip.block", Block, "chip", refuse, no_model_reason="built by our own zoo"),
    ]
    monkeypatch.setattr(qcore, "get_backend", lambda name: Fake(declared))
    summary = check_kernels_match_reference("chip")
    assert summary.startswith("0 kernel patterns agree")
    assert "not checked, built by our own zoo: chip.block" in summary
