"""mobilenetv2_like: MobileNetV2's inverted residual blocks, narrow, 32x32 input.

Beyond plain MobileNetV2 it has hardswish (as in MobileNetV3's later layers) and one
two-branch block whose branches are joined by torch.cat, so those ops are covered too.
"""

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
NUM_CLASSES = 10


def conv_bn_act(
    in_channels: int,
    out_channels: int,
    kernel_size: int = 1,
    stride: int = 1,
    groups: int = 1,
    activation: type[nn.Module] | None = nn.ReLU6,
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            kernel_size // 2,
            groups=groups,
            bias=False,
        ),
        nn.BatchNorm2d(out_channels),
    ]
    if activation is not None:
        layers.append(activation())
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """1x1 expand (conv-bn-act), 3x3 depthwise (conv-bn-act), 1x1 linear project (conv-bn).

    The input is added back (torch.add) when the shape allows, as in MobileNetV2.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int,
        expand_ratio: int,
        activation: type[nn.Module] = nn.ReLU6,
    ):
        super().__init__()
        hidden = in_channels * expand_ratio
        self.use_residual = stride == 1 and in_channels == out_channels
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(conv_bn_act(in_channels, hidden, activation=activation))
        layers.append(conv_bn_act(hidden, hidden, 3, stride, groups=hidden, activation=activation))
        layers.append(conv_bn_act(hidden, out_channels, activation=None))
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_residual:
            return torch.add(x, self.conv(x))
        return self.conv(x)


class TwoBranch(nn.Module):
    """A 1x1 branch and a depthwise-separable 3x3 branch, concatenated along channels."""

    def __init__(self, in_channels: int, branch_channels: int):
        super().__init__()
        self.branch1 = conv_bn_act(in_channels, branch_channels)
        self.branch2 = nn.Sequential(
            conv_bn_act(in_channels, in_channels, 3, groups=in_channels),
            conv_bn_act(in_channels, branch_channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x)], dim=1)


class MobileNetV2Like(nn.Module):
    # (expand_ratio, out_channels, repeats, first stride, activation)
    SETTINGS = (
        (1, 16, 1, 1, nn.ReLU6),
        (6, 24, 2, 2, nn.ReLU6),
        (6, 32, 2, 2, nn.ReLU6),
        (4, 48, 2, 2, nn.Hardswish),
    )

    def __init__(self, num_classes: int = NUM_CLASSES):
        super().__init__()
        in_channels = 16
        layers: list[nn.Module] = [conv_bn_act(3, in_channels, 3, stride=1)]
        for expand_ratio, out_channels, repeats, stride, activation in self.SETTINGS:
            for index in range(repeats):
                layers.append(
                    InvertedResidual(
                        in_channels,
                        out_channels,
                        stride if index == 0 else 1,
                        expand_ratio,
                        activation,
                    )
                )
                in_channels = out_channels
        layers.append(TwoBranch(in_channels, 32))
        layers.append(conv_bn_act(64, 128, activation=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def make_model() -> nn.Module:
    with seeded(MODEL_SEED):
        model = MobileNetV2Like()
        branch_ends = [
            m.conv[-1][1]
            for m in model.modules()
            if isinstance(m, InvertedResidual) and m.use_residual
        ]
        randomize_batchnorm(model, branch_ends)
        return settle_batchnorm(model, gaussian_batches((8, *INPUT_SHAPE), 4, seed=MODEL_SEED))


def example_inputs() -> tuple:
    return gaussian_batches((1, *INPUT_SHAPE), 1, seed=CALIBRATION_SEED)[0]


def calibration_data(n: int, seed: int = CALIBRATION_SEED) -> list[tuple]:
    return gaussian_batches((4, *INPUT_SHAPE), n, seed=seed)


ENTRY = ZooEntry(
    name="mobilenetv2_like",
    make_model=make_model,
    example_inputs=example_inputs,
    calibration_data=calibration_data,
    description="inverted residuals (relu6, depthwise, hardswish), a cat block, 3x32x32 input",
)
