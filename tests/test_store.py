"""RunStore: round-trips, atomic iterations (also under kill -9), lock, secrets, queries."""
from __future__ import annotations

import dataclasses

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evoattn.contract.types import ConfigResult, EvalResult, Verdict
from evoattn.config import RunConfig, config_to_dict
from evoattn.errors import RunDirError, UsageError
from evoattn.store import RunStore, scrub_secrets
from evoattn.types import LlmUsage, Program

ROOT = Path(__file__).resolve().parents[1]
PARAMS = {"B": 1, "H": 2, "S": 128, "D": 64, "causal": False}
CONFIG = config_to_dict(RunConfig())


def result(fitness: float, verdict: Verdict = Verdict.PASS) -> EvalResult:
    cfgs = (ConfigResult(params=PARAMS, dtype="float16", verdict=verdict, max_abs_err=1e-4,
                         tolerance=2e-3, ms=0.5, baseline_ms=0.5 * fitness, speedup=fitness),
            ConfigResult(params={**PARAMS, "causal": True}, dtype="float16", verdict=verdict,
                         ms=0.3, baseline_ms=0.3 * fitness, speedup=fitness))
    return EvalResult(verdict=verdict, reason="" if verdict.is_pass else "bad values",
                      fitness=fitness if verdict.is_pass else 0.0, configs=cfgs,
                      device="cpu", timing_device="cpu", versions={"torch": "2.11"},
                      flags=("implausible",) if fitness > 10 else (), log_tail="ok\n")


def make(pid: str, parent: str | None, fitness: float, iteration: int,
         verdict: Verdict = Verdict.PASS, island: int = 0) -> Program:
    return Program(id=pid, source=f"def attention():  # {pid}\n", suffix=".py",
                   parent_id=parent, iteration=iteration, island=island,
                   mutator="seed" if parent is None else "knobs", change=f"change {pid}",
                   result=result(fitness, verdict))


def commit(store: RunStore, iteration: int, program: Program | None = None, **kw) -> None:
    store.commit_iteration(iteration=iteration, program=program, rejection=kw.pop("rejection", None),
                           llm_usage=kw.pop("llm_usage", None),
                           rng_state=random.Random(iteration).getstate(),
                           population_snapshot=kw.pop("snapshot", {"islands": [[iteration]]}))


def reject(store: RunStore, iteration: int, mutator: str, reason: str, change: str) -> None:
    """Commits an iteration whose proposal for the seed was rejected, with the change it made."""
    store.commit_iteration(iteration=iteration, program=None,
                           rejection=("seed", mutator, reason), llm_usage=None,
                           rng_state=random.Random(iteration).getstate(),
                           population_snapshot={}, rejection_change=change)


@pytest.fixture
def store(tmp_path):
    s = RunStore.open(tmp_path / "run", CONFIG, create=True)
    yield s
    s.close()


def test_programs_round_trip_with_results(store):
    seed = make("seed", None, 1.0, 0)
    bad = Program(id="bad", source="x", suffix=".cu", parent_id="seed", iteration=1, island=1,
                  mutator="llm:m", change="diff", result=result(0, Verdict.BUILD_ERROR),
                  second_parent_id="seed")
    unevaluated = Program(id="u", source="y", suffix=".py", parent_id="seed", iteration=2,
                          island=0, mutator="knobs", change="")
    for i, p in enumerate([seed, bad, unevaluated]):
        commit(store, i, p)
    loaded = store.load_programs()
    assert list(loaded) == ["seed", "bad", "u"]
    assert loaded["seed"] == seed and loaded["bad"] == bad and loaded["u"] == unevaluated
    assert store.has_program("bad") and not store.has_program("nope")
    assert store.counts_by_verdict() == {"pass": 1, "build_error": 1, "unevaluated": 1}


def test_state_round_trip_restores_the_rng_exactly(store):
    rng = random.Random(123)
    rng.random()
    store.commit_iteration(iteration=7, program=None, rejection=("seed", "knobs", "no-op"),
                           llm_usage=None, rng_state=rng.getstate(),
                           population_snapshot={"version": 1, "islands": [["a"], ["b"]]})
    state = store.load_state()
    assert state["iteration"] == 7
    assert state["population"] == {"version": 1, "islands": [["a"], ["b"]]}
    assert state["stop_reason"] is None
    again = random.Random()
    again.setstate(state["rng_state"])
    assert [again.random() for _ in range(5)] == [rng.random() for _ in range(5)]
    store.record_stop("iterations")
    assert store.load_state()["stop_reason"] == "iterations"


def test_no_state_before_the_first_commit(store):
    assert store.load_state() is None


def test_failed_commit_rolls_back_everything_it_wrote(store):
    commit(store, 0, make("seed", None, 1.0, 0))
    before = store.load_state()
    with pytest.raises(TypeError):
        store.commit_iteration(iteration=1, program=make("a", "seed", 2.0, 1),
                               rejection=("seed", "llm:m", "bad diff"),
                               llm_usage=LlmUsage(model="m", prompt_tokens=10, cost_usd=0.5),
                               rng_state=random.Random(1).getstate(),
                               population_snapshot={"x": object()})   # not JSON: fails last
    assert not store.has_program("a")
    assert store.rejection_count() == 0
    assert store.llm_totals().calls == 0
    assert store.load_state() == before
    commit(store, 1, make("a", "seed", 2.0, 1))                      # the store still works
    assert store.load_state()["iteration"] == 1


def test_duplicate_program_is_refused_and_rolled_back(store):
    commit(store, 0, make("seed", None, 1.0, 0))
    with pytest.raises(ValueError, match="already stored"):
        commit(store, 1, make("seed", None, 1.0, 0))
    assert store.load_state()["iteration"] == 0


def test_llm_totals_and_rejections(store):
    commit(store, 0, make("seed", None, 1.0, 0))
    commit(store, 1, make("a", "seed", 2.0, 1),
           llm_usage=LlmUsage(model="m1", prompt_tokens=100, completion_tokens=50,
                              cost_usd=0.25, latency_s=2.0, attempts=2))
    commit(store, 2, rejection=("a", "llm:m1", "SEARCH block not found"),
           llm_usage=LlmUsage(model="m1", prompt_tokens=10, completion_tokens=5, cost_usd=0.5))
    commit(store, 3, rejection=("a", "llm:m1", "LLM call failed after 3 attempt(s): HTTP 500"),
           llm_usage=LlmUsage(model="m1", attempts=3, status="failed"))
    t = store.llm_totals()
    assert (t.calls, t.prompt_tokens, t.completion_tokens) == (3, 110, 55)
    assert t.cost_usd == pytest.approx(0.75) and t.latency_s == pytest.approx(2.0)
    assert store.rejection_count() == 2
    conn = sqlite3.connect(store.run_dir / "run.sqlite")
    assert [r[0] for r in conn.execute("SELECT status FROM llm_calls ORDER BY rowid")] == \
        ["ok", "rejected", "failed"]
    conn.close()


def test_a_parents_attempts_are_its_children_and_rejections_in_order(store, tmp_path):
    commit(store, 0, make("seed", None, 1.0, 0))
    commit(store, 1, make("a", "seed", 0.0, 1, Verdict.INCORRECT))
    reject(store, 2, "llm:m", "not found", "-x\n+y")
    commit(store, 3, make("b", "seed", 1.5, 3))
    commit(store, 4, make("c", "b", 1.6, 4))                   # another parent's child
    got = [(a.iteration, a.mutator, a.outcome, a.reason, a.change, a.fitness)
           for a in store.recent_attempts("seed", 10)]
    assert got == [(1, "knobs", "incorrect", "bad values", "change a", 0.0),
                   (2, "llm:m", "rejected", "not found", "-x\n+y", None),
                   (3, "knobs", "pass", "", "change b", 1.5)]
    assert [a.iteration for a in store.recent_attempts("seed", 2)] == [2, 3]
    assert store.committed_iteration() == 4
    store.close()
    db = tmp_path / "run" / "run.sqlite"                       # a run made before the column
    with sqlite3.connect(db) as conn:
        conn.execute("ALTER TABLE rejections DROP COLUMN change")
    with RunStore.open_readonly(tmp_path / "run") as old:
        assert [a.change for a in old.recent_attempts("seed", 10)][1] == ""
    RunStore.open(tmp_path / "run", None, create=False).close()   # the writer adds it back
    with RunStore.open_readonly(tmp_path / "run") as again:
        assert [a.reason for a in again.recent_attempts("seed", 10)][1] == "not found"
    conn = sqlite3.connect(db)
    assert "change" in {r[1] for r in conn.execute("PRAGMA table_info(rejections)")}
    conn.close()


def test_recent_changes_are_a_mutators_proposals_newest_first(store, tmp_path):
    commit(store, 0, make("seed", None, 1.0, 0))
    commit(store, 1, make("a", "seed", 0.0, 1, Verdict.INCORRECT))
    reject(store, 2, "knobs", "duplicate", "change r")
    reject(store, 3, "llm:m", "not found", "-x\n+y")
    commit(store, 4, make("b", "a", 1.5, 4))                   # any parent's child counts
    assert store.recent_changes("knobs", 10) == ["change b", "change r", "change a"]
    assert store.recent_changes("knobs", 2) == ["change b", "change r"]
    assert store.recent_changes("llm:m", 10) == ["-x\n+y"]
    store.close()
    with sqlite3.connect(tmp_path / "run" / "run.sqlite") as conn:   # a run made before
        conn.execute("ALTER TABLE rejections DROP COLUMN change")    # rejections kept changes
    with RunStore.open_readonly(tmp_path / "run") as old:
        assert old.recent_changes("knobs", 10) == ["change b", "change a"]


def test_recent_gains_are_changes_whose_child_beat_its_parent_beyond_its_noise(store):
    commit(store, 0, make("seed", None, 1.0, 0))
    commit(store, 1, make("a", "seed", 1.2, 1))                      # no interval: 1.2 > 1.0
    noisy = make("b", "seed", 1.05, 2)
    commit(store, 2, dataclasses.replace(noisy, result=dataclasses.replace(
        noisy.result, fitness_ci=(0.98, 1.12))))                     # within its noise: no
    sure = make("c", "a", 1.3, 3)
    commit(store, 3, dataclasses.replace(sure, result=dataclasses.replace(
        sure.result, fitness_ci=(1.25, 1.35))))                      # beyond it: yes
    commit(store, 4, make("d", "a", 1.1, 4))                         # slower than its parent
    commit(store, 5, make("e", "seed", 5.0, 5, Verdict.INCORRECT))   # not correct
    assert store.recent_gains("knobs", 10) == ["change c", "change a"]
    assert store.recent_gains("knobs", 2) == ["change c"]             # of the latest 2 children
    assert store.recent_gains("llm:m", 10) == []


def test_lineage_runs_from_seed_to_program(store):
    chain = [make("seed", None, 1.0, 0), make("c1", "seed", 1.1, 1), make("x", "seed", 1.2, 2),
             make("c2", "c1", 1.3, 3), make("c3", "c2", 1.4, 4)]
    for i, p in enumerate(chain):
        commit(store, i, p)
    assert [p.id for p in store.lineage("c3")] == ["seed", "c1", "c2", "c3"]
    assert [p.id for p in store.lineage("seed")] == ["seed"]
    with pytest.raises(UsageError, match="no program with id nope"):
        store.lineage("nope")


def test_leaderboard_is_correct_programs_by_fitness_then_id(store):
    progs = [make("seed", None, 1.0, 0), make("b", "seed", 3.0, 1), make("a", "seed", 3.0, 2),
             make("w", "seed", 99.0, 3, verdict=Verdict.INCORRECT), make("c", "seed", 0.5, 4)]
    for i, p in enumerate(progs):
        commit(store, i, p)
    assert [p.id for p in store.leaderboard(3)] == ["a", "b", "seed"]
    assert [p.id for p in store.leaderboard(10)] == ["a", "b", "seed", "c"]


def test_reopen_returns_stored_config_and_state(tmp_path):
    run = tmp_path / "run"
    with RunStore.open(run, CONFIG, create=True) as s:
        commit(s, 0, make("seed", None, 1.0, 0))
    with RunStore.open(run, None, create=False) as s:
        assert s.stored_config() == CONFIG
        assert s.load_state()["iteration"] == 0
        assert s.meta()["problem"] == "sdpa" and s.meta()["schema_version"] == "1"


def test_create_on_existing_run_and_resume_of_missing_run_fail(tmp_path):
    run = tmp_path / "run"
    RunStore.open(run, CONFIG, create=True).close()
    with pytest.raises(RunDirError, match="already holds a run"):
        RunStore.open(run, CONFIG, create=True)
    with pytest.raises(RunDirError, match="not a run directory"):
        RunStore.open(tmp_path / "other", None, create=False)


def test_schema_version_mismatch_is_refused(tmp_path):
    run = tmp_path / "run"
    RunStore.open(run, CONFIG, create=True).close()
    conn = sqlite3.connect(run / "run.sqlite")
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(RunDirError, match="schema version 99"):
        RunStore.open(run, None, create=False)


def test_garbage_database_is_a_run_dir_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(RunDirError):
        RunStore.open(run, None, create=False)


def test_second_writer_is_locked_out_until_close(tmp_path):
    run = tmp_path / "run"
    first = RunStore.open(run, CONFIG, create=True)
    with pytest.raises(RunDirError) as e:
        RunStore.open(run, None, create=False)
    assert str(e.value) == f"{run}: run directory is in use by another evoattn process"
    reader = RunStore.open_readonly(run)        # readers need no lock
    assert reader.load_state() is None
    reader.close()
    first.close()
    RunStore.open(run, None, create=False).close()


def test_lock_excludes_another_process(tmp_path):
    run = tmp_path / "run"
    RunStore.open(run, CONFIG, create=True).close()
    code = ("import sys, time; from evoattn.store import RunStore; "
            "s = RunStore.open(sys.argv[1], None, create=False); print('held', flush=True); "
            "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(run)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match="in use by another evoattn process"):
            RunStore.open(run, None, create=False)
    finally:
        child.kill()
        child.wait()
    RunStore.open(run, None, create=False).close()   # the kernel dropped the dead one's lock


def test_secrets_are_never_stored(tmp_path):
    cfg = config_to_dict(RunConfig())
    cfg["llm"]["models"][0]["api_key_env"] = "sk-live-SECRET123"   # key pasted in the wrong field
    cfg["llm"]["models"].append({**cfg["llm"]["models"][0], "api_key_env": "MY_KEY_ENV",
                                 "api_key": "sk-live-SECRET456", "auth_token": "tok-SECRET789"})
    run = tmp_path / "run"
    with RunStore.open(run, cfg, create=True) as s:
        stored = s.stored_config()
    models = stored["llm"]["models"]
    assert "api_key_env" not in models[0]
    assert models[1]["api_key_env"] == "MY_KEY_ENV"
    assert "api_key" not in models[1] and "auth_token" not in models[1]
    assert stored["llm"]["max_tokens"] == 8192         # a number under a 'token' key stays
    raw = b"".join(p.read_bytes() for p in run.iterdir() if p.is_file())
    assert b"SECRET" not in raw


def test_scrub_keeps_env_var_names_and_non_secret_keys():
    cfg = {"api_key_env": "OPENAI_API_KEY", "name": "sk-not-a-secret-key-name", "token": 5}
    assert scrub_secrets(cfg) == cfg


_CHILD = r"""
import random, sys
from evoattn.contract.types import EvalResult, Verdict
from evoattn.store import RunStore
from evoattn.types import LlmUsage, Program

store = RunStore.open(sys.argv[1], {"problem": "sdpa"}, create=True)
rng = random.Random(0)
pad = "#" * 200_000          # big rows: each commit takes long enough to be hit mid-write
parent = None
for i in range(1_000_000):
    pid = f"p{i:07d}"
    prog = Program(id=pid, source=f"{pad}\n# {i}\n", suffix=".py", parent_id=parent,
                   iteration=i, island=i % 2, mutator="knobs", change=pad,
                   result=EvalResult(verdict=Verdict.PASS, reason="", fitness=1.0 + i))
    rng.random()
    store.commit_iteration(iteration=i, program=prog, rejection=None,
                           llm_usage=LlmUsage(model="m", prompt_tokens=i), rng_state=rng.getstate(),
                           population_snapshot={"last": pid})
    parent = pid
    if i == 2:
        print("ready", flush=True)
"""


@pytest.mark.parametrize("delay_s", [0.0, 0.13, 0.37])
def test_kill_9_leaves_a_consistent_database(tmp_path, delay_s):
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(run)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(delay_s)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    with RunStore.open(run, None, create=False) as s:    # opens: lock gone, schema intact
        state = s.load_state()
        programs = s.load_programs()
        conn = sqlite3.connect(run / "run.sqlite")
        llm_rows = conn.execute("SELECT COUNT(*) FROM llm_calls").fetchone()[0]
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.close()
    n = state["iteration"] + 1                             # iterations 0..n-1 were committed
    assert n >= 3
    assert len(programs) == n == llm_rows
    assert state["population"] == {"last": f"p{n - 1:07d}"}
    rng = random.Random(0)
    for _ in range(n):
        rng.random()
    assert state["rng_state"] == rng.getstate()
