"""Forward hooks on the user's modules are named at prepare: the quantized model
does not run them (torch.fx traces through forward without hooks; convert replaces
a quantized layer). torch.ao drops them without a word: a pre-hook scaling a
layer's input cost 0.6 dB against float, silently, on both."""

from __future__ import annotations

import warnings

import pytest
import torch
from backends import backend_params
from tiny_models import TwoLinears as Net
from torch import nn

import qcore
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
