"""x86's oneDNN kernels against the reference form, through PT2E by name.

Each case is one fused pattern of x86's recipe (conv or linear with its
post-ops, a residual add, an int8 or a float output). The lowered model must
run it on the named oneDNN kernel, and agree with ``convert_pt2e(lower=False)``:
an int8 output within one quantization step, a float output to float rounding
(oneDNN accumulates the same integers exactly).

An int8 output is made observable by a 1x1 max pool (conv) or a cat of the
output with itself (linear): both copy int8 values, so the model's output is
the kernel's output dequantized.
"""

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcore
from qcore_x86.onednn import cpu_has_vnni
from qcore_x86.quantizer import X86Quantizer

GEN = torch.Generator().manual_seed(0)


class Conv(nn.Module):
    def __init__(self, post, residual, int8_out):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.shortcut = nn.Conv2d(8, 8, 1)  # makes the residual an int8 pattern output
        self.post, self.residual, self.int8_out = post, residual, int8_out

    def forward(self, x):
        shortcut = F.max_pool2d(self.shortcut(x), 1) if self.residual else None
        y = self.conv(x)
        if self.residual:
            y = y + shortcut
        y = self.post(y)
        return F.max_pool2d(y, 1) if self.int8_out else y


class Linear(nn.Module):
    def __init__(self, post, residual, int8_out):
        super().__init__()
        self.fc = nn.Linear(16, 12)
        self.post, self.residual, self.int8_out = post, residual, int8_out

    def forward(self, x, other):
        y = self.fc(x)
        if self.residual:
            y = y + other
        y = self.post(y)
        return torch.cat([y, y], dim=-1) if self.int8_out else y


CONV_POSTS = {
    "none": nn.Identity(),
    "relu": nn.ReLU(),
    "relu6": nn.ReLU6(),
    "hardswish": nn.Hardswish(),
    "silu": nn.SiLU(),
}
LINEAR_POSTS = {
    "none": nn.Identity(),
    "relu": nn.ReLU(),
    "leaky_relu": nn.LeakyReLU(0.1),
    "tanh": nn.Tanh(),
    "gelu": nn.GELU(),
}


def _cases():
    for kind, posts in (("conv", CONV_POSTS), ("linear", LINEAR_POSTS)):
        for post in posts:
            for int8_out in (True, False):
                yield kind, post, False, int8_out
        for int8_out in (True, False):
            yield kind, "relu", True, int8_out
            yield kind, "none", True, int8_out


def _inputs(kind, n=4):
    if kind == "conv":
        return [(torch.randn(2, 8, 6, 6, generator=GEN),) for _ in range(n)]
    return [
        (torch.randn(3, 16, generator=GEN), torch.randn(3, 12, generator=GEN)) for _ in range(n)
    ]


def _quantize(kind, post, residual, int8_out, quantizer=None):
    torch.manual_seed(0)
    posts = CONV_POSTS if kind == "conv" else LINEAR_POSTS
    model = (Conv if kind == "conv" else Linear)(posts[post], residual, int8_out).eval()
    batches = _inputs(kind)
    exported = torch.export.export(model, batches[0]).module()
    prepared = qcore.prepare_pt2e(exported, quantizer or "x86")
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    return prepared, batches


def _kernels(converted):
    return {entry.node: entry.kernel for entry in qcore.explain(converted).quantized}


@pytest.mark.parametrize(("kind", "post", "residual", "int8_out"), list(_cases()))
def test_onednn_kernel_matches_reference(kind, post, residual, int8_out):
    prepared, batches = _quantize(kind, post, residual, int8_out)
    reference = qcore.convert_pt2e(prepared, lower=False)
    lowered = qcore.convert_pt2e(prepared)
    weighted = (f"x86.{kind}", f"x86.onednn_{kind}")
    # The pattern under test is the model's last weighted op (a residual's
    # shortcut conv comes first).
    taken = [k for k in _kernels(lowered).values() if k.startswith(weighted)][-1:]
    # A plain or relu pattern with a full-range int8 output (reduce_range is off
    # on CPUs with VNNI) is the kernel library's, named after the fused pattern.
    library = int8_out and not residual and post in ("none", "relu")
    library = library and X86Quantizer().reduce_range is False
    library_kernel = ("x86.conv2d" if kind == "conv" else "x86.linear") + (
        "_relu" if post == "relu" else ""
    )
    assert taken == ([library_kernel] if library else [f"x86.onednn_{kind}"]), _kernels(lowered)
    with torch.no_grad():
        for batch in _inputs(kind, 3):
            expected, actual = reference(*batch), lowered(*batch)
            if int8_out:
                step = _output_step(lowered)
                assert (expected - actual).abs().max() <= step * 1.0001
            else:
                torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def _output_step(lowered) -> float:
    """The scale of the last weighted kernel: the model's output copies its int8 values."""
    weighted = [
        lowered.get_submodule(n.target)
        for n in lowered.graph.nodes
        if n.op == "call_module" and hasattr(lowered.get_submodule(n.target), "weight_int")
    ]
    return weighted[-1].scale


def test_resnet_block_runs_conv_add_relu_as_one_kernel():
    prepared, batches = _quantize("conv", "relu", True, True)
    lowered = qcore.convert_pt2e(prepared)
    adds = [n for n in lowered.graph.nodes if "add" in str(n.target)]
    assert adds == [], lowered.code
    fused = [m for m in lowered.modules() if type(m).__name__ == "OnednnConv" and m.residual_add]
    assert len(fused) == 1 and fused[0].unary == "relu"


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_state_dict_and_torch_save_round_trip(kind):
    """A converted model's state_dict loads into a fresh conversion; the whole
    converted model, oneDNN kernels included, survives torch.save/torch.load."""
    prepared, batches = _quantize(kind, "relu", True, True)
    lowered = qcore.convert_pt2e(prepared)
    fresh = qcore.convert_pt2e(_quantize(kind, "relu", True, True)[0])  # other calibration
    assert any(type(m).__name__.startswith("Onednn") for m in lowered.modules())
    with torch.no_grad():
        assert not torch.equal(fresh(*batches[0]), lowered(*batches[0]))
    fresh.load_state_dict(lowered.state_dict())
    buffer = io.BytesIO()
    torch.save(lowered, buffer)
    buffer.seek(0)
    with warnings.catch_warnings():
        # torch 2.13 warns unpickling the pytree specs of its own exported modules.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        loaded = torch.load(buffer, weights_only=False)
    assert [type(m).__name__ for m in loaded.modules()] == [
        type(m).__name__ for m in lowered.modules()
    ]
    with torch.no_grad():
        for batch in batches:
            assert torch.equal(fresh(*batch), lowered(*batch))
            assert torch.equal(loaded(*batch), lowered(*batch))


def test_forward_emits_no_warnings():
    prepared, batches = _quantize("conv", "hardswish", True, True)
    lowered = qcore.convert_pt2e(prepared)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            lowered(*batches[0])
    assert [str(w.message) for w in caught] == []


@pytest.mark.skipif(cpu_has_vnni(), reason="a CPU with VNNI takes 8-bit activations")
def test_without_vnni_8bit_activations_warn_once_with_what_to_do():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        X86Quantizer(reduce_range=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, qcore.QCoreWarning)]
    assert len(messages) == 1
    assert "without VNNI" in messages[0] and "leave reduce_range unset" in messages[0]


@pytest.mark.skipif(cpu_has_vnni(), reason="a CPU with VNNI sums int8 products in 32 bits")
@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_without_vnni_8bit_activations_give_the_reference_numbers(kind):
    """8-bit activations overflow oneDNN's 16-bit pair sums here: the lowered model
    moves those kernels to qnnpack's (or keeps them in reference form), and says so."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        quantizer = X86Quantizer(reduce_range=False)
    prepared, batches = _quantize(kind, "relu", False, False, quantizer)
    with torch.no_grad():  # weights large enough that the pair sums overflow
        for name, param in prepared.named_parameters():
            if name.endswith("weight") and param.dim() > 1:
                param.mul_(8)
        for batch in batches:
            prepared(*batch)
    reference = qcore.convert_pt2e(prepared, lower=False)
    lowered = qcore.convert_pt2e(prepared)
    reasons = [e.reason for e in qcore.explain(lowered).entries]
    assert any("all 8 bits" in reason for reason in reasons), reasons
    with torch.no_grad():
        for batch in batches:
            expected = reference(*batch)
            step = expected.abs().max() / 127
            assert (lowered(*batch) - expected).abs().max() <= step, kind


def test_default_reduce_range_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        X86Quantizer()
        X86Quantizer(reduce_range=True)


def test_reduce_range_defaults_to_what_the_cpu_needs():
    assert X86Quantizer().reduce_range is (not cpu_has_vnni())
    assert X86Quantizer(reduce_range=True).activation.quant_max == 127
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        assert X86Quantizer(reduce_range=False).activation.quant_max == 255
    with pytest.raises(TypeError, match="reduce_range: got 'yes'"):
        X86Quantizer(reduce_range="yes")


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_loaded_on_a_cpu_whose_sums_saturate_a_kernel_converted_with_vnni_says_so(
    kind, monkeypatch
):
    """Converted with 8-bit activations on a CPU with VNNI (made so here), loaded on
    one without: oneDNN's kernel cannot move to another engine, so loading warns and
    explain names the layer (docs/deploy.md, "Loading on another CPU")."""
    from qcore.kernels import runtime
    from qcore_x86 import onednn

    for module in (runtime, onednn):
        monkeypatch.setattr(module, "int8_products_saturate", lambda: False)
    quantizer = X86Quantizer(reduce_range=False)
    prepared, batches = _quantize(kind, "relu", False, False, quantizer)
    lowered = qcore.convert_pt2e(prepared)
    assert set(_kernels(lowered).values()) == {f"x86.onednn_{kind}"}
    for module in (runtime, onednn):
        monkeypatch.setattr(module, "int8_products_saturate", lambda: True)
    buffer = io.BytesIO()
    torch.save(lowered, buffer)
    buffer.seek(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        loaded = torch.load(buffer, weights_only=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, qcore.QCoreWarning)]
    assert len(messages) == 1 and "convert the model again on this CPU" in messages[0]
    reason = qcore.explain(loaded)[f"{kind}{'2d' if kind == 'conv' else ''}_reference"].reason
    assert reason.startswith("may compute wrong numbers on this CPU: its input uses all 8 bits")


def test_loaded_on_a_cpu_whose_onednn_gets_the_geometry_wrong_a_pt2e_conv_says_so(monkeypatch):
    """The probe asked again on the loading CPU (made wrong here): oneDNN's PT2E conv
    cannot move to another engine, so loading warns and explain names the layer."""
    from qcore.kernels import onednn_probe

    prepared, _ = _quantize("conv", "relu", False, False)
    lowered = qcore.convert_pt2e(prepared)
    assert set(_kernels(lowered).values()) == {"x86.onednn_conv"}

    def garbage(x, packed, scale, zero_point):
        return torch.quantize_per_tensor(torch.rand(1, 8, 6, 6) * 9, 0.05, 64, torch.quint8)

    monkeypatch.setitem(onednn_probe._QUANTIZED_CONVS, 2, garbage)
    monkeypatch.setattr(onednn_probe, "cpu_fingerprint", lambda: "another kind of CPU")
    onednn_probe.onednn_conv_wrong_here.cache_clear()
    buffer = io.BytesIO()
    torch.save(lowered, buffer)
    buffer.seek(0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            loaded = torch.load(buffer, weights_only=False)
    finally:
        onednn_probe.onednn_conv_wrong_here.cache_clear()
    messages = [str(w.message) for w in caught if issubclass(w.category, qcore.QCoreWarning)]
    assert len(messages) == 1 and "convert the model again on this CPU" in messages[0]
    reason = qcore.explain(loaded)["conv2d_reference"].reason
    assert reason.startswith("may compute wrong numbers on this CPU: oneDNN's int8 conv")
