"""Fuser methods: turn a matched module sequence into one (fused) module.

A fuser method is what ``BackendPatternConfig.set_fuser_method`` takes. The
engine calls it as ``fuser(is_qat, *modules)`` with the matched modules in
forward order (``conv, bn, relu``) and puts the returned module in place of
the sequence. ``is_qat`` says whether the model is prepared for
quantization-aware training.

Two kinds are provided, with the same behaviour as torch.ao's fuser methods:

* **BatchNorm folding** -- :func:`fuse_conv_bn`, :func:`fuse_conv_bn_relu`,
  :func:`fuse_linear_bn`, :func:`fuse_convtranspose_bn`. For post-training
  quantization (``is_qat=False``, modules in eval mode) the BatchNorm is folded
  into the weights and bias of the conv/linear with ``torch.nn.utils.fusion``;
  for QAT (modules in training mode) the modules are wrapped in the intrinsic
  ``ConvBn*d`` / ``ConvBnReLU*d`` / ``LinearBn1d`` module, which QAT later
  swaps for its trainable counterpart.
* **Sequential** -- :func:`sequential_fuser` makes a fuser that wraps the
  modules in a given ``torch.ao.nn.intrinsic`` class (``ConvReLU2d``,
  ``LinearReLU``, ``BNReLU2d``, ...), whatever ``is_qat`` is. The fusers for
  the standard classes are also module attributes (:data:`fuse_conv2d_relu`,
  ...), so every backend shares the same function objects: two plugins that
  configure the same pattern then agree on its fuser.

A module sequence that cannot be fused raises :class:`FusionError`, naming the
fuser, the modules and what was expected.

Example (a backend vendor's pattern config)::

    >>> from qcore.config.fusers import fuse_conv_bn_relu, sequential_fuser
    >>> (BackendPatternConfig((nn.Conv2d, nn.BatchNorm2d, nn.ReLU))
    ...     .set_fuser_method(fuse_conv_bn_relu)
    ...     .set_fused_module(nni.ConvBnReLU2d))
    >>> fuse_linear_tanh = sequential_fuser(nni.LinearTanh)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.ao.nn.intrinsic as nni
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

__all__ = [
    "FusionError",
    "fuse_conv_bn",
    "fuse_conv_bn_relu",
    "fuse_convtranspose_bn",
    "fuse_linear_bn",
    "sequential_fuser",
    "fuse_conv1d_relu",
    "fuse_conv2d_relu",
    "fuse_conv3d_relu",
    "fuse_linear_relu",
    "fuse_bn2d_relu",
    "fuse_bn3d_relu",
    "fuse_linear_leaky_relu",
    "fuse_linear_tanh",
]

Fuser = Callable[..., nn.Module]


class FusionError(ValueError):
    """A module sequence cannot be fused as asked; the message says why."""


# The fused module built for QAT, and the ReLU-fused module for the eval path,
# keyed by the exact conv class (as torch.ao does: a subclass is not assumed
# to be fusable).
_CONV_BN_QAT = {nn.Conv1d: nni.ConvBn1d, nn.Conv2d: nni.ConvBn2d, nn.Conv3d: nni.ConvBn3d}
_CONV_BN_RELU_QAT = {
    nn.Conv1d: nni.ConvBnReLU1d,
    nn.Conv2d: nni.ConvBnReLU2d,
    nn.Conv3d: nni.ConvBnReLU3d,
}
_CONV_RELU = {nn.Conv1d: nni.ConvReLU1d, nn.Conv2d: nni.ConvReLU2d, nn.Conv3d: nni.ConvReLU3d}


def _name(module: nn.Module) -> str:
    return f"{type(module).__name__}({module.extra_repr()})"


def _mode(module: nn.Module) -> str:
    return "training" if module.training else "eval"


def _check_same_mode(fuser: str, *modules: nn.Module) -> None:
    if len({module.training for module in modules}) > 1:
        modes = ", ".join(f"{_name(m)} in {_mode(m)} mode" for m in modules)
        raise FusionError(
            f"{fuser}: got {modes}; expected all modules in the same mode "
            "(call .train() or .eval() on the whole model before fusing)"
        )


def _check_eval(fuser: str, *modules: nn.Module) -> None:
    if any(module.training for module in modules):
        modes = ", ".join(f"{_name(m)} in {_mode(m)} mode" for m in modules)
        raise FusionError(
            f"{fuser}: got {modes} with is_qat=False; expected eval mode for post-training "
            "fusion, which folds the BatchNorm into the weights (call model.eval(), or fuse "
            "with is_qat=True for quantization-aware training)"
        )


def _check_bn_for_qat(fuser: str, bn: nn.Module, out_name: str, out: int, owner: nn.Module):
    if bn.num_features != out:
        raise FusionError(
            f"{fuser}: got {_name(owner)} with {out_name}={out} and {_name(bn)} with "
            f"num_features={bn.num_features}; expected them equal"
        )
    if not bn.affine:
        raise FusionError(
            f"{fuser}: got {_name(bn)} with affine=False; expected affine=True for QAT fusion"
        )
    if not bn.track_running_stats:
        raise FusionError(
            f"{fuser}: got {_name(bn)} with track_running_stats=False; expected "
            "track_running_stats=True for QAT fusion"
        )


def _lookup(fuser: str, table: dict[type, type], module: nn.Module) -> type:
    fused = table.get(type(module))
    if fused is None:
        expected = ", ".join(cls.__name__ for cls in table)
        raise FusionError(f"{fuser}: got {_name(module)}; expected one of {expected}")
    return fused


def fuse_conv_bn(is_qat: bool, conv: nn.Module, bn: nn.Module) -> nn.Module:
    """Fuse ``ConvNd`` and ``BatchNormNd`` (N = 1, 2, 3).

    ``is_qat=False``: returns a copy of ``conv`` with ``bn`` folded into its
    weight and bias (both modules must be in eval mode).
    ``is_qat=True``: returns ``nni.ConvBnNd(conv, bn)``.

    Example::

        >>> fuse_conv_bn(False, nn.Conv2d(3, 8, 3).eval(), nn.BatchNorm2d(8).eval())
        Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1))
    """
    _check_same_mode("fuse_conv_bn", conv, bn)
    if is_qat:
        fused = _lookup("fuse_conv_bn", _CONV_BN_QAT, conv)
        _check_bn_for_qat("fuse_conv_bn", bn, "out_channels", conv.out_channels, conv)
        return fused(conv, bn)
    _check_eval("fuse_conv_bn", conv, bn)
    if not isinstance(conv, tuple(_CONV_BN_QAT)):
        raise FusionError(
            f"fuse_conv_bn: got {_name(conv)}; expected a Conv1d, Conv2d or Conv3d "
            "(use fuse_convtranspose_bn for a transposed conv)"
        )
    return fuse_conv_bn_eval(conv, bn)


def fuse_conv_bn_relu(is_qat: bool, conv: nn.Module, bn: nn.Module, relu: nn.Module) -> nn.Module:
    """Fuse ``ConvNd``, ``BatchNormNd`` and ``ReLU`` (N = 1, 2, 3).

    ``is_qat=False``: returns ``nni.ConvReLUNd(folded conv, relu)``, the
    BatchNorm folded into the conv's weight and bias (eval mode required).
    ``is_qat=True``: returns ``nni.ConvBnReLUNd(conv, bn, relu)``.
    """
    _check_same_mode("fuse_conv_bn_relu", conv, bn, relu)
    if is_qat:
        fused = _lookup("fuse_conv_bn_relu", _CONV_BN_RELU_QAT, conv)
        _check_bn_for_qat("fuse_conv_bn_relu", bn, "out_channels", conv.out_channels, conv)
        return fused(conv, bn, relu)
    _check_eval("fuse_conv_bn_relu", conv, bn, relu)
    fused = _lookup("fuse_conv_bn_relu", _CONV_RELU, conv)
    return fused(fuse_conv_bn_eval(conv, bn), relu)


def fuse_linear_bn(is_qat: bool, linear: nn.Module, bn: nn.Module) -> nn.Module:
    """Fuse ``Linear`` and ``BatchNorm1d``.

    ``is_qat=False``: returns a copy of ``linear`` with ``bn`` folded into its
    weight and bias (eval mode required).
    ``is_qat=True``: returns ``nni.LinearBn1d(linear, bn)``.
    """
    _check_same_mode("fuse_linear_bn", linear, bn)
    if is_qat:
        _check_bn_for_qat("fuse_linear_bn", bn, "out_features", linear.out_features, linear)
        return nni.LinearBn1d(linear, bn)
    _check_eval("fuse_linear_bn", linear, bn)
    return fuse_linear_bn_eval(linear, bn)


def fuse_convtranspose_bn(is_qat: bool, convt: nn.Module, bn: nn.Module) -> nn.Module:
    """Fuse ``ConvTransposeNd`` and ``BatchNormNd`` for post-training quantization.

    ``is_qat=False``: returns a copy of ``convt`` with ``bn`` folded into its
    weight and bias (eval mode required). QAT fusion of a transposed conv is
    not supported (as in torch.ao) and raises :class:`FusionError`.
    """
    _check_same_mode("fuse_convtranspose_bn", convt, bn)
    if is_qat:
        raise FusionError(
            f"fuse_convtranspose_bn: got {_name(convt)} and {_name(bn)} with is_qat=True; "
            "expected is_qat=False (ConvTranspose + BatchNorm fusion is not supported for "
            "quantization-aware training)"
        )
    _check_eval("fuse_convtranspose_bn", convt, bn)
    return fuse_conv_bn_eval(convt, bn, transpose=True)


@functools.cache
def sequential_fuser(fused_class: type[nn.Module]) -> Fuser:
    """A fuser that returns ``fused_class(*modules)``, ignoring ``is_qat``.

    ``fused_class`` is a ``torch.ao.nn.intrinsic`` sequential class such as
    ``ConvReLU2d`` or ``LinearReLU``; it checks the module types itself, and a
    wrong type is reported as a :class:`FusionError`. The same class always
    gives the same function object, so configs built separately compare equal.

    Example::

        >>> fuse = sequential_fuser(nni.LinearReLU)
        >>> fuse(False, nn.Linear(4, 4), nn.ReLU())
        LinearReLU(...)
    """
    if not (isinstance(fused_class, type) and issubclass(fused_class, nn.Module)):
        raise TypeError(
            f"sequential_fuser: got {fused_class!r}; expected a torch.nn.Module subclass such "
            "as torch.ao.nn.intrinsic.ConvReLU2d"
        )
    name = f"fuse_into_{fused_class.__name__}"

    def fuser(is_qat: bool, *modules: nn.Module) -> nn.Module:
        try:
            return fused_class(*modules)
        except (AssertionError, TypeError) as error:
            got = ", ".join(_name(m) if isinstance(m, nn.Module) else repr(m) for m in modules)
            raise FusionError(
                f"{name}: got ({got}); expected modules that "
                f"{fused_class.__module__}.{fused_class.__qualname__} accepts ({error})"
            ) from error

    fuser.__name__ = fuser.__qualname__ = name
    fuser.__doc__ = f"Fuse modules into ``{fused_class.__qualname__}(*modules)``."
    fuser.fused_class = fused_class  # type: ignore[attr-defined]
    return fuser


fuse_conv1d_relu = sequential_fuser(nni.ConvReLU1d)
"""``(Conv1d, ReLU)`` -> ``nni.ConvReLU1d``."""
fuse_conv2d_relu = sequential_fuser(nni.ConvReLU2d)
"""``(Conv2d, ReLU)`` -> ``nni.ConvReLU2d``."""
fuse_conv3d_relu = sequential_fuser(nni.ConvReLU3d)
"""``(Conv3d, ReLU)`` -> ``nni.ConvReLU3d``."""
fuse_linear_relu = sequential_fuser(nni.LinearReLU)
"""``(Linear, ReLU)`` -> ``nni.LinearReLU``."""
fuse_bn2d_relu = sequential_fuser(nni.BNReLU2d)
"""``(BatchNorm2d, ReLU)`` -> ``nni.BNReLU2d``."""
fuse_bn3d_relu = sequential_fuser(nni.BNReLU3d)
"""``(BatchNorm3d, ReLU)`` -> ``nni.BNReLU3d``."""
fuse_linear_leaky_relu = sequential_fuser(nni.LinearLeakyReLU)
"""``(Linear, LeakyReLU)`` -> ``nni.LinearLeakyReLU`` (onednn)."""
fuse_linear_tanh = sequential_fuser(nni.LinearTanh)
"""``(Linear, Tanh)`` -> ``nni.LinearTanh`` (onednn)."""
