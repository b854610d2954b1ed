"""Where a real model's converted forward spends its time, qcore against torch.ao,
module by module: which kernel makes a latency gap (benchmarks/REALMODELS.md).

    python benchmarks/realmodels_modules.py regnet fx fbgemm [--calls 200]

Builds one case of tests/realmodels (both sides converted as the harness does),
wraps the forward of every leaf module of both converted GraphModules with a CPU
clock (``time.thread_time_ns``: this thread's time, so another job on a shared
machine inflates it far less than wall time), runs both models interleaved on one
thread, and prints per module kind (qcore's class against the peer's at the same
module path): count, microseconds per forward, difference; then the modules that
differ most. The time outside modules (graph code, functional ops) is the total
minus the modules' sum. A benchmark, not a check.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from realmodels.harness import run_case  # noqa: E402


def graph_module_of(model: Callable) -> torch.nn.Module:
    """The GraphModule behind a side's model (torch.ao's is wrapped in a function
    that sets its engine)."""
    if isinstance(model, torch.nn.Module):
        return model
    for cell in getattr(model, "__closure__", None) or ():
        if isinstance(cell.cell_contents, torch.nn.Module):
            return cell.cell_contents
    raise TypeError(f"no module behind {model!r}")


def instrument(side: str, root: torch.nn.Module, spent: dict) -> None:
    """Add each leaf module's CPU time per call to ``spent[(side, path, class)]``."""
    for path, module in root.named_modules():
        if not path or any(True for _ in module.children()):
            continue
        forward = module.forward
        key = (side, path, type(module).__name__)

        def timed(*args, __forward=forward, __key=key, **kwargs):
            start = time.thread_time_ns()
            result = __forward(*args, **kwargs)
            spent[__key] = spent.get(__key, 0) + time.thread_time_ns() - start
            return result

        module.forward = timed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("path", choices=["fx", "pt2e"])
    parser.add_argument("backend")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    case = run_case(args.model, args.path, args.backend)
    if not (case.qcore.ok and case.peer.ok):
        raise SystemExit(f"a side failed: {case.summary()}")
    sides = {"qcore": case.qcore.model, "peer": case.peer.model}
    spent: dict = {}
    for side, model in sides.items():
        instrument(side, graph_module_of(model), spent)
    with torch.no_grad():
        for model in sides.values():
            for _ in range(10):
                model(*case.inputs)
        spent.clear()
        total = dict.fromkeys(sides, 0)
        for _ in range(args.calls):
            for side, model in sides.items():
                start = time.thread_time_ns()
                model(*case.inputs)
                total[side] += time.thread_time_ns() - start

    def us(ns: float) -> float:
        return ns / args.calls / 1e3

    in_modules = {s: sum(v for (side, _, _), v in spent.items() if side == s) for s in sides}
    print(
        f"{args.model}/{args.path}/{args.backend}, us per forward: "
        + ", ".join(f"{s} {us(total[s]):.0f} (modules {us(in_modules[s]):.0f})" for s in sides)
    )
    by_path: dict = collections.defaultdict(dict)
    for (side, path, kind), ns in spent.items():
        by_path[path][side] = (kind, us(ns))
    kinds: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for sides_at in by_path.values():
        ours, theirs = sides_at.get("qcore", ("-", 0.0)), sides_at.get("peer", ("-", 0.0))
        row = kinds[(ours[0], theirs[0])]
        row[0] += 1
        row[1] += ours[1]
        row[2] += theirs[1]
    for (ours, theirs), (count, q, p) in sorted(kinds.items(), key=lambda kv: kv[1][2] - kv[1][1]):
        print(f"  {ours:24s} vs {theirs:24s} x{count:3d}  qcore {q:8.1f}  peer {p:8.1f}", end="")
        print(f"  {q - p:+8.1f}")
    worst = sorted(
        by_path.items(),
        key=lambda kv: kv[1].get("peer", ("", 0.0))[1] - kv[1].get("qcore", ("", 0.0))[1],
    )
    for path, sides_at in worst[:8]:
        print(f"    {path}: {sides_at}")


if __name__ == "__main__":
    main()
