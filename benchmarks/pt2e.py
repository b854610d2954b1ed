"""PT2E path: qcore against torchao 0.18 on the exported zoo models, as ratios.

    python benchmarks/pt2e.py [--repeat 3] [--inductor] [model ...]

For each model: prepare time, convert time (qcore lowers to its x86 kernels;
torchao's convert gives its reference graph) and the latency of one forward of
the converted model, best of ``--repeat`` runs, interleaved so machine load
hits both alike. Ratios are qcore / torchao (below 1: qcore is faster).
The machine (CPU model from /proc/cpuinfo, cores, torch) heads the table.

``--inductor`` adds the peer as torchao means it to run: its converted model
through ``torch.compile`` (inductor, weights frozen), timed after compilation;
the compile time is printed beside it (best of ``--repeat`` compiles from
scratch). A further column is ``qcore.compile`` (the x86 backend's recipe: its
reference form through Inductor with frozen weights) against it, with the
compile-time ratio; the compiled models are timed interleaved, 15 rounds of 100
calls each. ``--mode reduce-overhead`` compiles qcore's side in that mode (x86:
Inductor's C++ wrapper too) and adds a last column: torchao compiled with the
same options, what the options alone are worth.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from zoo import ZOO  # noqa: E402

import qcore  # noqa: E402
from qcore.config.qconfig import QConfig  # noqa: E402
from qcore.observers import HistogramObserver, PerChannelMinMaxObserver  # noqa: E402
from qcore.pt2e import BackendQuantizer  # noqa: E402


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"


def qcore_quantizer():
    activation = HistogramObserver.with_args(dtype=torch.quint8)
    weight = PerChannelMinMaxObserver.with_args(
        dtype=torch.qint8, qscheme=torch.per_channel_symmetric
    )
    mapping = qcore.get_default_qconfig_mapping("x86").set_global(QConfig(activation, weight))
    return BackendQuantizer.for_backend("x86", mapping)


def torchao_flow():
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    def quantizer():
        q = xiq.X86InductorQuantizer()
        return q.set_global(xiq.get_default_x86_inductor_quantization_config())

    return quantizer, prepare_pt2e, convert_pt2e


def timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def latency(model, batch, runs: int = 20) -> float:
    with torch.no_grad():
        model(*batch)
        start = time.perf_counter()
        for _ in range(runs):
            model(*batch)
    return (time.perf_counter() - start) / runs


def _prepared_pair(entry, quantizer):
    """(torchao's converted model, qcore's calibrated prepared model) of one entry."""
    their_quantizer, their_prepare, their_convert = torchao_flow()
    model = entry.make_model()
    batch = entry.calibration_data(1)[0]
    theirs = their_prepare(torch.export.export(model, batch).module(), their_quantizer())
    ours = qcore.prepare_pt2e(torch.export.export(model, batch).module(), quantizer())
    with torch.no_grad():
        for inputs in entry.calibration_data(4):
            theirs(*inputs)
            ours(*inputs)
    return their_convert(theirs), ours, batch


def _interleaved_latency(models: dict, batch, rounds: int = 15, calls: int = 100) -> dict:
    """Best seconds per call of each model, timed in turn ``rounds`` times, so that
    a spike of machine load hits all of them alike."""
    best = dict.fromkeys(models, float("inf"))
    with torch.no_grad():
        for _ in range(rounds):
            for key, model in models.items():
                start = time.perf_counter()
                for _ in range(calls):
                    model(*batch)
                best[key] = min(best[key], (time.perf_counter() - start) / calls)
    return best


def compiled_side_by_side(entry, quantizer, repeat: int, mode: str = "default") -> dict:
    """Compile time (best of ``repeat`` compiles from scratch) and latency (timed
    interleaved after the last compile) of ``qcore.compile(prepared, mode=mode)``
    ("qcore") and torchao's converted model under ``torch.compile`` with freezing,
    as its tutorial runs it ("torchao"). With a mode other than "default", also
    torchao compiled with the options qcore's recipe adds ("torchao+same options"):
    what those options are worth to either side. Returns {side: (compile s, latency s)}."""
    import copy

    import torch._inductor.config as inductor_config

    converted, prepared, batch = _prepared_pair(entry, quantizer)
    recipe = qcore.get_backend("x86").compile_recipe(mode)
    sides = {"qcore": None, "torchao": {"freezing": True}}
    if mode != "default":
        sides["torchao+same options"] = dict(recipe.options)
    compile_s = dict.fromkeys(sides, float("inf"))
    for _ in range(repeat):
        torch._dynamo.reset()
        compiled = {}
        for side, options in sides.items():
            if options is None:
                model = qcore.compile(prepared, mode=mode)
                _, seconds = timed(model, *batch)
            else:
                with inductor_config.patch(**options), torch.no_grad():
                    model = torch.compile(copy.deepcopy(converted))
                    _, seconds = timed(model, *batch)
            compiled[side] = model
            compile_s[side] = min(compile_s[side], seconds)
    latency_s = _interleaved_latency(compiled, batch)
    return {side: (compile_s[side], latency_s[side]) for side in sides}


def one_run(entry, flow):
    """(prepare s, convert s, latency s) for one flow on one model."""
    model = entry.make_model()
    batch = entry.calibration_data(1)[0]
    quantizer, prepare, convert = flow
    exported = torch.export.export(model, batch).module()
    prepared, prepare_s = timed(prepare, exported, quantizer())
    with torch.no_grad():
        for inputs in entry.calibration_data(4):
            prepared(*inputs)
    converted, convert_s = timed(convert, prepared)
    return prepare_s, convert_s, latency(converted, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=sorted(ZOO))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--quantizer",
        choices=["name", "compiled"],
        default="name",
        help="qcore's side: \"x86\" by name (the plugin's X86Quantizer, the default) or "
        "the Quantizer compiled from x86's native BackendConfig",
    )
    parser.add_argument(
        "--inductor",
        action="store_true",
        help="also time torchao's converted model under torch.compile (inductor)",
    )
    parser.add_argument(
        "--mode",
        choices=qcore.COMPILE_MODES,
        default="default",
        help="qcore.compile's mode (with --inductor); another than default adds a "
        "column: torchao compiled with the options that mode adds",
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    quantizer = qcore_quantizer if args.quantizer == "compiled" else lambda: "x86"
    ours = (quantizer, qcore.prepare_pt2e, qcore.convert_pt2e)
    theirs = torchao_flow()
    print(f"machine: {machine()}; qcore's quantizer: {args.quantizer}")
    header = ("model", "prepare qcore/ao", "convert qcore/ao", "latency qcore/ao")
    if args.inductor:
        header += ("latency qcore/ao+inductor (compile)", "qcore.compile/ao+inductor (compile)")
        if args.mode != "default":
            header += ("qcore.compile/ao+same options",)
    print(f"{header[0]:<18} " + " ".join(f"{h:>26}" for h in header[1:]))
    for name in args.models:
        best_ours = [float("inf")] * 3
        best_theirs = [float("inf")] * 3
        for _ in range(args.repeat):
            best_ours = [
                min(a, b) for a, b in zip(best_ours, one_run(ZOO[name], ours), strict=True)
            ]
            best_theirs = [
                min(a, b) for a, b in zip(best_theirs, one_run(ZOO[name], theirs), strict=True)
            ]
        cells = [
            f"{o * 1e3:8.1f}/{t * 1e3:8.1f}ms {o / t:5.2f}x"
            for o, t in zip(best_ours, best_theirs, strict=True)
        ]
        if args.inductor:
            result = compiled_side_by_side(ZOO[name], quantizer, args.repeat, args.mode)
            compile_s, compiled = result["torchao"]
            ours_compile_s, ours_compiled = result["qcore"]
            cells.append(
                f"{best_ours[2] * 1e3:8.1f}/{compiled * 1e3:8.1f}ms "
                f"{best_ours[2] / compiled:5.2f}x ({compile_s:.0f}s)"
            )
            cells.append(
                f"{ours_compiled * 1e3:8.1f}/{compiled * 1e3:8.1f}ms "
                f"{ours_compiled / compiled:5.2f}x ({ours_compile_s:.0f}/{compile_s:.0f}s "
                f"{ours_compile_s / compile_s:.2f}x)"
            )
            if "torchao+same options" in result:
                same_compile_s, same = result["torchao+same options"]
                cells.append(
                    f"{ours_compiled * 1e3:8.1f}/{same * 1e3:8.1f}ms {ours_compiled / same:5.2f}x "
                    f"({ours_compile_s:.0f}/{same_compile_s:.0f}s)"
                )
        print(f"{name:<18} " + " ".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    main()
