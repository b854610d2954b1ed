"""explain keeps an entry for each op a PT2E kernel takes in as a post-op (x86's
oneDNN ``linear -> gelu``, ``linear -> add``): they vanished on lowering, so the
lowered report counted 21 operators where the reference form counted 24, and
``report["gelu"]`` raised KeyError."""

from __future__ import annotations

import pytest
from backends import backend_params
from zoo import calibrated

import qcore


@pytest.mark.parametrize("backend", backend_params(("x86", "onednn")))
def test_post_ops_keep_their_entries_with_the_kernel_that_runs_them(backend):
    prepared, _ = calibrated("transformer_block", "pt2e", backend)
    lowered = qcore.explain(qcore.convert_pt2e(prepared))
    reference = qcore.explain(qcore.convert_pt2e(prepared, lower=False))
    ops = [e for e in lowered.entries if e.status.value != "-"]
    assert len(ops) == len([e for e in reference.entries if e.status.value != "-"])
    gelu = lowered["gelu"]
    assert gelu.status.value == "quantized"
    assert gelu.reason.startswith("a post-op in linear_")
    assert gelu.kernel == lowered[gelu.reason.split()[-2].removesuffix("'s")].kernel
