"""A model converted in eval mode is in eval mode all through: the kernel modules
lowering installs are built in training mode (nn.Module's default) and join their
parent's mode, so ``converted.training`` and every submodule's agree."""

from __future__ import annotations

import pytest
import torch
from backends import backend_params
from zoo import ZOO

import qcore


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_every_module_of_a_converted_eval_model_is_in_eval_mode(backend: str, path: str) -> None:
    entry = ZOO["mobilenetv2_like"]
    model, example = entry.make_model().eval(), entry.example_inputs()
    if path == "fx":
        prepared = qcore.prepare_fx(model, None, example, backend=backend)
    else:
        prepared = qcore.prepare_pt2e(torch.export.export(model, example).module(), backend)
    with torch.no_grad():
        prepared(*example)
    converted = (qcore.convert_fx if path == "fx" else qcore.convert_pt2e)(prepared)

    kernels = [m for m in converted.modules() if type(m).__module__.startswith("qcore")]
    assert kernels, qcore.explain(converted)
    assert [name for name, m in converted.named_modules() if m.training] == []
