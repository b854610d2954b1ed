"""The ``qcore`` command: list the installed quantization backends, show what one
supports, quantize the bundled example models, and run the conformance suite.

Exit codes, for scripts (``EXIT_CODES``, printed by ``qcore --help``):

* 0: done: ``backends`` found no broken plugin (a blocked plugin is not broken),
  ``show`` printed the backend, ``demo`` quantized every model, ``check`` passed;
* 1: ``backends --load`` printed its table, but at least one plugin is broken;
  ``demo`` could not quantize a model with some backend;
* 2: bad command line (unknown command or option, missing argument);
* 3: ``show``/``check``: the backend asked for is not installed;
* 4: ``show``/``check``: the backend asked for failed to load (the error is printed);
* 5: ``check`` ran, and at least one conformance check failed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from qcore.config import BackendPatternConfig, DTypeConfig, DTypeWithConstraints
from qcore.config.errors import QCoreWarning
from qcore.config.pattern import format_pattern
from qcore.plugin import (
    NATIVE,
    Backend,
    BackendLoadError,
    PluginState,
    UnknownBackendError,
    default_registry,
)
from qcore.plugin.discovery import BLOCK_PLUGINS_ENV, DISABLE_AUTOLOAD_ENV

EXIT_OK = 0
EXIT_BROKEN_PLUGIN = 1
EXIT_USAGE = 2
EXIT_UNKNOWN_BACKEND = 3
EXIT_LOAD_ERROR = 4
EXIT_CHECK_FAILED = 5

DESCRIPTION = (
    "qcore quantizes PyTorch models for int8 backends that are installed as plugins\n"
    "(qcore-x86, qcore-fbgemm, qcore-qnnpack, or a vendor's). This command lists the\n"
    "installed backends, shows what one supports, quantizes the bundled example\n"
    "models with each, and runs the conformance suite on a backend."
)

EXIT_CODES = {
    EXIT_OK: "done (backends: no plugin broken; a blocked one is not broken; check: all passed)",
    EXIT_BROKEN_PLUGIN: "backends --load: a plugin is broken; demo: a model failed with a backend",
    EXIT_USAGE: "bad command line",
    EXIT_UNKNOWN_BACKEND: "show, check, demo --backend: the backend is not installed",
    EXIT_LOAD_ERROR: "show, check: the backend failed to load (the error is printed)",
    EXIT_CHECK_FAILED: "check: at least one conformance check failed",
}


def _exit_codes(*codes: int) -> str:
    """The exit-code paragraph of a --help text."""
    lines = [f"  {code}  {EXIT_CODES[code]}" for code in codes or sorted(EXIT_CODES)]
    return "exit codes:\n" + "\n".join(lines)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _backend_rows(load: bool) -> tuple[list[dict], bool, list[str]]:
    """One row per plugin, then one for native, and the names of the failed plugins.

    Without ``load`` nothing is imported: the rows come from package metadata.
    With it, every backend is loaded, each isolated from the others.
    """
    registry = default_registry()
    rows, healthy, failed = [], True, []
    for name in registry.names():
        if name == NATIVE:
            continue
        backend, error = registry.loaded(name), None
        if load:
            try:
                backend = registry.get(name)
                _ask_lazy_hooks(backend)
            except BackendLoadError as load_error:
                error = load_error
        for plugin in registry.plugins():
            if plugin.spec.backend != name:
                continue
            status = plugin.state.value
            if plugin.state is PluginState.FAILED:
                status = f"failed: {plugin.error_summary()}"
                healthy = False
                failed.append(plugin.name)
            elif error is not None and f"plugin {plugin.name}" in str(error):
                status = f"failed: {error}"  # a hook asked only when it is needed
                healthy = False
                failed.append(plugin.name)
            elif error is not None and plugin.state is not PluginState.BLOCKED:
                status = f"not used: {name} failed to load"
                healthy = False
            rows.append(
                {
                    "name": name,
                    "distribution": plugin.spec.distribution,
                    "version": plugin.spec.version,
                    "patterns": len(backend.config) if backend else None,
                    "kernels": len(backend.kernels) if backend else None,
                    "status": status,
                }
            )
    rows.append(_native_row(registry, load))
    return rows, healthy, failed


def _ask_lazy_hooks(backend: Any) -> None:
    """The hooks a backend is asked only when they are needed (its default
    QConfigMappings, its own PT2E Quantizer): a bad answer raises BackendLoadError
    here, not at the user's first quantize."""
    for is_qat in (False, True):
        backend.default_qconfig_mapping(is_qat=is_qat)
        backend.own_quantizer(is_qat)


def _native_row(registry: Any, load: bool) -> dict:
    native = registry.get(NATIVE) if load else registry.loaded(NATIVE)
    if native is None:
        served = {
            plugin.spec.backend
            for plugin in registry.plugins()
            if plugin.state is not PluginState.BLOCKED
        }
        return {
            "name": NATIVE,
            "distribution": f"union of {len(served)} backend(s)",
            "version": "",
            "patterns": None,
            "kernels": None,
            "status": PluginState.FOUND.value,
        }
    status = "ok"
    if native.conflicts:
        status += f", {len(native.conflicts)} conflict(s)"
    if native.left_out:
        status += f"; leaves out {', '.join(name for name, _ in native.left_out)} (failed)"
    return {
        "name": NATIVE,
        "distribution": f"union of {len({p.spec.backend for p in native.plugins})} backend(s)",
        "version": "",
        "patterns": len(native.config),
        "kernels": len(native.kernels),
        "status": status,
    }


def cmd_backends(args: argparse.Namespace) -> int:
    import warnings

    with warnings.catch_warnings():
        # The table itself reports broken plugins and conflicts.
        warnings.simplefilter("ignore")
        rows, healthy, failed = _backend_rows(args.load)
    code = EXIT_OK if healthy else EXIT_BROKEN_PLUGIN
    if args.json:
        print(json.dumps(rows, indent=2))
        return code
    header = ["NAME", "DISTRIBUTION", "VERSION", "PATTERNS", "KERNELS", "STATUS"]
    cells = [header] + [
        [
            row["name"],
            row["distribution"],
            row["version"],
            "-" if row["patterns"] is None else str(row["patterns"]),
            "-" if row["kernels"] is None else str(row["kernels"]),
            row["status"],
        ]
        for row in rows
    ]
    print(_table(cells))
    registry = default_registry()
    if registry.autoload_disabled:
        print(
            f"\nPlugin autoloading is disabled ({DISABLE_AUTOLOAD_ENV} is set): installed "
            "plugins are not read,\nonly those registered in-process. Unset it to use them."
        )
    elif len(rows) == 1:
        print(
            "\nNo backend plugins are installed, so 'native' is empty. Install one, e.g.\n"
            "  pip install qcore-x86      (or qcore-fbgemm, qcore-qnnpack)"
        )
    elif not args.load:
        print("\nNo plugin was imported. `qcore backends --load` loads each one and checks it.")
    if failed:
        print(f"\nTo go on without the failed plugins, set {BLOCK_PLUGINS_ENV}={','.join(failed)}")
    return code


def _dtype(constrained: DTypeWithConstraints) -> str:
    text = str(constrained.dtype).replace("torch.", "")
    limits = []
    if (
        constrained.quant_min_lower_bound is not None
        or constrained.quant_max_upper_bound is not None
    ):
        limits.append(
            f"q in [{constrained.quant_min_lower_bound}, {constrained.quant_max_upper_bound}]"
        )
    if constrained.scale_min_lower_bound is not None:
        limits.append(f"scale >= {constrained.scale_min_lower_bound:g}")
    if constrained.scale_max_upper_bound is not None:
        limits.append(f"scale <= {constrained.scale_max_upper_bound:g}")
    if constrained.scale_exact_match is not None:
        limits.append(f"scale == {constrained.scale_exact_match:g}")
    if constrained.zero_point_exact_match is not None:
        limits.append(f"zp == {constrained.zero_point_exact_match}")
    return f"{text}{{{', '.join(limits)}}}" if limits else text


def _describe_dtype_config(dtype_config: DTypeConfig) -> str:
    parts = [
        f"{_dtype(dtype_config.input_dtype_with_constraints)} -> "
        f"{_dtype(dtype_config.output_dtype_with_constraints)}"
    ]
    if dtype_config.weight_dtype is not None:
        parts.append(f"weight {_dtype(dtype_config.weight_dtype_with_constraints)}")
    if dtype_config.bias_dtype is not None:
        parts.append(f"bias {str(dtype_config.bias_dtype).replace('torch.', '')}")
    if dtype_config.is_dynamic:
        parts.append("dynamic")
    return ", ".join(parts)


def _describe_pattern_config(config: BackendPatternConfig) -> list[str]:
    lines = [f"{config.describe_pattern()}  [{config.observation_type.name}]"]
    for label, value in (
        ("fuser", config.fuser_method),
        ("fused module", config.fused_module),
        ("root module", config.root_module),
        ("qat module", config.qat_module),
        ("reference module", config.reference_quantized_module),
    ):
        if value is not None:
            lines.append(f"    {label}: {getattr(value, '__qualname__', value)}")
    for dtype_config in config.dtype_configs:
        lines.append(f"    dtypes: {_describe_dtype_config(dtype_config)}")
    return lines


def show(backend: Backend) -> str:
    """The text ``qcore show`` prints for a backend."""
    contributors = ", ".join(
        f"{plugin.spec.distribution} {plugin.spec.version}".strip() for plugin in backend.plugins
    )
    lines = [
        f"backend {backend.name}: {len(backend.config)} patterns, {len(backend.kernels)} kernels",
        f"from: {contributors or 'no plugin'}",
        "",
    ]
    for config in backend.config.configs:
        lines.extend(_describe_pattern_config(config))
    if backend.kernels:
        lines += ["", "kernels:"]
        lines += [
            f"    {k.name}: {format_pattern(k.pattern)} on {k.engine}" for k in backend.kernels
        ]
    if backend.conflicts:
        lines += ["", f"conflicts ({len(backend.conflicts)}; the first source was kept):"]
        lines += [f"    {conflict}" for conflict in backend.conflicts]
    if backend.left_out:
        lines += ["", f"left out ({len(backend.left_out)} backend(s) failed to load):"]
        lines += [f"    {name}: {error}" for name, error in backend.left_out]
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QCoreWarning)  # printed below, with the rest
            backend = default_registry().get(args.name)
            _ask_lazy_hooks(backend)  # as backends --load does: one verdict on a backend
    except UnknownBackendError as error:
        print(f"qcore: {error}", file=sys.stderr)
        return EXIT_UNKNOWN_BACKEND
    except BackendLoadError as error:
        cause = (
            f"\n  caused by: {type(error.__cause__).__name__}: {error.__cause__}"
            if error.__cause__
            else ""
        )
        print(f"qcore: {error}{cause}", file=sys.stderr)
        return EXIT_LOAD_ERROR
    print(show(backend))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from qcore.demo import run_demo

    for name in args.backend or ():
        try:
            default_registry().get(name)
        except UnknownBackendError as error:
            print(f"qcore demo: --backend {name!r}: {error}", file=sys.stderr)
            return EXIT_UNKNOWN_BACKEND
        except BackendLoadError:
            pass  # the demo's row for it says what failed
    results = run_demo(
        args.backend, args.model, args.path, batches=args.batches, min_sqnr=args.min_sqnr
    )
    return EXIT_BROKEN_PLUGIN if any(result.error for result in results) else EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    from qcore.conformance import run_checks

    try:
        _ask_lazy_hooks(default_registry().get(args.name))
    except UnknownBackendError as error:
        print(f"qcore: {error}", file=sys.stderr)
        return EXIT_UNKNOWN_BACKEND
    except BackendLoadError as error:
        print(f"qcore: {error}", file=sys.stderr)
        return EXIT_LOAD_ERROR
    results = run_checks(args.name)
    for result in results:
        print(f"{'PASS' if result.passed else 'FAIL'}  {result.check}: {result.detail}")
    failed = sum(not result.passed for result in results)
    print(f"\n{len(results) - failed} passed, {failed} failed")
    return EXIT_CHECK_FAILED if failed else EXIT_OK


def _version() -> str:
    from qcore import __version__

    return f"qcore {__version__}"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected an integer >= 1")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a finite number of decibels")
    return value


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="qcore",
        description=DESCRIPTION,
        epilog=_exit_codes(),
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser(
        "backends",
        help="list installed backends and their plugins (imports none unless --load)",
        description="List the installed backends, their plugins and the plugins' state. "
        "Reads package metadata only; no plugin is imported unless --load is given.",
        epilog=_exit_codes(EXIT_OK, EXIT_BROKEN_PLUGIN, EXIT_USAGE),
        formatter_class=formatter,
    )
    backends.add_argument(
        "--load",
        action="store_true",
        help="import every plugin: count patterns and kernels, report the broken ones",
    )
    backends.add_argument("--json", action="store_true", help="print the rows as JSON")
    backends.set_defaults(run=cmd_backends)
    show_parser = commands.add_parser(
        "show",
        help="show a backend's patterns and dtype configs",
        description="Load a backend and print its patterns, dtype configs, kernels and the "
        "conflicts between its plugins.",
        epilog=_exit_codes(EXIT_OK, EXIT_USAGE, EXIT_UNKNOWN_BACKEND, EXIT_LOAD_ERROR),
        formatter_class=formatter,
    )
    show_parser.add_argument("name", help="backend name, e.g. fbgemm or native")
    show_parser.set_defaults(run=cmd_show)
    demo = commands.add_parser(
        "demo",
        help="quantize the bundled example models with every installed backend",
        description="Quantize the bundled example models with every installed backend "
        "(FX and PT2E) and print accuracy, size and latency.",
        epilog=_exit_codes(EXIT_OK, EXIT_BROKEN_PLUGIN, EXIT_USAGE, EXIT_UNKNOWN_BACKEND),
        formatter_class=formatter,
    )
    from qcore.examples import ZOO

    demo.add_argument("--backend", action="append", help="only this backend (repeatable)")
    demo.add_argument(
        "--model",
        action="append",
        choices=sorted(ZOO),
        help="only this example model (repeatable)",
    )
    demo.add_argument("--path", action="append", choices=["fx", "pt2e"], help="only this path")
    demo.add_argument(
        "--batches", type=_positive_int, default=8, help="calibration batches (default 8)"
    )
    demo.add_argument(
        "--min-sqnr",
        type=_finite_float,
        metavar="DB",
        help="also show the layers qcore.quantize(accuracy_budget=DB) keeps float on the FX "
        "path for an SQNR of at least DB dB, and why (about two conversions per conv/linear)",
    )
    demo.set_defaults(run=cmd_demo)
    check = commands.add_parser(
        "check",
        help="run the conformance suite on a backend",
        description="Run the conformance suite (qcore.conformance) on an installed backend.",
        epilog=_exit_codes(
            EXIT_OK, EXIT_USAGE, EXIT_UNKNOWN_BACKEND, EXIT_LOAD_ERROR, EXIT_CHECK_FAILED
        ),
        formatter_class=formatter,
    )
    check.add_argument("name", help="backend name")
    check.set_defaults(run=cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
