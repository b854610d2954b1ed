"""Hunt for accuracy gaps on random generated graphs, qcore against its peer.

    python benchmarks/generated_hunt.py [--path fx|pt2e] [--backend x86] [--models 200]
                                        [--max-steps 6] [--seed 0] [--tolerance 1.5]

The models are the ones ``tests/test_properties_vs_torch_ao.py`` generates (each
activation family in each form after a conv, modules called twice, residuals
reused, sizes and lists, bool masks, scalar arithmetic, in-place writes), drawn at
random and longer than the tests' (which run a fixed, derandomized sample in CI).
FX is compared with torch.ao FX under torch.ao's own default QConfigMapping for the
backend; PT2E with torchao's X86InductorQuantizer (``--backend x86`` only). Each
model whose qcore SQNR (reference or lowered, the worse) is more than
``--tolerance`` dB below the peer's lowered model is printed, as a line to paste
into a test, and so is each model qcore fails on where the peer runs. Each side
evaluates the first of the model's four batches (two samples); a flagged model is
measured again with each batch first in turn, and printed as a gap only where the
mean gap is below the tolerance too (else as noise). Not a test: a search.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_properties_vs_torch_ao as generated  # noqa: E402
import torch  # noqa: E402
from test_properties_vs_torch_ao import Step  # noqa: E402

KINDS = ("called_twice", "called_twice_fusable", "residual_reused", "view_list", "mask")
KINDS += ("write_ignored", "view_before_write")


def random_parts(rng: random.Random, max_steps: int) -> tuple[list[Step], tuple[str, str]]:
    steps = []
    for _ in range(rng.randint(1, max_steps)):
        draw = rng.random()
        if draw < 0.4:
            steps.append(Step("conv_act", activation=rng.choice(generated.ACTIVATION_FORMS)))
        elif draw < 0.7:
            steps.append(Step("scalar", scalar=rng.choice(generated.SCALAR_OPS)))
        else:
            steps.append(Step(rng.choice(KINDS)))
    return steps, rng.choice(generated.ACTIVATION_FORMS)


def fx_sides(backend: str):
    """(peer, ours): torch.ao's lowered output, and qcore's reference and lowered ones,
    as the CI test runs them (torch.ao's default mapping for the backend)."""

    def peer(model, data):
        # torch.fx prints a failing generated forward's traceback to stderr
        with contextlib.redirect_stderr(io.StringIO()):
            outputs = generated._run_torch_ao(model, data, backend)
        return None if outputs is None else outputs[1]

    def ours(model, data):
        return list(generated._run_qcore(model, data, backend))

    return peer, ours


def pt2e_sides(backend: str):
    import test_pt2e_generated_vs_torchao as pt2e

    if backend != "x86":
        raise SystemExit("--path pt2e compares with torchao's X86InductorQuantizer: --backend x86")
    return pt2e._torchao, lambda model, data: list(pt2e._qcore(model, data))


def _mean_gap(model, data, peer, ours) -> float:
    """The gap averaged over the model's batches: each side evaluates its first batch
    (two samples, a few outputs: a 2 dB gap there can be rounding luck), so each batch
    takes the first place in turn (calibration sees the same batches)."""
    gaps = []
    for k in range(len(data)):
        rotated = data[k:] + data[:k]
        with torch.no_grad():
            expected = model(rotated[0].clone())
        theirs = peer(model, rotated)
        if theirs is None:
            continue
        mine = min(generated.sqnr(expected, output) for output in ours(model, rotated))
        gaps.append(mine - generated.sqnr(expected, theirs))
    finite = [gap for gap in gaps if math.isfinite(gap)]
    return sum(finite) / len(finite) if finite else math.inf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=("fx", "pt2e"), default="fx")
    parser.add_argument("--backend", default="x86")
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1.5)
    args = parser.parse_args(argv)
    peer, ours = (fx_sides if args.path == "fx" else pt2e_sides)(args.backend)
    rng = random.Random(args.seed)
    compared = skipped = 0
    for _ in range(args.models):
        parts = random_parts(rng, args.max_steps)
        model, data, expected = generated.float_case(parts)
        theirs = peer(model, data)
        if theirs is None:
            skipped += 1
            continue
        compared += 1
        try:
            mine = min(generated.sqnr(expected, output) for output in ours(model, data))
        except Exception as error:  # noqa: BLE001 - where the peer runs, qcore must too
            print(f"qcore fails ({type(error).__name__}: {error}): {parts!r}")
            continue
        gap = mine - generated.sqnr(expected, theirs)
        if math.isfinite(gap) and gap < -args.tolerance:
            confirmed = _mean_gap(model, data, peer, ours)
            if confirmed < -args.tolerance:
                print(f"{gap:+.1f} dB (mean over every batch {confirmed:+.1f}): {parts!r}")
            else:
                print(f"# noise: {gap:+.1f} dB on the first batch, {confirmed:+.1f} on all")
    print(f"{args.path} {args.backend}: {compared} compared, {skipped} the peer could not run")


if __name__ == "__main__":
    main()
