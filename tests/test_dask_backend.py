"""The Dask backend on a real LocalCluster (CPU workers, `--device cpu`): a search through it,
workers killed mid-evaluation, the scheduler going away and coming back, and no secret
travelling to a worker."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import cloudpickle
import dask
import distributed
import pytest
import yaml

from evoattn.contract import program
from evoattn.contract.request import EvalRequest
from evoattn.contract.types import Verdict
from evoattn.backends.dask import START_TOPIC, DaskPool
from evoattn.runner import plan_run
from evoattn.slots import SlotSpec
from rundb import query

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "seeds" / "sdpa" / "flash_triton.py"
SECRET = "sk-evoattn-dask-test-0123456789SECRET"
# A correct candidate that takes a minute to load: long enough to kill its worker under it.
SLOW = program.read(SEED) + "\nimport time\ntime.sleep(60)\n"

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def _cluster(allowed_failures: int | None = None, port: int = 0
             ) -> Iterator[distributed.LocalCluster]:
    """A scheduler and two worker processes, each declaring one GPU."""
    over = {} if allowed_failures is None else \
        {"distributed.scheduler.allowed-failures": allowed_failures}
    with dask.config.set(over):
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                           resources={"GPU": 1}, scheduler_port=port,
                                           dashboard_address=None)
    try:
        yield cluster
    finally:
        cluster.close()


def _spec(request: EvalRequest, secret_names: tuple[str, ...] = (),
          plain: dict[str, Any] | None = None) -> SlotSpec:
    """A run's slots, with the default deadline rule and no station."""
    return SlotSpec(request, secret_names, 10.0, 60.0, None, plain or {})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp: Path, address: str, iterations: int, device: str = "cpu") -> Path:
    cfg = {"problem": "sdpa", "seed": str(SEED), "configs": ["1,2,64,64,nc"], "device": device,
           "iterations": iterations, "random_seed": 0, "output": str(tmp / "run"),
           "population": {"islands": 2, "elites_per_island": 4, "migration_interval": 2},
           "evaluator": {"trials": 1, "run_timeout_s": 300, "backend": "dask",
                         "scheduler_address": address}}
    p = tmp / "config.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _evoattn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "evoattn.cli", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)



def _programs(db: Path) -> int:
    """Returns how many programs a run being written has committed so far."""
    try:
        return query(db, "SELECT count(*) FROM programs")[0][0]
    except sqlite3.OperationalError:        # not there yet, or its tables not made yet
        return 0


def _starts(client: distributed.Client) -> list[dict[str, Any]]:
    """Returns every try that started on a worker: {"token", "worker"}, in order."""
    return [msg for _, msg in client.get_events(START_TOPIC)]


def _wait_for_start(client: distributed.Client, match: Callable[[str], bool], n: int = 1,
                    timeout_s: float = 120) -> dict[str, Any]:
    """Returns the n-th started try whose token passes `match`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        mine = [m for m in _starts(client) if match(m["token"])]
        if len(mine) >= n:
            return mine[n - 1]
        time.sleep(0.05)
    raise AssertionError(f"no try number {n} started: {_starts(client)}")


def _kill_worker(client: distributed.Client, address: str) -> None:
    os.kill(client.run(os.getpid)[address], signal.SIGKILL)


def test_a_search_runs_on_the_cluster_and_survives_a_worker_killed_under_a_candidate(
        tmp_path: Path) -> None:
    # allowed-failures 0: the scheduler gives up on the first death, so the retry on
    # another worker is the pool's own
    with _cluster(allowed_failures=0) as cluster, distributed.Client(cluster) as client:
        proc = _evoattn("run", "--config", str(_config(tmp_path, cluster.scheduler_address, 4)),
                        "--quiet")
        victim = _wait_for_start(client, lambda token: not token.startswith("seed-"))
        time.sleep(0.5)                                       # inside its evaluation
        _kill_worker(client, victim["worker"])
        out, err = proc.communicate(timeout=240)
        label = victim["token"].rsplit("-", 1)[0]
        tries = [m for m in _starts(client) if m["token"].startswith(label + "-")]
    assert proc.returncode == 0, out + err
    assert "stopped after iteration 4: iterations" in out
    assert len(tries) == 2 and tries[1]["worker"] != victim["worker"]
    rows = query(tmp_path / "run" / "run.sqlite", "SELECT id, verdict FROM programs")
    assert (label, "pass") in rows                            # retried, then judged as usual
    assert len(rows) >= 2 and all(v == "pass" for _, v in rows)


def test_a_candidate_whose_worker_dies_twice_is_marked_and_no_secret_travels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)   # the workers start with it in their env
    # the scheduler's default allowed-failures (3) would run it four times: the pool stops
    # the third try
    with _cluster() as cluster, distributed.Client(cluster) as client:
        pool = DaskPool(cluster.scheduler_address, _spec(EvalRequest(device="cpu", trials=1),
                                                         ("OPENAI_API_KEY",)))
        sent: list[bytes] = []
        submit = pool._client.submit
        monkeypatch.setattr(pool._client, "submit", lambda *a, **k: (
            sent.append(cloudpickle.dumps((a, k))), submit(*a, **k))[1])
        try:
            assert pool.slots == 2
            fut = pool.submit(SLOW, ".py", "slow")
            for n in (1, 2):
                start = _wait_for_start(client, lambda token: token.startswith("slow-"), n)
                time.sleep(0.5)
                _kill_worker(client, start["worker"])
            result = fut.result(timeout=120)
        finally:
            pool.close()
    assert result.verdict is Verdict.EVALUATOR_FAULT
    assert "died 2 times" in result.reason and start["worker"] in result.reason
    assert sent and all(SECRET.encode() not in blob for blob in sent)
    assert all(b"OPENAI_API_KEY" in blob for blob in sent)   # the name goes: workers scrub it


def test_losing_the_scheduler_stops_the_run_and_resume_goes_on_with_a_new_one(
        tmp_path: Path) -> None:
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    cfg = _config(tmp_path, address, 5)
    db = tmp_path / "run" / "run.sqlite"
    with _cluster(port=port):
        proc = _evoattn("run", "--config", str(cfg), "--quiet")
        deadline = time.monotonic() + 180
        while _programs(db) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out + err
    stop = next(line for line in out.splitlines() if line.startswith("stopped after"))
    assert f"lost the Dask scheduler at {address}" in stop
    assert f"evoattn run --resume {tmp_path / 'run'}" in out
    assert "Traceback" not in err
    assert int(query(db, "SELECT value FROM state WHERE key = 'iteration'")[0][0]) < 5
    assert "lost the Dask scheduler" in json.loads(
        query(db, "SELECT value FROM state WHERE key = 'stop_reason'")[0][0])
    with _cluster(port=port):
        again = _evoattn("run", "--resume", str(tmp_path / "run"), "--quiet")
        out, err = again.communicate(timeout=240)
    assert again.returncode == 0, out + err
    assert "stopped after iteration 5: iterations" in out
    assert sorted(i for (i,) in query(db, "SELECT iteration FROM programs"))[-1] <= 5
    assert json.loads(query(db, "SELECT value FROM state WHERE key = 'stop_reason'")[0][0]) \
        == "iterations"


def test_a_missing_scheduler_fails_fast_in_one_line_and_creates_nothing(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"
    proc = _evoattn("run", "--config", str(_config(tmp_path, address, 2)))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip().count("\n") == 0 and err.startswith("ClusterError: ") and address in err
    assert not (tmp_path / "run").exists()
    bad = _evoattn("run", "--config", str(_config(tmp_path, "tcp://127.0.0.1", 2)))
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 4 and err.startswith("UsageError: evaluator.scheduler_address")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_the_machine_that_runs_the_search_needs_no_gpu(tmp_path: Path, device: str) -> None:
    plan = plan_run(str(_config(tmp_path, "tcp://127.0.0.1:8786", 2, device)), None, None, None,
                    None, None, None)
    assert plan.device == plan.request.device == "cuda"     # the workers' GPUs, not this one's


def test_a_worker_times_on_its_gpu_s_cpus_and_plain_candidates_take_the_run_s_protocol(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In the worker (no cluster needed for this part): the slot's evaluator gets the run's
    plain-candidate fields and the CPUs of its GPU's block; a new plain protocol is a new
    evaluator."""
    from evoattn.backends import dask as backend
    made: list[tuple] = []

    class Fake:
        def __init__(self, request, sandbox, plain=None) -> None:  # noqa: ANN001
            made.append((request, sandbox, plain))

        def evaluate(self, source, suffix, label, rival=None):  # noqa: ANN001, ANN201
            from evoattn.contract.types import EvalResult
            return EvalResult.failure(Verdict.CRASH, "not run")

        def close(self) -> None:
            pass
    monkeypatch.setattr("evoattn.slots.SubprocessEvaluator", Fake)
    monkeypatch.setattr(backend, "_here", {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monkeypatch.setattr("evoattn.child.cpu_pin.host_gpu_count", lambda: 2)
    plain = {"width": 0.02, "graph": False, "heat": True}
    spec = _spec(EvalRequest(device="cuda"), plain=plain)
    backend._evaluate_here(spec.to_json(), "x = 1\n", ".py", "a", None)
    backend._evaluate_here(spec.to_json(), "x = 1\n", ".py", "b", None)       # the same one
    wider = dataclasses.replace(spec, plain={**plain, "width": 0.01})
    backend._evaluate_here(wider.to_json(), "x = 1\n", ".py", "c", None)
    assert len(made) == 2 and made[0][2] == plain and made[1][2]["width"] == 0.01
    assert made[0][1].station_refresh_s is None         # as a local slot: no station asked
    mine = sorted(os.sched_getaffinity(0))
    want = tuple(mine[len(mine) // 2:]) if len(mine) >= 2 else tuple(mine)
    assert made[0][1].timing_cpus == want
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert backend.worker_cpus() == ()


def test_the_pool_sends_the_plain_protocol_with_each_task(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    with _cluster() as cluster:
        plain = {"width": 0.02, "graph": False, "heat": False}
        pool = DaskPool(cluster.scheduler_address,
                        _spec(EvalRequest(device="cpu", trials=1), plain=plain))
        sent: list[tuple] = []
        submit = pool._client.submit
        monkeypatch.setattr(pool._client, "submit", lambda *a, **k: (
            sent.append(a), submit(*a, **k))[1])
        try:
            result = pool.submit("this is not python\n", ".py", "bad").result(timeout=120)
        finally:
            pool.close()
    assert result.verdict is not Verdict.PASS
    assert sent and SlotSpec.from_json(sent[0][1]).plain == plain
