"""Which backends this environment installed, for tests that run per backend.

Each tox environment installs a different set of plugins; a test parametrized
over backends skips the ones that are not here (tests/test_installed_plugins.py
checks that exactly the expected ones are).
"""

import pytest

import qcore

FIRST_PARTY = ("fbgemm", "qnnpack", "x86")


def installed(name: str) -> bool:
    """The backend loads here and has patterns ("native" with no plugin has none)."""
    try:
        backend = qcore.get_backend(name)
    except (qcore.UnknownBackendError, qcore.BackendLoadError):
        return False
    return bool(backend.config.configs)


def backend_params(names=FIRST_PARTY) -> list:
    """``names`` as pytest params, each skipped where its backend is not installed."""
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(not installed(name), reason=f"backend {name!r} not installed"),
        )
        for name in names
    ]


requires_fbgemm = pytest.mark.skipif(not installed("fbgemm"), reason="needs the fbgemm plugin")
requires_qnnpack = pytest.mark.skipif(not installed("qnnpack"), reason="needs the qnnpack plugin")
