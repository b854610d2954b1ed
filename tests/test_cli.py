"""The qcore command, on registries built in-process (issue 14 section 7).

tests/test_installed_plugins.py and tests/test_hostile_plugins.py run it on
plugins installed for real.
"""

import types

import pytest
import torch

import qcore
from qcore import BackendPatternConfig, DTypeConfig, cli, hookimpl
from qcore.plugin import BackendRegistry
from qcore.plugin.discovery import PluginSpec

INT8 = DTypeConfig(torch.quint8, torch.quint8, torch.qint8, torch.float)


def plugin(name, raises=None):
    module = types.ModuleType(name)
    module.QCORE_PLUGIN_API_VERSION = 1

    @hookimpl
    def qcore_backend_pattern_configs(backend):
        if raises is not None:
            raise raises
        return [BackendPatternConfig(torch.nn.Linear).add_dtype_config(INT8)]

    module.qcore_backend_pattern_configs = qcore_backend_pattern_configs
    return module


def spec(backend, distribution, module, imported=None):
    def load():
        if imported is not None:
            imported.append(backend)
        return module

    return PluginSpec(backend, f"{distribution}.plugin", distribution, "1.0", load)


@pytest.fixture
def use_registry(monkeypatch):
    def use(*specs, **environ):
        registry = BackendRegistry(find=lambda: list(specs), environ=environ)
        monkeypatch.setattr(cli, "default_registry", lambda: registry)
        return registry

    return use


def rows(output):
    return {line.split()[0]: line for line in output.splitlines()[2:] if line.strip()}


def test_backends_imports_no_plugin_unless_asked(use_registry, capsys):
    imported = []
    use_registry(spec("chip", "qcore-chip", plugin("chip"), imported))
    assert cli.main(["backends"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert imported == []
    assert rows(out)["chip"].split()[-2:] == ["not", "loaded"]
    assert "No plugin was imported" in out
    assert cli.main(["backends", "--load"]) == cli.EXIT_OK
    assert imported == ["chip"]
    assert rows(capsys.readouterr().out)["chip"].split()[3:] == ["1", "0", "ok"]


def test_a_blocked_plugin_is_not_broken(use_registry, capsys):
    use_registry(
        spec("chip", "qcore-chip", plugin("chip")),
        spec("evil", "QCore_Evil2", plugin("evil", raises=RuntimeError("boom"))),
        QCORE_BLOCK_PLUGINS="qcore-evil2",
    )
    assert cli.main(["backends", "--load"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert rows(out)["evil"].rstrip().endswith("blocked")
    assert "QCORE_BLOCK_PLUGINS=" not in out


def test_a_broken_plugin_exits_1_and_the_table_says_how_to_block_it(use_registry, capsys):
    use_registry(
        spec("chip", "qcore-chip", plugin("chip")),
        spec("evil", "qcore-evil", plugin("evil", raises=SystemExit(3))),
    )
    assert cli.main(["backends", "--load"]) == cli.EXIT_BROKEN_PLUGIN
    out = capsys.readouterr().out
    table = rows(out)
    assert "failed: SystemExit: 3" in table["evil"]
    assert table["chip"].rstrip().endswith("ok")
    assert "leaves out evil (failed)" in table["native"]
    assert "set QCORE_BLOCK_PLUGINS=qcore-evil:evil" in out


def test_show_native_lists_what_it_left_out(use_registry, capsys):
    use_registry(
        spec("chip", "qcore-chip", plugin("chip")),
        spec("evil", "qcore-evil", plugin("evil", raises=RuntimeError("boom"))),
    )
    assert cli.main(["show", "native"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "left out (1 backend(s) failed to load):" in out
    assert "evil: backend 'evil' could not be loaded" in out


def test_autoload_disabled_does_not_claim_nothing_is_installed(use_registry, capsys):
    use_registry(spec("chip", "qcore-chip", plugin("chip")), QCORE_DISABLE_PLUGIN_AUTOLOAD="1")
    assert cli.main(["backends"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "No backend plugins are installed" not in out
    assert "Plugin autoloading is disabled (QCORE_DISABLE_PLUGIN_AUTOLOAD is set)" in out


def test_nothing_installed(use_registry, capsys):
    use_registry()
    assert cli.main(["backends"]) == cli.EXIT_OK
    assert "No backend plugins are installed" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"qcore {qcore.__version__}"


def test_help_describes_the_command_and_every_exit_code(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "The ``qcore`` command" not in out
    assert "qcore quantizes PyTorch models" in out
    for code, meaning in cli.EXIT_CODES.items():
        assert f"  {code}  {meaning}" in out


@pytest.mark.parametrize(
    "command, codes",
    [
        ("backends", (0, 1, 2)),
        ("show", (0, 2, 3, 4)),
        ("demo", (0, 1, 2, 3)),
        ("check", (0, 2, 3, 4, 5)),
    ],
)
def test_each_command_documents_its_exit_codes(capsys, command, codes):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    documented = out.split("exit codes:")[1]
    assert [int(line.split()[0]) for line in documented.strip().splitlines()] == list(codes)


def test_every_exit_code_is_documented_in_the_plugin_guide():
    from pathlib import Path

    guide = (Path(__file__).parents[1] / "docs" / "plugin-guide.md").read_text()
    for code in cli.EXIT_CODES:
        assert f"\n| {code} | " in guide


def test_demo_names_an_unknown_model_and_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--model", "nosuch"])
    assert exit_info.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--model: invalid choice: 'nosuch'" in err and "'resnet18_like'" in err


def test_demo_refuses_an_unknown_backend_before_quantizing_anything(capsys):
    assert cli.main(["demo", "--backend", "nosuch", "--model", "mlp"]) == cli.EXIT_UNKNOWN_BACKEND
    captured = capsys.readouterr()
    assert "--backend 'nosuch': unknown backend 'nosuch'" in captured.err
    assert captured.out == ""


def test_backends_load_asks_the_hooks_asked_only_when_needed():
    """A plugin answering its default QConfigMapping with a str showed ok in
    ``qcore backends --load`` and failed at the user's first quantize; the plugin
    guide says --load marks it failed."""
    import qcore
    from qcore.cli import _ask_lazy_hooks
    from qcore.plugin import BackendLoadError, BackendRegistry

    class WrongMapping:
        @qcore.hookimpl
        def qcore_default_qconfig_mapping(self, backend, is_qat):
            return "fbgemm"

    registry = BackendRegistry(find=lambda: [], environ={})
    registry.register(WrongMapping(), "lazybad")
    backend = registry.get("lazybad")  # loads: the mapping is not asked for yet
    with pytest.raises(BackendLoadError, match="qcore_default_qconfig_mapping.. returned 'fbgemm'"):
        _ask_lazy_hooks(backend)


@pytest.mark.parametrize("command", ["show", "check"])
def test_show_and_check_give_the_verdict_backends_load_gives(use_registry, capsys, command):
    """show printed the patterns and exited 0 for a backend that backends --load
    marks failed (its default QConfigMapping hook answers a str)."""
    import qcore

    module = plugin("lazybad")

    @qcore.hookimpl
    def qcore_default_qconfig_mapping(backend, is_qat):
        return "fbgemm"

    module.qcore_default_qconfig_mapping = qcore_default_qconfig_mapping
    use_registry(spec("lazybad", "qcore-lazybad", module))
    assert cli.main([command, "lazybad"]) == cli.EXIT_LOAD_ERROR
    err = capsys.readouterr().err
    assert "qcore_default_qconfig_mapping" in err and "'fbgemm'" in err


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        # --batches 0 ran the demo with no calibration; nan and inf ran it to
        # "failed: TypeError" rows, exiting 0
        ("--batches", "0", "an integer >= 1"),
        ("--batches", "-3", "an integer >= 1"),
        ("--batches", "x", "an integer >= 1"),
        ("--min-sqnr", "nan", "a finite number of decibels"),
        ("--min-sqnr", "inf", "a finite number of decibels"),
    ],
)
def test_demo_refuses_an_out_of_range_option_as_a_usage_error(capsys, option, value, expected):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--model", "mlp", option, value])
    assert exit_info.value.code == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert f"argument {option}: got {value!r}; expected {expected}" in captured.err
    assert captured.out == ""
