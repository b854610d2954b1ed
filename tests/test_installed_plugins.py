"""What a user sees with the plugins a tox environment installed for real.

Each tox environment names the backends it installed in QCORE_EXPECTED_BACKENDS
("none" for qcore alone); outside tox these tests are skipped.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import qcore

EXPECTED = os.environ.get("QCORE_EXPECTED_BACKENDS")
pytestmark = pytest.mark.skipif(EXPECTED is None, reason="run by tox, which installs the plugins")
EXPECTED_NAMES = set() if EXPECTED in (None, "none") else set(EXPECTED.split(","))
BROKEN = {name for name in EXPECTED_NAMES if name.startswith("broken-")}
HEALTHY = EXPECTED_NAMES - BROKEN
# torch.ao's pattern counts, and channel_shuffle (module and function) in every family
NATIVE_COUNTS = {"fbgemm": 194, "qnnpack": 192, "x86": 194, "onednn": 223}
DISTRIBUTION = {"fbgemm": "qcore-fbgemm", "qnnpack": "qcore-qnnpack", "x86": "qcore-x86"}
DISTRIBUTION["onednn"] = "qcore-x86"  # the x86 plugin's second entry point


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "qcore", *args], capture_output=True, text=True, timeout=120
    )


def test_exactly_the_installed_backends_are_listed():
    assert set(qcore.list_backends()) == EXPECTED_NAMES | {"native"}


def test_listing_imports_no_plugin():
    code = (
        "import sys, qcore; qcore.list_backends(); "
        "print([m for m in sys.modules if m.startswith('qcore_')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_asking_for_a_backend_imports_only_its_plugins(name):
    serving = {
        plugin.spec.target.split(".")[0]
        for plugin in qcore.plugin.default_registry().plugins()
        if plugin.spec.backend == name
    }
    code = (
        f"import sys, qcore; qcore.get_backend({name!r}); "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('qcore_') and '.' not in m)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert set(out.stdout.split()) == serving


@pytest.mark.parametrize("name", sorted(NATIVE_COUNTS))
def test_first_party_backend_pattern_counts(name):
    if name not in EXPECTED_NAMES:
        with pytest.raises(qcore.UnknownBackendError, match=f"pip install {DISTRIBUTION[name]}"):
            qcore.get_backend(name)
        return
    config = qcore.get_backend_config(name)
    assert len(config.configs) == NATIVE_COUNTS[name]
    # A vendor may add to a first-party backend (tests/thirdparty/mychip adds to x86).
    distributions = {plugin.spec.distribution for plugin in qcore.get_backend(name).plugins}
    assert DISTRIBUTION[name] in distributions


def test_native_is_the_union_of_the_installed_backends():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)  # broken plugins are reported
        native = qcore.get_backend("native")
    union = set()
    for name in HEALTHY:
        union |= {repr(c.pattern_complex_format) for c in qcore.get_backend(name).config.configs}
    assert {repr(c.pattern_complex_format) for c in native.config.configs} == union
    if not HEALTHY:
        assert native.config.configs == []


def test_native_accepts_linear_relu_under_qnnpack_symmetric_qconfig():
    if EXPECTED_NAMES != {"fbgemm", "qnnpack", "x86", "onednn"}:
        pytest.skip("needs all three first-party plugins")
    from torch.ao.quantization import default_symmetric_qnnpack_qconfig
    from torch.ao.quantization.backend_config import get_native_backend_config

    from qcore.config.torch_ao import import_torch_ao_backend_config

    import_torch_ao_backend_config()

    from qcore.config.compat import accepts
    from qcore.config.torch_ao import from_torch_ao

    pattern = (torch.nn.Linear, torch.nn.ReLU)
    native = qcore.get_backend_config("native")
    assert accepts(native, pattern, default_symmetric_qnnpack_qconfig)
    # torch.ao's hand-copied native config drops qnnpack's symmetric qint8 configs.
    assert not accepts(
        from_torch_ao(get_native_backend_config()), pattern, default_symmetric_qnnpack_qconfig
    )


def test_cli_backends_lists_without_importing():
    result = run_cli("backends")
    assert result.returncode == 0, result.stderr  # nothing imported: nothing found broken
    table = result.stdout.split("\n\n")[0]
    rows = [line.split() for line in table.splitlines()[2:]]
    assert {row[0] for row in rows} == EXPECTED_NAMES | {"native"}
    assert all(row[-2:] == ["not", "loaded"] for row in rows), result.stdout


def test_cli_backends_table():
    result = run_cli("backends", "--load")
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "VERSION", "PATTERNS", "KERNELS", "STATUS"]
    rows = {line.split()[0]: line for line in lines[2:] if line and not line.startswith(" ")}
    for name in HEALTHY & set(NATIVE_COUNTS):
        assert DISTRIBUTION[name] in rows[name] and str(NATIVE_COUNTS[name]) in rows[name]
        assert rows[name].rstrip().endswith("ok")
    for name in BROKEN:
        assert "failed" in rows[name]
    assert result.returncode == (1 if BROKEN else 0), result.stderr
    if not EXPECTED_NAMES:
        assert "No backend plugins are installed" in result.stdout
    if BROKEN:
        assert "leaves out " in rows["native"] and "(failed)" in rows["native"]
        blocked = ",".join(f"qcore-broken:{name}" for name in sorted(BROKEN))
        assert f"QCORE_BLOCK_PLUGINS={blocked}" in result.stdout
        # Blocked, the broken plugins are not broken: exit 0.
        env = dict(os.environ, QCORE_BLOCK_PLUGINS="qcore-broken")
        quiet = subprocess.run(
            [sys.executable, "-m", "qcore", "backends", "--load"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert quiet.returncode == 0, quiet.stdout + quiet.stderr


def test_cli_backends_json_matches_the_api():
    rows = json.loads(run_cli("backends", "--load", "--json").stdout)
    assert {row["name"] for row in rows} == EXPECTED_NAMES | {"native"}


def test_cli_show():
    if not HEALTHY:
        result = run_cli("show", "x86")
        assert result.returncode == 3 and "pip install qcore-x86" in result.stderr
        return
    name = sorted(HEALTHY)[0]
    result = run_cli("show", name)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"backend {name}: ")
    assert "dtypes:" in result.stdout
    assert run_cli("show", "no-such-backend").returncode == 3


thirdparty = pytest.mark.skipif(not BROKEN, reason="the thirdparty tox environment")


@thirdparty
def test_third_party_backend_is_discovered_like_any_other():
    backend = qcore.get_backend("mychip")
    assert backend.plugins[0].spec.distribution == "qcore-mychip"
    assert backend.plugins[0].spec.version == "0.3.1"
    assert [c.describe_pattern() for c in backend.config.configs] == [
        "Linear",
        "(Conv2d, ReLU)",
        "ConvReLU2d",
    ]


@thirdparty
def test_a_vendor_adds_a_dtype_config_to_a_backend_it_does_not_own():
    backend = qcore.get_backend("x86")
    # The backend's owner ranks first, though qcore-mychip sorts before it.
    assert [p.spec.distribution for p in backend.plugins] == ["qcore-x86", "qcore-mychip"]
    linear = backend.config.get(torch.nn.Linear)
    constrained = [
        d for d in linear.dtype_configs if d.input_dtype_with_constraints.has_constraints
    ]
    assert (
        constrained and constrained[0].input_dtype_with_constraints.scale_min_lower_bound == 2**-12
    )
    assert linear.root_module is torch.nn.Linear and linear.qat_module is not None


@thirdparty
@pytest.mark.parametrize(
    "name, cause, text",
    [
        ("broken-import", ModuleNotFoundError, "qcore_broken_missing_dependency"),
        ("broken-hook", RuntimeError, "raised in qcore_backend_pattern_configs"),
        (
            "broken-api",
            qcore.PluginAPIVersionError,
            "written for plugin API 0; this qcore implements plugin API 1",
        ),
    ],
)
def test_a_broken_plugin_fails_alone_with_its_cause(name, cause, text):
    with pytest.raises(qcore.BackendLoadError, match=text) as error:
        qcore.get_backend(name)
    assert isinstance(error.value.__cause__, cause)
    assert "qcore-broken:" + name in str(error.value)
    assert len(qcore.get_backend("mychip").config.configs) == 3


@thirdparty
def test_native_leaves_out_broken_backends_with_one_warning():
    registry = qcore.plugin.BackendRegistry()
    with pytest.warns(qcore.QCoreWarning, match="failed to load") as record:
        native = registry.get("native")
    assert len([w for w in record if "failed to load" in str(w.message)]) == 1
    assert {p.spec.backend for p in native.plugins} == HEALTHY
    assert HEALTHY == {"acme", "mychip", "onednn", "x86"}
    assert sorted(name for name, _ in native.left_out) == sorted(BROKEN)


@thirdparty
def test_blocking_a_plugin_by_environment_variable():
    code = "import qcore; print(qcore.get_backend('x86').plugins[0].spec.distribution)"
    env = dict(os.environ, QCORE_BLOCK_PLUGINS="qcore-mychip")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "qcore-x86", out.stderr
    env = dict(os.environ, QCORE_DISABLE_PLUGIN_AUTOLOAD="1")
    out = subprocess.run(
        [sys.executable, "-c", "import qcore; print(qcore.list_backends())"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "['native']"


@thirdparty
def test_a_vendor_ignoring_backend_does_not_decide_native():
    """qcore-acme answers every hook whatever `backend` says, and "acme" sorts before
    every first-party backend: native's defaults must not come from it."""
    from qcore.config.qconfig import default_qconfig_mapping

    native = qcore.get_backend("native")
    assert native.default_qconfig_mapping() is None  # no plugin is asked for native
    mapping = qcore.get_default_qconfig_mapping("native")
    expected = default_qconfig_mapping("x86").global_qconfig
    assert repr(mapping.global_qconfig) == repr(expected)
    fused = native.config.get((torch.nn.ReLU, torch.nn.Conv2d))
    assert fused.fused_module is torch.ao.nn.intrinsic.ConvReLU2d
    assert any(c.ignored_source == "acme" and c.field == "fuser_method" for c in native.conflicts)
    # acme's own backend still gets acme's choices.
    assert qcore.get_default_qconfig_mapping("acme").global_qconfig is not None
    acme_fused = qcore.get_backend("acme").config.get((torch.nn.ReLU, torch.nn.Conv2d))
    assert acme_fused.fused_module.__name__ == "AcmeConvReLU2d"
