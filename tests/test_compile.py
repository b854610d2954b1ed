"""qcore.compile: a backend's compile recipe (issue 15 §2).

x86's recipe is Inductor with frozen weights: the reference form's
quantized_decomposed graph is matched by Inductor's oneDNN int8 passes, and the
compiled model gives the reference form's numbers. A backend without a recipe
gets its eager kernels. Compiling takes seconds, so each path compiles one small
model.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from backends import installed
from test_registry import linear, plugin_module, registry, spec

import qcore
from qcore.compiling import CompiledModel

requires_x86 = pytest.mark.skipif(not installed("x86"), reason="needs the x86 plugin")


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu_(self.bn(self.conv(x)))  # an in-place relu after the conv
        y = torch.relu(self.conv2(y)) + y
        return self.fc(y.mean((2, 3)))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = ConvNet().eval()
    model.bn.running_mean.uniform_(-0.2, 0.2)
    model.bn.running_var.uniform_(0.5, 2.0)
    return model


def _data(count: int = 4) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 3, 12, 12, generator=generator),) for _ in range(count)]


def _prepared(
    path: str, backend: str, model: torch.nn.Module | None = None, batches: list | None = None
) -> torch.fx.GraphModule:
    """``model`` (the ConvNet) prepared on ``path`` and calibrated on ``batches``."""
    model = model if model is not None else _model()
    batches = batches if batches is not None else _data()
    if path == "pt2e":
        prepared = qcore.prepare_pt2e(torch.export.export(model, batches[0]).module(), backend)
    else:
        prepared = qcore.prepare_fx(model, None, batches[0], backend=backend)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    return prepared


def _reference(prepared: torch.fx.GraphModule, path: str) -> torch.fx.GraphModule:
    if path == "pt2e":
        return qcore.convert_pt2e(prepared, lower=False)
    return qcore.convert_to_reference_fx(prepared)


def _sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (expected - actual).pow(2).mean()
    return (10 * torch.log10(expected.pow(2).mean() / noise)).item()


@requires_x86
@pytest.mark.parametrize("path", ["pt2e", "fx"])
def test_x86_compiles_the_reference_form_to_int8_kernels(path, recwarn):
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    prepared = _prepared(path, "x86")
    before = copy.deepcopy(prepared.state_dict())
    reference = _reference(prepared, path)
    torch._dynamo.reset()
    counters.clear()
    fast = qcore.compile(prepared)
    assert isinstance(fast, CompiledModel) and fast.recipe.options["freezing"] is True

    (x,) = _data(1)[0]
    x = x + 0.01  # not a calibration batch
    recwarn.clear()
    compiled = fast(x)
    assert [str(w.message) for w in recwarn] == [], "compiling printed warnings"
    with torch.no_grad():
        eager, float_out = reference(x), _model()(x)
    # Inductor's int8 passes took the convs and the linear: oneDNN kernels ran.
    assert counters["inductor"]["qconv_weight_prepack_matcher_count"] >= 2
    assert counters["inductor"]["qlinear_weight_prepack_matcher_count"] >= 1
    # ...and they give the reference form's numbers: within a step of its output,
    # and as accurate against float.
    assert (compiled - eager).abs().max().item() <= 0.05 * eager.abs().max().item()
    assert _sqnr(float_out, compiled) >= _sqnr(float_out, eager) - 0.5
    # Compiling left no process-wide setting changed and the prepared model as it was.
    assert inductor_config.freezing is False
    after = prepared.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert qcore.explain(fast).backend == "x86"
    assert "oneDNN" in repr(fast)


@requires_x86
def test_a_new_input_shape_compiles_with_the_recipe_again():
    """Calls on a shape already compiled skip setting the recipe's options; a new
    shape makes dynamo trace again, and that trace gets them (frozen int8 weights)."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    prepared = _prepared("fx", "x86")  # traced for any batch size
    torch._dynamo.reset()
    fast = qcore.compile(prepared)
    (x,) = _data(1)[0]
    fast(x)
    fast(x)
    counters.clear()
    wider = torch.cat([x, x + 0.01])  # another batch size: dynamo compiles again
    compiled = fast(wider)
    assert counters["inductor"]["qconv_weight_prepack_matcher_count"] >= 2
    assert inductor_config.freezing is False
    with torch.no_grad():
        eager = qcore.convert_to_reference_fx(prepared)(wider)
    assert (compiled - eager).abs().max().item() <= 0.05 * eager.abs().max().item()


@requires_x86
def test_a_recompile_the_signature_does_not_see_gets_the_recipe_too():
    """dynamo also compiles again for inputs of the same shape in another memory
    format, and after ``torch._dynamo.reset()``. Such a compile without the recipe's
    options failed inside Inductor (its int8 passes prepacking weights that were not
    frozen): both now give the reference form's numbers."""
    prepared = _prepared("pt2e", "x86")
    torch._dynamo.reset()
    fast = qcore.compile(prepared)
    (x,) = _data(1)[0]
    with torch.no_grad():
        eager = qcore.convert_pt2e(prepared, lower=False)(x)
    first = fast(x)
    channels_last = fast(x.contiguous(memory_format=torch.channels_last))
    torch._dynamo.reset()
    after_reset = fast(x)
    for compiled in (first, channels_last, after_reset):
        assert (compiled - eager).abs().max().item() <= 0.05 * eager.abs().max().item()


class NormResidual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


@requires_x86
def test_a_compiled_model_leaves_its_inputs_as_they_were():
    """Inductor fuses ``x + fc(norm(x))`` into oneDNN's qlinear with an in-place "sum"
    post-op on the graph input ``x``: the caller's tensor was overwritten (by up to
    1.55 here), came back as the output, and a second call on it was 1.36 off
    (torchao's compiled model does the same). Inputs the graph writes are copied."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = NormResidual().eval()
    batches = [torch.randn(4, 16) for _ in range(4)]
    prepared = qcore.prepare_pt2e(torch.export.export(model, (batches[0],)).module(), "x86")
    for batch in batches:
        prepared(batch)
    with torch.no_grad():
        x = torch.randn(4, 16)
        eager = qcore.convert_pt2e(prepared, lower=False)(x.clone())
    torch._dynamo.reset()
    fast = qcore.compile(prepared)
    kept = x.clone()
    first = fast(x)
    counters.clear()
    second = fast(x)
    assert torch.equal(x, kept)
    assert first.data_ptr() != x.data_ptr()
    for compiled in (first, second):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 0  # the second call ran what was compiled


@pytest.mark.parametrize("backend", ["qnnpack", "fbgemm"])
def test_a_backend_without_a_recipe_gets_its_eager_kernels(backend):
    if not installed(backend):
        pytest.skip(f"needs the {backend} plugin")
    prepared = _prepared("pt2e", backend)
    assert qcore.get_backend(backend).compile_recipe() is None
    fast = qcore.compile(prepared)
    lowered = qcore.convert_pt2e(prepared)
    assert not isinstance(fast, CompiledModel)
    assert [e.kernel for e in qcore.explain(fast).quantized] == [
        e.kernel for e in qcore.explain(lowered).quantized
    ]
    assert qcore.explain(fast).quantized, "the eager model runs on the backend's kernels"
    (x,) = _data(1)[0]
    assert torch.equal(fast(x), lowered(x))


def test_native_asks_no_plugin_for_a_recipe():
    assert qcore.get_backend("native").compile_recipe() is None


def test_compile_takes_a_prepared_model_and_says_so():
    with pytest.raises(TypeError, match=r"model: got .*Linear.*expected a calibrated model"):
        qcore.compile(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_a_converted_model_is_named_as_one(path):
    """A converted model got the plain-module message, which did not say what was
    wrong with it."""
    backend = next((name for name in ("x86", "fbgemm", "qnnpack") if installed(name)), None)
    if backend is None:
        pytest.skip("needs a first-party backend")
    prepared = _prepared(path, backend)
    converted = qcore.convert_pt2e(prepared) if path == "pt2e" else qcore.convert_fx(prepared)
    with pytest.raises(TypeError, match=r"a model qcore already converted; qcore.compile takes"):
        qcore.compile(converted)


@pytest.mark.parametrize("backend", ["x86", "qnnpack", "fbgemm"])
def test_fx_reference_modules_become_int8_weights_with_the_same_numbers(backend):
    from qcore.engine.decomposed import weights_in_graph

    if not installed(backend):
        pytest.skip(f"needs the {backend} plugin")
    reference = qcore.convert_to_reference_fx(_prepared("fx", backend))
    (x,) = _data(1)[0]
    expected = reference(x)
    assert weights_in_graph(reference) == 3  # conv, conv2, fc
    qd = torch.ops.quantized_decomposed
    dequantized = [  # per channel (fbgemm, x86) or per tensor (qnnpack)
        n.args[0].target
        for n in reference.graph.nodes
        if n.target in (qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default)
        and n.args[0].op == "get_attr"
    ]
    assert len(dequantized) == 3
    assert all(getattr(reference, name).dtype == torch.int8 for name in dequantized)
    assert torch.equal(reference(x), expected)


class _SameConvAddLeaky(torch.nn.Module):
    """A ``padding="same"`` conv, a conv + add and a linear + leaky relu (onednn
    fuses both): qcore.compile left these float on the FX path."""

    def __init__(self) -> None:
        super().__init__()
        self.same = torch.nn.Conv2d(3, 8, 3, padding="same")
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc, self.leaky = torch.nn.Linear(8, 4), torch.nn.LeakyReLU(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.same(x))
        y = self.conv(y) + y
        return self.leaky(self.fc(y.mean((2, 3))))


@pytest.mark.parametrize("backend", ["x86", "onednn"])
def test_same_padding_conv_add_and_fused_activations_become_int8_weights(backend):
    from qcore.engine.decomposed import weights_in_graph

    if not installed(backend):
        pytest.skip(f"needs the {backend} plugin")
    torch.manual_seed(0)
    model, x = _SameConvAddLeaky().eval(), torch.randn(2, 3, 8, 8)
    prepared = qcore.prepare_fx(model, None, (x,), backend=backend)
    prepared(x)
    reference = qcore.convert_to_reference_fx(prepared)
    expected = reference(x)
    assert weights_in_graph(reference) == 3  # same, conv (onednn: + add), fc (+ leaky relu)
    assert torch.equal(reference(x), expected)


@pytest.mark.parametrize(
    "arguments, error, words",
    [
        (
            {"recipe": "inductor"},
            TypeError,
            r"recipe: got 'inductor' \(str\); expected a qcore.CompileRecipe",
        ),
        (
            {"mode": "max-autotune"},
            ValueError,
            r"mode: got 'max-autotune' \(str\); expected one of 'default', 'reduce-overhead'",
        ),
        (
            {"mode": "reduce-overhead", "recipe": qcore.CompileRecipe("eager", summary="mine")},
            ValueError,
            r"mode: got 'reduce-overhead' with recipe=mine .*give mode or recipe, not both",
        ),
    ],
)
def test_compile_names_the_argument_it_refuses(arguments, error, words):
    if not installed("qnnpack"):
        pytest.skip("needs the qnnpack plugin")
    with pytest.raises(error, match=words):
        qcore.compile(_prepared("pt2e", "qnnpack"), **arguments)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"compiler": 3}, r"CompileRecipe.compiler: got 3 \(int\); expected a torch.compile"),
        ({"compiler": ""}, r"CompileRecipe.compiler: got '' \(str\)"),
        ({"options": {1: True}}, r"CompileRecipe.options: got \{1: True\} .*; expected a mapping"),
        ({"dynamic": "yes"}, r"CompileRecipe.dynamic: got 'yes' \(str\); expected True, False"),
        ({"no_grad": 1}, r"CompileRecipe.no_grad: got 1 \(int\); expected True or False"),
        (
            {"concat_linears": "yes"},
            r"CompileRecipe.concat_linears: got 'yes' \(str\); expected True or False",
        ),
    ],
)
def test_a_recipe_names_the_field_it_refuses(fields, words):
    with pytest.raises(TypeError, match=words):
        qcore.CompileRecipe(**fields)


def test_a_recipe_keeps_its_own_options():
    options = {"freezing": True}
    recipe = qcore.CompileRecipe("inductor", options, summary="frozen")
    options["freezing"] = False
    assert recipe.options == {"freezing": True}
    assert recipe.describe() == "frozen (torch.compile(backend=inductor, freezing=True))"


def test_a_plugin_answering_something_else_is_named():
    module = plugin_module("m", [linear()], qcore_compile_recipe=lambda backend: "inductor")
    backend = registry(spec("m", "qcore-m", module)).get("m")
    with pytest.raises(
        qcore.BackendLoadError, match=r"plugin qcore-m:m.*expected a qcore.CompileRecipe"
    ):
        backend.compile_recipe()


def test_a_plugins_recipe_is_what_compile_uses():
    recipe = qcore.CompileRecipe("eager", summary="no compiler")
    module = plugin_module("m", [linear()], qcore_compile_recipe=lambda backend: recipe)
    backend = registry(spec("m", "qcore-m", module)).get("m")
    assert backend.compile_recipe() is recipe


@pytest.mark.parametrize("backend", ["x86", "qnnpack", "fbgemm"])
def test_weights_are_folded_to_integers_in_the_reference_form(backend):
    """A conv whose output an in-place relu overwrites still gets its int8 weights
    folded (it was quantized on every call: the in-place op counted as writing to
    the conv's weight), and so does a buffer written in place: it stays live."""
    if not installed(backend):
        pytest.skip(f"needs the {backend} plugin")
    reference = qcore.convert_pt2e(_prepared("pt2e", backend), lower=False)
    weight_quantizes = [
        n
        for n in reference.graph.nodes
        if n.target is torch.ops.quantized_decomposed.quantize_per_channel.default
    ]
    assert weight_quantizes == []
    folded = [
        n.target
        for n in reference.graph.find_nodes(op="get_attr")
        if n.target.startswith("_frozen_param")
    ]
    assert len(folded) == 3  # conv, conv2, fc
    assert all(getattr(reference, name).dtype == torch.int8 for name in folded)


class WritesItsBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1.0)
        return self.fc(x) + torch.nn.functional.linear(x, self.count)


@requires_x86  # x86's Quantizer quantizes a functional linear's weight
def test_a_buffer_written_in_place_is_not_folded():
    torch.manual_seed(0)
    model = WritesItsBuffer().eval()
    example = (torch.randn(2, 4),)
    prepared = qcore.prepare_pt2e(torch.export.export(model, example).module(), "x86")
    prepared(*example)
    reference = qcore.convert_pt2e(prepared, lower=False)
    # The written buffer is quantized on each call, from its value then.
    (quantize,) = [
        n
        for n in reference.graph.nodes
        if n.target is torch.ops.quantized_decomposed.quantize_per_channel.default
    ]
    assert quantize.args[0].target is torch.ops.aten.add_.Tensor


@requires_x86
def test_reduce_overhead_runs_the_same_kernels_from_inductors_cpp_wrapper():
    """mode="reduce-overhead": x86's recipe adds Inductor's C++ wrapper. The kernels
    are the default mode's, so are the numbers; no process-wide setting is left."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    prepared = _prepared("pt2e", "x86")
    (x,) = _data(1)[0]
    torch._dynamo.reset()
    default = qcore.compile(prepared)(x)
    counters.clear()
    fast = qcore.compile(prepared, mode="reduce-overhead")
    assert fast.recipe.options == {"freezing": True, "cpp_wrapper": True, "size_asserts": False}
    assert "C++ wrapper" in repr(fast)
    compiled = fast(x)
    assert counters["inductor"]["qconv_weight_prepack_matcher_count"] >= 2
    assert inductor_config.cpp_wrapper is False and inductor_config.freezing is False
    torch.testing.assert_close(compiled, default, rtol=0, atol=1e-5)


def test_a_plugin_is_asked_for_the_users_mode():
    recipes = {mode: qcore.CompileRecipe("eager", summary=mode) for mode in qcore.COMPILE_MODES}
    module = plugin_module(
        "m", [linear()], qcore_compile_recipe=lambda backend, mode: recipes[mode]
    )
    backend = registry(spec("m", "qcore-m", module)).get("m")
    assert backend.compile_recipe() is recipes["default"]
    assert backend.compile_recipe("reduce-overhead") is recipes["reduce-overhead"]
    with pytest.raises(ValueError, match=r"mode: got 'fast' \(str\); expected one of"):
        backend.compile_recipe("fast")


def test_a_plugin_with_one_recipe_answers_every_mode():
    recipe = qcore.CompileRecipe("eager", summary="no compiler")
    module = plugin_module("m", [linear()], qcore_compile_recipe=lambda backend: recipe)
    backend = registry(spec("m", "qcore-m", module)).get("m")
    assert backend.compile_recipe("reduce-overhead") is recipe


PADDING_ONLY = {
    "padding past the kernel": (
        lambda: torch.nn.Conv2d(16, 32, (3, 1), stride=3, padding=1),
        (2, 16, 8, 1),
    ),
    "dilation over the input": (
        lambda: torch.nn.Conv2d(3, 4, 2, padding=1, dilation=2),
        (2, 3, 5, 1),
    ),
}


@requires_x86
@pytest.mark.parametrize("path", ["pt2e", "fx"])
@pytest.mark.parametrize("name", list(PADDING_ONLY))
def test_a_conv_whose_outputs_read_padding_only_is_kept_from_onednn(name, path):
    """Inductor lowered such a conv to oneDNN's int8 conv, which left those outputs
    as garbage: 32-150 steps off the reference form, 2-13 dB (torchao + Inductor
    too). Its weight reaches the compiler as a float constant; the eager kernels
    check each call (tests/test_torch_kernel_traps.py)."""
    from torch._dynamo.utils import counters

    make, shape = PADDING_ONLY[name]
    torch.manual_seed(0)
    conv = make()
    model = torch.nn.Sequential(conv, torch.nn.ReLU(), torch.nn.Conv2d(conv.out_channels, 4, 1))
    batches = [(torch.randn(shape),) for _ in range(4)]
    prepared = _prepared(path, "x86", model.eval(), batches)
    reference = _reference(prepared, path)
    torch._dynamo.reset()
    counters.clear()
    fast = qcore.compile(prepared)
    x = torch.randn(shape)
    with torch.no_grad():
        compiled, expected = fast(x), reference(x)
    assert counters["inductor"]["qconv_weight_prepack_matcher_count"] == 1  # the 1x1 conv only
    step = (expected.max() - expected.min()) / 255
    assert (compiled - expected).abs().max() <= 2 * step


class _Conv1dAdd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + x


@pytest.mark.parametrize("backend", ["x86", "onednn"])
def test_a_padded_conv1d_into_an_add_compiles(backend):
    """Inductor's int8 conv + add fusion sized the padded 1-D conv's output wrongly
    and failed to compile ("Attempting to broadcast a dimension of length 20"):
    qcore's FX x86 and onednn configs quantize conv1d + add, torchao's quantizer
    leaves a bare conv1d float. Its weight reaches the compiler as a float constant."""
    if not installed(backend):
        pytest.skip(f"needs the {backend} plugin")
    torch.manual_seed(0)
    batches = [(torch.randn(2, 8, 20),) for _ in range(4)]
    prepared = _prepared("fx", backend, _Conv1dAdd().eval(), batches)
    reference = _reference(prepared, "fx")
    torch._dynamo.reset()
    fast = qcore.compile(prepared)
    with torch.no_grad():
        compiled, expected = fast(*batches[0]), reference(*batches[0])
    step = (expected.max() - expected.min()) / 255
    assert (compiled - expected).abs().max() <= 2 * step


def _flipping_compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """A torch.compile backend that lowers wrongly: every output reversed."""

    def run(*args: Any) -> Any:
        outputs = gm(*args)
        return type(outputs)(o.flip(-1) if isinstance(o, torch.Tensor) else o for o in outputs)

    return run


def test_a_compiled_graph_that_disagrees_with_its_reference_form_is_refused():
    """The first call on each new signature is checked against the reference form,
    which lets x86's recipe turn Inductor's per-call size asserts off."""
    if not installed("qnnpack"):
        pytest.skip("needs the qnnpack plugin")
    prepared = _prepared("pt2e", "qnnpack")
    (x,) = _data(1)[0]
    wrong = qcore.compile(prepared, recipe=qcore.CompileRecipe(_flipping_compiler, summary="flip"))
    with pytest.raises(RuntimeError, match=r"disagrees with its reference form \(output 0: SQNR"):
        wrong(x)
    right = qcore.compile(prepared, recipe=qcore.CompileRecipe("eager", summary="eager"))
    torch.testing.assert_close(right(x), right.reference(x), rtol=0, atol=0)
    if installed("x86"):
        assert qcore.get_backend("x86").compile_recipe("default").options["size_asserts"] is False


class CountsItsCalls(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1.0)
        return self.fc(x) * self.count


@requires_x86
def test_the_first_calls_check_leaves_a_written_buffer_as_one_call_leaves_it():
    torch.manual_seed(0)
    model = CountsItsCalls().eval()
    x = torch.randn(2, 4)
    prepared = qcore.prepare_pt2e(torch.export.export(model, (x,)).module(), "x86")
    fast = qcore.compile(prepared)
    (count,) = [b for name, b in fast.reference.named_buffers() if name.endswith("count")]
    start = count.item()
    first, second = fast(x), fast(x)
    # two calls: two increments, though the first also ran the reference form
    assert count.item() == start + 2
    torch.testing.assert_close(second, first * (start + 2) / (start + 1), rtol=1e-5, atol=1e-5)


class NormalizedAndItsMean(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.nn.functional.layer_norm(self.fc(x), (8,))
        return y, y.mean(-1)  # about 0: rounding is all there is of it


class Samples(torch.nn.Module):  # a VAE's sampling step
    def __init__(self) -> None:
        super().__init__()
        self.mu, self.log_var = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mu(x) + torch.randn_like(x) * torch.exp(0.5 * self.log_var(x))


@requires_x86
def test_the_first_calls_check_raises_no_false_alarm():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for model in (NormalizedAndItsMean(), Samples()):
        exported = torch.export.export(model.eval(), (x,)).module()
        prepared = qcore.prepare_pt2e(exported, "x86")
        prepared(x)
        fast = qcore.compile(prepared)
        torch.manual_seed(5)
        fast(x)  # compiles and checks (a random model: not compared)
        after_first = torch.random.get_rng_state()
        torch.manual_seed(5)
        fast(x)
        # the check drew no random numbers of the caller's
        assert torch.equal(after_first, torch.random.get_rng_state())
