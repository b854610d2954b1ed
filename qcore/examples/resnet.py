"""resnet18_like: ResNet-18's structure (2-2-2-2 BasicBlocks), widths 16-32-64-128, 32x32 input."""

from __future__ import annotations

import torch
from torch import nn

from qcore.examples._common import (
    CALIBRATION_SEED,
    MODEL_SEED,
    ZooEntry,
    gaussian_batches,
    randomize_batchnorm,
    seeded,
    settle_batchnorm,
)

INPUT_SHAPE = (3, 32, 32)
WIDTHS = (16, 32, 64, 128)
NUM_CLASSES = 10


class BasicBlock(nn.Module):
    """conv-bn-relu, conv-bn, add the (possibly downsampled) input, relu."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + identity
        return self.relu2(out)


class ResNet18Like(nn.Module):
    def __init__(self, widths: tuple[int, ...] = WIDTHS, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        stages = []
        in_channels = widths[0]
        for index, width in enumerate(widths):
            stride = 1 if index == 0 else 2
            stages.append(
                nn.Sequential(BasicBlock(in_channels, width, stride), BasicBlock(width, width))
            )
            in_channels = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def make_model() -> nn.Module:
    with seeded(MODEL_SEED):
        model = ResNet18Like()
        branch_ends = [m.bn2 for m in model.modules() if isinstance(m, BasicBlock)]
        randomize_batchnorm(model, branch_ends)
        return settle_batchnorm(model, gaussian_batches((8, *INPUT_SHAPE), 4, seed=MODEL_SEED))


def example_inputs() -> tuple:
    return gaussian_batches((1, *INPUT_SHAPE), 1, seed=CALIBRATION_SEED)[0]


def calibration_data(n: int, seed: int = CALIBRATION_SEED) -> list[tuple]:
    return gaussian_batches((4, *INPUT_SHAPE), n, seed=seed)


ENTRY = ZooEntry(
    name="resnet18_like",
    make_model=make_model,
    example_inputs=example_inputs,
    calibration_data=calibration_data,
    description="ResNet-18 structure, widths 16-32-64-128, 3x32x32 input",
)
