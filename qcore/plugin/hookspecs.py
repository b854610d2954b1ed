"""Every hook a qcore backend plugin can implement.

A plugin is a module (or object) found through the ``qcore.backends`` entry
point group. The entry point's *name* is the backend the plugin serves, so
``qcore backends`` can list names without importing anything::

    [project.entry-points."qcore.backends"]
    mychip = "qcore_mychip.plugin"

Several plugins may serve one name (a vendor adding kernels to ``x86``): their
contributions are merged, the backend's owner first (``qcore.plugin.registry.
rank_plugins``). Each hook receives the backend name it is asked about, so one
module may serve several entry points; a hook is only ever asked about the
names its module is registered under, never ``"native"`` (native is built from
the other backends). Returning ``None`` means "nothing to add". Whatever a hook
raises or returns that is not what it promises fails that plugin only, with an
error naming it. Implementations are marked with :data:`qcore.hookimpl`::

    from qcore import hookimpl

    QCORE_PLUGIN_API_VERSION = 1

    @hookimpl
    def qcore_backend_pattern_configs(backend):
        return [linear_config, conv_relu_config]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qcore.plugin.markers import hookspec

if TYPE_CHECKING:
    from collections.abc import Sequence

    from qcore.config import BackendPatternConfig
    from qcore.plugin.kernels import Kernel
    from qcore.plugin.recipes import AlgorithmStep, CompileRecipe


@hookspec
def qcore_backend_pattern_configs(backend: str) -> list[BackendPatternConfig] | None:
    """The operator patterns this plugin supports for ``backend``.

    Called once, the first time ``backend`` (or ``"native"``) is asked for.
    Returns BackendPatternConfigs, including the fusion patterns with their
    fuser methods and fused modules. When several plugins configure the same
    pattern, their dtype configs are united (see ``qcore.plugin.union``).
    """


@hookspec
def qcore_backend_kernels(backend: str) -> list[Kernel] | None:
    """The int8 kernels this plugin provides for ``backend``.

    Called once, the first time ``backend`` is asked for. Returns
    :class:`qcore.Kernel` objects; at convert, each replaces the reference
    patterns it matches. A pattern no kernel matches stays in reference form.
    ``qcore check`` tests each kernel on a model built from its pattern; a kernel
    it cannot test says why in ``Kernel.no_model_reason``, or fails the check.
    """


@hookspec(firstresult=True)
def qcore_default_qconfig_mapping(backend: str, is_qat: bool) -> Any | None:
    """The QConfigMapping users get when they pass no mapping of their own.

    Called when a default mapping for ``backend`` is needed, with
    ``is_qat=True`` for quantization-aware training. Returns a QConfigMapping
    (qcore's or torch.ao's), or None to leave it to another plugin. The first
    non-None answer wins, the backend's owner asked first. Never called for
    ``"native"``, whose default is qcore's own whatever is installed.
    """


@hookspec(firstresult=True)
def qcore_backend_quantizer(backend: str, is_qat: bool) -> Any | None:
    """A hand-written PT2E Quantizer for ``backend``, or None.

    Called when ``prepare_pt2e`` (``is_qat=False``) or ``prepare_qat_pt2e``
    (``is_qat=True``) is given the backend's name. A Quantizer returned here
    takes precedence over the one qcore compiles from the backend's
    BackendConfig. The first non-None answer wins, the backend's owner asked
    first; other plugins' pattern configs then annotate what it leaves float
    (``qcore.pt2e.extended``). Never called for ``"native"``. As with every
    hook, an implementation may leave out the arguments it does not use.
    """


@hookspec(firstresult=True)
def qcore_compile_recipe(backend: str, mode: str) -> CompileRecipe | None:
    """How ``backend``'s quantized models run fastest compiled, or None.

    Called by :func:`qcore.compile` (once per call) for the backend the model was
    prepared for, with the user's ``mode``: ``"default"`` (compile time matters as
    well as latency, as ``torch.compile``'s default mode) or ``"reduce-overhead"``
    (latency first: the per-call overhead removed at a higher compile cost; x86
    answers with Inductor's C++ wrapper). Returns a :class:`qcore.CompileRecipe`:
    the ``torch.compile`` backend and options qcore applies to the model's
    reference form (quantize and dequantize as ``torch.ops.quantized_decomposed``
    ops around float ops). A backend with one recipe answers every mode with it
    (and may leave ``mode`` out of its signature). None means the backend's eager
    kernels are its best: ``qcore.compile`` then returns the lowered model, as
    ``convert_fx``/``convert_pt2e`` do. The first non-None answer wins, the
    backend's owner asked first. Never called for ``"native"``, whose models run
    on the eager kernels of the backends it unites.
    """


@hookspec(firstresult=True)
def qcore_recommended_algorithms(backend: str) -> Sequence[AlgorithmStep] | None:
    """The post-training algorithms ``backend`` recommends by default, or None.

    Called by :func:`qcore.quantize` with ``algorithms="recommended"`` (once per
    call), and by ``qcore.get_backend(name).recommended_algorithms()``. Returns a
    list or tuple of :class:`qcore.AlgorithmStep`, in the order they should run
    within their stage: each names an algorithm of ``qcore.algorithms.ALGORITHMS``
    (``"equalize"`` and ``"smooth_quant"`` run before calibration,
    ``"correct_bias"`` and ``"adaround"`` after it) with its options, and says why
    in ``reason``. An empty list recommends none (plain calibration is this
    backend's best); None leaves it to another plugin. The first non-None answer
    wins, the backend's owner asked first. A plugin that raises or answers
    something else is skipped with a warning naming it (the next plugin is asked);
    a step naming an algorithm this qcore does not have is dropped with a warning.
    Never called for ``"native"``, which recommends none.
    """
