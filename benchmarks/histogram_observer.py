"""Time HistogramObserver.calculate_qparams: torch.ao's against qcore's.

    python benchmarks/histogram_observer.py

Prints, per input distribution, the milliseconds per observer for both (same
histogram, same qparams checked), and the CPU model. Not a test: timings vary.
"""

from __future__ import annotations

import time
import warnings

import torch
from _machine import cpu_model  # noqa: E402
from torch.ao.quantization.observer import HistogramObserver as TorchAOHistogramObserver

from qcore.observers import HistogramObserver


def conv_activations(gen: torch.Generator) -> list[list[torch.Tensor]]:
    """Activations of a small random conv net (conv, batchnorm, relu) x 4."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU()]
    torch.nn.Sequential(*layers).eval()  # batchnorm in eval mode
    batches = [torch.randn(4, 16, 32, 32, generator=gen) for _ in range(4)]
    outs: list[list[torch.Tensor]] = [[] for _ in layers]
    with torch.no_grad():
        for h in batches:
            for i, layer in enumerate(layers):
                h = layer(h)
                outs[i].append(h.clone())
    return outs


def cases() -> dict[str, list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    student = torch.distributions.StudentT(torch.tensor(1.5))

    def n(*shape):
        return torch.randn(*shape, generator=gen)

    return {
        "conv net activations": conv_activations(gen),
        "gaussian": [[n(4096) for _ in range(4)] for _ in range(6)],
        "relu(gaussian)": [[torch.relu(n(4096)) for _ in range(4)] for _ in range(6)],
        "lognormal": [[n(4096).exp() for _ in range(4)] for _ in range(6)],
        "student-t (1.5)": [[student.sample((4096,)) for _ in range(4)] for _ in range(6)],
        "gaussian + outliers": [
            [torch.cat([n(4096), n(4) * 100]) for _ in range(4)] for _ in range(6)
        ],
        "few distinct values": [[torch.randint(0, 4, (4096,)).float()] for _ in range(6)],
    }


def time_observer(cls, streams: list[list[torch.Tensor]]) -> tuple[float, list]:
    observers = []
    for stream in streams:
        obs = cls(reduce_range=True)
        for x in stream:
            obs(x)
        observers.append(obs)
    start = time.perf_counter()
    qparams = [obs.calculate_qparams() for obs in observers]
    return (time.perf_counter() - start) / len(observers) * 1e3, qparams


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # warm up both (qcore builds its table of quantile steps once per process)
    for cls in (TorchAOHistogramObserver, HistogramObserver):
        time_observer(cls, [[torch.randn(100)]])
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; 1 thread")
    print(f"{'distribution':<24}{'torch.ao ms':>12}{'qcore ms':>10}{'speed-up':>10}  same qparams")
    total_ao = total_qc = 0.0
    for name, streams in cases().items():
        ao_ms, ao_q = time_observer(TorchAOHistogramObserver, streams)
        qc_ms, qc_q = time_observer(HistogramObserver, streams)
        pairs = zip(ao_q, qc_q, strict=True)
        same = all(torch.equal(a, b) for pa, pb in pairs for a, b in zip(pa, pb, strict=True))
        total_ao += ao_ms
        total_qc += qc_ms
        print(f"{name:<24}{ao_ms:>12.2f}{qc_ms:>10.2f}{ao_ms / qc_ms:>9.1f}x  {same}")
    print(
        f"{'mean over distributions':<24}{total_ao / len(cases()):>12.2f}"
        f"{total_qc / len(cases()):>10.2f}{total_ao / total_qc:>9.1f}x"
    )


if __name__ == "__main__":
    main()
