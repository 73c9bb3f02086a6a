"""The local multi-slot pool with fake GPUs: one GPU per slot's children, N evaluations at
once, a search that does not depend on the slot count, and nvcc builds on CPU threads."""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from evoattn.contract import program, runtime
from evoattn.contract.request import EvalRequest
from evoattn.contract.types import EvalResult, Verdict
from evoattn.config import PopulationConfig, RunConfig, config_to_dict
from evoattn.mutators.knobs import KnobMutator
from evoattn.pool import LocalPool, visible_gpus
from evoattn.prebuild import Prebuilder
from evoattn.sandbox import SandboxSettings
from evoattn.search import Search
from evoattn.store import RunStore
from evoattn.slots import SlotSpec
from fakes import TOY_SEED, FakeEvaluator, FakeSlot, sandboxed


class _EnvProbe(FakeSlot):
    """Stands in for a slot's evaluator: records the environment its real one would give a
    child, and this process's own CUDA_VISIBLE_DEVICES while it runs."""

    def __init__(self, real: Any, work: Path) -> None:
        self.real, self.work = real, work
        self.seen: list[tuple[str | None, str | None]] = []

    def evaluate(self, source: str, suffix: str, label: str) -> EvalResult:
        child = self.real.child_environment(str(self.work))
        self.seen.append((child.get("CUDA_VISIBLE_DEVICES"),
                          os.environ.get("CUDA_VISIBLE_DEVICES")))
        time.sleep(0.05)
        return EvalResult(Verdict.PASS, "ok", 1.0, ())


def test_each_slot_gives_its_children_one_gpu_and_never_changes_this_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    monkeypatch.setenv("EVOATTN_TEST_TOKEN", "hidden")
    devices = visible_gpus((0, 2))
    assert devices == ["3", "7"]
    probes: dict[str, _EnvProbe] = {}

    def make(device: str) -> _EnvProbe:
        real = SlotSpec(EvalRequest(device="cuda"), (), 10.0, 60.0, None).slot(device)
        probes[device] = _EnvProbe(real, tmp_path)
        return probes[device]

    pool = LocalPool(devices, make)
    try:
        futures = [pool.submit(f"x = {i}\n", ".py", str(i)) for i in range(8)]
        assert all(f.result(timeout=30).correct for f in futures)
    finally:
        pool.close()
    assert {seen for p in probes.values() for seen in p.seen} <= {("3", "3,5,7"), ("7", "3,5,7")}
    assert all(child == d for d, p in probes.items() for child, _ in p.seen)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5,7"
    assert "EVOATTN_TEST_TOKEN" not in probes["3"].real.child_environment(str(tmp_path))


class _Gate(FakeSlot):
    """A fake evaluator whose every evaluation waits until `parties` are running at once."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def evaluate(self, source: str, suffix: str, label: str) -> EvalResult:
        self.barrier.wait()                # BrokenBarrierError unless all run together
        return EvalResult(Verdict.PASS, "ok", 1.0, ())


@pytest.mark.parametrize("slots", [2, 4])
def test_n_slots_run_n_evaluations_at_once(slots: int) -> None:
    barrier = threading.Barrier(slots, timeout=10)
    pool = LocalPool([str(i) for i in range(slots)], lambda d: _Gate(barrier))
    try:
        futures = [pool.submit(f"x = {i}\n", ".py", str(i)) for i in range(2 * slots)]
        assert all(f.result(timeout=30).correct for f in futures)
    finally:
        pool.close()


class _Shuffled(FakeEvaluator):
    """The fake evaluator's scores, finishing after a delay drawn from the program's text, so
    results arrive out of order; records the order they finish in."""

    def __init__(self, finished: list[str], lock: threading.Lock) -> None:
        super().__init__()
        self.finished, self.lock = finished, lock

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        time.sleep(hashlib.sha256(source.encode()).digest()[0] / 255 * 0.06)
        result = super().evaluate(source, suffix, label, rival)
        with self.lock:
            self.finished.append(label)
        return result


def _search(tmp: Path, slots: int, window: int | None) -> tuple[list[tuple], list[str], list[str]]:
    """Runs a search on `slots` fake GPUs; returns (committed programs, submission order,
    finishing order)."""
    cfg = RunConfig(iterations=16, random_seed=3,
                    population=PopulationConfig(islands=2, elites_per_island=3,
                                                migration_interval=4))
    finished: list[str] = []
    lock = threading.Lock()
    pool = LocalPool([str(i) for i in range(slots)], lambda d: _Shuffled(finished, lock))
    submitted: list[str] = []
    submit = pool.submit
    pool.submit = lambda s, x, label, rival=None: (  # type: ignore
        submitted.append(label), submit(s, x, label, rival))[1]
    store = RunStore.open(tmp, config_to_dict(cfg), create=True)
    holder: dict[str, Search] = {}
    knobs = KnobMutator(0.2, is_known=lambda pid: pid in holder["s"].programs)
    try:
        holder["s"] = Search(cfg, store, pool, [(knobs, 1.0)], TOY_SEED, ".py", window=window)
        holder["s"].run()
    finally:
        store.close()
        pool.close()
    with RunStore.open_readonly(tmp) as st:
        history = [(p.iteration, p.id, p.parent_id) for p in st.load_programs().values()]
    return history, submitted, finished


def test_the_search_commits_the_same_programs_on_1_2_and_4_slots(tmp_path: Path) -> None:
    runs = {n: _search(tmp_path / str(n), n, window=4) for n in (1, 2, 4)}
    histories = {n: r[0] for n, r in runs.items()}
    assert histories[1] == histories[2] == histories[4]
    assert len(histories[1]) > 8
    _, submitted, finished = runs[4]
    assert submitted != finished                    # results did finish out of order
    assert sorted(submitted) == sorted(finished)


TINY_CU = """\
// evoattn: companion tiny.cuh
#include "tiny.cuh"
__global__ void twice(float* x) { x[threadIdx.x] *= TWO; }
extern "C" int evoattn_sdpa(void* q, void* k, void* v, void* out, int B, int H, int S, int D,
                            int dtype, int causal, float scale, void* stream) { return 0; }
"""
TINY_CUH = "#define TWO 2.0f\n"
PY_MAIN = """\
# evoattn: companion tiny.cuh
# evoattn: companion helper.cu when(@target=sm90)
# evoattn: companion other.cu when(@target=sm80)
def attention(q, k, v, causal=False, scale=None):
    return q
"""


class _Blocked(FakeSlot):
    """A fake slot evaluator: the first job waits for `release`; records, when each job
    starts, whether its CUDA library is already in the cache."""

    def __init__(self, release: threading.Event, cache: Path) -> None:
        self.release, self.cache = release, cache
        self.started: list[tuple[str, bool]] = []

    def evaluate(self, source: str, suffix: str, label: str) -> EvalResult:
        self.started.append((label, any(self.cache.glob("*/lib.so"))))
        if label == "first":
            assert self.release.wait(60)
        return EvalResult(Verdict.PASS, "ok", 1.0, ())


class _SlowBuilds:
    """Stands in for the Prebuilder: a job whose source names a build gets a future that
    finishes `seconds` after its submission; other jobs get none."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.timers: list[threading.Timer] = []

    def submit(self, source: str, suffix: str) -> Any:
        if "build" not in source:
            return None
        import concurrent.futures as cf
        fut: cf.Future[None] = cf.Future()
        timer = threading.Timer(self.seconds, fut.set_result, (None,))
        self.timers.append(timer)
        timer.start()
        return fut

    def close(self) -> None:
        for t in self.timers:
            t.cancel()


class _Quick(FakeSlot):
    """A fake slot evaluator that records the order it is given jobs in."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def evaluate(self, source: str, suffix: str, label: str) -> EvalResult:
        self.order.append(label)
        return EvalResult(Verdict.PASS, "ok", 1.0, (), duration_s=0.5, stage_s={"time": 0.5})


def test_a_job_still_building_lets_a_ready_one_go_first_and_the_wait_is_counted() -> None:
    slot = _Quick()
    pool = LocalPool(["0"], lambda d: slot, _SlowBuilds(0.8))   # type: ignore[arg-type]
    try:
        built = pool.submit("# build\n", ".py", "built")
        plain = pool.submit("x = 1\n", ".py", "plain")
        built_result, plain_result = built.result(timeout=30), plain.result(timeout=30)
    finally:
        pool.close()
    assert slot.order == ["plain", "built"]
    assert 0.5 <= built_result.stage_s["build wait"] < 5     # nothing else was ready
    assert built_result.stage_s["time"] == 0.5
    assert built_result.duration_s == pytest.approx(0.5 + built_result.stage_s["build wait"],
                                                    abs=0.01)
    assert plain_result.stage_s == {"time": 0.5} and plain_result.duration_s == 0.5


def test_a_cancelled_job_still_building_does_not_keep_its_slot_waiting() -> None:
    slot = _Quick()
    pool = LocalPool(["0"], lambda d: slot, _SlowBuilds(30))   # type: ignore[arg-type]
    try:
        gone = pool.submit("# build\n", ".py", "gone")
        assert gone.cancel()
        time.sleep(1.5)                       # the slot drops it instead of waiting for it
        later = pool.submit("x = 1\n", ".py", "later").result(timeout=30)
    finally:
        pool.close()
    assert slot.order == ["later"] and "build wait" not in later.stage_s


def test_closing_the_pool_cancels_the_jobs_still_waiting_for_their_build() -> None:
    pool = LocalPool(["0"], lambda d: _Quick(), _SlowBuilds(30))   # type: ignore[arg-type]
    waiting = pool.submit("# build\n", ".py", "built")
    time.sleep(0.2)
    t0 = time.monotonic()
    pool.close()
    assert waiting.cancelled() and time.monotonic() - t0 < 5


SDPA_CALL = """\
import torch


def attention(q, k, v, causal=False, scale=None):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            scale=scale)
"""


@pytest.mark.parametrize("slots, builds", [(2, False), (1, True)])
def test_zygotes_started_ahead_outlive_the_thread_that_asked_for_them(
        tmp_path: Path, slots: int, builds: bool) -> None:
    # A zygote started from a thread that then ends is killed with it (PR_SET_PDEATHSIG follows
    # the thread), and its slot would go on in fresh interpreters, without spares.
    evs = [sandboxed(device="cpu", cache_dir=str(tmp_path / str(i)), zygote=True, reps=2,
                     warmup=1, policy="allow-library") for i in range(slots)]
    given = iter(evs)
    pool = LocalPool(["cpu"] * slots, lambda d: next(given),
                     _SlowBuilds(0) if builds else None)   # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 120
        while any(ev._zygote is None for ev in evs):
            assert time.monotonic() < deadline, "a zygote was not started ahead"
            time.sleep(0.1)
        zygotes = [ev._zygote for ev in evs]
        time.sleep(1.0)
        assert all(z.alive() for z in zygotes)
        results = [pool.submit(SDPA_CALL, ".py", f"sdpa{i}") for i in range(slots)]
        assert all(r.result(timeout=300).correct for r in results)
        assert [ev._zygote for ev in evs] == zygotes
        assert not any(ev._zygote_failed for ev in evs)
    finally:
        pool.close()


@pytest.mark.skipif(not runtime.shutil.which("nvcc"), reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("kind", ["cu-main", "py-companion"])
def test_cuda_builds_run_on_cpu_threads_before_the_slot_takes_the_job(tmp_path: Path,
                                                                       kind: str) -> None:
    cache = tmp_path / "cache"
    request = EvalRequest(device="cuda", arch="sm_90a", build_timeout_s=120)
    prebuild = Prebuilder(request, SandboxSettings(cache_dir=str(cache)))
    if kind == "cu-main":
        source = program.join([("candidate.cu", TINY_CU), ("tiny.cuh", TINY_CUH)])
        suffix, built = ".cu", ("candidate.cu", TINY_CU)
    else:
        source = program.join([("main.py", PY_MAIN), ("helper.cu", TINY_CU),
                               ("tiny.cuh", TINY_CUH), ("other.cu", "this is not CUDA\n")])
        suffix, built = ".py", ("helper.cu", TINY_CU)
    assert prebuild.names(source, suffix) == (built[0],)    # other.cu: not for sm90
    release = threading.Event()
    slot = _Blocked(release, cache)
    pool = LocalPool(["0"], lambda d: slot, prebuild)
    try:
        first = pool.submit("x = 1\n", ".py", "first")
        cuda = pool.submit(source, suffix, "cuda")
        deadline = time.monotonic() + 120
        while not any(cache.glob("*/lib.so")):             # built while the slot is busy
            assert time.monotonic() < deadline, "the build did not happen"
            time.sleep(0.1)
        assert slot.started == [("first", False)]
        release.set()
        assert first.result(timeout=30).correct and cuda.result(timeout=120).correct
    finally:
        release.set()
        pool.close()
    assert slot.started == [("first", False), ("cuda", True)]
    # the child's own build, as evoattn/child/loader.py runs it, finds that library cached
    src = tmp_path / "again" / built[0]
    src.parent.mkdir()
    src.write_text(built[1])
    again = runtime.build_fast(src, cache, "sm_90a", 120,
                             extra_files={"tiny.cuh": TINY_CUH.encode()})
    assert again.ok and again.cached


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_prebuilds_run_nvcc_in_the_idle_scheduling_class_and_leave_the_caller_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An evaluation timing launch-bound calls keeps its CPU while nvcc builds the next
    candidate: the build thread, and what it starts, take only idle CPU time."""
    import subprocess
    import sys
    seen: dict[str, int] = {}

    def build_fast(path: Any, *args: Any, **kwargs: Any) -> runtime.BuildResult:
        seen["thread"] = os.sched_getscheduler(0)
        child = [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"]
        seen["nvcc"] = int(subprocess.run(child, capture_output=True, text=True).stdout)
        return runtime.BuildResult(True, None, "", False, 0.0)
    monkeypatch.setattr("evoattn.prebuild.runtime.build_fast", build_fast)
    prebuild = Prebuilder(EvalRequest(device="cuda", arch="sm_90a"),
                          SandboxSettings(cache_dir=str(tmp_path)))
    try:
        future = prebuild.submit(program.join([("candidate.cu", "int x;\n")]), ".cu")
        assert future is not None and future.result(timeout=60)[0].ok
    finally:
        prebuild.close()
    assert seen == {"thread": os.SCHED_IDLE, "nvcc": os.SCHED_IDLE}
    assert os.sched_getscheduler(0) != os.SCHED_IDLE        # the caller's own thread: unchanged


def test_a_prebuild_is_skipped_where_nothing_is_built_with_nvcc(tmp_path: Path) -> None:
    prebuild = Prebuilder(EvalRequest(device="cuda", arch="sm_90a"),
                          SandboxSettings(cache_dir=str(tmp_path)))
    try:
        assert prebuild.submit(TOY_SEED, ".py") is None
        ext = "#include <torch/extension.h>\ntorch::Tensor attention(torch::Tensor q);\n"
        assert prebuild.names(ext, ".cu") == ()             # the extension form needs torch
    finally:
        prebuild.close()


def test_slots_per_gpu_share_each_gpu_its_lock_and_the_run_s_plain_protocol(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from evoattn.config import EvaluatorConfig, RunConfig
    from evoattn.pool import make_evaluator
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.setenv("EVOATTN_CACHE", str(tmp_path))
    cfg = RunConfig(evaluator=EvaluatorConfig(per_gpu=2, candidate_width=0.03))
    pool = make_evaluator(cfg, EvalRequest(device="cuda"), ())
    try:
        assert (pool.slots, pool.gpus) == (4, 2)
        subs = list(pool._evaluators)
        locks = [s.request.gpu_lock for s in subs]
        assert [os.path.basename(p) for p in locks] == ["gpu-4.lock"] * 2 + ["gpu-6.lock"] * 2
        assert [s.sandbox.visible_device for s in subs] == ["4", "4", "6", "6"]
        assert all(s.plain == {"width": 0.03, "graph": False, "heat": False} for s in subs)
        # each GPU's timings pick their CPU from a block of their own (disjoint on 2 CPUs)
        cpus = [s.request.timing_cpus for s in subs]
        assert cpus[0] == cpus[1] and cpus[2] == cpus[3] and cpus[0] and cpus[2]
        if len(os.sched_getaffinity(0)) >= 2:
            assert not set(cpus[0]) & set(cpus[2])
        assert set(cpus[0]) | set(cpus[2]) == os.sched_getaffinity(0)
    finally:
        pool.close()
    # One slot per GPU: its spare children's set-up keeps out of its timing by the same lock
    alone = make_evaluator(RunConfig(evaluator=EvaluatorConfig(per_gpu=1)),
                           EvalRequest(device="cuda"), ())
    try:
        assert alone.slots == 2 and [os.path.basename(ev.request.gpu_lock)
                                     for ev in alone._evaluators] == ["gpu-4.lock", "gpu-6.lock"]
        assert all(ev._spares for ev in alone._evaluators)
    finally:
        alone.close()
    bare = make_evaluator(RunConfig(evaluator=EvaluatorConfig(per_gpu=1, spare=False)),
                          EvalRequest(device="cuda"), ())
    try:
        assert all(not ev.request.gpu_lock and not ev._spares
                   for ev in bare._evaluators)
    finally:
        bare.close()


def test_both_backends_slots_come_from_one_spec_with_a_station_only_when_asked() -> None:
    from evoattn.config import EvaluatorConfig
    from evoattn.slots import slot_spec
    request = EvalRequest(device="cuda")
    plain = slot_spec(RunConfig(evaluator=EvaluatorConfig(run_factor=4.0)), request, ("K",))
    assert plain.station_refresh_s is None and plain.run_factor == 4.0
    assert plain.secret_names == ("K",)
    assert plain.plain["width"] == RunConfig().evaluator.candidate_width
    asked = slot_spec(RunConfig(evaluator=EvaluatorConfig(station=True, baseline_refresh_s=30.0)),
                      request, ())
    assert asked.station_refresh_s == 30.0
    # what a Dask task carries is the same spec, and calibrating it sets the seed's deadline
    assert SlotSpec.from_json(asked.to_json()) == asked
    seed = EvalResult(Verdict.PASS, "ok", 1.0, (), stage_s={"build": 50.0, "time": 20.0})
    calibrated = asked.calibrated(seed)
    assert calibrated.request.run_timeout_s == asked.deadline_s(seed) == \
        max(asked.run_floor_s, min(request.run_timeout_s, asked.run_factor * 20.0))
