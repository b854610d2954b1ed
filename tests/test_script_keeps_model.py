"""torch.jit.script reads a converted model; it must not change it.

qcore's kernels hand TorchScript other modules to compile (``__prepare_scriptable__``)
and torch writes those into the scripted model's parents: before qcore scripted a
copy (qcore/engine/scripting.py), scripting replaced the user's conv kernels with
their scripted forms, which qcore.save refused ("ScriptedConv2d.__getstate__
returns a tuple"), and wrote ``__overloads__`` into every module.
"""

import copy

import pytest
import torch
from backends import backend_params

import qcore
from qcore.examples import ZOO


def _modules(model: torch.nn.Module) -> dict:
    """Each module by name: its class, the object, and its attributes by identity."""
    return {
        name: (type(module), id(module), {k: id(v) for k, v in vars(module).items()})
        for name, module in model.named_modules(remove_duplicate=False)
    }


def _assert_unchanged(model: torch.nn.Module, before: dict) -> None:
    after = _modules(model)
    assert {n: m[0] for n, m in after.items()} == {n: m[0] for n, m in before.items()}
    assert after == before


def _quantized(name: str, backend: str) -> tuple[torch.nn.Module, tuple]:
    example = ZOO[name]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = example.make_model()
    inputs = example.example_inputs()
    return qcore.quantize(model, inputs, example.calibration_data(2), backend=backend), inputs


def _assert_identical(expected, actual) -> None:
    expected = torch.utils._pytree.tree_leaves(expected)
    actual = torch.utils._pytree.tree_leaves(actual)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual, strict=True):
        assert torch.equal(e, a), (e - a).abs().max()


# resnet18_like: conv kernels (scripted as ScriptedConv2d); lstm: dynamic LSTM and
# linear kernels (scripted as typed modules)
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", ["resnet18_like", "lstm"])
def test_script_leaves_the_converted_model_as_it_was(name, backend, tmp_path):
    converted, inputs = _quantized(name, backend)
    with torch.no_grad():
        expected = converted(*inputs)
    before = _modules(converted)

    scripted = torch.jit.script(converted)

    _assert_unchanged(converted, before)
    path = tmp_path / "model.qcore"
    qcore.save(converted, path)
    loaded = qcore.load(path)
    with torch.no_grad():
        _assert_identical(expected, converted(*inputs))
        _assert_identical(expected, scripted(*inputs))
        _assert_identical(expected, loaded(*inputs))


@pytest.mark.parametrize("backend", backend_params())
def test_a_loaded_or_copied_model_is_kept_too(backend, tmp_path):
    converted, inputs = _quantized("resnet18_like", backend)
    with torch.no_grad():
        expected = converted(*inputs)
    qcore.save(converted, tmp_path / "model.qcore")
    for model in (qcore.load(tmp_path / "model.qcore"), copy.deepcopy(converted)):
        before = _modules(model)

        scripted = torch.jit.script(model)

        _assert_unchanged(model, before)
        with torch.no_grad():
            _assert_identical(expected, scripted(*inputs))
            _assert_identical(expected, model(*inputs))


class _ConvThenTransposed3d(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(3, 4, 1)
        self.up = torch.nn.ConvTranspose3d(4, 2, 2)

    def forward(self, x):
        return self.up(torch.relu(self.conv(x)))


# torch 2.13 has no int8 conv_transpose3d on qnnpack: it stays a ReferenceModule,
# which hands TorchScript its float module
@pytest.mark.parametrize("backend", backend_params(("qnnpack",)))
def test_a_pattern_left_in_reference_form_stays(backend, tmp_path):
    torch.manual_seed(0)
    inputs = (torch.randn(1, 3, 4, 4, 4),)
    converted = qcore.quantize(_ConvThenTransposed3d().eval(), inputs, [inputs], backend)
    assert [e.op for e in qcore.explain(converted).reference] == ["ConvTranspose3d"]
    with torch.no_grad():
        expected = converted(*inputs)
    before = _modules(converted)

    torch.jit.script(converted)

    _assert_unchanged(converted, before)
    assert [e.op for e in qcore.explain(converted).reference] == ["ConvTranspose3d"]
    qcore.save(converted, tmp_path / "model.qcore")
    with torch.no_grad():
        _assert_identical(expected, qcore.load(tmp_path / "model.qcore")(*inputs))


@pytest.mark.parametrize("backend", backend_params())
def test_pt2e_converted_model_is_kept(backend, tmp_path):
    example = ZOO["resnet18_like"]
    inputs = example.example_inputs()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        exported = torch.export.export(example.make_model().eval(), inputs).module()
    prepared = qcore.prepare_pt2e(exported, backend)
    prepared(*inputs)
    converted = qcore.convert_pt2e(prepared)
    with torch.no_grad():
        expected = converted(*inputs)
    before = _modules(converted)

    # torch 2.13 does not script export's graphs (the input guard takes *inputs);
    # the kernels' __prepare_scriptable__ runs before that fails, all the same
    try:
        torch.jit.script(converted)
    except torch.jit.frontend.NotSupportedError:
        pass

    _assert_unchanged(converted, before)
    qcore.save(converted, tmp_path / "model.qcore")
    with torch.no_grad():
        _assert_identical(expected, qcore.load(tmp_path / "model.qcore")(*inputs))
