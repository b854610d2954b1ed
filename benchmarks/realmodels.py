"""Real architectures from transformers (tiny configs, random weights): qcore against its
peers on every model x path x backend of tests/realmodels, as a table.

    python benchmarks/realmodels.py [--models a,b] [--paths fx,pt2e] [--backends x,y]
                                    [--rounds 7] [--out benchmarks/REALMODELS.md]

Per case (tests/realmodels/harness.py does the quantizing): whether each side
succeeded, SQNR (dB) of each quantized model against the float model on held-out
batches, the linears and convs each side quantized, the FX workaround tracing
needed, and the latency of one forward of each side's converted model, measured
interleaved in this one process (alternating qcore's and the peer's model, each
round's median of a block of calls, the median over rounds; torch.set_num_threads
fixed). Latency is a benchmark, never a pass/fail check. Writes the table, headed
by the machine (CPU model from /proc/cpuinfo, cores, torch), to --out.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from realmodels.harness import (  # noqa: E402
    FX_BACKENDS,
    PATHS,
    PT2E_BACKENDS,
    SQNR_TOLERANCE_DB,
    CaseResult,
    run_case,
)
from realmodels.models import BUILDERS, MODELS  # noqa: E402

THREADS = 2


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def latencies_ms(
    models: dict[str, Callable], inputs: tuple, rounds: int, block_seconds: float = 0.05
) -> dict[str, float]:
    """Milliseconds per call of each model: interleaved rounds (the order alternates), a
    block of calls per model per round, its median; the median over the rounds."""
    with torch.no_grad():
        calls = {}
        for name, model in models.items():
            for _ in range(3):
                model(*inputs)  # warmup
            start = time.perf_counter()
            model(*inputs)
            once = time.perf_counter() - start
            calls[name] = max(3, min(100, int(block_seconds / max(once, 1e-6))))
        per_round: dict[str, list[float]] = {name: [] for name in models}
        names = list(models)
        for index in range(rounds):
            for name in names if index % 2 == 0 else names[::-1]:
                model = models[name]
                model(*inputs)  # settle after the other model
                times = []
                for _ in range(calls[name]):
                    start = time.perf_counter()
                    model(*inputs)
                    times.append(time.perf_counter() - start)
                per_round[name].append(statistics.median(times))
    return {name: 1000 * statistics.median(values) for name, values in per_round.items()}


def measure(model: str, path: str, backend: str, rounds: int) -> tuple[CaseResult, dict]:
    """One case and, where both sides succeeded, their latencies (and float's)."""
    case = run_case(model, path, backend)
    timing: dict[str, float] = {}
    if case.qcore.ok and case.peer.ok:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            timing = latencies_ms(
                {"qcore": case.qcore.model, "peer": case.peer.model, "float": case.float_model},
                case.inputs,
                rounds,
            )
    return case, timing


def _db(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) else f"{value:.1f}"


def status(case: CaseResult) -> str:
    """ok, or who failed and where (qcore's failures are the findings)."""
    if case.qcore.ok and case.peer.ok:
        if case.qcore.sqnr < case.peer.sqnr - SQNR_TOLERANCE_DB:
            return "**qcore loses accuracy**"
        return "ok"
    if not case.peer.ok and not case.qcore.ok:
        return "both fail"
    if not case.peer.ok:
        return f"peer fails ({case.peer.stage})"
    return f"**qcore fails ({case.qcore.stage})**"


def render(rows: list[tuple[CaseResult, dict]], rounds: int, load: float) -> str:
    """The markdown report; ``load``: the mean load average over the run."""
    lines = [
        "# Real models: qcore vs its peers on transformers architectures",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, torch.set_num_threads({THREADS}); "
        f"torch {torch.__version__}, Python {platform.python_version()}.",
        "",
        f"Load average while measuring: {load:.1f} (a shared machine: the two sides of a "
        "case are timed in alternating rounds, so load hits both alike; absolute times "
        "are noisy, the ratio less so).",
        "",
        "Generated by `python benchmarks/realmodels.py`; the CI subset is "
        "tests/realmodels (`tox -e realmodels`), qcore's open failures are in "
        "tests/realmodels/FINDINGS.md.",
        "",
        "Legend. Models: transformers architectures built from tiny configs with random "
        "weights (tests/realmodels/models.py; batch 2: 3x32x32 images, 16 tokens, 1600 "
        "audio samples or 16x32 mel frames; batch norms given running statistics), each "
        "returning its main tensor (logits or last_hidden_state). `fx`: qcore.prepare_fx/"
        "convert_fx vs torch.ao's quantize_fx, both with torch.ao's "
        "`get_default_qconfig_mapping(backend)` (onednn on a CPU without VNNI: its x86 "
        "mapping, 7-bit activations), torch.ao run under its quantized engine. `pt2e`: "
        'torch.export, then qcore.prepare_pt2e(model, "x86")/convert_pt2e (lowered) vs '
        "torchao's X86InductorQuantizer default config (its reference graph, eager), same "
        "`reduce_range` both sides. SQNR: dB against the float model, mean over 3 held-out "
        "batches (calibration: the same 4 batches both sides). `lin/conv`: linears and "
        "convs quantized, qcore/peer. `workaround`: what FX tracing needed, found from "
        "qcore's TraceFailure advice and given to both sides (pt2e needs none). Latency: "
        f"ms per forward, median over {rounds} interleaved rounds; `peer/q` above 1: qcore "
        "is faster. A benchmark, not a check.",
        "",
    ]
    ok = [c for c, _ in rows if c.qcore.ok and c.peer.ok]
    losses = [c for c in ok if c.qcore.sqnr < c.peer.sqnr - SQNR_TOLERANCE_DB]
    fails = [c for c, _ in rows if c.peer.ok and not c.qcore.ok]
    faster = [t for _, t in rows if t and t["qcore"] <= t["peer"]]
    timed = [t for _, t in rows if t]
    lines += [
        "## Summary",
        "",
        f"- cases: {len(rows)}; both sides ok: {len(ok)}; peer fails: "
        f"{sum(not c.peer.ok for c, _ in rows)}",
        f"- qcore fails where the peer succeeds: {len(fails)}"
        + "".join(f"\n  - {c.model}/{c.path}/{c.backend}: {c.qcore.error}" for c in fails),
        f"- qcore more than {SQNR_TOLERANCE_DB} dB below the peer: {len(losses)}"
        + "".join(
            f"\n  - {c.model}/{c.path}/{c.backend}: {c.qcore.sqnr:.1f} vs {c.peer.sqnr:.1f} dB"
            for c in losses
        ),
        f"- qcore at most the peer's latency: {len(faster)} of {len(timed)} timed cases",
        "",
    ]
    header = (
        "| model | family | path | backend | status | SQNR qcore | SQNR peer | lin/conv "
        "| float ms | qcore ms | peer ms | peer/q | workaround |"
    )
    lines += ["## Cases", "", header, "|" + "---|" * (header.count("|") - 1)]
    for case, timing in rows:
        family = BUILDERS[case.model][0]
        ms = [f"{timing[k]:.2f}" if timing else "-" for k in ("float", "qcore", "peer")]
        ratio = f"{timing['peer'] / timing['qcore']:.2f}" if timing else "-"
        lines.append(
            f"| {case.model} | {family} | {case.path} | {case.backend} | {status(case)} "
            f"| {_db(case.qcore.sqnr)} | {_db(case.peer.sqnr)} "
            f"| {case.qcore.weighted_quantized}/{case.peer.weighted_quantized} "
            f"| {' | '.join(ms)} | {ratio} | {case.workaround} |"
        )
    errors = [c for c, _ in rows if not (c.qcore.ok and c.peer.ok)]
    if errors:
        lines += ["", "## Errors", ""]
        for case in errors:
            for side in (case.qcore, case.peer):
                if not side.ok:
                    lines.append(
                        f"- {case.model}/{case.path}/{case.backend}, {side.side} at "
                        f"{side.stage}: `{side.error}`"
                    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--backends", default=",".join(FX_BACKENDS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "REALMODELS.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    warnings.simplefilter("ignore")
    backends = args.backends.split(",")
    rows, loads = [], []
    for path in args.paths.split(","):
        allowed = FX_BACKENDS if path == "fx" else PT2E_BACKENDS
        for model in args.models.split(","):
            for backend in [b for b in backends if b in allowed]:
                case, timing = measure(model, path, backend, args.rounds)
                rows.append((case, timing))
                loads.append(os.getloadavg()[0])
                print(case.summary(), {k: round(v, 3) for k, v in timing.items()}, flush=True)
    Path(args.out).write_text(render(rows, args.rounds, statistics.mean(loads)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
