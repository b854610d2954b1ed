"""qcore.compile against torchao + Inductor on real architectures (issue 15 §2).

    python benchmarks/realmodels_compiled.py [--repeat 2] [model ...]   # resnet bert

transformers' ResNet and BERT, built from small configs with random weights
(tests/realmodels/models.py; nothing is downloaded; needs ``transformers``),
exported, quantized with the x86 backend's own Quantizer on qcore's side and
torchao's X86InductorQuantizer (default config) on the other, each compiled as its
project recommends: ``qcore.compile`` (the x86 recipe: Inductor, frozen weights)
and ``torch.compile`` with Inductor's freezing on. Compile time (best of
``--repeat`` compiles from scratch), latency (timed interleaved after the last
compile), and SQNR of the compiled model against float on held-out batches.
``--mode reduce-overhead`` compiles qcore's side in that mode and adds torchao
compiled with the same options.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from pt2e import compiled_side_by_side, machine, torchao_flow  # noqa: E402
from realmodels.models import build  # noqa: E402

import qcore  # noqa: E402
from qcore.accuracy import sqnr  # noqa: E402


class CaseEntry:
    """A real-model case in the zoo entry's shape, as pt2e.py's timers take it."""

    def __init__(self, name: str) -> None:
        self.case = build(name)

    def make_model(self) -> torch.nn.Module:
        return self.case.model

    def calibration_data(self, count: int) -> list[tuple]:
        return (self.case.calibration * count)[:count]


def compiled_sqnr(entry: CaseEntry, side: str, mode: str = "default") -> float:
    """SQNR against float of the compiled model on the held-out batches."""
    import torch._inductor.config as inductor_config

    case = entry.case
    exported = torch.export.export(case.model, case.example_inputs).module()
    if side == "qcore":
        prepared = qcore.prepare_pt2e(exported, "x86")
        for batch in case.calibration:
            prepared(*batch)
        compiled = qcore.compile(prepared, mode=mode)
    else:
        quantizer, prepare, convert = torchao_flow()
        prepared = prepare(exported, quantizer())
        for batch in case.calibration:
            prepared(*batch)
        compiled = torch.compile(convert(prepared))
    scores = []
    with inductor_config.patch(freezing=True), torch.no_grad():
        for batch in case.evaluation:
            scores.append(sqnr(case.model(*batch), compiled(*batch)))
    return statistics.mean(scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["resnet", "bert"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--mode", choices=qcore.COMPILE_MODES, default="default")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"machine: {machine()}; qcore.compile mode: {args.mode}")
    same = args.mode != "default"
    print(
        "| model | qcore.compile ms | torchao+inductor ms | latency ratio | compile s "
        "(qcore/torchao) | SQNR dB (qcore/torchao) |"
        + (" torchao, same options: ms, ratio, compile s |" if same else "")
    )
    print("|---|---|---|---|---|---|" + ("---|" if same else ""))
    for name in args.models:
        entry = CaseEntry(name)
        result = compiled_side_by_side(entry, lambda: "x86", args.repeat, args.mode)
        ours_compile, ours = result["qcore"]
        theirs_compile, theirs = result["torchao"]
        ours_sqnr = compiled_sqnr(entry, "qcore", args.mode)
        theirs_sqnr = compiled_sqnr(entry, "torchao")
        row = (
            f"| {name} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | {ours / theirs:.2f}x "
            f"| {ours_compile:.1f} / {theirs_compile:.1f} ({ours_compile / theirs_compile:.2f}x) "
            f"| {ours_sqnr:.1f} / {theirs_sqnr:.1f} |"
        )
        if same:
            same_compile, same_latency = result["torchao+same options"]
            row += f" {same_latency * 1e3:.2f}, {ours / same_latency:.2f}x, {same_compile:.1f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
