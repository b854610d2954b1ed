"""explain keeps an entry for each op a PT2E kernel takes in as a post-op (x86's
oneDNN ``linear -> gelu``, ``linear -> add``): they vanished on lowering, so the
lowered report counted 21 operators where the reference form counted 24, and
``report["gelu"]`` raised KeyError."""

from __future__ import annotations

import pytest
import torch
from backends import backend_params

import qcore
from qcore.examples import ZOO


@pytest.mark.parametrize("backend", backend_params(("x86", "onednn")))
def test_post_ops_keep_their_entries_with_the_kernel_that_runs_them(backend):
    entry = ZOO["transformer_block"]
    model, example = entry.make_model().eval(), entry.example_inputs()
    prepared = qcore.prepare_pt2e(torch.export.export(model, example).module(), backend)
    with torch.no_grad():
        prepared(*example)
    lowered = qcore.explain(qcore.convert_pt2e(prepared))
    reference = qcore.explain(qcore.convert_pt2e(prepared, lower=False))
    ops = [e for e in lowered.entries if e.status.value != "-"]
    assert len(ops) == len([e for e in reference.entries if e.status.value != "-"])
    gelu = lowered["gelu"]
    assert gelu.status.value == "quantized"
    assert gelu.reason.startswith("a post-op in linear_")
    assert gelu.kernel == lowered[gelu.reason.split()[-2].removesuffix("'s")].kernel
