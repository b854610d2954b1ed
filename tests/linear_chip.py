"""A vendor backend "chip" with one Linear pattern and one kernel, registered in a
fresh registry: the kernel tests' plugin (trial run, output qparams, SystemExit)."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch

import qcore
from qcore import BackendPatternConfig, DTypeConfig, ObservationType, hookimpl
from qcore.config.qconfig import get_default_qconfig
from qcore.plugin import BackendRegistry
from qcore.plugin.kernels import Kernel

INT8 = DTypeConfig(torch.quint8, torch.quint8, torch.qint8, torch.float)


def linear_chip(lower: Callable, *, default_mapping: bool = False) -> types.ModuleType:
    """A plugin module: Linear (int8, torch.ao's reference module) and the kernel
    ``chip.linear`` built by ``lower``; with ``default_mapping``, x86's QConfig as
    the backend's default mapping (what ``qcore check`` quantizes with)."""
    plugin = types.ModuleType("chip_plugin")
    plugin.QCORE_PLUGIN_API_VERSION = 1

    @hookimpl
    def qcore_backend_pattern_configs(backend):
        return [
            BackendPatternConfig(torch.nn.Linear)
            .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
            .add_dtype_config(INT8)
            .set_root_module(torch.nn.Linear)
            .set_reference_quantized_module(torch.ao.nn.quantized.reference.Linear)
        ]

    @hookimpl
    def qcore_backend_kernels(backend):
        return [Kernel("chip.linear", torch.nn.Linear, "chip", lower)]

    plugin.qcore_backend_pattern_configs = qcore_backend_pattern_configs
    plugin.qcore_backend_kernels = qcore_backend_kernels
    if default_mapping:

        @hookimpl
        def qcore_default_qconfig_mapping(backend, is_qat):
            return qcore.QConfigMapping().set_global(get_default_qconfig("x86"))

        plugin.qcore_default_qconfig_mapping = qcore_default_qconfig_mapping
    return plugin


def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> BackendRegistry:
    """qcore's registry for this test: no installed plugin, the chip's alone."""
    fresh = BackendRegistry(find=lambda: [])
    monkeypatch.setattr(qcore.plugin, "_default_registry", fresh)
    return fresh
