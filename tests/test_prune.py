"""The end of a run: the best's changes from the seed set back unless they pay (prune.py)."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any
from pathlib import Path

from evoattn.contract.knobs import find_knobs
from evoattn.contract.types import EvalResult, Verdict
from evoattn.config import PopulationConfig, RunConfig, config_to_dict
from evoattn.mutators.knobs import KnobMutator
from evoattn.prune import PRUNE, apply_setbacks, change_of, costs_nothing, setbacks
from evoattn.endofrun import END_MARGIN
from evoattn.search import Search
from evoattn.store import RunStore

from fakes import TOY_SEED, FakeEvaluator, duel_result, duel_with_a_hidden_kernel_loss


@dataclasses.dataclass
class _TwoKnobsMatter(FakeEvaluator):
    """Only BLOCK_M and BLOCK_N change the speed; STAGES and SPLIT ride along for free."""

    def score(self, source: str) -> float:
        source = re.sub(r"STAGES = \d", "STAGES = 2", source)
        return super().score(re.sub(r"SPLIT = \w+", "SPLIT = False", source))


@dataclasses.dataclass
class _OnlyBlockM(FakeEvaluator):
    """Only BLOCK_M changes the speed."""

    def score(self, source: str) -> float:
        return super().score(re.sub(r"(BLOCK_N|STAGES|SPLIT) = \w+", "", source))


@dataclasses.dataclass
class _FirstDuelLucky(FakeEvaluator):
    """Every program is as fast as the seed, but a child reads 3% faster alone and its first
    duel reads it 5% faster."""

    seen: set[str] = dataclasses.field(default_factory=set)

    def score(self, source: str) -> float:
        return 1.0

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        if rival is None and source != TOY_SEED:
            return dataclasses.replace(super().evaluate(source, suffix, label), fitness=1.03,
                                       fitness_ci=(1.028, 1.032))
        if rival is None or source in self.seen:
            return super().evaluate(source, suffix, label, rival)
        self.seen.add(source)
        self.duels.append((source, rival))
        return duel_result(1.05, 1.0, 0.002)


def _knobs(source: str) -> dict[str, str]:
    return {k.key: k.value for k in find_knobs(source)}


def _run(tmp: Path, ev: FakeEvaluator, prune: bool = True, iterations: int = 25,
         random_seed: int = 6):                            # 6: a best with two free rides
    cfg = RunConfig(iterations=iterations, random_seed=random_seed,
                    population=PopulationConfig(prune=prune))
    store = RunStore.open(tmp, config_to_dict(cfg), create=True)
    s = Search(cfg, store, ev, [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py")
    return cfg, store, s


def _resume_and_prune(tmp: Path, ev: FakeEvaluator):
    """Resumes the run in `tmp` (its 25 iterations done), then its end: (best, after it)."""
    store = RunStore.open(tmp, None, create=False)
    try:
        s = Search(RunConfig(iterations=25, random_seed=6), store, ev,
                   [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py")
        out = s.run()
        return out.best, s.prune(out.best, out.seed)
    finally:
        store.close()


def test_the_rule_keeps_a_change_that_pays_in_the_whole_or_at_one_config() -> None:
    assert costs_nothing(duel_result(1.0, 1.0, 0.002))          # a tie
    assert costs_nothing(duel_result(1.01, 1.0, 0.002))         # setting back is faster
    assert not costs_nothing(duel_result(0.99, 1.0, 0.002))     # slower beyond noise
    assert costs_nothing(duel_result(0.998, 1.0, 0.005))        # slower within noise
    assert not costs_nothing(dataclasses.replace(duel_result(1.0, 1.0, 0.002),
                                                 verdict=Verdict.INCORRECT))
    # even in call time, but 0.70x in kernel time at one config: the change pays there
    assert not costs_nothing(duel_with_a_hidden_kernel_loss(0.0163))
    assert costs_nothing(duel_with_a_hidden_kernel_loss(0.0116))  # 0.983x within noise


def test_setbacks_are_the_knobs_the_best_changed_that_the_seed_s_value_fits() -> None:
    best = TOY_SEED.replace("BLOCK_M = 64", "BLOCK_M = 128").replace("STAGES = 2", "STAGES = 4")
    # an edit that changed a knob's choices so that the seed's value is no longer one of them
    best = best.replace("BLOCK_N = 32  # evoattn: choice(16, 32, 64)",
                        "BLOCK_N = 64  # evoattn: choice(64, 128)")
    found = setbacks(best, TOY_SEED)
    assert [(s.key, s.best, s.seed) for s in found] == [("BLOCK_M", "128", "64"),
                                                          ("STAGES", "4", "2")]
    assert change_of(found[:1]) == "BLOCK_M: 128 -> 64"
    assert _knobs(apply_setbacks(best, found[1:]))["STAGES"] == "2"
    assert setbacks(TOY_SEED, TOY_SEED) == []


def test_a_change_that_rode_along_is_set_back_and_one_that_pays_stays(tmp_path: Path) -> None:
    ev = _TwoKnobsMatter()
    _cfg, store, s = _run(tmp_path, ev)
    try:
        out = s.run()
        before = out.best
        seed = _knobs(out.seed.source)
        changed = {k for k, v in _knobs(before.source).items() if v != seed[k]}
        assert changed & {"STAGES", "SPLIT"}, "the run should crown a best carrying a free ride"
        assert changed & {"BLOCK_M", "BLOCK_N"}
        duels = len(ev.duels)
        after = s.prune(before, out.seed)
        # one duel per changed knob, each beside the best the phase started from
        assert len(ev.duels) - duels == len(changed)
        assert all(rival == before.source for _, rival in ev.duels[duels:])
    finally:
        store.close()
    left = {k for k, v in _knobs(after.source).items() if v != seed[k]}
    assert left == changed & {"BLOCK_M", "BLOCK_N"}                # only what pays
    assert ev.score(after.source) == ev.score(before.source)
    assert after.mutator == PRUNE and after.result.rival and costs_nothing(after.result)
    assert s.set_back == (len(changed), len(changed & {"STAGES", "SPLIT"}))
    with RunStore.open_readonly(tmp_path) as st:
        assert st.champion().id == after.id                         # committed, crowned
        record = st.pruned(after.id)
        assert st.pruned(before.id) is None                          # another best: none
        assert (record["before"], record["best"]) == (before.id, after.id)
        assert [(r["change"], r["kept_back"]) for r in record["steps"]] == \
            [(f"{k}: {_knobs(before.source)[k]} -> {seed[k]}", k in {"STAGES", "SPLIT"})
             for k in ("BLOCK_M", "BLOCK_N", "STAGES", "SPLIT") if k in changed]
        tried = [p for p in st.load_programs().values() if p.mutator == PRUNE]
        assert len(tried) == len(changed)                            # kept or not, stored
        assert all(p.iteration == out.iterations_done for p in tried)
        assert st.load_state()["iteration"] == out.iterations_done   # no iteration spent
        chain = [p.id for p in st.lineage(after.id)]
        assert before.id in chain                                    # descends from the best
    from evoattn.export import export_run
    summary = export_run(tmp_path, tmp_path / "out")
    assert summary.best_id == after.id
    assert "set back at the end of the run, costing nothing: 1.000x" in \
        (tmp_path / "out" / "lineage.md").read_text()
    readme = summary.readme.read_text()
    assert "## Changes set back at the end of the run" in readme
    assert "\nSTAGES: 4 -> 2: 1.000x [0.998, 1.002]: costs nothing, set back\n" in readme
    assert "\nBLOCK_M: 128 -> 64: 0.824x" in readme and "it pays, kept" in readme
    kept = json.loads((tmp_path / "out" / "set_back.json").read_text())
    assert kept["best"] == after.id and len(kept["steps"]) == len(changed)
    assert (summary.package_dir / "evidence" / "set_back.json").is_file()


def test_a_finished_run_resumed_holds_no_duels_again(tmp_path: Path) -> None:
    ev = _TwoKnobsMatter()
    _cfg, store, s = _run(tmp_path, ev)
    try:
        out = s.run()
        after = s.prune(out.best, out.seed)
    finally:
        store.close()
    ev2 = _TwoKnobsMatter()
    resumed_best, final = _resume_and_prune(tmp_path, ev2)
    assert resumed_best.id == after.id and final.id == after.id
    assert ev2.duels == [] and ev2.calls == []


def test_nothing_is_set_back_when_switched_off_or_when_the_best_is_the_seed(
        tmp_path: Path) -> None:
    ev = _TwoKnobsMatter()
    _cfg, store, s = _run(tmp_path / "off", ev, prune=False)
    try:
        out = s.run()
        duels = len(ev.duels)
        assert out.best.id != out.seed.id
        assert s.prune(out.best, out.seed).id == out.best.id
        assert len(ev.duels) == duels and s.set_back == (0, 0)
    finally:
        store.close()
    ev = _TwoKnobsMatter()
    _cfg, store, s = _run(tmp_path / "seed", ev, iterations=0)
    try:
        out = s.run()
        assert s.prune(out.seed, out.seed).id == out.seed.id and ev.duels == []
    finally:
        store.close()


@dataclasses.dataclass
class _SetBackFails(_TwoKnobsMatter):
    """A duel of a set-back program fails its checks (say, the seed's STAGES with the best's
    tile is wrong): the failure is stored as data and the change stays."""

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        if rival is not None and " vs " in label and "STAGES = 2" in source:
            self.duels.append((source, rival))
            return EvalResult.failure(Verdict.INCORRECT, "max error 3.1 > tolerance 0.01")
        return super().evaluate(source, suffix, label, rival)


def test_a_set_back_that_fails_its_checks_is_stored_and_the_change_stays(
        tmp_path: Path) -> None:
    ev = _SetBackFails()
    _cfg, store, s = _run(tmp_path, ev)
    try:
        out = s.run()
        lines: list[str] = []
        assert _knobs(out.best.source)["STAGES"] != "2", "the best should carry a STAGES change"
        after = s.prune(out.best, out.seed, say=lines.append)
    finally:
        store.close()
    assert _knobs(after.source)["STAGES"] == _knobs(out.best.source)["STAGES"]
    assert any("STAGES" in ln and "incorrect: max error 3.1 > tolerance" in ln and "kept" in ln
               for ln in lines), lines
    with RunStore.open_readonly(tmp_path) as st:
        failed = [p for p in st.load_programs().values()
                  if p.mutator == PRUNE and not p.correct]
        assert len(failed) == 1 and "tolerance" in failed[0].result.reason


def test_a_set_back_met_in_the_search_is_duelled_and_its_record_kept(tmp_path: Path) -> None:
    ev = _OnlyBlockM()
    _cfg, store, s = _run(tmp_path, ev, iterations=10)
    try:
        out = s.run()
        stored_before = {p.id: p.result for p in s.programs.values()}
        lines: list[str] = []
        after = s.prune(out.best, out.seed, say=lines.append)
    finally:
        store.close()
    met = [ln for ln in lines if "met in the search" in ln and "set back" in ln]
    assert met, lines                           # a program the search had evaluated plainly
    assert after.id in met[-1] and after.mutator != PRUNE
    with RunStore.open_readonly(tmp_path) as st:
        assert st.champion().id == after.id
        # its stored record stays what the search measured; the phase keeps the duel
        assert st.get_program(after.id).result == stored_before[after.id]
        step = next(r for r in st.pruned(after.id)["steps"] if r["program"] == after.id)
        assert step["kept_back"] and step["gain_ci"][0] <= 1.0 <= step["gain_ci"][1]
    assert {k for k, v in _knobs(after.source).items() if v != _knobs(TOY_SEED)[k]} == \
        {"BLOCK_M"}


def test_a_best_crowned_by_one_lucky_duel_is_set_back_to_the_seed(tmp_path: Path) -> None:
    ev = _FirstDuelLucky()
    _cfg, store, s = _run(tmp_path, ev, iterations=12)
    try:
        out = s.run()
        assert out.best.id != out.seed.id, "a lucky duel should have crowned a child"
        lines: list[str] = []
        after = s.prune(out.best, out.seed, say=lines.append)
    finally:
        store.close()
    assert after.id == out.seed.id, lines
    with RunStore.open_readonly(tmp_path) as st:
        assert st.champion().id == out.seed.id
        assert not st.get_program(out.seed.id).result.rival        # the reference stays


@dataclasses.dataclass
class _LostAfterOneDuel(_TwoKnobsMatter):
    """The evaluator goes away after the first set-back duel (a Dask cluster lost, say)."""

    held: int = 0

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        if rival is not None and " vs " in label and self.held >= 0:
            if self.held == 1:
                raise ConnectionError("scheduler tcp://127.0.0.1:8786 unreachable")
            self.held += 1
        return super().evaluate(source, suffix, label, rival)


def test_a_lost_evaluator_ends_the_phase_with_what_it_set_back(tmp_path: Path) -> None:
    ev = _LostAfterOneDuel(held=-1)                  # no limit during the search
    _cfg, store, s = _run(tmp_path, ev)
    try:
        out = s.run()
        ev.held = 0
        lines: list[str] = []
        after = s.prune(out.best, out.seed, say=lines.append)
    finally:
        store.close()
    assert any("setting back stopped (ConnectionError: scheduler" in ln for ln in lines), lines
    with RunStore.open_readonly(tmp_path) as st:
        assert st.champion().id == after.id
        assert len(st.pruned(after.id)["steps"]) == 1        # the one duel held is recorded
        assert st.pruned(after.id)["complete"] is False
    # resumed with the evaluator back: the phase goes on from the best it reached
    ev2 = _TwoKnobsMatter()
    resumed_best, final = _resume_and_prune(tmp_path, ev2)
    assert resumed_best.id == after.id
    assert ev2.duels and {k for k, v in _knobs(final.source).items()
                          if v != _knobs(TOY_SEED)[k]} == {"BLOCK_M", "BLOCK_N"}


@dataclasses.dataclass
class _Timed(_TwoKnobsMatter):
    """Each evaluation takes 5 s and each duel 10 s on a clock the search reads."""

    now: float = 0.0

    def clock(self) -> float:
        return self.now

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        self.now += 5.0 if rival is None else 10.0
        return super().evaluate(source, suffix, label, rival)


def _timed_run(tmp: Path, ev: _Timed, wall: float):
    cfg = RunConfig(iterations=200, random_seed=6, max_wall_s=wall,
                    population=PopulationConfig(prune=True))
    store = RunStore.open(tmp, config_to_dict(cfg), create=True)
    return store, Search(cfg, store, ev, [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py",
                         clock=ev.clock)


def _search_timed(tmp: Path, ev: _Timed, wall: float):
    """The search alone, to its stop: its outcome."""
    store, s = _timed_run(tmp, ev, wall)
    try:
        return s.run()
    finally:
        store.close()


def test_a_wall_time_keeps_room_for_the_end_of_the_run(tmp_path: Path) -> None:
    ev = _Timed()
    store, s = _timed_run(tmp_path, ev, wall=200.0)
    try:
        out = s.run()
        searched = ev.now
        changed = len(setbacks(out.best.source, out.seed.source))
        assert changed >= 2 and "kept for the end of the run" in out.stop_reason, out.stop_reason
        end = s.prune(out.best, out.seed)
        s.remeasure(end, out.seed)
        assert store.pruned(end.id)["complete"] is True      # every change was duelled
    finally:
        store.close()
    # the search stopped when the end's duels (10 s each: one per change, one re-measure) no
    # longer fitted; they then fitted within the wall time
    assert searched + (changed + 1) * 10.0 >= 200.0 - 15.0     # within one iteration of it
    assert ev.now <= 200.0


def test_setting_back_stops_at_the_wall_time_and_a_resumed_run_goes_on(
        tmp_path: Path) -> None:
    ev = _Timed()
    store, s = _timed_run(tmp_path, ev, wall=200.0)
    try:
        out = s.run()
        ev.now = 200.0                          # the end took longer than the search measured
        lines: list[str] = []
        duels = len(ev.duels)
        after = s.prune(out.best, out.seed, say=lines.append)
        assert after.id == out.best.id and len(ev.duels) == duels     # no duel began
        assert any("setting back stopped: wall time 200 s reached" in ln for ln in lines)
        assert store.pruned(after.id)["complete"] is False
    finally:
        store.close()
    ev2 = _TwoKnobsMatter()
    store = RunStore.open(tmp_path, None, create=False)
    try:
        s2 = Search(RunConfig(iterations=out.iterations_done, random_seed=6), store, ev2,
                    [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py")
        out2 = s2.run()
        final = s2.prune(out2.best, out2.seed)
    finally:
        store.close()
    assert out2.best.id == out.best.id and ev2.duels and final.id != out.best.id


@dataclasses.dataclass
class _TimedFlat(_Timed):
    """Every program as fast as the seed: nothing is crowned, nothing to set back."""

    def score(self, source: str) -> float:
        return 1.0


def test_a_wall_time_stops_the_run_before_its_next_iteration_would_cross_it(
        tmp_path: Path) -> None:
    ev = _TimedFlat()
    out = _search_timed(tmp_path, ev, wall=98.0)
    assert out.best.id == out.seed.id and out.stop_reason == "wall time 98 s"
    assert 98.0 - 2 * 5.0 <= ev.now <= 98.0


@dataclasses.dataclass
class _DuelsQueued(_Timed):
    """A duel takes 10 s, but the search waits 30 s for it (queued behind candidates); an
    evaluation 5 s."""

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        result = super().evaluate(source, suffix, label, rival)
        if rival is None:
            return dataclasses.replace(result, duration_s=5.0)
        self.now += 20.0
        return dataclasses.replace(result, duration_s=10.0)


def test_the_end_is_estimated_from_a_duels_own_time_not_its_wait(tmp_path: Path) -> None:
    ev = _DuelsQueued()
    out = _search_timed(tmp_path, ev, wall=200.0)
    duels = len(setbacks(out.best.source, out.seed.source)) + 1
    kept = re.search(r"its last (\d+) s kept", out.stop_reason)
    assert kept, out.stop_reason
    assert int(kept.group(1)) == round(duels * 10.0 * END_MARGIN)


@dataclasses.dataclass
class _SlowSeed(_TimedFlat):
    """The seed's evaluation takes 50 s (a cold build), every other one 5 s."""

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        if label == "seed":
            self.now += 45.0
        return super().evaluate(source, suffix, label, rival)


def test_the_next_iteration_is_estimated_without_the_seeds_start(tmp_path: Path) -> None:
    ev = _SlowSeed()
    out = _search_timed(tmp_path, ev, wall=98.0)
    assert out.stop_reason == "wall time 98 s" and 98.0 - 2 * 5.0 <= ev.now <= 98.0


def test_a_resumed_run_keeps_room_by_the_duel_that_crowned_its_best(tmp_path: Path) -> None:
    ev = _DuelsQueued()
    cfg = RunConfig(iterations=25, random_seed=6, population=PopulationConfig(prune=True))
    store = RunStore.open(tmp_path, config_to_dict(cfg), create=True)
    try:
        first = Search(cfg, store, ev, [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py",
                       clock=ev.clock).run()
    finally:
        store.close()
    assert first.best.id != first.seed.id and first.best.result.duration_s == 10.0
    store = RunStore.open(tmp_path, None, create=False)
    try:                                        # no duel yet in this session
        out = Search(dataclasses.replace(cfg, iterations=200, max_wall_s=30.0), store, ev,
                     [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py", clock=ev.clock).run()
    finally:
        store.close()
    duels = len(setbacks(first.best.source, first.seed.source)) + 1
    assert out.iterations_done == first.iterations_done
    assert f"its last {round(duels * 10.0 * END_MARGIN)} s kept" in out.stop_reason


_ROUTED = """\
import torch
ROUTE_A = True  # evoattn: choice(True, False)
TILE_A = 64  # evoattn: choice(32, 64) when(ROUTE_A=True)
WARPS_A = 4  # evoattn: choice(4, 8) when(ROUTE_A=True)
GATE = 1  # evoattn: choice(0, 1) when(ROUTE_A=True)
DEEP = 2  # evoattn: choice(2, 3) when(GATE=1)
BLOCK = 32  # evoattn: choice(32, 64)
def attention(q, k, v, causal=False, scale=None):
    return q
"""


def _routed(**values: str) -> str:
    from evoattn.contract.knobs import set_knobs
    return set_knobs(_ROUTED, values)


def test_knobs_whose_code_runs_no_call_are_set_back_together_in_one_duel() -> None:
    from evoattn.prune import asleep, duels
    # a route turned off left TILE_A and WARPS_A behind: their code runs no call in the best
    best = _routed(ROUTE_A="False", TILE_A="32", WARPS_A="8", BLOCK="64")
    steps = setbacks(best, _ROUTED)
    assert [s.key for s in asleep(steps, best)] == ["TILE_A", "WARPS_A"]
    plan = duels(steps, best)
    assert [[s.key for s in g] for g in plan] == [["TILE_A", "WARPS_A"], ["ROUTE_A"], ["BLOCK"]]
    assert change_of(plan[0]) == "TILE_A: 32 -> 64, WARPS_A: 8 -> 4"
    # GATE asleep too, but setting it back to 1 would wake DEEP (when(GATE=1) only): no group
    woken = _routed(ROUTE_A="False", TILE_A="32", GATE="0", DEEP="3")
    assert asleep(setbacks(woken, _ROUTED), woken) == []
    assert len(duels(setbacks(woken, _ROUTED), woken)) == 4
    # one sleeping change alone is a duel either way; a running route keeps them all awake
    one = _routed(ROUTE_A="False", TILE_A="32")
    assert asleep(setbacks(one, _ROUTED), one) == []
    awake = _routed(TILE_A="32", WARPS_A="8")
    assert asleep(setbacks(awake, _ROUTED), awake) == []
    # a fact rules code out as a knob's value does
    gated = _ROUTED.replace("when(ROUTE_A=True)", "when(@target=sm90)")
    best = gated.replace("TILE_A = 64", "TILE_A = 32").replace("WARPS_A = 4", "WARPS_A = 8")
    assert len(asleep(setbacks(best, gated), best, {"target": "cpu"})) == 2
    assert asleep(setbacks(best, gated), best, {"target": "sm90"}) == []


@dataclasses.dataclass
class _RouteAndBlock(FakeEvaluator):
    """Only ROUTE_A and BLOCK change the speed (both pay at their best's values); with
    `sleepers_cost`, the knobs behind a route that is off cost anyway (their conditions lie)."""

    sleepers_cost: bool = False

    def score(self, source: str) -> float:
        k = _knobs(source)
        s = 1.0 + 0.05 * (k["ROUTE_A"] == "False") + 0.05 * (k["BLOCK"] == "64")
        return s + 0.04 * (self.sleepers_cost and k["TILE_A"] == "32")


def _prune_a_best(tmp: Path, ev: FakeEvaluator, best_source: str) -> tuple[Any, list[str]]:
    """Crowns `best_source` over the seed _ROUTED, then runs the end of the run: (the best
    after it, the lines it said)."""
    from evoattn.types import Program, program_id
    cfg = RunConfig(iterations=0, population=PopulationConfig(prune=True))
    store = RunStore.open(tmp, config_to_dict(cfg), create=True)
    try:
        s = Search(cfg, store, ev, [(KnobMutator(0.0), 1.0)], _ROUTED, ".py",
                   facts={"target": "sm90"})
        out = s.run()
        best = Program(program_id(best_source), best_source, ".py", out.seed.id, 0, 0, "knobs",
                       "by hand", ev.evaluate(best_source, ".py"))
        assert s._pop is not None
        s._pop.add(best)
        s._pop.crown(best)
        lines: list[str] = []
        return s.prune(best, out.seed, say=lines.append), lines
    finally:
        store.close()


def test_the_end_of_a_run_holds_one_duel_for_the_knobs_a_route_left_behind(
        tmp_path: Path) -> None:
    best = _routed(ROUTE_A="False", TILE_A="32", WARPS_A="8", BLOCK="64")
    ev = _RouteAndBlock()
    after, lines = _prune_a_best(tmp_path, ev, best)
    assert len(ev.duels) == 3, lines        # one for the two sleepers, one per other change
    assert any("TILE_A: 32 -> 64, WARPS_A: 8 -> 4 (code that runs no call)" in ln
               and "costs nothing, set back" in ln for ln in lines), lines
    assert {k: v for k, v in _knobs(after.source).items() if v != _knobs(_ROUTED)[k]} == \
        {"ROUTE_A": "False", "BLOCK": "64"}
    with RunStore.open_readonly(tmp_path) as st:
        steps = st.pruned(after.id)["steps"]
    assert [s.get("runs_no_call", False) for s in steps] == [True, False, False]


def test_sleepers_that_cost_after_all_are_tried_one_at_a_time(tmp_path: Path) -> None:
    best = _routed(ROUTE_A="False", TILE_A="32", WARPS_A="8", BLOCK="64")
    ev = _RouteAndBlock(sleepers_cost=True)
    after, lines = _prune_a_best(tmp_path, ev, best)
    assert len(ev.duels) == 5, lines        # the group, then TILE_A, WARPS_A, ROUTE_A, BLOCK
    assert any("costs beyond noise, each tried alone" in ln for ln in lines), lines
    # TILE_A's lie is caught and it stays; WARPS_A is set back
    assert {k: v for k, v in _knobs(after.source).items() if v != _knobs(_ROUTED)[k]} == \
        {"ROUTE_A": "False", "BLOCK": "64", "TILE_A": "32"}


def test_an_end_that_tried_no_change_is_not_shown(tmp_path: Path) -> None:
    store = RunStore.open(tmp_path, config_to_dict(RunConfig()), create=True)
    try:
        store.record_pruned("b1", "b1", [], True)      # every set-back had failed in the search
        assert store.pruned("b1")["complete"] and store.set_back("b1") is None
        step = {"change": "STAGES: 4 -> 2", "program": "p2", "met": False, "kept_back": True,
                "verdict": "pass", "reason": "", "gain": 1.0, "gain_ci": [0.99, 1.01]}
        store.record_pruned("b1", "p2", [step], True)
        assert store.set_back("p2")["steps"] == [step] and store.set_back("b1") is None
    finally:
        store.close()
