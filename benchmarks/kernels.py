"""Latency, SQNR and size of qcore's lowered models against torch.ao FX and float.

For every zoo model and backend (fbgemm, qnnpack, x86, onednn), in one process: the
float model, torch.ao FX's converted model (same engine, same QConfigMapping:
torch.ao's default for the backend, or its dynamic one for the LSTM) and
qcore's, at batch 1 and 32. Latency is the median of timed single calls after
warmup, with torch.backends.quantized.engine set to the backend for all three.
SQNR is against the float model on held-out data; size is the serialized
state_dict. Writes benchmarks/RESULTS.md.

Run: python benchmarks/kernels.py [--models a,b] [--backends x,y] [--out PATH]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import sys
import warnings
from pathlib import Path

import torch
from _machine import cpu_model, round_medians  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from zoo import EVAL_SEED, ZOO  # noqa: E402
from zoo.baseline import (  # noqa: E402
    default_qconfig_mapping,
    quantize_zoo_entry,
    quantized_engine,
    sqnr,
)

import qcore  # noqa: E402

BACKENDS = ("fbgemm", "qnnpack", "x86", "onednn")
BATCHES = (1, 32)
CONV_NETS = ("resnet18_like", "mobilenetv2_like")


def latencies_ms(models: dict, inputs: tuple, rounds: int = 9, block_seconds: float = 0.05):
    """Per model, milliseconds of one call: the fastest of interleaved rounds."""
    medians = round_medians(models, inputs, rounds, block_seconds, most_calls=200)
    return {name: 1000 * min(values) for name, values in medians.items()}


def size_kb(model) -> float:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell() / 1024


def batch_of(entry, batch: int) -> tuple:
    example = entry.example_inputs()
    generator = torch.Generator().manual_seed(7)
    return tuple(torch.randn(batch, *t.shape[1:], generator=generator) for t in example)


def peer_mapping(backend: str, dynamic: bool):
    """The QConfigMapping both sides use: torch.ao's default for the backend. For
    onednn on a CPU whose int8 sums saturate (no VNNI), torch.ao's default keeps
    8-bit activations (and warns so); both sides then get its x86 mapping, the same
    but with 7-bit activations, as qcore's own onednn default does there."""
    from qcore.kernels.runtime import int8_products_saturate

    if backend == "onednn" and not dynamic and int8_products_saturate():
        backend = "x86"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return default_qconfig_mapping(backend, dynamic=dynamic)


def qcore_quantize(entry, backend: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's observers (the peer's mapping) warn
        mapping = peer_mapping(backend, entry.dynamic)
        prepared = qcore.prepare_fx(entry.make_model(), mapping, entry.example_inputs(), backend)
        with torch.no_grad():
            for batch in entry.calibration_data(8):
                prepared(*batch)
        return qcore.convert_fx(prepared)


def qcore_keep_float_if_slower(entry, backend: str, inputs: tuple):
    """qcore as it recommends running a model whose int8 form measured slower than
    float: ``quantize(keep_float_if_slower=True)``, timed on the row's batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mapping = peer_mapping(backend, entry.dynamic)
        return qcore.quantize(
            entry.make_model(),
            inputs,
            entry.calibration_data(8),
            backend,
            mapping,
            keep_float_if_slower=True,
        )


def measure(name: str, backend: str) -> dict:
    entry = ZOO[name]
    model = entry.make_model()
    baseline = quantize_zoo_entry(
        entry, backend, qconfig_mapping=peer_mapping(backend, entry.dynamic)
    )
    ours = qcore_quantize(entry, backend)
    evals = entry.calibration_data(4, seed=EVAL_SEED)
    row = {"model": name, "backend": backend, "ao_ok": baseline.ok}
    with torch.no_grad(), quantized_engine(backend), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's models create quantized tensors
        row["sqnr_qcore"] = sum(sqnr(model(*b), ours(*b)) for b in evals) / len(evals)
        row["sqnr_ao"] = baseline.sqnr if baseline.ok else float("nan")
        # qcore's model twice: the two timings' ratio is the row's own measurement noise
        models = {"float": model, "qcore": ours, "qcore_again": ours}
        if baseline.ok:
            models["ao"] = baseline.model
        for batch in BATCHES:
            timings = latencies_ms(models, batch_of(entry, batch))
            for variant in ("float", "ao", "qcore", "qcore_again"):
                row[f"{variant}_{batch}"] = timings.get(variant, float("nan"))
            row[f"recommended_{batch}"] = row[f"qcore_{batch}"]
            row[f"float_again_{batch}"] = row[f"float_{batch}"]
            if row[f"qcore_{batch}"] > row[f"float_{batch}"]:
                faster = qcore_keep_float_if_slower(entry, backend, batch_of(entry, batch))
                pair = latencies_ms({"float": model, "faster": faster}, batch_of(entry, batch))
                row[f"float_again_{batch}"] = pair["float"]
                row[f"recommended_{batch}"] = pair["faster"]
                kept = [
                    e.node
                    for e in qcore.explain(faster).float
                    if e.reason.startswith("kept float (keep_float_if_slower")
                ]
                row[f"kept_{batch}"] = len(kept)
                # nothing paid in int8: quantize returned a copy of the float model
                row[f"own_{batch}"] = not isinstance(faster, torch.fx.GraphModule)
    row["size_float"], row["size_qcore"] = size_kb(model), size_kb(ours)
    row["size_ao"] = size_kb(baseline.model) if baseline.ok else float("nan")
    report = qcore.explain(ours)
    row["ops"] = f"{len(report.quantized)}/{len(report.ops)}"
    return row


def noise(row: dict, batch: int) -> float:
    """How far apart two timings of the very same qcore model came out (0.03: 3%)."""
    return abs(row[f"qcore_{batch}"] / row[f"qcore_again_{batch}"] - 1)


def targets(rows: list[dict]) -> list[str]:
    """The issue's two targets, row by row: which rows meet them and which do not."""
    slower_rows = [(r, b) for r in rows for b in BATCHES if r[f"qcore_{b}"] > r[f"ao_{b}"]]
    slower = [
        f"{r['backend']} {r['model']} b{b} ({r[f'ao_{b}'] / r[f'qcore_{b}']:.2f}"
        + (")" if r[f"ao_{b}"] / r[f"qcore_{b}"] < 1 - noise(r, b) else ", within its noise)")
        for r, b in slower_rows
    ]
    cells = [(r, b) for r in rows for b in BATCHES]
    conv = [(r, b) for r, b in cells if r["model"] in CONV_NETS]
    below_2x = [
        f"{r['backend']} {r['model']} b{b} ({r[f'float_{b}'] / r[f'qcore_{b}']:.2f})"
        for r, b in conv
        if r[f"float_{b}"] < 2 * r[f"qcore_{b}"]
    ]
    x86_fbgemm = [(r, b) for r, b in cells if r["backend"] in ("x86", "fbgemm")]
    # the user's own float model timed against itself: a tie, whatever the timing says
    own = [(r, b) for r, b in x86_fbgemm if r.get(f"own_{b}")]
    slower_than_float = [
        f"{r['backend']} {r['model']} b{b} ({recommended_speedup(r, b):.2f})"
        for r, b in x86_fbgemm
        if (r, b) not in own and recommended_speedup(r, b) < 1 - noise(r, b)
    ]
    return [
        "## Targets",
        "",
        f"- x86 and fbgemm, int8 as qcore recommends (`rec`: its kernels, or "
        "`keep_float_if_slower=True` where they measured slower than float) at least "
        f"float's speed: {len(x86_fbgemm) - len(slower_than_float)} of {len(x86_fbgemm)} rows"
        + (f" ({len(own)} of them the user's float model itself, where no int8 layer paid)")
        + (f"; below: {', '.join(slower_than_float)}" if slower_than_float else ""),
        f"- qcore at most torch.ao's latency: {len(cells) - len(slower)} of {len(cells)} rows"
        + (f"; slower: {', '.join(slower)}" if slower else ""),
        f"- int8 at least 2x faster than float on the conv nets: {len(conv) - len(below_2x)} "
        f"of {len(conv)} rows" + (f"; below: {', '.join(below_2x)}" if below_2x else ""),
        "",
    ]


def recommended_speedup(row: dict, batch: int) -> float:
    """float over qcore as recommended, the two timed in the same rounds."""
    return row[f"float_again_{batch}"] / row[f"recommended_{batch}"]


def recommended_cell(row: dict, batch: int) -> str:
    if f"kept_{batch}" not in row:
        return f"{recommended_speedup(row, batch):.2f}"
    if row.get(f"own_{batch}"):
        return f"{recommended_speedup(row, batch):.2f} (all: float model)"
    return f"{recommended_speedup(row, batch):.2f} ({row[f'kept_{batch}']})"


def render(rows: list[dict], threads: int) -> str:
    lines = [
        "# Kernel benchmarks: qcore vs torch.ao FX vs float",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} logical cores, "
        f"torch.set_num_threads({threads}); torch {torch.__version__}, "
        f"Python {platform.python_version()}.",
        "",
        f"Load average while measuring: {os.getloadavg()[0]:.1f} (a shared machine: the "
        "models of a row are timed in interleaved rounds and each keeps its fastest "
        "round's median).",
        "",
        "Latency of one forward (ms) after warmup; `ao/q` is torch.ao's latency over "
        "qcore's (above 1: qcore is faster), `f/q` float's over qcore's (the int8 speed-up). "
        "SQNR (dB) against the float model on held-out data. Size: serialized state_dict (KiB). "
        "`f/rec`: float's latency over qcore's as it recommends running the model: its "
        "kernels, or where those measured slower than float, "
        "`qcore.quantize(keep_float_if_slower=True)` (timed against float in the same "
        "rounds; in brackets, the layers it kept float; `all: float model` where no int8 "
        "layer paid and it returned the user's own float model, a tie with float). "
        "`ops`: operators on qcore kernels / operators. `noise`: how far two timings of "
        "the same qcore model differ in that row (a ratio that close to 1 is a tie). "
        "Same engine and QConfigMapping for "
        "torch.ao and qcore (torch.ao's default for the backend; its dynamic one for lstm; "
        "for onednn on a CPU without VNNI, its x86 one: 7-bit activations, see "
        "`peer_mapping`).",
        "Generated by `python benchmarks/kernels.py`.",
        "",
        *targets(rows),
    ]
    for backend in BACKENDS:
        selected = [r for r in rows if r["backend"] == backend]
        if not selected:
            continue
        lines += [
            f"## {backend}",
            "",
            "| model | batch | float | torch.ao | qcore | ao/q | f/q | f/rec (kept float) "
            "| noise | SQNR ao | SQNR qcore | size float | size ao | size qcore | ops |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in selected:
            for batch in BATCHES:
                f, a, q = r[f"float_{batch}"], r[f"ao_{batch}"], r[f"qcore_{batch}"]
                lines.append(
                    f"| {r['model']} | {batch} | {f:.3f} | {a:.3f} | {q:.3f} | {a / q:.2f} "
                    f"| {f / q:.2f} | {recommended_cell(r, batch)} "
                    f"| {noise(r, batch):.0%} | {r['sqnr_ao']:.1f} "
                    f"| {r['sqnr_qcore']:.1f} "
                    f"| {r['size_float']:.0f} | {r['size_ao']:.0f} | {r['size_qcore']:.0f} "
                    f"| {r['ops']} |"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(sorted(ZOO)))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = parser.parse_args(argv)
    threads = min(2, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    rows = []
    for backend in args.backends.split(","):
        for name in args.models.split(","):
            row = measure(name, backend)
            rows.append(row)
            print(
                f"{backend:8s} {name:18s} "
                + " ".join(
                    f"b{b}: f {row[f'float_{b}']:.3f} ao {row[f'ao_{b}']:.3f} "
                    f"q {row[f'qcore_{b}']:.3f}"
                    for b in BATCHES
                ),
                flush=True,
            )
    Path(args.out).write_text(render(rows, threads) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
