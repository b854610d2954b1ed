"""sync_observers: calibration split over two gloo processes on localhost (issue 7).

Two processes each calibrate on half of the data, then merge their observers:
min/max observers end exactly where one process calibrating on all the data
ends, histograms within one bin width, moving averages at the batch-weighted
mean of the two halves' averages; the converted models are identical on both
ranks. Faults (different models, another backend, a rank that never joins)
are errors on the ranks that called, naming the rank and the observer, and the
model is left as it was.

Hostile numbers (issue 14 section 5): a rank calibrating on NaN skips them and
every rank's convert warns about the total; NaN statistics (torch.ao's observers
propagate them) and an eps that differs between ranks are errors naming the rank
and the observer; a rank arriving after the others timed out gets RankTimeoutError
naming them; after a timeout destroy_process_group() returns promptly.

All scenarios run in three spawned groups of two processes (one for everything
that leaves the process group usable, one for the never-joining rank, one for a
stuck and a late rank), each joined with a deadline and killed if it overruns.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import qcore
from qcore.observers import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    NonFiniteValuesWarning,
    default_per_channel_weight_observer,
)

pytest.importorskip("qcore_fbgemm", reason="needs the fbgemm plugin")
pytest.importorskip("qcore_qnnpack", reason="needs the qnnpack plugin")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORLD = 2
BATCHES = 8
SPLIT = 3  # rank 0 calibrates on batches [0, 3), rank 1 on [3, 8): unequal weights
GROUP_DEADLINE = 60.0  # seconds for one spawned group, then its processes are killed
FAULT_TIMEOUT = datetime.timedelta(seconds=5)
GROUP_TIMEOUT = datetime.timedelta(seconds=30)  # the process group's own


class Net(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc1 = nn.Linear(8 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)
        self.extra = nn.Linear(10, 10) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn(self.conv(x)))
        x = self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))
        return self.extra(x) if self.extra is not None else x


def make_model(extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return Net(extra).eval()


def data() -> list[torch.Tensor]:
    """Batches whose ranges differ (scaled and shifted), so that both halves matter."""
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randn(4, 3, 6, 6, generator=generator) * (1 + i / 2) + (i % 3 - 1)
        for i in range(BATCHES)
    ]


def held_out() -> torch.Tensor:
    return torch.randn(16, 3, 6, 6, generator=torch.Generator().manual_seed(2)) * 2


def shard(rank: int) -> list[torch.Tensor]:
    return data()[:SPLIT] if rank == 0 else data()[SPLIT:]


NAN_VALUES = 3  # in the batch rank 1 calibrates on last, in the "nan" scenarios


def with_nan(batches: list[torch.Tensor]) -> list[torch.Tensor]:
    poisoned = batches[-1].clone()
    poisoned.view(-1)[[5, 50, 100]] = float("nan")
    return [*batches[:-1], poisoned]


def nan_shard(rank: int) -> list[torch.Tensor]:
    return with_nan(shard(rank)) if rank == 1 else shard(rank)


def mapping(kind: str):
    if kind == "histogram":
        return qcore.get_default_qconfig_mapping("fbgemm")
    if kind == "qnnpack":
        return qcore.get_default_qconfig_mapping("qnnpack")
    if kind == "qat":
        return qcore.get_default_qat_qconfig_mapping("fbgemm")
    if kind == "torch.ao minmax":
        from torch.ao.quantization import observer as ao

        return qcore.QConfigMapping().set_global(
            qcore.QConfig(
                activation=ao.MinMaxObserver.with_args(quant_min=0, quant_max=127),
                weight=ao.default_per_channel_weight_observer,
            )
        )
    activation = {
        "minmax": MinMaxObserver.with_args(reduce_range=True),
        "minmax eps": MinMaxObserver.with_args(reduce_range=True, eps=1e-5),
        "moving": MovingAverageMinMaxObserver.with_args(averaging_constant=0.3, reduce_range=True),
    }[kind]
    return qcore.QConfigMapping().set_global(
        qcore.QConfig(activation=activation, weight=default_per_channel_weight_observer)
    )


def prepare(kind: str, extra: bool = False) -> nn.Module:
    model = make_model(extra)
    example = (torch.randn(1, 3, 6, 6),)
    if kind == "qat":
        # calibrated in eval mode: BatchNorm's running statistics stay those of the
        # float model (they are not observers; DDP's SyncBatchNorm is their business)
        prepared = qcore.prepare_qat_fx(model.train(), mapping(kind), example, backend="fbgemm")
        return prepared.eval()
    backend = "qnnpack" if kind == "qnnpack" else "fbgemm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)  # an op left in float
        return qcore.prepare_fx(model, mapping(kind), example, backend=backend)


def calibrate(prepared: nn.Module, batches: list[torch.Tensor]) -> nn.Module:
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    return prepared


def convert(prepared: nn.Module) -> nn.Module:
    prepared = copy.deepcopy(prepared)
    if isinstance(prepared, nn.Module):
        prepared.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qcore.convert_fx(prepared)


def observer_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every observer's and fake quant's buffers, persistent or not."""
    return {
        name: buffer.clone()
        for name, buffer in model.named_buffers()
        if "activation_post_process" in name or "fake_quant" in name
    }


# -- the workers ------------------------------------------------------------------------


def _init(rank: int, port: int, timeout: datetime.timedelta = GROUP_TIMEOUT) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timeout,
    )


def _catch(results: dict, key: str, fn) -> None:
    try:
        results[key] = fn()
    except Exception as error:  # reported by the test that reads this key
        results[key] = {"error": error, "traceback": traceback.format_exc()}


def _calibrate_and_sync(rank: int, kind: str) -> dict:
    prepared = calibrate(prepare(kind), shard(rank))
    result = qcore.sync_observers(prepared, timeout=datetime.timedelta(seconds=20))
    return {
        "state": observer_state(prepared),
        "output": convert(prepared)(held_out()),
        "kinds": result.kinds,
    }


def _nan_calibrate_and_sync(rank: int, kind: str) -> dict:
    """Rank 1's shard holds NaN: it skips them, and after the sync every rank's
    convert warns once about the values all ranks skipped."""
    prepared = calibrate(prepare(kind), nan_shard(rank))
    qcore.sync_observers(prepared, timeout=datetime.timedelta(seconds=20))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = qcore.convert_fx(copy.deepcopy(prepared))
    nonfinite = [str(w.message) for w in caught if issubclass(w.category, NonFiniteValuesWarning)]
    output = converted(held_out())
    return {"state": observer_state(prepared), "output": output, "warnings": nonfinite}


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN included (torch.ao's observers record NaN statistics)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return torch.equal(a, b)


def _mismatch(
    rank: int, kind_of_rank: dict, extra_on_rank: int | None, data_of=shard, default="histogram"
) -> dict:
    kind = kind_of_rank.get(rank, default)
    prepared = calibrate(prepare(kind, extra=rank == extra_on_rank), data_of(rank))
    before = observer_state(prepared)
    try:
        qcore.sync_observers(prepared, timeout=FAULT_TIMEOUT)
    except qcore.ObserverSyncError as error:
        after = observer_state(prepared)
        unchanged = before.keys() == after.keys() and all(
            _identical(before[k], after[k]) for k in before
        )
        return {"error": error, "unchanged": unchanged}
    return {"error": None}


def _worker(rank: int, port: int, outdir: str) -> None:
    _init(rank, port)
    results: dict = {}
    for kind in ("minmax", "histogram", "moving", "qat"):
        _catch(results, kind, lambda kind=kind: _calibrate_and_sync(rank, kind))
    _catch(results, "other model", lambda: _mismatch(rank, {}, extra_on_rank=1))
    _catch(results, "other backend", lambda: _mismatch(rank, {1: "qnnpack"}, extra_on_rank=None))
    _catch(results, "other eps", lambda: _mismatch(rank, {1: "minmax eps"}, None, default="minmax"))
    for kind in ("minmax", "histogram"):
        _catch(results, f"nan {kind}", lambda kind=kind: _nan_calibrate_and_sync(rank, kind))
    _catch(
        results,
        "torch.ao nan",
        lambda: _mismatch(rank, {}, None, data_of=nan_shard, default="torch.ao minmax"),
    )
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _absent_worker(rank: int, port: int, outdir: str) -> None:
    """Rank 1 never calls sync_observers; rank 0 must fail within the timeout."""
    _init(rank, port)
    results: dict = {}
    if rank == 0:
        prepared = calibrate(prepare("histogram"), shard(rank))
        before = observer_state(prepared)
        started = time.monotonic()
        try:
            qcore.sync_observers(prepared, timeout=FAULT_TIMEOUT)
            results["error"] = None
        except qcore.ObserverSyncError as error:
            results["error"] = error
        results["seconds"] = time.monotonic() - started
        after = observer_state(prepared)
        results["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        open(os.path.join(outdir, "done"), "w").close()
        started = time.monotonic()
        dist.destroy_process_group()  # the documented cleanup after a timeout
        results["destroy seconds"] = time.monotonic() - started
    else:
        _wait_for(outdir, "done")
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))


SHORT_TIMEOUT = datetime.timedelta(seconds=2)


def _wait_for(outdir: str, name: str) -> None:
    deadline = time.monotonic() + GROUP_DEADLINE
    while not os.path.exists(os.path.join(outdir, name)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _sync_outcome(prepared: nn.Module, group) -> dict:
    started = time.monotonic()
    try:
        qcore.sync_observers(prepared, group=group, timeout=SHORT_TIMEOUT)
        error = None
    except Exception as caught:  # the test checks which
        error = caught
    return {"error": error, "seconds": time.monotonic() - started}


def _stuck_and_late_worker(rank: int, port: int, outdir: str) -> None:
    """First, on a group of its own, rank 1 arrives after rank 0 timed out waiting
    for it. Then, on the world, rank 1 joins, then is stuck before the first
    collective until rank 0 has timed out there and called destroy_process_group(),
    which must not wait for the group's own timeout (15 s here)."""
    _init(rank, port, timeout=datetime.timedelta(seconds=15))
    late = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=15))
    results: dict = {}
    prepared = calibrate(prepare("minmax"), shard(rank))

    if rank == 1:
        _wait_for(outdir, "timed out")
    results["late"] = _sync_outcome(prepared, late)
    if rank == 0:
        open(os.path.join(outdir, "timed out"), "w").close()
        _wait_for(outdir, "late done")
    else:
        open(os.path.join(outdir, "late done"), "w").close()

    dist.barrier()  # both call sync_observers together: rank 1 joins, then is stuck
    if rank == 1:
        from qcore.distributed import _Comm

        gather = _Comm.all_gather_json

        def stuck_gather(self, *args, **kwargs):
            _wait_for(outdir, "stuck destroyed")
            return gather(self, *args, **kwargs)

        _Comm.all_gather_json = stuck_gather
        results["stuck"] = _sync_outcome(prepared, None)
        _Comm.all_gather_json = gather
    else:
        results["stuck"] = _sync_outcome(prepared, None)
    started = time.monotonic()
    dist.destroy_process_group()  # the documented cleanup
    results["stuck"]["destroy seconds"] = time.monotonic() - started
    if rank == 0:
        open(os.path.join(outdir, "stuck destroyed"), "w").close()
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    # Everything checked is saved. Leave without the interpreter's teardown: there,
    # torch 2.13's gloo sometimes calls std::terminate ("terminate called without an
    # active exception", SIGABRT) destroying the group whose peer timed out, which
    # failed the fixture with both ranks' results already written.
    os._exit(0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(worker, outdir) -> list[dict]:
    context = mp.start_processes(
        worker, args=(_free_port(), str(outdir)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + GROUP_DEADLINE
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise AssertionError(f"workers did not finish within {GROUP_DEADLINE} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return _spawn(_worker, tmp_path_factory.mktemp("sync"))


def result_of(ranks: list[dict], key: str) -> list[dict]:
    for rank, results in enumerate(ranks):
        value = results[key]
        if isinstance(value, dict) and "traceback" in value:
            pytest.fail(f"rank {rank}, scenario {key!r}:\n{value['traceback']}")
    return [results[key] for results in ranks]


def single_process(kind: str) -> nn.Module:
    return calibrate(prepare(kind), data())


def assert_same_on_every_rank(results: list[dict]) -> None:
    first = results[0]
    for rank, other in enumerate(results[1:], start=1):
        assert first["state"].keys() == other["state"].keys()
        for name, value in first["state"].items():
            assert torch.equal(value, other["state"][name]), f"rank {rank} differs at {name}"
        assert torch.equal(first["output"], other["output"]), f"rank {rank}'s model differs"


# -- correctness ------------------------------------------------------------------------


def test_min_max_equals_one_process_on_all_data(ranks):
    results = result_of(ranks, "minmax")
    assert_same_on_every_rank(results)
    assert set(results[0]["kinds"].values()) == {"min/max"}
    reference = single_process("minmax")
    expected = observer_state(reference)
    assert expected.keys() == results[0]["state"].keys()
    for name, value in expected.items():
        assert torch.equal(results[0]["state"][name], value), name
    assert torch.equal(results[0]["output"], convert(reference)(held_out()))


def _range(state: dict, name: str) -> tuple[float, float, float]:
    observer = HistogramObserver()
    observer.histogram.resize_(state[f"{name}.histogram"].shape)
    observer.load_state_dict(
        {key: state[f"{name}.{key}"] for key in ("eps", "histogram", "min_val", "max_val")}
    )
    lo, hi = observer._non_linear_param_search()
    width = float(observer.max_val - observer.min_val) / observer.bins
    return float(lo), float(hi), width


def test_histograms_within_one_bin_of_one_process(ranks):
    results = result_of(ranks, "histogram")
    assert_same_on_every_rank(results)
    assert "histogram" in results[0]["kinds"].values()
    reference = single_process("histogram")
    expected = observer_state(reference)
    names = {key.rsplit(".", 1)[0] for key in expected if key.endswith(".histogram")}
    assert len(names) >= 3
    state = results[0]["state"]
    for name in sorted(names):
        for buffer in ("min_val", "max_val"):  # the union of the ranges: exact
            assert torch.equal(state[f"{name}.{buffer}"], expected[f"{name}.{buffer}"])
        merged_total = state[f"{name}.histogram"].sum()
        assert torch.allclose(merged_total, expected[f"{name}.histogram"].sum())
        lo, hi, width = _range(state, name)
        ref_lo, ref_hi, ref_width = _range(expected, name)
        assert width == pytest.approx(ref_width)
        assert abs(lo - ref_lo) <= width and abs(hi - ref_hi) <= width, (
            f"{name}: merged range [{lo}, {hi}], one process [{ref_lo}, {ref_hi}], bin {width}"
        )
    ours, theirs = results[0]["output"], convert(reference)(held_out())
    step = (theirs.max() - theirs.min()) / 255  # the output's quantization step
    assert (ours - theirs).abs().max() <= step + 1e-6


def _expected_moving_average(kind: str) -> nn.Module:
    """One process: each half calibrated separately, then the batch-weighted mean."""
    halves = [calibrate(prepare(kind), shard(rank)) for rank in range(WORLD)]
    merged = halves[0]
    modules = [dict(half.named_modules()) for half in halves]
    for name, module in merged.named_modules():
        if not hasattr(module, "batches_observed"):
            continue
        counts = [float(m[name].batches_observed) for m in modules]
        for buffer in ("min_val", "max_val"):
            total = sum(
                n * getattr(m[name], buffer).double() for n, m in zip(counts, modules, strict=True)
            )
            getattr(module, buffer).copy_(total / sum(counts))
        module.batches_observed.fill_(int(sum(counts)))
    return merged


def test_moving_averages_are_batch_weighted_means(ranks):
    results = result_of(ranks, "moving")
    assert_same_on_every_rank(results)
    assert "moving average" in results[0]["kinds"].values()
    expected = _expected_moving_average("moving")
    state = results[0]["state"]
    for name, value in observer_state(expected).items():
        assert torch.equal(state[name], value), name
    # every observer counted as many tensors as one process on all the data
    counts = {k: v for k, v in observer_state(single_process("moving")).items()}
    counts = {k: v for k, v in counts.items() if k.endswith("batches_observed")}
    assert counts and all(torch.equal(state[k], v) for k, v in counts.items())
    assert torch.equal(results[0]["output"], convert(expected)(held_out()))


def test_qat_fake_quants_merged_and_qparams_recomputed(ranks):
    results = result_of(ranks, "qat")
    assert_same_on_every_rank(results)
    assert "fake quant" in results[0]["kinds"].values()
    expected = _expected_moving_average("qat")
    state = results[0]["state"]
    for name, module in expected.named_modules():
        if not hasattr(module, "activation_post_process") or not hasattr(module, "scale"):
            continue
        scale, zero_point = module.activation_post_process.calculate_qparams()
        assert torch.equal(state[f"{name}.scale"], scale), name
        assert torch.equal(state[f"{name}.zero_point"], zero_point.to(torch.int32)), name
        for buffer in ("min_val", "max_val"):
            key = f"{name}.activation_post_process.{buffer}"
            assert torch.equal(state[key], getattr(module.activation_post_process, buffer)), key
    # the expected model's fake quants take the merged qparams, then convert
    for name, module in expected.named_modules():
        if f"{name}.scale" in state and hasattr(module, "activation_post_process"):
            module.scale.resize_(state[f"{name}.scale"].shape).copy_(state[f"{name}.scale"])
            zp = state[f"{name}.zero_point"]
            module.zero_point.resize_(zp.shape).copy_(zp)
    assert torch.equal(results[0]["output"], convert(expected)(held_out()))


# -- faults ---------------------------------------------------------------------------------


def test_another_model_is_an_error_naming_rank_and_observer(ranks):
    for rank, outcome in enumerate(result_of(ranks, "other model")):
        error = outcome["error"]
        assert isinstance(error, qcore.ObserverMismatchError), f"rank {rank}: {error!r}"
        assert error.rank == 1
        assert error.observer.startswith("activation_post_process_")
        assert "rank 1" in str(error) and repr(error.observer) in str(error)
        assert outcome["unchanged"], f"rank {rank}'s observers changed"


def test_another_backend_is_an_error_naming_rank_and_observer(ranks):
    for rank, outcome in enumerate(result_of(ranks, "other backend")):
        error = outcome["error"]
        assert isinstance(error, qcore.ObserverMismatchError), f"rank {rank}: {error!r}"
        assert error.rank == 1 and error.observer == "activation_post_process_0"
        assert "quant_max=127" in str(error) and "quant_max=255" in str(error)
        assert outcome["unchanged"], f"rank {rank}'s observers changed"


def test_rank_that_never_joins_is_named_within_the_timeout(tmp_path):
    results = _spawn(_absent_worker, tmp_path)[0]
    error = results["error"]
    assert isinstance(error, qcore.RankTimeoutError), repr(error)
    assert error.ranks == [1] and "rank(s) 1 of 2 did not join" in str(error)
    timeout = FAULT_TIMEOUT.total_seconds()
    assert timeout - 0.5 <= results["seconds"] <= timeout + 5
    assert results["unchanged"]
    assert results["destroy seconds"] < 5


@pytest.fixture(scope="module")
def stuck_and_late(tmp_path_factory) -> list[dict]:
    return _spawn(_stuck_and_late_worker, tmp_path_factory.mktemp("stuck"))


def test_destroy_after_a_timeout_in_a_collective_returns_promptly(stuck_and_late):
    """torch.distributed's collectives left the group's own timeout to the backend:
    destroy_process_group() waited for it (35 s in QA's run, 13 s here)."""
    outcome = stuck_and_late[0]["stuck"]
    error = outcome["error"]
    assert isinstance(error, qcore.ObserverSyncError), repr(error)
    assert "comparing the ranks' observers" in str(error) and "timeout 2 s" in str(error)
    assert outcome["seconds"] < SHORT_TIMEOUT.total_seconds() + 5
    assert outcome["destroy seconds"] < 5, outcome
    # the stuck rank fails too once it gets there, and destroys promptly as well
    assert isinstance(stuck_and_late[1]["stuck"]["error"], qcore.ObserverSyncError)
    assert stuck_and_late[1]["stuck"]["destroy seconds"] < 5


def test_rank_arriving_after_the_others_timed_out_gets_rank_timeout_error(stuck_and_late):
    """It used to get gloo's raw RuntimeError ("Connection closed by peer")."""
    first, latecomer = stuck_and_late[0]["late"], stuck_and_late[1]["late"]
    assert isinstance(first["error"], qcore.RankTimeoutError) and first["error"].ranks == [1]
    error = latecomer["error"]
    assert isinstance(error, qcore.RankTimeoutError), repr(error)
    assert error.ranks == [0]
    assert "rank 1: rank(s) 0 of 2 did not join sync_observers" in str(error)
    assert "closed the connection before this rank joined" in str(error)
    assert latecomer["seconds"] < SHORT_TIMEOUT.total_seconds() + 5


def test_eps_differing_between_ranks_is_an_error_naming_observer_and_values(ranks):
    """Both ranks' observers merged to the same range but kept their own eps: they
    converted to different models, and nothing said so."""
    for rank, outcome in enumerate(result_of(ranks, "other eps")):
        error = outcome["error"]
        assert isinstance(error, qcore.ObserverMismatchError), f"rank {rank}: {error!r}"
        assert error.rank == 1 and error.observer == "activation_post_process_0"
        message = str(error)
        assert "eps=1.1920928955078125e-07 on rank 0" in message
        assert "eps=9.999999747378752e-06 on rank 1" in message
        assert outcome["unchanged"], f"rank {rank}'s observers changed"


@pytest.mark.parametrize("kind", ["minmax", "histogram"])
def test_nan_on_one_rank_is_skipped_and_every_rank_warns_about_it(ranks, kind):
    """Before: min/max observers merged the NaN into every rank (NaN scales, NaN
    outputs); histograms failed in torch.histc on the rank that saw it."""
    results = result_of(ranks, f"nan {kind}")
    assert_same_on_every_rank(results)
    assert torch.isfinite(results[0]["output"]).all()
    # as one process calibrating on all the data, NaN batch included
    expected = calibrate(prepare(kind), with_nan(data()))
    ours, theirs = results[0]["output"], convert(expected)(held_out())
    if kind == "minmax":
        assert torch.equal(ours, theirs)
    else:  # merged histograms: within a bin, so the output within a step
        assert (ours - theirs).abs().max() <= (theirs.max() - theirs.min()) / 255 + 1e-6
    for rank, result in enumerate(results):
        assert len(result["warnings"]) == 1, f"rank {rank}: {result['warnings']}"
        assert f"activation_post_process_0 (of 'x'): {NAN_VALUES}" in result["warnings"][0]
    assert results[0]["warnings"] == results[1]["warnings"]


def test_nan_statistics_are_an_error_naming_rank_and_observer(ranks):
    """torch.ao's MinMaxObserver records NaN: merged, every rank would convert to NaN."""
    for rank, outcome in enumerate(result_of(ranks, "torch.ao nan")):
        error = outcome["error"]
        assert isinstance(error, qcore.ObserverSyncError), f"rank {rank}: {error!r}"
        message = str(error)
        assert message.startswith("rank 1: observer 'activation_post_process_0'"), message
        assert "min_val=nan" in message
        assert outcome["unchanged"], f"rank {rank}'s observers changed"


def test_without_a_process_group_is_a_clear_error():
    prepared = calibrate(prepare("minmax"), shard(0))
    with pytest.raises(qcore.ObserverSyncError, match="init_process_group"):
        qcore.sync_observers(prepared)


def test_rebinning_puts_each_part_where_bucketize_does():
    """HistogramObserver re-bins (what merging costs) by counting parts before each
    new edge; it must give what a bucketize of every part's middle (torch.ao's) gives,
    including ranges where middles fall exactly on new edges."""
    from qcore.observers.histogram import HistogramObserver

    generator = torch.Generator().manual_seed(3)
    for trial in range(200):
        bins = int(torch.randint(1, 3000, (1,), generator=generator))
        observer = HistogramObserver(bins=bins)
        rate = observer.upsample_rate
        hist = torch.rand(bins, generator=generator) * 100
        lo = torch.tensor(float(torch.randn(1, generator=generator)) * 100)
        exponent = int(torch.randint(-4, 3, (1,), generator=generator))
        # A span float32 can hold at lo (a single value is re-binned by histc instead).
        hi = lo + float(torch.rand(1, generator=generator)) * 10**exponent + lo.abs() * 1e-5
        grow = float(torch.rand(1, generator=generator)) * float(hi - lo)
        # Every third range unchanged or grown by whole old bins: edges on part middles.
        new_lo, new_hi = [
            (lo - grow, hi + grow / 3),
            (lo, hi),
            (lo - (hi - lo) / bins * 3, hi),
        ][trial % 3]
        parts = bins * rate
        middles = torch.linspace(lo, hi, parts + 1)[:-1] + 0.5 * (hi - lo) / parts
        new_edges = torch.linspace(new_lo, new_hi, bins + 1)
        where = (torch.bucketize(middles, new_edges, right=True) - 1).clamp(0, bins - 1)
        expected = torch.bincount(
            where, weights=hist.repeat_interleave(rate) / rate, minlength=bins
        )
        actual = observer._rebin(hist, lo, hi, new_lo, new_hi)
        torch.testing.assert_close(actual, expected.float(), rtol=0, atol=1e-5 * float(hist.sum()))
