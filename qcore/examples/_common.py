"""What every zoo model module shares: the entry record and deterministic randomness."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

#: Seeds. Weights, calibration data and held-out evaluation data never share a stream.
MODEL_SEED = 0
CALIBRATION_SEED = 1
EVAL_SEED = 2


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo.

    make_model() returns a fresh model in eval mode whose weights depend only on MODEL_SEED.
    example_inputs() is one batch, as a tuple of positional arguments.
    calibration_data(n, seed=CALIBRATION_SEED) is n such tuples (each a batch of the size
    `calibration_batch`), drawn from the distribution the model was "trained" for; pass
    seed=EVAL_SEED for held-out data to measure accuracy on.
    dynamic says the model is meant for dynamic quantization (weights only, activations
    quantized on the fly), so calibration is not needed for it.
    """

    name: str
    make_model: Callable[[], nn.Module]
    example_inputs: Callable[[], tuple]
    calibration_data: Callable[..., list[tuple]]
    dynamic: bool = False
    description: str = ""


@contextlib.contextmanager
def seeded(seed: int = MODEL_SEED) -> Iterator[None]:
    """Run a block with torch's global CPU generator seeded; the caller's state is kept."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def gaussian_batches(shape: Sequence[int], n: int, seed: int) -> list[tuple[torch.Tensor]]:
    """n single-tensor input tuples of standard normal data (like normalized images/features)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=generator),) for _ in range(n)]


@torch.no_grad()
def randomize_batchnorm(model: nn.Module, residual_branch_ends: list[nn.Module] = ()) -> None:
    """Give every BatchNorm random affine parameters, as training would.

    Freshly initialized BatchNorms are identities (weight 1, bias 0), which makes conv-bn
    folding trivial. The BatchNorms ending a residual branch get a smaller weight, as in
    trained residual networks, where the identity path dominates; without that, a random
    deep network amplifies every rounding error and no quantizer looks good on it.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.weight.uniform_(0.5, 1.5)
            module.bias.normal_(0.0, 0.2)
    for norm in residual_branch_ends:
        norm.weight.mul_(0.25)


@torch.no_grad()
def settle_batchnorm(model: nn.Module, batches: list[tuple]) -> nn.Module:
    """Set every BatchNorm's running statistics to the exact averages over `batches`.

    So the model sees normalized activations, like a trained one, on the zoo's input
    distribution. Returns the model in eval mode.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average
    model.train()
    for args in batches:
        model(*args)
    for norm in norms:
        norm.momentum = 0.1
    return model.eval()


def export_batch_free(model: nn.Module, inputs: tuple) -> torch.fx.GraphModule:
    """``torch.export`` ``model`` at ``inputs`` with dimension 0 (the batch) left free.

    Exported at a batch of one, export specialises the batch size and its guards
    refuse calibration batches of another; export at a batch of two or more.
    """
    import warnings

    free_batch = tuple({0: torch.export.Dim.AUTO} for _ in inputs)
    with warnings.catch_warnings():
        # export's notice that nn.LSTM assigns its flat weights while it is traced
        warnings.filterwarnings("ignore", "The tensor attributes", UserWarning)
        return torch.export.export(model, inputs, dynamic_shapes=free_batch).module()
