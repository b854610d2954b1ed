"""Calibration batches as users have them: what ``qcore.quantize`` runs the model on.

Each batch becomes the arguments of one call of the prepared model:

* a tensor: the one positional input, ``model(batch)``;
* a tuple or a list (what a DataLoader yields for ``(x, y)`` samples): the
  positional inputs, in order. Trailing items beyond the parameters the model's
  ``forward`` takes (labels, targets) are dropped; a ``forward(*args)`` takes them all;
* a dict: keyword arguments, ``model(**batch)``; every key must be a parameter of
  ``forward`` (or ``forward`` takes ``**kwargs``);
* with ``input_fn``: ``input_fn(batch)`` gives the arguments instead, read by the
  same rules except that a tuple is taken as it is, nothing dropped.

A batch that does not fit ``forward`` is a TypeError naming the batch's index,
what it holds and what ``forward`` takes, before the model runs on it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch

from qcore.config.errors import raise_prefixed

__all__ = ["calibrate", "calibration_calls", "raise_in_batch"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _summary(value: Any, depth: int = 0) -> str:
    """What a batch holds, by type and shape, never by contents."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if depth < 2 and isinstance(value, (tuple, list)):
        items = ", ".join(_summary(item, depth + 1) for item in value[:4])
        more = ", ..." if len(value) > 4 else ""
        return f"a {type(value).__name__} of {len(value)} ({items}{more})"
    if depth < 2 and isinstance(value, dict):
        items = ", ".join(f"{key!r}: {_summary(item, depth + 1)}" for key, item in value.items())
        return f"a dict ({items})"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


class _Forward:
    """The model's ``forward`` signature, and how batches bind to it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.name = f"{type(model).__name__}.forward"
        try:
            self.signature: inspect.Signature | None = inspect.signature(model.forward)
        except (TypeError, ValueError):  # a builtin or C forward: let the call decide
            self.signature = None
        params = list(self.signature.parameters.values()) if self.signature else []
        kinds = {param.kind for param in params}
        self.varargs = self.signature is None or inspect.Parameter.VAR_POSITIONAL in kinds
        self.positional = sum(param.kind in _POSITIONAL for param in params)
        # None: any name binds (forward takes **kwargs), or the call decides
        self.keywords = (
            None
            if self.signature is None or inspect.Parameter.VAR_KEYWORD in kinds
            else {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
        )

    def describe(self) -> str:
        return f"{self.name}{self.signature}" if self.signature else self.name

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.signature is not None:
            self.signature.bind(*args, **kwargs)


def _arguments(value: Any, forward: _Forward, drop_extra: bool) -> tuple[tuple, dict]:
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, (tuple, list)):
        if drop_extra and not forward.varargs:
            value = value[: forward.positional]
        return tuple(value), {}
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError("a dict batch must have str keys (forward's parameter names)")
        unknown = [
            key for key in value if forward.keywords is not None and key not in forward.keywords
        ]
        if unknown:
            raise TypeError(f"forward takes no parameter named {', '.join(map(repr, unknown))}")
        return (), dict(value)
    raise TypeError(f"a {type(value).__name__} is not a tensor, a tuple, a list or a dict")


def calibration_calls(
    model: torch.nn.Module,
    calibration_data: Iterable[Any],
    input_fn: Callable[[Any], Any] | None = None,
) -> Iterator[tuple[tuple, dict[str, Any]]]:
    """``(args, kwargs)`` for each batch of ``calibration_data``, by the rules above,
    checked against ``model.forward``'s signature.

    Example::

        >>> loader = [(torch.randn(8, 16), torch.zeros(8))]    # (x, y) pairs
        >>> [args[0].shape for args, _ in calibration_calls(model, loader)]
        [torch.Size([8, 16])]
    """
    if input_fn is not None and not callable(input_fn):
        raise TypeError(
            f"input_fn: got {_summary(input_fn)}; expected a function mapping a calibration "
            "batch to the model's arguments (a tensor, a tuple of positional inputs or a dict)"
        )
    if isinstance(calibration_data, (torch.Tensor, dict, str, bytes)) or not isinstance(
        calibration_data, Iterable
    ):
        raise TypeError(
            f"calibration_data: got {_summary(calibration_data)}; expected an iterable of "
            "batches (a list, a DataLoader), e.g. [x1, x2] or [(x1, y1), (x2, y2)]"
        )
    forward = _Forward(model)
    index = -1
    for index, batch in enumerate(calibration_data):
        value = batch if input_fn is None else input_fn(batch)
        try:
            args, kwargs = _arguments(value, forward, drop_extra=input_fn is None)
            forward.bind(args, kwargs)
        except TypeError as error:
            source = "" if input_fn is None else f", which input_fn turned into {_summary(value)}"
            raise TypeError(
                f"calibration batch {index}: got {_summary(batch)}{source}; expected the "
                f"arguments of {forward.describe()} ({error}): a tensor, a tuple or list of "
                "positional inputs (trailing items forward does not take, such as labels, are "
                "dropped), a dict of keyword arguments, or pass input_fn= to map each batch "
                "to them"
            ) from None
        yield args, kwargs
    if index < 0:
        # Observers that saw nothing give qparams for an empty range: a model near
        # 0 dB, with only a warning per observer.
        raise ValueError(
            f"calibration_data: got {_summary(calibration_data)}, which gave no batches; "
            "expected at least one (a generator can be iterated once only: pass a list)"
        )


def raise_in_batch(error: Exception, index: int) -> NoReturn:
    """Raise ``error``, raised by the model on calibration batch ``index``, saying
    which batch, as calibration_calls' own errors do."""
    raise_prefixed(error, f"calibration batch {index}")


def calibrate(prepared: Callable[..., Any], calls: Iterable[tuple[tuple, dict]]) -> None:
    """Run ``prepared`` on each ``(args, kwargs)`` of ``calls`` (what
    :func:`calibration_calls` gives) without gradients; an error names its batch."""
    with torch.no_grad():
        for index, (args, kwargs) in enumerate(calls):
            try:
                prepared(*args, **kwargs)
            except Exception as error:
                raise_in_batch(error, index)
