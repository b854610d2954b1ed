"""A pytest plugin that runs the peers' own suites against qcore.

Loaded with ``-p qcore_peer_adapter`` (``tests/peer_suite`` on ``PYTHONPATH``) by
``tox -e peersuite``. It swaps the peers' prepare/convert/fuse entry points for
qcore's, wherever the suites and their helpers bound them, and nothing else:
the tests' own arguments reach qcore unchanged.
"""
from __future__ import annotations

import importlib

import qcore

FX_ENTRY_POINTS = (
    "prepare_fx",
    "prepare_qat_fx",
    "convert_fx",
    "convert_to_reference_fx",
    "fuse_fx",
)
PT2E_ENTRY_POINTS = ("prepare_pt2e", "prepare_qat_pt2e", "convert_pt2e")

# Where the peers and their test helpers bind the entry points.
FX_HOMES = (
    "torch.ao.quantization.quantize_fx",
    "torch.testing._internal.common_quantization",
)
PT2E_HOMES = (
    "torchao.quantization.pt2e.quantize_pt2e",
    "torchao.quantization.pt2e",
    "torchao.testing.pt2e.utils",
)


def _swap(module_names: tuple[str, ...], names: tuple[str, ...]) -> None:
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in names:
            if hasattr(module, name):
                setattr(module, name, getattr(qcore, name))


def pytest_configure(config) -> None:
    _swap(FX_HOMES, FX_ENTRY_POINTS)
    _swap(PT2E_HOMES, PT2E_ENTRY_POINTS)


def pytest_collection_modifyitems(session, config, items) -> None:
    for module in {item.module for item in items if getattr(item, "module", None)}:
        _swap_in(module, FX_ENTRY_POINTS + PT2E_ENTRY_POINTS)


def _swap_in(module, names) -> None:
    for name in names:
        if hasattr(module, name):
            setattr(module, name, getattr(qcore, name))
