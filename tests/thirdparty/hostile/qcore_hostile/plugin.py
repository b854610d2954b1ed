"""The ``hostile`` backend: misbehaves as the environment variable QCORE_HOSTILE says.

Each value is one way a real plugin can go wrong; tests/test_hostile_plugins.py
tries every one (HOSTILE_BEHAVIOURS there) and checks that qcore, the other
backends and "native" survive it. Unset, the plugin is well behaved.
"""

import os
import time

import torch

from qcore import BackendPatternConfig, Kernel, hookimpl
from qcore_hostile.common import INT8

MODE = os.environ.get("QCORE_HOSTILE", "")

QCORE_PLUGIN_API_VERSION = 0 if MODE == "old-api" else 1


class HostileBaseException(BaseException):
    """Neither an Exception nor SystemExit: what a careless SDK may raise."""


if MODE == "exit-import":
    raise SystemExit(3)
if MODE == "base-exception-import":
    raise HostileBaseException("raised at import")
if MODE == "import-error":
    import qcore_hostile_missing_dependency  # noqa: F401
if MODE == "slow-import":
    time.sleep(float(os.environ.get("QCORE_HOSTILE_SLEEP", "5")))


@hookimpl
def qcore_backend_pattern_configs(backend):
    if MODE == "exit-hook":
        raise SystemExit(3)
    if MODE == "base-exception-hook":
        raise HostileBaseException("raised in a hook")
    if MODE == "hook-error":
        raise RuntimeError("vendor SDK not initialised")
    if MODE == "no-pattern":
        return [BackendPatternConfig().add_dtype_config(INT8)]
    if MODE == "not-a-list":
        return 42
    if MODE == "wrong-item":
        return ["Linear"]
    return [BackendPatternConfig(torch.nn.Linear).add_dtype_config(INT8)]


@hookimpl
def qcore_backend_kernels(backend):
    if MODE == "bad-kernel":
        return [Kernel(name="hostile.linear", pattern=42, engine="hostile")]
    return []


@hookimpl
def qcore_default_qconfig_mapping(backend, is_qat):
    if MODE == "mapping-str":
        return "x86"
    if MODE == "mapping-dict":
        return {"": None}
    return None


@hookimpl
def qcore_backend_quantizer(backend, is_qat):
    if MODE == "quantizer-str":
        return "x86"
    return None


if MODE == "misspelled-hook":

    @hookimpl
    def qcore_backend_kernel(backend):
        return []
