"""What `import qcore` plus `qcore.list_backends()` adds to `import torch`.

Each sample is a fresh interpreter; we report medians of the two timings and
their difference. Run: python benchmarks/import_time.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys

from _machine import cpu_model  # noqa: E402

TORCH_ONLY = "import time; t=time.perf_counter(); import torch; print(time.perf_counter()-t)"
WITH_QCORE = (
    "import time; t=time.perf_counter(); import torch; t1=time.perf_counter(); "
    "import qcore; qcore.list_backends(); print(time.perf_counter()-t, time.perf_counter()-t1)"
)


def sample(code: str) -> list[float]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [float(value) for value in out.stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    torch_only, with_qcore, qcore_part = [], [], []
    for _ in range(runs):  # interleaved, so drift hits both equally
        torch_only += sample(TORCH_ONLY)
        total, part = sample(WITH_QCORE)
        with_qcore.append(total)
        qcore_part.append(part)
    median = statistics.median
    machine = f"{platform.machine()} {cpu_model()}, {os.cpu_count()} cores"
    print(f"machine: {machine}, python {platform.python_version()}")
    print(f"import torch                          median {median(torch_only) * 1e3:7.1f} ms")
    print(f"import torch + qcore + list_backends  median {median(with_qcore) * 1e3:7.1f} ms")
    print(f"qcore part, measured in-process       median {median(qcore_part) * 1e3:7.1f} ms")
    difference = median(with_qcore) - median(torch_only)
    print(f"difference of medians                        {difference * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
