"""`qcore demo`, the README's main job: a small run through the command line."""

import subprocess
import sys

import pytest
import torch
from backends import installed


def demo(*args):
    return subprocess.run(
        [sys.executable, "-m", "qcore", "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(not installed("fbgemm"), reason="needs the fbgemm plugin")
def test_demo_quantizes_on_both_paths_and_explains_what_stayed_float():
    result = demo("--backend", "fbgemm", "--model", "mlp", "--model", "transformer_block")
    assert result.returncode == 0, result.stderr
    rows = {
        tuple(line.split()[:3]): line.split()
        for line in result.stdout.splitlines()
        if line.startswith("fbgemm ")
    }
    assert set(rows) == {
        ("fbgemm", model, path) for model in ("mlp", "transformer_block") for path in ("fx", "pt2e")
    }
    for (_, model, path), cells in rows.items():
        quantized, total = map(int, cells[3].split("/"))
        assert 0 < quantized <= total, (model, path, cells)
        sqnr = float(cells[7])  # after "4/4 (4 on kernels)"
        assert 20 < sqnr < 80, (model, path, sqnr)  # quantized, and close to float
        assert cells[10].endswith("x")  # the speed-up column
    # The transformer's layer norms stay float on fbgemm; the report says why, once.
    assert "What stayed in float, and why:" in result.stdout
    assert "no pattern in backend 'fbgemm' matches LayerNorm" in result.stdout
    # Calibration shows progress on stderr.
    assert "calibrating mlp for fbgemm (fx)" in result.stderr


def test_demo_without_backends_says_what_to_install():
    if any(installed(name) for name in ("fbgemm", "qnnpack", "x86")):
        pytest.skip("backends are installed (the core tox environment has none)")
    result = demo()
    assert result.returncode == 0, result.stderr
    assert "pip install qcore-x86" in result.stdout


@pytest.mark.skipif(not installed("x86"), reason="needs the x86 plugin")
def test_demo_min_sqnr_shows_the_layers_kept_float_and_why():
    import re
    import warnings

    import qcore
    from qcore.demo import _mapping
    from qcore.examples import ZOO

    result = demo("--backend", "x86", "--model", "mlp", "--path", "fx", "--min-sqnr", "40")
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("BACKEND"))
    assert header.split()[-2:] == ["KEPT", "FLOAT"]
    row = next(line for line in result.stdout.splitlines() if line.startswith("x86 "))
    kept, held_out = re.search(r"(\d+) -> ([\d.]+) dB$", row).groups()
    reasons = re.findall(
        r"^    (\w+): kept float \(accuracy budget\): SQNR ([\d.]+) dB with it float, "
        r"([\d.]+) dB int8; budget 40 dB$",
        result.stdout,
        re.MULTILINE,
    )
    assert len(reasons) == int(kept) > 0
    for _, with_float, int8 in reasons:
        assert float(with_float) >= 40 > float(int8)
    assert float(held_out) > float(row.split()[7])  # above plain int8's SQNR column
    # the same layers qcore.quantize keeps float in this process
    entry = ZOO["mlp"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        chosen = qcore.quantize(
            entry.make_model(),
            entry.example_inputs(),
            entry.calibration_data(8),
            "x86",
            _mapping("x86", entry),
            accuracy_budget=40.0,
        )
    report = qcore.explain(chosen)
    assert {node for node, _, _ in reasons} == {
        e.node for e in report.float if e.reason.startswith("kept float (accuracy budget)")
    }


def _int8_slower_clock(model) -> float:
    """1 ms per conv/linear on a kernel, 0.5 ms each in float: int8 is slower."""
    import qcore
    from qcore.engine.explain import Status

    try:
        report = qcore.explain(model)
    except TypeError:  # the float model
        return 1e-3 * sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    seconds = 0.0
    for entry in report.ops:
        if entry.op.lower().startswith("linear"):
            seconds += 2e-3 if entry.status is Status.QUANTIZED else 1e-3
    return seconds


@pytest.mark.skipif(not installed("x86"), reason="needs the x86 plugin")
def test_demo_says_where_int8_is_slower_and_shows_keep_float_if_slower(monkeypatch):
    """Issue 15 §3: a row whose int8 model runs slower than float shows the speedup
    qcore.quantize(keep_float_if_slower=True) gives, and which layers it keeps float.
    The clock is injected: int8 linears cost twice their float form."""
    import io

    from qcore import demo as demo_module
    from qcore import latency

    monkeypatch.setattr(
        demo_module, "_latency_ms", lambda model, inputs, repeats: 1e3 * _int8_slower_clock(model)
    )
    monkeypatch.setattr(latency, "measure_latency", lambda inputs: _int8_slower_clock)
    out = io.StringIO()
    (result,) = demo_module.run_demo(
        ["x86"], ["mlp"], ["fx"], stream=out, progress_stream=io.StringIO()
    )
    text = out.getvalue()
    assert result.speedup < 1.0
    assert result.recommended_speedup == pytest.approx(1.0)  # every linear kept float
    assert set(result.kept_for_speed) == {"body_0", "body_2", "body_4", "head"}
    row = next(line for line in text.splitlines() if line.startswith("x86 "))
    assert "0.50x -> 1.00x*" in row
    assert "SLOWER IN INT8" in text
    assert "x86 / mlp (fx): 1.00x with float: body_0, body_2, body_4, head" in text
