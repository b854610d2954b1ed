"""Example inputs the model cannot run are accepted, as torch.ao accepts them, with
one warning that gives the cause, and nothing printed: torch.fx's ShapeProp
printed a 20-line traceback to stderr and the warning quoted its wrapper, cut
off before the cause. The run leaves each module's mode as it found it."""

import warnings

import torch

import qcore
from qcore.config.qconfig import get_default_qconfig


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = torch.nn.Linear(8, 4), torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x))


def test_the_warning_gives_the_cause_and_nothing_is_printed(capfd) -> None:
    net = Net().train()
    net.drop.eval()  # a mode of its own, kept through prepare's runs
    mapping = qcore.QConfigMapping().set_global(get_default_qconfig("x86"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = qcore.prepare_fx(net, mapping, (torch.randn(2, 5),))
    messages = [str(w.message) for w in caught if "did not run" in str(w.message)]
    assert len(messages) == 1
    assert "mat1 and mat2 shapes cannot be multiplied (2x5 and 8x4)" in messages[0]
    assert capfd.readouterr().err == ""
    assert prepared.training and not prepared.drop.training
    prepared(torch.randn(2, 8))  # calibrates on inputs that run
    assert qcore.convert_fx(prepared)(torch.randn(2, 8)).shape == (2, 4)
