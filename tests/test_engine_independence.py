"""A converted model's outputs depend on nothing global (issue 14, section 1).

torch's int8 ops pick their implementation by the process-wide
``torch.backends.quantized.engine``; some of those implementations disagree (qnnpack's
clamp scrambles channels-last input, its avg pooling, mean and hardswish round some
values a step apart, ``quantized::conv2d_add`` refuses to run unless the engine is
onednn). qcore's kernels carry their engine, so:

* every backend's model (the bundled examples, FX and PT2E, and the same after a
  torch.save/torch.load round trip) gives the same outputs under each global engine;
* 8 threads converting and running models of different backends at once give
  outputs bit-identical to single-threaded runs;
* converting (packing weights for a kernel's engine is the one place qcore sets the
  global, under a lock) leaves the user's engine setting as it was, and running a
  converted model never sets it.
"""

from __future__ import annotations

import copy
import io
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from backends import FIRST_PARTY, backend_params, installed
from kernel_cases import CASES, build

import qcore
from qcore.examples import ZOO, export_batch_free
from qcore.kernels.runtime import packing_for, quiet_quantized_tensors

BACKENDS = backend_params((*FIRST_PARTY, "onednn"))
ENGINES = tuple(e for e in torch.backends.quantized.supported_engines if e != "none")


@contextmanager
def global_engine(engine: str) -> Iterator[None]:
    """The user's own setting of the global engine, as a user writes it (no lock)."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


@contextmanager
def engine_settings_recorded() -> Iterator[list[int]]:
    """Every setting of the global engine made in the block, by whatever code (the
    property ``torch.backends.quantized.engine = ...`` goes through this function)."""
    settings: list[int] = []
    original = torch._C._set_qengine

    def recording(engine_id: int) -> None:
        settings.append(engine_id)
        original(engine_id)

    torch._C._set_qengine = recording
    try:
        yield settings
    finally:
        torch._C._set_qengine = original


def _outputs(model: torch.nn.Module, inputs: tuple) -> list[torch.Tensor]:
    with torch.no_grad():
        return torch.utils._pytree.tree_leaves(model(*inputs))


def _differing(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> float:
    """The largest difference between two runs' outputs (0.0: bit-identical)."""
    assert len(expected) == len(actual)
    worst = 0.0
    for e, a in zip(expected, actual, strict=True):
        if not torch.equal(e, a):
            worst = max(worst, (e.float() - a.float()).abs().max().item(), 1e-30)
    return worst


def _convert(name: str, backend: str, path: str) -> torch.nn.Module:
    entry = ZOO[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export's notices, reduce_range
        if path == "fx":
            return qcore.quantize(
                entry.make_model(), entry.example_inputs(), entry.calibration_data(2), backend
            )
        # exported at a calibration batch (two or more) so the batch stays free
        exported = export_batch_free(entry.make_model().eval(), entry.calibration_data(1)[0])
        prepared = qcore.prepare_pt2e(exported, backend)
        for batch in entry.calibration_data(2):
            prepared(*batch)
        return qcore.convert_pt2e(prepared)


def _load(buffer: io.BytesIO) -> torch.nn.Module:
    buffer.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notice on exported modules' pytree specs
        return torch.load(buffer, weights_only=False)


ZOO_CASES = [
    pytest.param(name, path, id=f"{name}-{path}")
    for name in sorted(ZOO)
    for path in ("fx", "pt2e")
    if not (path == "pt2e" and ZOO[name].dynamic)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, path", ZOO_CASES)
def test_zoo_model_outputs_are_the_same_under_every_global_engine(name, path, backend):
    user_engine = torch.backends.quantized.engine
    converted = _convert(name, backend, path)
    assert torch.backends.quantized.engine == user_engine, "converting changed the engine"
    inputs = ZOO[name].calibration_data(1, seed=5)[0]
    with engine_settings_recorded() as settings:
        expected = _outputs(converted, inputs)
    assert settings == [], "running the converted model set the global engine"
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    differing = {}
    for engine in ENGINES:
        with global_engine(engine):
            differing[f"run under {engine}"] = _differing(expected, _outputs(converted, inputs))
            loaded = _load(buffer)  # packs its weights again, for its kernels' engines
        # and run under another engine than the one it was loaded under
        other = ENGINES[(ENGINES.index(engine) + 1) % len(ENGINES)]
        with global_engine(other):
            differing[f"loaded under {engine}, run under {other}"] = _differing(
                expected, _outputs(loaded, inputs)
            )
    assert torch.backends.quantized.engine == user_engine
    assert {k: v for k, v in differing.items() if v} == {}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_kernel_gives_the_same_output_under_every_global_engine(name, backend):
    built = build(CASES[name], backend)
    expected = _outputs(built.converted, built.inputs)
    differing = {}
    for engine in ENGINES:
        with global_engine(engine):
            differing[engine] = _differing(expected, _outputs(built.converted, built.inputs))
    assert {k: v for k, v in differing.items() if v} == {}


def _channels_last_quint8(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    quiet_quantized_tensors()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 2 + 0.3
    return torch.quantize_per_tensor(x, 0.043, 131, torch.quint8).contiguous(
        memory_format=torch.channels_last
    )


def _under_each_engine(op) -> dict[str, torch.Tensor]:
    results = {}
    for engine in ("fbgemm", "qnnpack"):
        with global_engine(engine):
            results[engine] = op().int_repr()
    return results


def _steps_apart(results: dict[str, torch.Tensor]) -> int:
    fbgemm, qnnpack = results["fbgemm"].int(), results["qnnpack"].int()
    return int((fbgemm - qnnpack).abs().max())


@pytest.mark.skipif("qnnpack" not in ENGINES, reason="torch built without qnnpack")
def test_the_kernels_replacing_engine_dependent_torch_ops_agree_where_torch_does_not():
    """The inputs on which torch 2.13's own int8 ops give different values under the
    qnnpack engine than under the others, and qcore's kernels for those ops on them:
    the same values under both, equal to the reference's (the float op on the
    dequantized input, quantized once)."""
    from qcore.kernels.activations import QuantizedClamp, QuantizedHardswish
    from qcore.kernels.shape import QuantizedAverage
    from qcore.plugin.kernels import ActivationQParams

    # 12 channels, these qparams: inputs on which torch's engines disagree (not all do)
    x = _channels_last_quint8((2, 12, 8, 8), seed=0)
    same = ActivationQParams(x.q_scale(), x.q_zero_point(), torch.quint8)
    hardswish_out = ActivationQParams(0.03, 100, torch.quint8)

    def reference(op, qparams: ActivationQParams) -> torch.Tensor:
        y = op(x.dequantize())
        return torch.quantize_per_tensor(y, qparams.scale, qparams.zero_point, torch.quint8)

    cases = {
        # name: (torch's int8 op, qcore's kernel, the float op, output qparams)
        "relu6": (
            lambda: F.relu6(x),
            lambda: QuantizedClamp(0.0, 6.0, None)(x),
            F.relu6,
            same,
        ),
        "hardswish": (
            lambda: torch.ops.quantized.hardswish(x, 0.03, 100),
            lambda: QuantizedHardswish(hardswish_out)(x),
            F.hardswish,
            hardswish_out,
        ),
        "avg_pool2d": (
            lambda: F.avg_pool2d(x, 2),
            lambda: QuantizedAverage("avg_pool2d", same, {"kernel_size": 2})(x),
            lambda t: F.avg_pool2d(t, 2),
            same,
        ),
        "adaptive_avg_pool2d": (
            lambda: F.adaptive_avg_pool2d(x, 2),
            lambda: QuantizedAverage("adaptive_avg_pool2d", same, {"output_size": 2})(x),
            lambda t: F.adaptive_avg_pool2d(t, 2),
            same,
        ),
        "mean": (
            lambda: x.mean((2, 3), keepdim=True),
            lambda: QuantizedAverage("mean", same, {"dim": (2, 3), "keepdim": True})(x),
            lambda t: t.mean((2, 3), keepdim=True),
            same,
        ),
    }
    torch_apart, qcore_apart, off_reference = {}, {}, {}
    for name, (torch_op, kernel, float_op, qparams) in cases.items():
        torch_apart[name] = _steps_apart(_under_each_engine(torch_op))
        ours = _under_each_engine(kernel)
        qcore_apart[name] = _steps_apart(ours)
        expected = reference(float_op, qparams).int_repr().int()
        off_reference[name] = int((ours["fbgemm"].int() - expected).abs().max())
    # torch's op: steps apart between the engines (relu6 scrambles channels-last)
    assert torch_apart == {
        "relu6": torch_apart["relu6"],
        "hardswish": 1,
        "avg_pool2d": 1,
        "adaptive_avg_pool2d": 1,
        "mean": 1,
    }
    assert torch_apart["relu6"] > 50
    assert qcore_apart == dict.fromkeys(cases, 0)
    assert off_reference == dict.fromkeys(cases, 0)


# ---------------------------------------------------------------- threads

THREAD_MODELS = ("mobilenetv2_like", "resnet18_like")  # clamp, hardswish, pools, conv + add


def _prepared(name: str, backend: str) -> torch.nn.Module:
    entry = ZOO[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(entry.make_model(), None, entry.example_inputs(), backend)
        with torch.no_grad():
            for batch in entry.calibration_data(2):
                prepared(*batch)
    return prepared


def test_threads_converting_and_running_models_of_different_backends_agree_bit_for_bit():
    """8 threads, each converting its own copy of a prepared model (its backend and
    model differ from its neighbours') and running it and an already converted model
    many times, while the others do the same. Tracing (prepare) patches torch.nn.Module
    process-wide in torch.fx, so the models are prepared before the threads start.
    The user's engine setting is an unusual one and is left as it was."""
    backends = [b for b in (*FIRST_PARTY, "onednn") if installed(b)]
    if len(backends) < 2:
        pytest.skip("needs two installed backends")
    pairs = [(backends[i % len(backends)], THREAD_MODELS[i % 2]) for i in range(8)]
    prepared = {pair: _prepared(pair[1], pair[0]) for pair in set(pairs)}
    inputs = {name: ZOO[name].calibration_data(1, seed=5)[0] for name in THREAD_MODELS}
    single = {}  # single-threaded: the model converted alone, and its outputs
    for pair, model in prepared.items():
        converted = qcore.convert_fx(copy.deepcopy(model))
        single[pair] = converted, _outputs(converted, inputs[pair[1]])
    rounds, runs_each = 2, 8
    copies = [[copy.deepcopy(prepared[pair]) for _ in range(rounds)] for pair in pairs]

    counts = {"inferences": 0, "wrong": 0}
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(len(pairs))

    def worker(index: int) -> None:
        pair = pairs[index]
        shared, expected = single[pair]
        try:
            start.wait()
            for round_ in range(rounds):
                fresh = qcore.convert_fx(copies[index][round_])
                for model in (fresh, shared):
                    for _ in range(runs_each):
                        wrong = _differing(expected, _outputs(model, inputs[pair[1]])) != 0
                        with lock:
                            counts["inferences"] += 1
                            counts["wrong"] += wrong
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    with global_engine("qnnpack" if "qnnpack" in ENGINES else ENGINES[0]):
        user_engine = torch.backends.quantized.engine
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(pairs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert torch.backends.quantized.engine == user_engine
    assert errors == []
    assert counts == {"inferences": len(pairs) * rounds * 2 * runs_each, "wrong": 0}


def test_packing_holds_the_engine_for_its_whole_prepack_and_restores_it():
    """Threads packing for different engines at once each see their own engine for
    the whole block, and the user's setting comes back, also after a failure."""
    engines = [e for e in ("fbgemm", "qnnpack", "x86", "onednn") if e in ENGINES]
    user_engine = torch.backends.quantized.engine
    seen_other: list[tuple[str, str]] = []

    def worker(engine: str) -> None:
        for _ in range(200):
            with packing_for(engine):
                current = torch.backends.quantized.engine
                if current != engine:
                    seen_other.append((engine, current))

    threads = [threading.Thread(target=worker, args=(e,)) for e in engines * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen_other == []
    assert torch.backends.quantized.engine == user_engine
    with pytest.raises(ZeroDivisionError), packing_for(engines[-1]):
        1 / 0  # noqa: B018
    assert torch.backends.quantized.engine == user_engine


def test_a_setting_made_by_another_thread_while_packing_is_kept():
    """The global is process-wide: a thread outside qcore may set it while a kernel
    packs. qcore restores the setting it found only where the global still holds the
    engine qcore set, so the other thread's later setting is not undone."""
    engines = [e for e in ("fbgemm", "qnnpack", "x86", "onednn") if e in ENGINES]
    if len(engines) < 3:
        pytest.skip("needs three quantized engines")
    mine, other, theirs = engines[:3]
    with global_engine(theirs):
        with packing_for(mine):
            torch.backends.quantized.engine = other  # what the other thread does
        assert torch.backends.quantized.engine == other


class _FlattenThenMaxPool1d(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)
        self.pool = torch.nn.MaxPool1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.flatten(self.conv(x), 2))


@pytest.mark.parametrize("backend", backend_params(FIRST_PARTY))
def test_max_pool1d_of_a_flattened_channels_last_batch_of_one(backend):
    """``flatten(2)`` of a conv's channels-last output at batch 1 has strides (C, 1, C):
    torch 2.13's int8 max_pool1d reads that wrong on every engine but qnnpack (3.8
    off); the kernel makes it contiguous first, so every engine gives the reference's
    values."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(_FlattenThenMaxPool1d().eval(), None, (x,), backend)
        prepared(x)
        lowered = qcore.convert_fx(prepared)
        reference = qcore.convert_to_reference_fx(prepared)
    assert qcore.explain(lowered)["pool"].kernel == f"{backend}.pool_and_shape"
    expected = _outputs(reference, (x,))
    differing = {}
    for engine in ENGINES:
        with global_engine(engine):
            differing[engine] = _differing(expected, _outputs(lowered, (x,)))
    assert {k: v for k, v in differing.items() if v} == {}
    scripted = torch.jit.script(lowered)
    assert _differing(expected, _outputs(scripted, (x,))) == 0


def test_a_user_thread_setting_the_engine_while_qcore_packs_changes_no_weight():
    """The lock keeps qcore's threads apart, not the user's: a user thread setting the
    global between qcore's set and torch's prepack made it pack for the user's engine
    (17-34 of 40 qnnpack models a step off, and for good)."""
    if not installed("qnnpack") or "fbgemm" not in ENGINES:
        pytest.skip("needs the qnnpack plugin and torch's fbgemm engine")
    import copy
    import time

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 12 * 12, 10),
    ).eval()
    x = torch.randn(4, 3, 16, 16) * 3
    prepared = qcore.prepare_fx(model, None, (x,), backend="qnnpack")
    prepared(x)
    with torch.no_grad():
        expected = qcore.convert_fx(copy.deepcopy(prepared))(x)
    user_engine = torch.backends.quantized.engine
    others = [e for e in ENGINES if e != "qnnpack"]
    stop = threading.Event()

    def user() -> None:
        index = 0
        while not stop.is_set():
            torch.backends.quantized.engine = others[index % len(others)]
            index += 1
            time.sleep(0.0001)

    thread = threading.Thread(target=user)
    thread.start()
    try:
        converted = [qcore.convert_fx(copy.deepcopy(prepared)) for _ in range(40)]
    finally:
        stop.set()
        thread.join()
        torch.backends.quantized.engine = user_engine
    with torch.no_grad():
        wrong = sum(not torch.equal(model(x), expected) for model in converted)
    assert wrong == 0


class _LayerScaleResidual(torch.nn.Module):
    """ConvNeXt's residual: a branch scaled by a layer scale of 1e-6 (its init)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        with torch.no_grad():
            self.b.weight.mul_(1e-6)
            self.b.bias.mul_(1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.a(x) + self.b(x)), self.a(x) + self.b(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_add_of_scales_qnnpack_refuses_runs_under_every_engine(backend):
    """torch.ops.quantized.add runs qnnpack's add when the global engine is qnnpack,
    which refuses an input-to-output scale ratio outside [2**-14, 2**8) with an
    internal assert: every backend's model crashed under that engine (qnnpack's own
    too; torch.ao's as well)."""
    x = torch.randn(8, 16)
    prepared = qcore.prepare_fx(_LayerScaleResidual().eval(), None, (x,), backend=backend)
    prepared(x)
    converted = qcore.convert_fx(prepared)
    kernels = {entry.kernel for entry in qcore.explain(converted).entries if entry.kernel}
    assert any("add" in kernel for kernel in kernels), kernels
    with torch.no_grad():
        expected = [y.dequantize() if y.is_quantized else y for y in converted(x)]
        for engine in ENGINES:
            with global_engine(engine):
                outputs = [y.dequantize() if y.is_quantized else y for y in converted(x)]
            for output, wanted in zip(outputs, expected, strict=True):
                torch.testing.assert_close(output, wanted, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_default_dtype_while_quantizing_changes_no_output(backend):
    """Observers made their buffers (statistics, eps) in the default dtype: under
    ``torch.set_default_dtype(torch.float64)`` scales came out in float64 and
    outputs moved by a step (torch.ao's did not move)."""
    entry = ZOO["resnet18_like"]
    calibration = entry.calibration_data(3)
    x = entry.calibration_data(1, seed=2)[0]

    def quantized(dtype: torch.dtype) -> torch.Tensor:
        model = entry.make_model()  # float32, as the user built it
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            prepared = qcore.prepare_fx(model, None, calibration[0], backend=backend)
            for batch in calibration:
                prepared(*batch)
            converted = qcore.convert_fx(prepared)
        finally:
            torch.set_default_dtype(previous)
        with torch.no_grad():
            return converted(*x)

    torch.testing.assert_close(quantized(torch.float64), quantized(torch.float32), rtol=0, atol=0)


class NewPaths(torch.nn.Module):
    """The run-time paths stop 30 added: a dilated conv on a map narrower than its
    dilation (computed as the reference does), a broadcasting add and mul where
    neither operand has the output's shape (expanded), and a dropout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 4, 2, padding=1, dilation=2)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        y = self.drop(self.conv(x))
        row, column = y.mean(2, keepdim=True), y.mean(3, keepdim=True)
        return row + column, row * column


@pytest.mark.parametrize("backend", backend_params())
def test_this_stops_run_time_paths_read_no_global_engine(backend):
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 4, 6, 6, generator=generator),) for _ in range(3)]
    converted = qcore.quantize(NewPaths().eval(), batches[0], batches, backend=backend)
    converted.train()  # the dropout too
    narrow = (torch.randn(2, 4, 5, 1, generator=generator),)
    with engine_settings_recorded() as settings:
        expected = _outputs(converted, narrow) + _outputs(converted, batches[0])
    assert settings == []
    for engine in ENGINES:
        with global_engine(engine):
            got = _outputs(converted, narrow) + _outputs(converted, batches[0])
        assert _differing(expected, got) == 0.0, engine


def test_a_prepack_that_fails_under_a_user_threads_engine_is_tried_again():
    """Under some other engine torch's prepack raises (``Didn't find engine for
    operation quantized::conv2d_prepack X86``): lowering caught that and left the layer
    in reference form, 1 of 600 conversions in the test above under load. The pack is
    tried again under the kernel's engine; an error under that engine still raises."""
    from qcore.kernels.runtime import packed_for

    if len(ENGINES) < 2:
        pytest.skip("needs two quantized engines")
    engine, other = ENGINES[0], ENGINES[1]
    user_engine = torch.backends.quantized.engine
    calls = []

    def pack_raced_once() -> str:
        calls.append(torch.backends.quantized.engine)
        if len(calls) == 1:
            torch.backends.quantized.engine = other  # a user thread, mid-pack
            raise RuntimeError(
                f"Didn't find engine for operation quantized::conv2d_prepack {other}"
            )
        return "packed"

    try:
        assert packed_for(engine, pack_raced_once) == "packed"
        assert calls == [engine, engine]

        def pack_failing() -> str:
            raise RuntimeError("a real prepack error")

        with pytest.raises(RuntimeError, match="a real prepack error"):
            packed_for(engine, pack_failing)
    finally:
        torch.backends.quantized.engine = user_engine
