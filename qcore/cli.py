"""The ``qcore`` command.

Exit codes, for scripts:

* 0: done, every plugin involved loaded;
* 1: ``qcore backends`` printed its table, but at least one plugin is broken
  (or ``qcore demo`` could not quantize a model with some backend);
* 2: bad command line;
* 3: the backend asked for is not installed;
* 4: the backend asked for failed to load (the error is printed);
* 5: ``qcore check`` ran, and at least one conformance check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from qcore.config import BackendPatternConfig, DTypeConfig, DTypeWithConstraints
from qcore.config.pattern import format_pattern
from qcore.plugin import (
    NATIVE,
    Backend,
    BackendLoadError,
    PluginState,
    UnknownBackendError,
    default_registry,
)

EXIT_OK = 0
EXIT_BROKEN_PLUGIN = 1
EXIT_USAGE = 2
EXIT_UNKNOWN_BACKEND = 3
EXIT_LOAD_ERROR = 4
EXIT_CHECK_FAILED = 5


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _backend_rows() -> tuple[list[dict], bool]:
    """One row per plugin, then one for native; loads every backend, each isolated."""
    registry = default_registry()
    rows, healthy = [], True
    for name in registry.names():
        if name == NATIVE:
            continue
        backend, error = None, None
        try:
            backend = registry.get(name)
        except BackendLoadError as load_error:
            error = load_error
        for plugin in registry.plugins():
            if plugin.spec.backend != name:
                continue
            broken = plugin.state is PluginState.FAILED or (
                error is not None and plugin.error is None
            )
            healthy &= not broken
            status = plugin.state.value
            if plugin.error is not None:
                status = f"failed: {plugin.error_summary()}"
            elif error is not None and plugin.state is not PluginState.BLOCKED:
                status = f"not used: {error}"
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
    native = registry.get(NATIVE)
    rows.append(
        {
            "name": NATIVE,
            "distribution": f"union of {len({p.spec.backend for p in native.plugins})} backend(s)",
            "version": "",
            "patterns": len(native.config),
            "kernels": len(native.kernels),
            "status": f"ok, {len(native.conflicts)} conflict(s)" if native.conflicts else "ok",
        }
    )
    return rows, healthy


def cmd_backends(args: argparse.Namespace) -> int:
    import warnings

    with warnings.catch_warnings():
        # The table itself reports broken plugins and conflicts.
        warnings.simplefilter("ignore")
        rows, healthy = _backend_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK if healthy else EXIT_BROKEN_PLUGIN
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
    if len(rows) == 1:
        print(
            "\nNo backend plugins are installed, so 'native' is empty. Install one, e.g.\n"
            "  pip install qcore-x86      (or qcore-fbgemm, qcore-qnnpack)"
        )
    return EXIT_OK if healthy else EXIT_BROKEN_PLUGIN


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
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    try:
        backend = default_registry().get(args.name)
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

    results = run_demo(args.backend, args.model, args.path, batches=args.batches)
    return EXIT_BROKEN_PLUGIN if any(result.error for result in results) else EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    from qcore.conformance import run_checks

    try:
        default_registry().get(args.name)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qcore", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser("backends", help="list installed backends and their status")
    backends.add_argument("--json", action="store_true", help="print the rows as JSON")
    backends.set_defaults(run=cmd_backends)
    show_parser = commands.add_parser("show", help="show a backend's patterns and dtype configs")
    show_parser.add_argument("name", help="backend name, e.g. fbgemm or native")
    show_parser.set_defaults(run=cmd_show)
    demo = commands.add_parser(
        "demo", help="quantize the bundled example models with every installed backend"
    )
    demo.add_argument("--backend", action="append", help="only this backend (repeatable)")
    demo.add_argument("--model", action="append", help="only this example model (repeatable)")
    demo.add_argument("--path", action="append", choices=["fx", "pt2e"], help="only this path")
    demo.add_argument("--batches", type=int, default=8, help="calibration batches (default 8)")
    demo.set_defaults(run=cmd_demo)
    check = commands.add_parser("check", help="run the conformance suite on a backend")
    check.add_argument("name", help="backend name")
    check.set_defaults(run=cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
