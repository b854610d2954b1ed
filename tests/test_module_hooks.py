"""Forward hooks on the user's modules are named at prepare: the quantized model
does not run a leaf layer's or the model's own (convert replaces a quantized layer),
and runs only the traced part of a hook on a module torch.fx traces through. torch.ao
drops them without a word: a pre-hook scaling a layer's input cost 0.6 dB against
float, silently, on both."""

from __future__ import annotations

import warnings

import pytest
import torch
from backends import backend_params
from tiny_models import TwoLinears as Net
from torch import nn

import qcore
from qcore.accuracy import sqnr
from qcore.config.errors import QCoreWarning


def _prepare_warnings(model: nn.Module, backend: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qcore.prepare_fx(model, None, (torch.randn(2, 16),), backend=backend)
    return [str(w.message) for w in caught if issubclass(w.category, QCoreWarning)]


@pytest.mark.parametrize("backend", backend_params())
def test_hooks_on_layers_and_on_the_model_are_named(backend):
    model = Net().eval()
    model.fc1.register_forward_pre_hook(lambda module, args: (args[0] * 0.1,))
    model.fc2.register_forward_hook(lambda module, args, out: out)
    model.register_forward_pre_hook(lambda module, args: args)
    messages = [m for m in _prepare_warnings(model, backend) if "forward hooks" in m]
    assert len(messages) == 1, messages
    assert (
        "will not run these forward hooks: the model itself (forward pre-hook); "
        "'fc1' (forward pre-hook); 'fc2' (forward hook)"
    ) in messages[0]


@pytest.mark.parametrize("backend", backend_params())
def test_a_hook_that_changes_values_is_given_as_the_likeliest_cause(backend):
    model = Net().eval()
    model.register_forward_pre_hook(lambda module, args: (args[0] * 0.1,))
    unfaithful = [m for m in _prepare_warnings(model, backend) if "traced graph does not" in m]
    assert len(unfaithful) == 1
    assert "The model has forward hooks" in unfaithful[0]


@pytest.mark.parametrize("backend", backend_params())
def test_a_model_without_hooks_gets_no_such_warning(backend):
    assert not [m for m in _prepare_warnings(Net().eval(), backend) if "hook" in m]


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.block(x))


@pytest.mark.parametrize("backend", backend_params())
def test_a_hook_on_a_module_traced_through_is_named_as_traced_into_the_graph(backend):
    """Such a hook's output runs in the quantized model (torch.fx calls the module
    with its hooks while tracing): prepare said it would not run."""
    model = Blocks().eval()
    model.block.register_forward_hook(lambda module, args, out: out * 3)
    messages = [m for m in _prepare_warnings(model, backend) if "forward hooks" in m]
    assert len(messages) == 1, messages
    assert "these forward hooks were traced into the graph: 'block' (forward hook)" in messages[0]
    assert "will not run" not in messages[0]
    x = torch.randn(32, 16)
    converted = qcore.quantize(model, (x,), [(x,)], backend=backend)
    expected = model(x)  # with the hook
    assert sqnr(expected, converted(x)) > 25


@pytest.mark.parametrize("backend", backend_params())
def test_hooks_inside_a_leaf_that_stays_float_are_not_named(backend):
    model = Blocks().eval()
    model.block[0].register_forward_hook(lambda module, args, out: out)
    custom = {"non_traceable_module_name": ["block"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qcore.prepare_fx(
            model, None, (torch.randn(2, 16),), prepare_custom_config=custom, backend=backend
        )
    assert not [w for w in caught if "hook" in str(w.message)]
