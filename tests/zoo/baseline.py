"""The peer qcore is measured against: torch.ao's FX graph mode quantization.

    result = torch_ao_fx_quantize(model, example_inputs, calibration, backend="fbgemm")
    result.ok, result.stage, result.error     # torch.ao failing is a fact, not an exception
    result.sqnr                               # dB against the float model
    result.op_counts                          # count_quantized_ops(result.model)
    result(*inputs)                           # run it with the backend's quantized engine

Where torch.ao raises, the result says at which stage ("prepare", "calibrate", "convert",
"run") and why; qcore must not fail where torch.ao does, so tests compare against that too.

torch.ao is deprecated upstream and warns loudly (a DeprecationWarning per prepare/convert,
a UserWarning per observer, one per quantized tensor created). Inside this module those known
messages are silenced; every warning torch.ao gave is kept, deduplicated, in result.warnings,
and unknown ones are re-emitted.
"""

from __future__ import annotations

import contextlib
import copy
import math
import operator
import re
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

# Warnings torch.ao gives on every use; silenced inside this module only.
_NOISE = (
    r"torch\.ao\.quantization is deprecated",
    r"Please use quant_min and quant_max to specify the range for observers",
    r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other quantized tensor creation",
    r"To copy construct from a tensor, it is recommended",  # torch.ao's reference LSTM
    # A fact about torch.ao's result (kept in BaselineResult.warnings), not about the caller:
    r"All inputs of this cat operator must share the same quantization parameters",
)
_NOISE_RE = re.compile("|".join(_NOISE))


@contextlib.contextmanager
def _quiet(seen: list[str] | None = None) -> Iterator[None]:
    """Record warnings into `seen`; drop torch.ao's known ones, re-emit the rest after."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for item in caught:
                if seen is not None and str(item.message) not in seen:
                    seen.append(str(item.message))
    for item in caught:
        if not _NOISE_RE.search(str(item.message)):
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)


with _quiet():
    # torch 2.13: backend_config.utils must be imported before the get_*_backend_config
    # functions are called (it completes the import cycle they rely on).
    import torch.ao.quantization.backend_config.utils  # noqa: F401
    from torch.ao.quantization import (
        QConfigMapping,
        default_dynamic_qconfig,
        get_default_qconfig_mapping,
    )
    from torch.ao.quantization.backend_config import (
        BackendConfig,
        get_fbgemm_backend_config,
        get_qnnpack_backend_config,
    )
    from torch.ao.quantization.backend_config.onednn import get_onednn_backend_config
    from torch.ao.quantization.backend_config.x86 import get_x86_backend_config
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

BACKEND_CONFIGS = {
    "fbgemm": get_fbgemm_backend_config,
    "qnnpack": get_qnnpack_backend_config,
    "x86": get_x86_backend_config,
    "onednn": get_onednn_backend_config,
}
BACKENDS = ("fbgemm", "qnnpack", "x86")
"""The backends the zoo's tests compare; onednn (x86's engine) is in the benchmarks."""


def backend_config(backend: str) -> BackendConfig:
    """torch.ao's BackendConfig for fbgemm, qnnpack, x86 or onednn."""
    try:
        factory = BACKEND_CONFIGS[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; torch.ao has {BACKENDS}") from None
    with _quiet():
        return factory()


def default_qconfig_mapping(backend: str, dynamic: bool = False) -> QConfigMapping:
    """torch.ao's default static mapping for `backend`, or its dynamic one for LSTM and Linear."""
    with _quiet():
        if dynamic:
            return (
                QConfigMapping()
                .set_object_type(nn.LSTM, default_dynamic_qconfig)
                .set_object_type(nn.Linear, default_dynamic_qconfig)
            )
        return get_default_qconfig_mapping(backend)


@contextlib.contextmanager
def quantized_engine(backend: str) -> Iterator[None]:
    """Run a block with torch.backends.quantized.engine set to `backend`, then restore it."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = backend
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


# ---------------------------------------------------------------------------- accuracy


def _flat(outputs) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        tensor = outputs.dequantize() if outputs.is_quantized else outputs
        return tensor.detach().reshape(-1).to(torch.float64)
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    return torch.cat([_flat(item) for item in outputs])


def sqnr(reference, actual) -> float:
    """Signal to quantization noise ratio in dB: 20 * log10(||reference|| / ||reference - actual||).

    Either side may be a tensor (quantized ones are dequantized) or a nested sequence of
    tensors, compared flattened. Identical outputs give +inf.
    """
    ref, out = _flat(reference), _flat(actual)
    if ref.shape != out.shape:
        raise ValueError(f"shapes differ: {tuple(ref.shape)} vs {tuple(out.shape)}")
    signal, noise = ref.norm().item(), (ref - out).norm().item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 20.0 * math.log10(signal / noise)


# ---------------------------------------------------------------------------- op counting

QUANTIZE = "quantize"
DEQUANTIZE = "dequantize"
FLOAT_PREFIX = "float."
DYNAMIC_PREFIX = "dynamic."

_QUANTIZE_FUNCTIONS = {
    torch.quantize_per_tensor,
    torch.quantize_per_channel,
    torch.quantize_per_tensor_dynamic,
}
_QUANTIZED_MODULE_PACKAGES = ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized")
_META_METHODS = {"size", "dim"}


def op_name(name: str) -> str:
    """A readable snake_case op name: ConvReLU2d -> conv_relu2d, LayerNorm -> layer_norm."""
    name = name.replace("ReLU", "Relu")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _function_name(target) -> str:
    if isinstance(target, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
        return target._qualified_op_name if hasattr(target, "_qualified_op_name") else str(target)
    return getattr(target, "__name__", str(target))


def count_quantized_ops(graph_module: fx.GraphModule) -> dict[str, int]:
    """Count the ops of a converted torch.ao model by what data they run on.

    Keys:
      "<op>"          an op running on quantized data: a module from torch.ao.nn.quantized or
                      torch.ao.nn.intrinsic.quantized ("conv_relu2d", "linear", "layer_norm"),
                      a quantized function ("add" for torch.ops.quantized.add, "matmul", "mul"),
                      or a plain op whose input is a quantized tensor ("max_pool2d", "cat",
                      "flatten", "reshape");
      "dynamic.<op>"  a dynamically quantized op (float in and out, int8 weights):
                      "dynamic.linear", "dynamic.lstm";
      "float.<op>"    an op left running on float data ("float.softmax", "float.layer_norm");
      "quantize", "dequantize"  the conversions between the two.
    Bookkeeping is not counted: placeholders, outputs, attributes, shape queries, tuple
    indexing. Whether data is quantized is propagated through the graph from the
    quantize/dequantize nodes and the quantized modules.
    """
    modules = dict(graph_module.named_modules())
    quantized: set[fx.Node] = set()  # nodes whose output is a quantized tensor
    meta: set[fx.Node] = set()  # nodes whose output is shape bookkeeping, not data
    counts: Counter[str] = Counter()

    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        inputs = node.all_input_nodes
        data_inputs = [n for n in inputs if n.op != "get_attr" and n not in meta]
        on_quantized = any(n in quantized for n in data_inputs)
        target = node.target

        if node.op == "call_module":
            module = modules[target]
            package = type(module).__module__
            name = op_name(type(module).__name__)
            if package.startswith(_QUANTIZED_MODULE_PACKAGES):
                if ".dynamic" in package:
                    counts[DYNAMIC_PREFIX + name] += 1
                else:
                    counts[name] += 1
                    quantized.add(node)
                continue
        elif node.op == "call_method":
            name = target
            if name in _META_METHODS:
                meta.add(node)
                continue
            if name == "dequantize":
                counts[DEQUANTIZE] += 1
                continue
        else:  # call_function
            if target is getattr or (inputs and not data_inputs):
                meta.add(node)  # x.shape, shape[0], batch * seq, ...
                continue
            if target is operator.getitem and isinstance(node.args[1], int):
                if on_quantized:  # tuple indexing: pass quantizedness through
                    quantized.add(node)
                continue
            if target in _QUANTIZE_FUNCTIONS:
                counts[QUANTIZE] += 1
                quantized.add(node)
                continue
            if target is torch.dequantize:
                counts[DEQUANTIZE] += 1
                continue
            qualified = _function_name(target)
            if qualified.startswith("quantized::"):
                name = qualified.removeprefix("quantized::")
                if name.endswith("_dynamic"):
                    counts[DYNAMIC_PREFIX + name.removesuffix("_dynamic")] += 1
                else:
                    counts[name] += 1
                    quantized.add(node)
                continue
            name = op_name(qualified.split("::")[-1])

        if on_quantized:
            counts[name] += 1
            quantized.add(node)
        else:
            counts[FLOAT_PREFIX + name] += 1
    return dict(sorted(counts.items()))


def split_op_counts(counts: dict[str, int]) -> tuple[dict, dict, dict]:
    """(ops on quantized data incl. dynamic ones, float ops without prefix, conversions)."""
    quantized, floating, conversions = {}, {}, {}
    for key, value in counts.items():
        if key in (QUANTIZE, DEQUANTIZE):
            conversions[key] = value
        elif key.startswith(FLOAT_PREFIX):
            floating[key.removeprefix(FLOAT_PREFIX)] = value
        else:
            quantized[key] = value
    return quantized, floating, conversions


# ---------------------------------------------------------------------------- the baseline


@dataclass
class BaselineResult:
    """What torch.ao made of one model, or where and why it failed."""

    backend: str
    ok: bool
    model: fx.GraphModule | None = None
    stage: str | None = None  # where it failed: prepare, calibrate, convert, run
    error: str | None = None  # "ExceptionType: message"
    details: str | None = None  # the traceback
    sqnr: float | None = None
    op_counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # prepare + calibrate + convert
    warnings: list[str] = field(default_factory=list)

    def __call__(self, *args):
        if self.model is None:
            raise RuntimeError(f"torch.ao failed at {self.stage}: {self.error}")
        with quantized_engine(self.backend), _quiet(), torch.no_grad():
            return self.model(*args)

    def summary(self) -> str:
        if not self.ok:
            return f"torch.ao FAILED at {self.stage}: {self.error}"
        return f"ok, SQNR {self.sqnr:.1f} dB, {self.seconds:.2f} s"


def torch_ao_fx_quantize(
    model: nn.Module,
    example_inputs: tuple,
    calibration_data: Iterable[tuple],
    backend: str = "fbgemm",
    qconfig_mapping: QConfigMapping | None = None,
    *,
    dynamic: bool = False,
    eval_data: Sequence[tuple] | None = None,
) -> BaselineResult:
    """Quantize `model` with torch.ao's prepare_fx / convert_fx for `backend`.

    The model is not modified (a deep copy is prepared). qconfig_mapping defaults to
    torch.ao's default for the backend, or its default dynamic mapping when dynamic=True
    (calibration is then still run, and harmless). The result's sqnr compares the converted
    model with the float one on eval_data (default: the example inputs).
    Exceptions raised by torch.ao are caught and reported in the result.
    """
    config = backend_config(backend)
    if qconfig_mapping is None:
        qconfig_mapping = default_qconfig_mapping(backend, dynamic)
    eval_data = [tuple(example_inputs)] if eval_data is None else list(eval_data)
    result = BaselineResult(backend=backend, ok=False)
    stage = "prepare"
    with _quiet(result.warnings):  # outside the try: re-emitted warnings are not failures
        try:
            with quantized_engine(backend), torch.no_grad():
                start = time.perf_counter()
                prepared = prepare_fx(
                    copy.deepcopy(model).eval(),
                    qconfig_mapping,
                    tuple(example_inputs),
                    backend_config=config,
                )
                stage = "calibrate"
                for args in calibration_data:
                    prepared(*args)
                stage = "convert"
                converted = convert_fx(prepared, backend_config=config)
                result.seconds = time.perf_counter() - start
                result.model = converted
                stage = "run"
                actual = [converted(*args) for args in eval_data]
        except Exception as error:  # torch.ao failing is a result, not a test error
            result.stage = stage
            result.error = f"{type(error).__name__}: {_first_line(error)}"
            result.details = traceback.format_exc()
            return result
    with torch.no_grad():
        reference = [model(*args) for args in eval_data]
    result.ok = True
    result.sqnr = sqnr(reference, actual)
    result.op_counts = count_quantized_ops(converted)
    return result


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def quantize_zoo_entry(entry, backend: str = "fbgemm", calibration_batches: int = 8, **kwargs):
    """torch_ao_fx_quantize on a zoo entry, measured on held-out data (EVAL_SEED)."""
    from . import EVAL_SEED

    return torch_ao_fx_quantize(
        entry.make_model(),
        entry.example_inputs(),
        entry.calibration_data(calibration_batches),
        backend,
        dynamic=entry.dynamic,
        eval_data=entry.calibration_data(4, seed=EVAL_SEED),
        **kwargs,
    )
