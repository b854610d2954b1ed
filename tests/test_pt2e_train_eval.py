"""An exported graph's dropouts and batch norms between training and eval (issue 13).

A QAT model is exported in training mode: its dropouts and batch norms record that
mode as arguments. convert_pt2e switches every kind to eval (attention's dropout_p,
Dropout2d's feature_dropout and AlphaDropout's too: they used to stay on, and the
int8 model's outputs changed from call to call); qcore.pt2e's
move_exported_model_to_eval/_train switch them both ways keeping each dropout's
probability (torchao's put 0.5 back on every one).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backends import installed
from torch import nn

import qcore
from qcore.pt2e import move_exported_model_to_eval, move_exported_model_to_train

requires_x86 = pytest.mark.skipif(not installed("x86"), reason="needs the x86 plugin")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        # as transformers' models pass it
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3 if self.training else 0.0)
        return self.drop(self.out(attended.transpose(1, 2).reshape(x.shape)))


class ConvDrop(nn.Module):
    def __init__(self, drop: nn.Module) -> None:
        super().__init__()
        self.conv, self.bn, self.drop = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), drop
        self.conv2 = nn.Conv2d(8, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.drop(torch.relu(self.bn(self.conv(x)))))


CASES = {
    "attention dropout_p": (lambda: Attention(), (2, 5, 16)),
    "Dropout2d": (lambda: ConvDrop(nn.Dropout2d(0.5)), (2, 3, 8, 8)),
    "AlphaDropout": (lambda: ConvDrop(nn.AlphaDropout(0.5)), (2, 3, 8, 8)),
}


def _sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    return (10 * torch.log10(expected.pow(2).mean() / (expected - actual).pow(2).mean())).item()


def _dropouts(gm: torch.fx.GraphModule) -> list[tuple[str, object, object]]:
    """(op, p, train) of each dropout; attention's as (op, dropout_p, None)."""
    found = []
    for node in gm.graph.nodes:
        name = str(node.target)
        if "dropout" in name:
            found.append((name, node.args[1], node.args[2]))
        elif "scaled_dot_product_attention" in name:
            p = node.args[4] if len(node.args) > 4 else node.kwargs["dropout_p"]
            found.append((name, p, None))
    return found


@requires_x86
@pytest.mark.parametrize("name", sorted(CASES))
def test_convert_switches_every_dropout_of_a_qat_model_to_eval(name):
    make, shape = CASES[name]
    torch.manual_seed(0)
    model, x = make(), torch.randn(*shape)
    exported = torch.export.export(model.train(), (x,)).module()
    prepared = qcore.prepare_qat_pt2e(exported, "x86")
    prepared(x)
    converted = qcore.convert_pt2e(prepared)
    with torch.no_grad():
        first, second, expected = converted(x), converted(x), model.eval()(x)
    assert torch.equal(first, second), "the converted model's outputs change from call to call"
    assert _sqnr(expected, first) > 25


def test_moving_between_modes_keeps_each_dropouts_probability():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    exported = torch.export.export(Attention().train(), (x,)).module()
    trained = _dropouts(exported)
    assert [p for _, p, _ in trained] == [0.3, 0.1]

    assert move_exported_model_to_eval(exported) is exported
    assert [(p, train) for _, p, train in _dropouts(exported)] == [(0.0, None), (0.1, False)]
    assert torch.equal(exported(x), exported(x))
    move_exported_model_to_eval(exported)  # twice: nothing more changes
    move_exported_model_to_train(exported)
    assert _dropouts(exported) == trained
    torch.manual_seed(1)
    first = exported(x)
    assert not torch.equal(first, exported(x)), "dropout is off in training mode"


def test_batch_norms_switch_and_weight_standardization_stays():
    class Standardized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = F.batch_norm(self.weight, None, None, training=True)  # BiT's standardization
            return self.bn(x) @ w

    torch.manual_seed(0)
    x = torch.randn(8, 4)
    exported = torch.export.export(Standardized().train(), (x,)).module()

    def modes() -> list[bool]:
        return [n.args[5] for n in exported.graph.nodes if "batch_norm" in str(n.target)]

    assert sorted(modes()) == [True, True]
    move_exported_model_to_eval(exported)
    assert sorted(modes()) == [False, True]
    move_exported_model_to_train(exported)
    assert sorted(modes()) == [True, True]


def test_a_model_that_is_not_a_graph_module_is_named():
    with pytest.raises(TypeError, match=r"model: got .*Linear.*; expected a GraphModule"):
        move_exported_model_to_eval(nn.Linear(2, 2))
