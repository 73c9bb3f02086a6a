"""The search loop with a fake evaluator: determinism, resume, stopping, rejections, integrity."""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

from evoattn.contract.types import EvalResult, Verdict
from evoattn.config import PopulationConfig, RunConfig, config_to_dict
from evoattn.mutators.knobs import KnobMutator, find_knobs
from evoattn.search import Search
from evoattn.store import RunStore
from evoattn.types import MutationRequest, Proposal
from fakes import TOY_SEED, FakeEvaluator


def _cfg(**kw: object) -> RunConfig:
    base = RunConfig(iterations=12, random_seed=1,
                     population=PopulationConfig(islands=2, elites_per_island=3,
                                                 migration_interval=4))
    return dataclasses.replace(base, **kw)


def _run(tmp: Path, cfg: RunConfig, ev: FakeEvaluator | None = None, create: bool = True,
         mutators: list | None = None, **kw: object) -> tuple[Search, object]:
    store = RunStore.open(tmp, config_to_dict(cfg), create=create)
    ev = ev or FakeEvaluator()
    holder: dict[str, Search] = {}
    muts = mutators or [(KnobMutator(0.2, is_known=lambda pid: pid in holder["s"].programs), 1.0)]
    s = Search(cfg, store, ev, muts, TOY_SEED, ".py", **kw)
    holder["s"] = s
    try:
        out = s.run()
    finally:
        store.close()
    return s, out


def _history(run_dir: Path) -> list[tuple[int, str, str | None]]:
    with RunStore.open_readonly(run_dir) as st:
        return [(p.iteration, p.id, p.parent_id) for p in st.load_programs().values()]


def test_same_seed_same_choices_different_seed_different(tmp_path: Path) -> None:
    _run(tmp_path / "a", _cfg())
    _run(tmp_path / "b", _cfg())
    _run(tmp_path / "c", _cfg(random_seed=2))
    assert _history(tmp_path / "a") == _history(tmp_path / "b")
    assert _history(tmp_path / "a") != _history(tmp_path / "c")
    assert len(_history(tmp_path / "a")) > 5


def test_best_improves_and_no_program_is_evaluated_twice(tmp_path: Path) -> None:
    ev = FakeEvaluator()
    s, out = _run(tmp_path, _cfg(iterations=25), ev)
    assert out.best is not None and out.best.fitness > out.seed.fitness
    assert len(ev.calls) == len(set(ev.calls))
    assert out.stop_reason == "iterations" and out.iterations_done == 25


def test_resume_continues_with_the_same_population_and_counter(tmp_path: Path) -> None:
    cfg = _cfg(iterations=6)
    s1, out1 = _run(tmp_path, cfg)
    with RunStore.open_readonly(tmp_path) as st:
        snap_before = st.load_state()["population"]
    ev2 = FakeEvaluator()
    s2, out2 = _run(tmp_path, dataclasses.replace(cfg, iterations=12), ev2, create=False)
    assert out2.iterations_done == 12
    # the seed is not evaluated again, and the restored population is the stored one
    assert TOY_SEED not in ev2.calls
    assert s2.programs.keys() >= s1.programs.keys()
    hist = _history(tmp_path)
    assert [i for i, *_ in hist][:len(s1.programs)] == [p.iteration for p in s1.programs.values()]
    assert max(i for i, *_ in hist) <= 12
    assert snap_before["seed"] == out2.seed.id
    new = [p.iteration for p in s2.programs.values() if p.id not in s1.programs]
    assert new and min(new) > 6          # the counter went on from 6, it did not restart


def test_resume_reproduces_an_uninterrupted_run(tmp_path: Path) -> None:
    _run(tmp_path / "whole", _cfg(iterations=10))
    _run(tmp_path / "split", _cfg(iterations=5))
    _run(tmp_path / "split", _cfg(iterations=10), create=False)
    assert _history(tmp_path / "whole") == _history(tmp_path / "split")


def test_target_fitness_and_wall_time_stop_the_run(tmp_path: Path) -> None:
    _, out = _run(tmp_path / "t", _cfg(iterations=50, target_fitness=1.0))
    assert out.stop_reason.startswith("target fitness") and out.iterations_done == 0
    ticks = iter(range(0, 10_000, 10))
    _, out = _run(tmp_path / "w", _cfg(iterations=50, max_wall_s=35),
                  clock=lambda: float(next(ticks)))
    assert out.stop_reason.startswith("wall time") and 0 < out.iterations_done < 50


def test_budget_exhaustion_stops_cleanly(tmp_path: Path) -> None:
    spent = {"n": 0}

    def exhausted() -> bool:
        spent["n"] += 1
        return spent["n"] > 3
    _, out = _run(tmp_path, _cfg(iterations=50), budget_exhausted=exhausted)
    assert out.stop_reason == "LLM budget exhausted" and out.iterations_done == 3


class _Rejecting:
    name = "llm:fake"

    def __init__(self) -> None:
        self.requests: list[MutationRequest] = []

    def propose(self, request: MutationRequest) -> Proposal:
        self.requests.append(request)
        return Proposal(request.parent.id, self.name, None, change=f"-a{len(self.requests)}\n+b",
                        rejected_reason=f"SEARCH block {len(self.requests)} not found")


def test_rejections_are_recorded_with_their_change_as_the_parents_attempts(
        tmp_path: Path) -> None:
    mut = _Rejecting()
    s, out = _run(tmp_path, _cfg(iterations=4, population=PopulationConfig(islands=1)),
                  mutators=[(mut, 1.0)])
    with RunStore.open_readonly(tmp_path) as st:
        assert st.rejection_count() == 4
        tried = st.recent_attempts(out.seed.id, 3)
    assert [(a.iteration, a.outcome, a.reason, a.change) for a in tried] == [
        (i, "rejected", f"SEARCH block {i} not found", f"-a{i}\n+b") for i in (2, 3, 4)]
    assert out.best is not None and out.best.id == out.seed.id


def test_incorrect_and_flagged_children_never_become_best(tmp_path: Path) -> None:
    class Cheated(FakeEvaluator):
        """SPLIT=True 'wins' with fitness 99 but an unresolved integrity flag."""

        def evaluate(self, source: str, suffix: str, label: str = "",
                     rival: str | None = None) -> EvalResult:
            r = super().evaluate(source, suffix, label, rival)
            if {k.name: k.value for k in find_knobs(source)}.get("SPLIT") == "True":
                return dataclasses.replace(r, verdict=Verdict.IMPLAUSIBLE, fitness=99.0,
                                           flags=("implausible 99x",))
            return r

    s, out = _run(tmp_path, _cfg(iterations=30), Cheated())
    assert out.best is not None and out.best.fitness < 99.0
    assert {k.name: k.value for k in find_knobs(out.best.source)}["SPLIT"] == "False"
    bad = {p.id for p in s.programs.values() if not p.correct}
    assert bad, "the fake should have produced flagged children"
    assert all(s.programs[i].result.verdict is Verdict.IMPLAUSIBLE for i in bad)
    with RunStore.open_readonly(tmp_path) as st:
        islands = st.load_state()["population"]["islands"]
    assert not bad & {pid for island in islands for pid in island}   # never an elite


def test_ctrl_c_stops_cleanly_and_keeps_committed_iterations(tmp_path: Path) -> None:
    class Interrupting(FakeEvaluator):
        def evaluate(self, source: str, suffix: str, label: str = "",
                     rival: str | None = None) -> EvalResult:
            if len(self.calls) == 4:
                raise KeyboardInterrupt
            return super().evaluate(source, suffix, label, rival)
    _, out = _run(tmp_path, _cfg(iterations=20), Interrupting())
    assert out.stop_reason.startswith("interrupted")
    with RunStore.open_readonly(tmp_path) as st:
        state = st.load_state()
        assert state["iteration"] == out.iterations_done == 3
        assert state["stop_reason"].startswith("interrupted")


class _SlowMutator(KnobMutator):
    """Knob mutator that sleeps a varying time (like an LLM) to exercise the pipeline."""

    blocking_io = True

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()

    def propose(self, request: MutationRequest) -> Proposal:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        time.sleep(0.01 * (request.seed % 5))
        try:
            return super().propose(request)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_pipelined_mutations_overlap_yet_stay_deterministic(tmp_path: Path) -> None:
    m1, m2 = _SlowMutator(), _SlowMutator()
    _run(tmp_path / "a", _cfg(iterations=10), mutators=[(m1, 1.0)], lookahead=3)
    _run(tmp_path / "b", _cfg(iterations=10), mutators=[(m2, 1.0)], lookahead=3)
    assert _history(tmp_path / "a") == _history(tmp_path / "b")
    assert m1.max_in_flight >= 2


def test_incorrect_seed_stops_with_its_reason(tmp_path: Path) -> None:
    _, out = _run(tmp_path, _cfg(), FakeEvaluator(fail_when={"BLOCK_M": "64"}))
    assert out.iterations_done == 0 and "seed is not correct" in out.stop_reason
    assert "BLOCK_M=64 is wrong" in out.stop_reason


@pytest.mark.parametrize("islands", [1, 3])
def test_runs_with_any_island_count(tmp_path: Path, islands: int) -> None:
    _, out = _run(tmp_path, _cfg(iterations=8, population=PopulationConfig(islands=islands)))
    assert out.iterations_done == 8


class _Scripted:
    """Proposes the given sources in turn (None: a rejection)."""

    name = "scripted"

    def __init__(self, sources: list[str | None]) -> None:
        self.sources = list(sources)

    def propose(self, request: MutationRequest) -> Proposal:
        src = self.sources.pop(0)
        if src is None:
            return Proposal(request.parent.id, self.name, None, rejected_reason="no edit")
        return Proposal(request.parent.id, self.name, src, change="scripted")


def test_migration_happens_on_schedule_even_when_that_iteration_is_rejected(
        tmp_path: Path) -> None:
    child = TOY_SEED.replace("BLOCK_M = 64 ", "BLOCK_M = 128 ")
    cfg = _cfg(iterations=2, population=PopulationConfig(islands=2, elites_per_island=3,
                                                         migration_interval=2))
    s, _ = _run(tmp_path, cfg, mutators=[(_Scripted([child, None]), 1.0)])
    with RunStore.open_readonly(tmp_path) as st:
        islands = st.load_state()["population"]["islands"]
    cid = next(p.id for p in s.programs.values() if p.iteration == 1)
    assert cid in islands[1] and cid in islands[0]     # iteration 2 migrated island 1's best


def test_the_view_counts_rejections_of_earlier_sessions_after_resume(tmp_path: Path) -> None:
    seen: list = []
    cfg = _cfg(iterations=3, population=PopulationConfig(islands=1))
    _run(tmp_path, cfg, mutators=[(_Scripted([None, TOY_SEED, None]), 1.0)])
    _run(tmp_path, dataclasses.replace(cfg, iterations=4), create=False,
         mutators=[(_Scripted([None]), 1.0)], on_progress=seen.append)
    assert (seen[-1].rejected, seen[-1].cached) == (3, 1)


def test_mixed_local_and_pooled_mutators_stay_deterministic(tmp_path: Path) -> None:
    histories = []
    for name in ("a", "b"):
        holder: dict[str, Search] = {}
        knobs = KnobMutator(0.2, is_known=lambda pid: pid in holder["s"].programs)
        cfg = _cfg(iterations=12)
        store = RunStore.open(tmp_path / name, config_to_dict(cfg), create=True)
        s = Search(cfg, store, FakeEvaluator(), [(knobs, 1.0), (_SlowMutator(), 1.0)],
                   TOY_SEED, ".py", lookahead=3)
        holder["s"] = s
        try:
            s.run()
        finally:
            store.close()
        histories.append(_history(tmp_path / name))
    assert histories[0] == histories[1]


@dataclasses.dataclass
class _Staged(FakeEvaluator):
    """Every evaluation reports 0.5 s of timing and 5 s of checks."""

    seen: list[str] = dataclasses.field(default_factory=list)

    def evaluate(self, *args: object, **kw: object) -> EvalResult:
        self.seen.append("x")                         # list.append: safe from several slots
        return dataclasses.replace(super().evaluate(*args, **kw),  # type: ignore[arg-type]
                                   stage_s={"check": 5.0, "time": 0.5})


def test_the_gpu_figure_is_the_timing_share_of_the_wall_time_per_gpu(tmp_path: Path) -> None:
    from evoattn.pool import LocalPool
    staged = _Staged()
    pool = LocalPool(["0", "1"], lambda d: staged, per_device=2)      # 4 slots on 2 GPUs
    try:
        store = RunStore.open(tmp_path, config_to_dict(_cfg(iterations=6)), create=True)
        try:
            out = Search(_cfg(iterations=6), store, pool,
                         [(KnobMutator(0.2, is_known=lambda pid: False), 1.0)], TOY_SEED,
                         ".py").run()
        finally:
            store.close()
    finally:
        pool.close()
    assert len(staged.seen) > 1
    assert out.gpu_busy == pytest.approx(0.5 * len(staged.seen) / (out.elapsed_s * 2))


class _TwoKnobs(FakeEvaluator):
    """Of 24 knobs K05 and K17 make it 10% faster each when True, eight others (K00-K03, K08,
    K09, K12, K20) 30% slower each: beside one of those a good knob's gain is hidden."""

    def score(self, source: str) -> float:
        knobs = {k.name: k.value for k in find_knobs(source)}
        good = 1.0 + 0.1 * (knobs.get("K05") == "True") + 0.1 * (knobs.get("K17") == "True")
        return good * 0.7 ** sum(knobs.get(f"K{i:02d}") == "True"
                                 for i in (0, 1, 2, 3, 8, 9, 12, 20))


def test_a_short_search_with_the_run_history_finds_the_two_knobs_that_matter(
        tmp_path: Path) -> None:
    """Coverage first (the knob mutator reads the run's earlier changes, turns each knob
    alone once and carries a one-knob gain to parents that lack it): 32 iterations over 24
    knobs, two that help and eight that hurt, find both that help in every one of 20 runs;
    drawing knobs uniformly, some runs miss one."""
    from evoattn.mutators.history import StoreHistory
    wide = TOY_SEED + "".join(f"K{i:02d} = False  # evoattn: choice(True, False)\n"
                              for i in range(24))

    def found(seed: int, with_history: bool) -> bool:
        run_dir = tmp_path / f"{seed}{with_history}"
        cfg = _cfg(iterations=32, random_seed=seed,
                   population=PopulationConfig(islands=1, elites_per_island=4))
        store = RunStore.open(run_dir, config_to_dict(cfg), create=True)
        holder: dict[str, Search] = {}
        knobs = KnobMutator(0.2, is_known=lambda pid: pid in holder["s"].programs,
                            history=StoreHistory(run_dir) if with_history else None)
        holder["s"] = s = Search(cfg, store, _TwoKnobs(), [(knobs, 1.0)], wide, ".py")
        try:
            out = s.run()
        finally:
            store.close()
        assert out.best is not None
        return out.best.fitness == pytest.approx(1.2)

    seeds = range(1, 21)
    assert all(found(seed, True) for seed in seeds)
    assert sum(found(seed, False) for seed in seeds) < len(seeds)


class _Disturbed(FakeEvaluator):
    """Every program is as fast as the seed; a child's plain evaluation reads 3x its true speed
    (a disturbed baseline), its duel beside the best the truth."""

    def score(self, source: str) -> float:
        return 1.0

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        r = super().evaluate(source, suffix, label, rival)
        if rival is not None or source == TOY_SEED or not r.correct:
            return r
        return dataclasses.replace(r, fitness=3 * r.fitness)


def test_a_lost_duel_s_log_line_shows_the_plain_reading_that_raised_the_bar(
        tmp_path: Path) -> None:
    import re
    notes: list[str] = []
    s, out = _run(tmp_path, _cfg(iterations=25), _Disturbed(),
                  on_progress=lambda p: notes.append(p.last_note))
    raised = [n for n in notes if "a duel now takes a plain reading above" in n]
    assert raised, notes
    for note in raised:
        plain = re.search(r" fitness (\d+\.\d+) \(", note).group(1)
        duel = re.search(r"\) -> (\d+\.\d+) re-measured", note).group(1)
        bar, setter = re.search(r"above (\d+\.\d+), set by this one's (\d+\.\d+)", note).groups()
        assert plain == setter == bar != duel
        assert float(plain) == pytest.approx(3 * float(duel), rel=0.01)
    # The champion's figure is never a reading that only a plain evaluation gave.
    assert out.best.id == out.seed.id and out.best.fitness == pytest.approx(1.0)
