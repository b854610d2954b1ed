"""Output a person can read (issue 16 §2): no progress frames in logs, explain's
lines within a terminal width with the details on request, no "inf" SQNR, a
warning that points to something the user has, no NumPy notice from torch."""

import io
import math
import subprocess
import sys
import warnings

import pytest
import torch
from backends import backend_params, installed
from torch import nn

import qcore
from qcore.config.errors import describe
from qcore.config.qconfig import QConfigMapping, default_qconfig
from qcore.demo import DemoResult, format_results, run_demo, sqnr
from qcore.engine.explain import WIDTH, Entry, Report, Status

# What lower.py writes when every kernel of a family refuses a match (~900 characters).
REFUSALS = (
    "; ".join(
        f"kernel x86.conv{dims}d{suffix}: its weights are per-channel with axis 1 "
        f"(qscheme torch.per_channel_affine, dtype torch.qint8), but x86's conv{dims}d packs "
        "per-channel weights along the output channels (axis 0) only"
        for dims in (1, 2, 3)
        for suffix in ("", "_relu")
    )
    + " (left in reference form)"
)

DTYPE_REJECTION = (
    "QConfig rejected by pattern Softmax: DTypeConfig(input_dtype=DTypeWithConstraints("
    "dtype=torch.quint8, quant_min_lower_bound=0, quant_max_upper_bound=255, "
    "scale_min_lower_bound=None, scale_max_upper_bound=None, scale_exact_match=0.00390625, "
    "zero_point_exact_match=0), output_dtype=DTypeWithConstraints(dtype=torch.quint8, "
    "quant_min_lower_bound=0, quant_max_upper_bound=255, scale_exact_match=0.00390625, "
    "zero_point_exact_match=0)): activation observer is not a fixed-qparams one, but the "
    "backend requires fixed qparams scale=0.00390625, zero_point=0 (use FixedQParamsObserver "
    "with scale=0.00390625, zero_point=0, e.g. from get_default_qconfig_mapping)"
)


def _report() -> Report:
    return Report(
        "x86",
        [
            Entry("x", "placeholder", Status.NOT_AN_OP),
            Entry("conv", "Conv2d", Status.REFERENCE, REFUSALS, "Conv2d"),
            Entry("softmax", "softmax", Status.FLOAT, DTYPE_REJECTION, "Softmax"),
            Entry("fc", "Linear", Status.QUANTIZED, "", "Linear", "x86.linear"),
            Entry("sigmoid", "sigmoid", Status.FLOAT, "no QConfig for sigmoid in the mapping"),
        ],
    )


def _words(text: str) -> list[str]:
    return text.split()


def test_explain_lines_fit_the_terminal_with_details_on_request():
    report = _report()
    assert len(REFUSALS) > 700
    text = str(report)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH == 100
    # Short reasons and kernels stay on their row, whole.
    assert any(
        line.split() == ["sigmoid", "sigmoid", "float", *_words(report["sigmoid"].reason)]
        for line in lines
    )
    assert any(
        line.split() == ["fc", "Linear", "quantized", "kernel", "x86.linear"] for line in lines
    )
    # A long reason is shortened: the DTypeConfig's fields fold to (…), and the
    # table says where the rest is.
    assert "QConfig rejected by pattern Softmax: DTypeConfig(…): activation observer" in text
    assert "scale_min_lower_bound" not in text
    assert lines[-1].startswith("(cut to fit: report.details(node)")
    # In full on request: one node, or every reason wrapped.
    details = report.details("conv")
    assert max(len(line) for line in details.splitlines()) <= WIDTH
    assert details.splitlines()[:4] == [
        "node: conv",
        "op: Conv2d",
        "status: reference",
        "pattern: Conv2d",
    ]
    assert _words(details.split("reason: ", 1)[1]) == _words(REFUSALS.replace("; ", " "))
    assert (
        sum(line.startswith(("reason: kernel", "        kernel")) for line in details.splitlines())
        == 6
    )
    verbose = report.format(verbose=True)
    assert max(len(line) for line in verbose.splitlines()) <= WIDTH
    assert " ".join(_words(DTYPE_REJECTION)) in " ".join(_words(verbose))
    assert "cut to fit" not in verbose
    # width=None: the old unbounded table.
    assert REFUSALS in report.format(width=None)
    with pytest.raises(KeyError, match="no node named 'nope'"):
        report.details("nope")


@pytest.mark.parametrize(
    ("width", "error"),
    [("80", TypeError), (80.0, TypeError), (True, TypeError), (0, ValueError), (-5, ValueError)],
)
@pytest.mark.parametrize("method", ["format", "details"])
def test_a_width_that_is_no_number_of_columns_is_refused(method, width, error):
    """'80' raised "'>' not supported between 'int' and 'str'"; 0 and -5 printed a
    table (and verbose=True raised textwrap's error)."""
    report = _report()
    with pytest.raises(error) as refused:
        if method == "format":
            report.format(width=width, verbose=True)
        else:
            report.details("softmax", width=width)
    assert str(refused.value) == (
        f"width: got {describe(width)}; expected a number of columns (an int >= 1) or None "
        "for no limit"
    )


@pytest.mark.parametrize("backend", backend_params(("fbgemm",)))
def test_a_real_rejection_is_readable(backend):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.softmax = nn.Softmax(dim=-1)

        def forward(self, x):
            return self.softmax(self.fc(x))

    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        prepared = qcore.prepare_fx(
            Net().eval(), QConfigMapping().set_global(default_qconfig), (x,), backend
        )
    report = qcore.explain(prepared)
    assert len(report["softmax"].reason) > WIDTH
    assert max(len(line) for line in str(report).splitlines()) <= WIDTH
    assert "FixedQParamsObserver" in report.details("softmax")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86", "qnnpack")))
def test_progress_frames_only_on_a_terminal(backend):
    log, terminal = io.StringIO(), _Terminal()
    for progress in (log, terminal):
        run_demo(
            [backend],
            ["mlp"],
            ["fx"],
            batches=3,
            repeats=1,
            stream=io.StringIO(),
            progress_stream=progress,
        )
    assert "\r" not in log.getvalue()
    lines = log.getvalue().splitlines()
    assert lines[:2] == [f"{backend}:", f"  calibrating mlp for {backend} (fx): 3 batches"]
    # where int8 measured slower than float on this machine, one line more says so
    assert lines[2:] in (
        [],
        ["  mlp: int8 slower than float; measuring which layers to keep float"],
    )
    assert terminal.getvalue().count("\r") == 3  # one frame per batch
    assert f"3/3 calibrating mlp for {backend} (fx)\n" in terminal.getvalue()


def test_sqnr_column_says_when_nothing_was_quantized():
    identical = torch.randn(10)
    assert math.isinf(sqnr(identical, identical))
    float_only = DemoResult("chip", "mlp", "fx", ops_quantized=0, ops_total=4, sqnr_db=math.inf)
    exact = DemoResult("chip", "mlp", "pt2e", ops_quantized=4, ops_total=4, sqnr_db=math.inf)
    quantized = DemoResult("chip", "lstm", "fx", ops_quantized=3, ops_total=5, sqnr_db=47.84)
    rows = format_results([float_only, exact, quantized]).splitlines()[2:]
    assert "inf" not in "\n".join(rows)
    assert rows[0].split()[3:8] == ["0/4", "(0", "on", "kernels)", "n/a,"]
    assert "n/a, all float" in rows[0]
    assert rows[1].split()[7] == "exact"
    assert rows[2].split()[7] == "47.8"


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86", "qnnpack")))
def test_the_float_warning_points_to_the_model_the_user_has(backend):
    class Net(nn.Module):
        def forward(self, x):
            return torch.erf(x) + 1  # no backend quantizes erf

    x = torch.randn(4)
    mapping = QConfigMapping().set_global(default_qconfig)
    for call in (
        lambda: qcore.prepare_fx(Net(), mapping, (x,), backend),
        lambda: qcore.quantize(Net(), (x,), [x], backend, mapping),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        (warning,) = [w for w in caught if issubclass(w.category, qcore.QCoreWarning)]
        message = str(warning.message)
        assert "qcore.explain(model), on the model this call returns" in message
        assert "prepared_model" not in message
        assert warning.filename == __file__  # the user's line, not qcore's


NO_NUMPY = (
    "import sys; sys.modules['numpy'] = None; "  # as if NumPy were not installed
    "from qcore.cli import main; sys.exit(main(['backends']))"
)


def test_commands_print_no_numpy_notice_without_numpy():
    result = subprocess.run(
        [sys.executable, "-c", NO_NUMPY], capture_output=True, text=True, timeout=120
    )
    assert result.returncode in (0, 1), result.stderr
    assert "NumPy" not in result.stderr, result.stderr
    assert "NAME" in result.stdout


@pytest.mark.skipif(not installed("fbgemm"), reason="needs the fbgemm plugin")
def test_qcore_quantizes_without_numpy():
    """Why NumPy is not a dependency: FX and PT2E quantize without it."""
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "from qcore.demo import run_demo\n"
        "results = run_demo(['fbgemm'], ['mlp'], batches=2, repeats=1)\n"
        "assert results and not any(r.error for r in results), results\n"
        "assert all(r.ops_quantized == r.ops_total >= 4 for r in results), results\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "NumPy" not in result.stderr, result.stderr


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "qnnpack", "x86", "onednn")))
@pytest.mark.parametrize("path", ["fx", "pt2e", "pt2e reference"])
@pytest.mark.parametrize("name", ["transformer_block", "mobilenetv2_like"])
def test_every_converted_model_prints(name, path, backend):
    """print(model) raised on x86's PT2E transformer_block: a oneDNN linear with a
    float output has no output scale, and its extra_repr read one."""
    from zoo import calibrated

    prepared, _ = calibrated(name, "fx" if path == "fx" else "pt2e", backend)
    if path == "fx":
        converted = qcore.convert_fx(prepared)
    else:
        converted = qcore.convert_pt2e(prepared, lower=path == "pt2e")
    text = str(converted)
    assert all(repr(module) for module in converted.modules())
    assert text.count("\n") > 5
