"""Finding plugins without importing them.

Plugins are entry points of the group ``qcore.backends``; the entry point's
name is the backend it serves. Reading them touches only package metadata, so
``qcore.list_backends()`` costs a metadata scan and no plugin import.

Two environment variables control autoloading, after pytest's:

* ``QCORE_DISABLE_PLUGIN_AUTOLOAD=1``: read no entry points at all; only
  plugins registered in-process with ``qcore.register_plugin`` are used.
* ``QCORE_BLOCK_PLUGINS=name,name``: never import these plugins. A name is a
  backend name (blocks every plugin serving it), a distribution name
  (``qcore-x86``) or a plugin name (``qcore-x86:x86``). Names are compared
  after PEP 503 normalization, as pip compares distribution names: case is
  ignored and runs of ``-``, ``_`` and ``.`` are equal, so ``qcore-evil2``
  blocks the distribution ``QCore_Evil2``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENTRY_POINT_GROUP = "qcore.backends"
DISABLE_AUTOLOAD_ENV = "QCORE_DISABLE_PLUGIN_AUTOLOAD"
BLOCK_PLUGINS_ENV = "QCORE_BLOCK_PLUGINS"

IN_PROCESS = "<in-process>"


@dataclass(frozen=True)
class PluginSpec:
    """A plugin as found: where it is, not yet what it does.

    ``load`` imports it; for an in-process plugin it returns the object given
    to ``register_plugin``.
    """

    backend: str
    target: str
    distribution: str = IN_PROCESS
    version: str = ""
    _loader: Any = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        """The plugin's unique name: ``distribution:backend``."""
        return f"{self.distribution}:{self.backend}"

    def load(self) -> Any:
        return self._loader()

    def is_blocked_by(self, blocked: frozenset[str]) -> bool:
        """Whether a name in ``blocked`` (already normalized) names this plugin."""
        backend, distribution = normalize(self.backend), normalize(self.distribution)
        return bool({backend, distribution, f"{distribution}:{backend}"} & blocked)


def normalize(name: str) -> str:
    """``name`` PEP 503-normalized: lower case, each run of ``-``, ``_``, ``.`` one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def autoload_disabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("", "0", "false", "no")


def blocked_names(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The names in ``QCORE_BLOCK_PLUGINS``, normalized (a ``dist:backend`` pair
    is normalized on each side of the colon)."""
    raw = environ.get(BLOCK_PLUGINS_ENV, "")
    return frozenset(
        ":".join(normalize(side.strip()) for side in part.split(":", 1))
        for part in raw.split(",")
        if part.strip()
    )


def find_entry_point_plugins() -> list[PluginSpec]:
    """Every plugin of the ``qcore.backends`` group, sorted by backend, then
    distribution, then target, so the order never depends on sys.path."""
    import importlib_metadata

    found: dict[tuple[str, str, str], PluginSpec] = {}
    for entry_point in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = entry_point.dist
        spec = PluginSpec(
            backend=entry_point.name,
            target=entry_point.value,
            distribution=dist.name if dist is not None else "<unknown>",
            version=dist.version if dist is not None else "",
            _loader=entry_point.load,
        )
        # The same distribution seen twice on sys.path is one plugin.
        found.setdefault((spec.backend, spec.distribution, spec.target), spec)
    return [found[key] for key in sorted(found)]


def in_process_spec(plugin: Any, backend: str) -> PluginSpec:
    target = getattr(plugin, "__name__", None) or type(plugin).__qualname__
    return PluginSpec(backend=backend, target=target, _loader=lambda: plugin)
