"""Cost of qcore.sync_observers next to one calibration batch (issue 7).

A deep MLP prepared with qcore's FX engine (fbgemm) holds hundreds of
observers, half HistogramObserver (2048 bins), half MinMaxObserver. Two gloo
processes on 127.0.0.1 each calibrate on their own batches, then merge; the
merge is timed (median of several runs, every rank entering together) next to
one calibration batch on the prepared model.

    python benchmarks/distributed_merge.py [--blocks 400] [--width 256] [--batch 64]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _machine import cpu_model  # noqa: E402
from torch import nn

import qcore
from qcore.observers import MinMaxObserver, default_per_channel_weight_observer


class DeepMLP(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def prepared_model(blocks: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = DeepMLP(blocks, width).eval()
    mapping = qcore.get_default_qconfig_mapping("fbgemm")  # HistogramObserver activations
    minmax = qcore.QConfig(
        activation=MinMaxObserver.with_args(reduce_range=True),
        weight=default_per_channel_weight_observer,
    )
    for index in range(0, blocks, 2):  # every other block: MinMaxObserver
        mapping.set_module_name(f"layers.{index}", minmax)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qcore.prepare_fx(model, mapping, (torch.randn(1, width),), backend="fbgemm")


def worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=120),
    )
    prepared = prepared_model(args.blocks, args.width)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(args.batch, args.width, generator=generator) for _ in range(4)]
    batch_times = []
    with torch.no_grad():
        for batch in batches:
            started = time.perf_counter()
            prepared(batch)
            batch_times.append(time.perf_counter() - started)
    calibrated = {name: b.clone() for name, b in prepared.named_buffers()}
    buffers = dict(prepared.named_buffers())
    merge_times, result = [], None
    for _ in range(args.repeat):
        for name, value in calibrated.items():  # each merge starts from the calibration
            buffers[name].resize_(value.shape).copy_(value)
        dist.barrier()
        started = time.perf_counter()
        result = qcore.sync_observers(prepared, timeout=datetime.timedelta(seconds=60))
        merge_times.append(time.perf_counter() - started)
    # the floor: one all_gather of as many bytes as all the histograms
    histograms = [b for name, b in buffers.items() if name.endswith(".histogram")]
    payload = torch.cat([h.reshape(-1) for h in histograms])
    gather_times = []
    for _ in range(args.repeat):
        out = [torch.empty_like(payload) for _ in range(args.world)]
        dist.barrier()
        started = time.perf_counter()
        dist.all_gather(out, payload)
        gather_times.append(time.perf_counter() - started)
    kinds: dict[str, int] = {}
    for kind in result.kinds.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    queue.put((rank, batch_times, merge_times, kinds, gather_times, payload.numel() * 4))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=400, help="Linear+ReLU blocks")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="samples per calibration batch")
    parser.add_argument("--repeat", type=int, default=5, help="timed merges")
    parser.add_argument("--world", type=int, default=2, help="gloo processes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    context = mp.start_processes(
        worker, args=(port, args, queue), nprocs=args.world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 600
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise SystemExit("benchmark workers did not finish within 600 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    results = sorted(queue.get() for _ in range(args.world))

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, load average {load}; "
        f"torch {torch.__version__}"
    )
    print(
        f"model: {args.blocks} x (Linear({args.width}, {args.width}) + ReLU), "
        f"observers: {results[0][3]}"
    )
    print(
        f"{args.world} gloo processes on 127.0.0.1, {args.threads} thread(s) each, "
        f"batch of {args.batch}"
    )
    for rank, batch_times, merge_times, _, gather_times, nbytes in results:
        batch = statistics.median(batch_times[1:])  # the first batch warms up
        merge = statistics.median(merge_times)
        print(
            f"rank {rank}: one calibration batch {batch * 1e3:7.1f} ms | "
            f"sync_observers median {merge * 1e3:6.1f} ms "
            f"(min {min(merge_times) * 1e3:.1f}, max {max(merge_times) * 1e3:.1f}) "
            f"= {merge / batch:.2f} batch | one all_gather of the {nbytes / 1e6:.1f} MB of "
            f"histograms alone: {statistics.median(gather_times) * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
