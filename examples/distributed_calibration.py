"""Calibrate a model on several processes, then merge the observers (qcore.sync_observers).

Run it with torchrun, one process per shard of the calibration data::

    torchrun --nproc_per_node=2 examples/distributed_calibration.py

On several machines, run the same command on each with ``--nnodes``,
``--node_rank`` and ``--rdzv-endpoint`` (or ``--master_addr``/``--master_port``).
Each rank calibrates on its own shard; ``sync_observers`` merges every
observer's statistics, so every rank converts to the same quantized model.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import qcore


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(x, 1))


def calibration_data(batches: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(8, 3, 16, 16, generator=generator) for _ in range(batches)]


def main() -> None:
    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; gloo runs on CPU
    # ("nccl" where every rank has a GPU).
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same float model on every rank
    model = SmallCNN().eval()
    example_inputs = (torch.randn(1, 3, 16, 16),)
    mapping = qcore.get_default_qconfig_mapping("fbgemm")  # histogram observers
    prepared = qcore.prepare_fx(model, mapping, example_inputs, backend="fbgemm")

    with torch.no_grad():
        for batch in calibration_data()[rank::world]:  # this rank's shard
            prepared(batch)

    result = qcore.sync_observers(prepared, timeout=timedelta(seconds=60))
    quantized = qcore.convert_fx(prepared)

    # every rank now holds the same quantized model: check it on one input
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output = quantized(torch.ones(2, 3, 16, 16))
    outputs = [torch.empty_like(output) for _ in range(world)]
    dist.all_gather(outputs, output)
    same = all(torch.equal(outputs[0], other) for other in outputs)
    if rank == 0:
        print(result)
        print(f"{world} ranks, identical quantized models: {same}")
    dist.destroy_process_group()
    if not same:
        raise SystemExit("the ranks' quantized models differ")


if __name__ == "__main__":
    main()
