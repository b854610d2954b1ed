"""torch.ao's HistogramObserver, named in a porting user's QConfig, built as qcore's.

A user porting from torch.ao passes ``torch.ao.quantization.get_default_qconfig_mapping``,
whose activations are torch.ao's ``HistogramObserver``: its qparam search walks the
candidates in Python (tens of ms per observer, 11 s for 800 conv-bn-relu blocks
against 3 s with qcore's mapping). :func:`fast_constructor` turns a constructor
that builds torch.ao's ``HistogramObserver`` into one that builds qcore's
(:class:`qcore.observers.HistogramObserver`) with the same arguments: the same
histogram, range search and qparams on finite data (``tests/test_observers.py``,
``tests/test_porting_observers.py``), the same buffers (``state_dict`` keys), and
qcore's handling of NaN and ±inf (skipped and counted; torch.ao's fails in
``torch.histc``).

What is swapped, and why only that:

* Exactly ``torch.ao.quantization.observer.HistogramObserver``: a user's subclass
  keeps its own class (it may override anything), and so does any constructor
  this module cannot see through (a lambda, a user's function or factory).
  Constructors are seen through ``with_args``/``with_callable_args`` wrappers
  (torch.ao's and qcore's) and ``functools.partial``; every bound argument and
  callable argument is kept.
* Not MinMaxObserver, PerChannelMinMaxObserver or the moving-average ones. Their
  work is one ``aminmax`` per batch, which torch.ao's do as fast as qcore's (qcore's
  add the NaN/±inf checks, slightly slower), so there is nothing to gain; and
  torch.ao's peer suite counts them by exact class in prepared graphs
  (``ns.call_module(torch.ao.quantization.MinMaxObserver)`` uses ``type(module)``), in
  tests qcore passes today. The HistogramObserver is where the time goes. The peer
  tests that count torch.ao's HistogramObserver by class (``test_functional_conv``,
  ``test_functional_linear``) also assert torch.ao's quantized functional ops, so they
  are listed peer-name failures already.
* torchao's PT2E observers (``torchao.quantization.pt2e.observer``), built by a
  torchao Quantizer's annotations, are left as torchao builds them
  (:func:`qcore.pt2e.foreign.observer_like_torchao`).
"""

from __future__ import annotations

import functools
from typing import Any

from torch.ao.quantization import observer as _torch_ao

from qcore.observers.base import PartialConstructor
from qcore.observers.histogram import HistogramObserver

__all__ = ["SUBSTITUTES", "fast_constructor"]

#: torch.ao's observer class -> qcore's, taking the same constructor arguments.
SUBSTITUTES: dict[type, type] = {_torch_ao.HistogramObserver: HistogramObserver}

# Wrappers with a ``p`` (functools.partial) and ``callable_args``, rebuilt around
# the substitute: torch.ao's with_args/with_callable_args, qcore's PartialConstructor.
_WRAPPERS = (_torch_ao._PartialWrapper, PartialConstructor)
_DEPTH = 16  # with_args chains nest one wrapper and one partial per call


def _rebuilt(ctr: Any, depth: int) -> Any:
    """``ctr`` building the substitute instead, or None when it does not build
    exactly one of :data:`SUBSTITUTES` through wrappers this module knows."""
    if depth > _DEPTH:
        return None
    if isinstance(ctr, type):
        return SUBSTITUTES.get(ctr)  # exact class: a subclass is the user's own
    if type(ctr) is functools.partial:
        inner = _rebuilt(ctr.func, depth + 1)
        return None if inner is None else functools.partial(inner, *ctr.args, **ctr.keywords)
    if type(ctr) in _WRAPPERS:
        inner = _rebuilt(ctr.p, depth + 1)
        if inner is None:
            return None
        result = type(ctr)(inner)
        result.callable_args = dict(ctr.callable_args)
        return result
    return None


def fast_constructor(ctr: Any) -> Any:
    """A constructor building qcore's observer where ``ctr`` builds torch.ao's
    ``HistogramObserver`` (the class itself or through ``with_args``), with the same
    arguments; otherwise ``ctr`` itself."""
    rebuilt = _rebuilt(ctr, 0)
    return ctr if rebuilt is None else rebuilt
