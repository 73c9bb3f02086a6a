"""Noise as data: intervals, adaptive rounds, the champion challenge, a busy GPU."""
from __future__ import annotations

import dataclasses
import json
import re
import random
import statistics
from pathlib import Path

import pytest

from evoattn.contract import stats
from evoattn.child.timing import FLOOR, Plan, adapt
from evoattn.contract.types import EvalResult, Verdict
from evoattn.config import RunConfig, config_to_dict
from evoattn.mutators.knobs import KnobMutator, find_knobs
from evoattn.search import Search, beats
from evoattn.store import RunStore

from fakes import TOY_SEED, FakeEvaluator, duel_result, duel_with_a_hidden_kernel_loss, timed


# ---- intervals -------------------------------------------------------------------------------
def test_a_median_interval_holds_the_median_and_narrows_with_more_rounds() -> None:
    rng = random.Random(1)
    few = [1.0 + rng.gauss(0, 0.05) for _ in range(6)]
    many = [1.0 + rng.gauss(0, 0.05) for _ in range(60)]
    lo, hi = stats.median_ci(few)
    assert lo <= statistics.median(few) <= hi
    assert stats.rel_half_width(statistics.median(many), stats.median_ci(many)) < \
        stats.rel_half_width(statistics.median(few), (lo, hi))
    assert stats.median_ci([1.0]) is None


def test_pairing_cancels_what_both_functions_see_in_a_round() -> None:
    # Each round's host state slows both functions alike (x1..x1.5); the candidate is truly
    # 10% faster. Paired, the ratio is known tightly; resampled apart, it is not.
    rng = random.Random(2)
    drift = [1.0 + 0.5 * rng.random() for _ in range(20)]
    base = [2.0 * d for d in drift]
    cand = [2.0 / 1.1 * d * (1 + rng.gauss(0, 0.002)) for d in drift]
    point, paired = stats.ratio(base, cand, paired=True)
    _, apart = stats.ratio(base, cand, paired=False)
    assert point == pytest.approx(1.1, rel=0.01)
    assert paired[0] > 1.09 and paired[1] < 1.11
    assert stats.rel_half_width(point, apart) > 5 * stats.rel_half_width(point, paired)


def test_a_paired_ratio_is_the_median_of_the_units_ratios() -> None:
    # A host that flips between a fast and a slow state (x1.25) from one batch to the next;
    # candidate and baseline are equally fast. In 20 rounds both batches saw the same state,
    # in 7 only the baseline's was slow, in 3 only the candidate's. Each function's own median
    # then lands in a different state (the baseline's between the two, the candidate's fast),
    # so their ratio reads 1.12; the rounds' ratios are mostly 1.
    rng = random.Random(5)
    states = [(1.0, 1.0)] * 12 + [(1.25, 1.25)] * 8 + [(1.25, 1.0)] * 7 + [(1.0, 1.25)] * 3
    base = [20.0 * b * (1 + rng.gauss(0, 0.003)) for b, _ in states]
    cand = [20.0 * c * (1 + rng.gauss(0, 0.003)) for _, c in states]
    assert statistics.median(base) / statistics.median(cand) > 1.08   # what medians would say
    point, (lo, hi) = stats.ratio(base, cand, paired=True)
    assert point == pytest.approx(1.0, abs=0.01)
    assert lo <= 1.0 <= hi
    # Measured apart, the rounds do not pair: each side's center, each resampled alone.
    assert stats.ratio(base, cand, paired=False)[0] == pytest.approx(
        stats.center(base)[0] / stats.center(cand)[0])


def test_a_pair_of_rounds_cancels_what_a_position_in_the_round_adds() -> None:
    # The order is reversed every round; whichever function runs first in a round reads 3%
    # slow (the pause before the round). Candidate and baseline are equally fast. Round by
    # round the ratios fall in two clusters, 0.97 and 1.03, and a median of 13 rounds lands
    # in one of them; each pair of rounds holds both orders, so its ratio is 1.
    rng = random.Random(7)
    cand, base = [], []
    for r in range(13):
        first = 1.03
        c, b = (first, 1.0) if r % 2 == 0 else (1.0, first)
        cand.append(10 * c * (1 + rng.gauss(0, 0.001)))
        base.append(10 * b * (1 + rng.gauss(0, 0.001)))
    by_round = statistics.median(b / c for b, c in zip(base, cand))
    assert abs(by_round - 1) > 0.025                         # what rounds alone would say
    point, ci = stats.ratio(base, cand, paired=True)
    assert point == pytest.approx(1.0, abs=0.003)
    assert stats.rel_half_width(point, ci) < 0.005
    # a function's own time: the median of pair means, the same balance
    assert stats.center(cand)[0] == pytest.approx(10 * 1.015, rel=0.003)
    assert stats.units([1.0, 3.0, 5.0]) == [2.0, 5.0]          # an odd last round alone
    assert stats.ratio_units([2.0, 4.0], [1.0, 1.0]) == [3.0]


def test_rounds_stop_only_after_a_whole_pair_and_the_rule_is_asked_every_round() -> None:
    plan = Plan(warmup=1, reps=40, rounds=40, graph_rounds=40, sets=8, graph=True, mode="call")
    asked = []

    def rule(mode: str, samples: dict[str, list[float]]) -> bool:
        asked.append(len(samples["candidate"]))
        return len(samples["candidate"]) >= 7            # converged from the 7th round on
    got = adapt("call", ["candidate", "baseline:sdpa"], plan, rule, _noisy_rounds(0.01))
    assert len(got["candidate"]) == 8
    assert asked == [6, 7, 8]        # past the floor, after each round: the same pause for both
    assert FLOOR["call"] % 2 == 0 and all(v % 2 == 0 for v in FLOOR.values())
    assert Plan.for_device(True, 10, 31, set_bytes=2 ** 20).rounds == 32


def test_a_config_s_speedup_is_its_paired_ratio_where_rounds_were_shared() -> None:
    from evoattn.contract.scoring import score
    from evoattn.contract.types import ConfigResult, Times
    states = [1.0] * 5 + [1.25] * 6           # the baseline's batches: its median slow
    flips = [1.0] * 5 + [1.25] * 3 + [1.0] * 3   # the candidate's, same rounds: its median fast
    cand_s = [10.0 * f for f in flips]
    base_s = [10.0 * s for s in states]
    cand = Times(call_ms=statistics.median(cand_s))
    base = Times(call_ms=statistics.median(base_s))
    checked = ConfigResult(params={"B": 1}, dtype="float16", verdict=Verdict.PASS)
    rounds = {"call": {"candidate": cand_s, "baseline:sdpa": base_s}}
    paired = score(checked, cand, {"sdpa": base}, {}, "call", "best", 1e9, None, samples=rounds)
    apart = score(checked, cand, {"sdpa": base}, {}, "call", "best", 1e9, None, samples=rounds,
                  given=True)
    ratios = sorted(b / c for b, c in zip(base_s, cand_s))
    assert paired.speedup == pytest.approx(ratios[len(ratios) // 2]) == pytest.approx(1.0)
    assert apart.speedup == pytest.approx(base.call_ms / cand.call_ms) == pytest.approx(1.25)
    assert paired.speedup_ci is not None and paired.speedup_ci[0] <= 1.0


def test_the_geometric_mean_interval_comes_from_the_configs_intervals() -> None:
    lo, hi = stats.geomean_ci([1.0, 1.0, 1.0, 1.0], [(0.98, 1.02)] * 4)
    assert lo == pytest.approx(0.99, abs=0.002) and hi == pytest.approx(1.01, abs=0.002)
    assert stats.geomean_ci([1.0, 2.0], [(0.9, 1.1), None]) is None


# ---- adaptive rounds ----------------------------------------------------------------------------
def _noisy_rounds(noise: float, seed: int = 3):  # noqa: ANN202
    rng = random.Random(seed)

    def one_round(r: int, order: list[str], samples: dict[str, list[float]]) -> None:
        for name in order:
            samples[name].append(1.0 * (1 + rng.gauss(0, noise)))
    return one_round


def test_quiet_timings_stop_at_the_floor_and_noisy_ones_at_the_cap() -> None:
    plan = Plan(warmup=1, reps=40, rounds=40, graph_rounds=40, sets=8, graph=True, mode="call")
    quiet = adapt("call", ["candidate", "baseline:sdpa"], plan, None, _noisy_rounds(0.0005))
    noisy = adapt("call", ["candidate", "baseline:sdpa"], plan, None, _noisy_rounds(0.2))
    assert len(quiet["candidate"]) == FLOOR["call"]
    assert len(noisy["candidate"]) == 40


def test_rounds_stop_once_the_ratio_is_known_within_the_width() -> None:
    from evoattn.contract.scoring import converged_rule
    plan = Plan(warmup=1, reps=60, rounds=60, graph_rounds=60, sets=8, graph=True, mode="call")
    rule = converged_rule("best", 0.01, False, "call")
    got = adapt("call", ["candidate", "baseline:sdpa"], plan, rule, _noisy_rounds(0.01))
    n = len(got["candidate"])
    assert FLOOR["call"] < n < 60
    point, ci = stats.ratio(got["baseline:sdpa"], got["candidate"], paired=True)
    assert stats.rel_half_width(point, ci) <= 0.01
    shorter = {k: v[:-2] for k, v in got.items()}   # one pair fewer was not yet enough
    assert not rule("call", shorter)


def test_a_looser_width_stops_sooner_and_leaves_graph_mode_out_unless_it_is_the_fitness() -> None:
    from evoattn.contract.scoring import converged_rule
    tight = Plan.for_device(True, 10, 60, set_bytes=2 ** 20, mode="call", width=0.01)
    loose = Plan.for_device(True, 10, 60, set_bytes=2 ** 20, mode="call", width=0.03,
                            graph=False)
    assert (tight.width, tight.graph, loose.width, loose.graph) == (0.01, True, 0.03, False)
    assert Plan.for_device(True, 10, 60, 2 ** 20, mode="graph", graph=False).graph
    n = {}
    for plan in (tight, loose):
        rule = converged_rule("best", plan.width, False, "call")
        got = adapt("call", ["candidate", "baseline:sdpa"], plan, rule, _noisy_rounds(0.01))
        n[plan.width] = len(got["candidate"])
    assert FLOOR["call"] <= n[0.03] < n[0.01]


def test_a_request_s_width_and_graph_reach_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    from evoattn.child import measure
    from evoattn.contract.request import EvalRequest
    seen = []
    real = Plan.for_device

    def spy(*a, **kw):  # noqa: ANN001, ANN002, ANN003
        plan = real(*a, **kw)
        seen.append(plan)
        raise RuntimeError("enough")
    monkeypatch.setattr(measure.Plan, "for_device", spy)
    req = EvalRequest(device="cuda", width=0.04, graph=False, heat=False)
    ctx = measure.TimingContext(None, req, None, None, "float16", None, None, {}, {})  # type: ignore
    case = type("C", (), {"cfg": {}, "trials": [type("T", (), {"inputs": {}})()],
                          "gen": type("G", (), {"manual_seed": lambda self, s: None})()})()
    ctx = dataclasses.replace(ctx, problem=type("P", (), {"random_inputs": ()})())
    with pytest.raises(RuntimeError, match="enough"):
        measure.time_case(ctx, case, lambda i, c: None, __import__("random").Random(0),
                          None, [])  # type: ignore[arg-type]
    assert (seen[0].width, seen[0].graph, seen[0].mode, seen[0].heat) == (0.04, False, "call",
                                                                          False)


def test_other_modes_get_a_fixed_few_rounds() -> None:
    plan = Plan(warmup=1, reps=40, rounds=40, graph_rounds=40, sets=8, graph=True, mode="call")
    got = adapt("kernel", ["candidate"], plan, None, _noisy_rounds(0.3))
    assert len(got["candidate"]) == plan.bounds("kernel")[0] == plan.bounds("kernel")[1]


def test_a_call_batch_lasts_long_enough_and_fits_in_memory() -> None:
    plan = Plan.for_device(True, 10, 50, set_bytes=50 * 2 ** 20)
    assert plan.call_sets(0.05) == 40                  # 2 ms of 50 µs calls
    assert plan.call_sets(5.0) == 8                    # at least 8 distinct sets
    big = Plan.for_device(True, 10, 50, set_bytes=3 * 2 ** 30)
    assert big.call_sets(0.01) == 2                    # 4 GB allows two


# ---- the champion challenge ---------------------------------------------------------------------
@dataclasses.dataclass
class _NoisyEvaluator(FakeEvaluator):
    """True speeds from the knobs; a stand-alone evaluation of `lucky` reads 30% fast (one
    lucky measurement); duels measure the truth within 0.5%."""

    lucky: str = ""

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        r = super().evaluate(source, suffix, label, rival)
        if rival is None and self.lucky and self.lucky in source:
            return dataclasses.replace(r, fitness=r.fitness * 1.3)
        return r


def _search(tmp: Path, ev: FakeEvaluator, iterations: int) -> tuple[Search, object]:
    cfg = RunConfig(iterations=iterations, random_seed=5)
    store = RunStore.open(tmp, config_to_dict(cfg), create=True)
    s = Search(cfg, store, ev, [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py")
    try:
        out = s.run()
    finally:
        store.close()
    return s, out


def test_a_lucky_measurement_does_not_make_a_champion(tmp_path: Path) -> None:
    # Every child differs from the seed in some knob; the seed's speed comes from BLOCK_M=64,
    # BLOCK_N=32, STAGES=2, so a child that only changes SPLIT to False... is the seed.
    # Children that read lucky here are as fast as the seed in truth.
    ev = _NoisyEvaluator(lucky="STAGES = 2")
    s, out = _search(tmp_path, ev, 12)
    lucky = [p for p in s.programs.values() if p.id != out.seed.id and "STAGES = 2" in p.source
             and ev.score(p.source) <= ev.score(out.seed.source)]
    assert lucky, "the run should have met a lucky, not faster, child"
    assert ev.duels, "a child reading above the best must be re-measured head to head"
    for p in lucky:
        assert out.best.id != p.id
    # what is stored for a challenger is its re-measured fitness, not the lucky one
    for source, _rival in ev.duels:
        stored = next(p for p in s.programs.values() if p.source == source)
        assert stored.fitness == pytest.approx(ev.score(source))


def test_a_truly_faster_child_is_crowned_after_its_duel(tmp_path: Path) -> None:
    ev = FakeEvaluator()
    s, out = _search(tmp_path, ev, 25)
    assert out.best.id != out.seed.id
    assert ev.score(out.best.source) > ev.score(out.seed.source)
    assert any(src == out.best.source for src, _ in ev.duels)
    assert out.best.result.gain_ci[0] > 1.0
    with RunStore.open_readonly(tmp_path) as st:
        assert st.load_state()["population"]["champion"] == out.best.id


def test_the_log_line_of_a_crowned_child_names_its_change_in_full(tmp_path: Path) -> None:
    """A user reading `evoattn run --quiet` sees which knobs made each new best: the change
    comes before the duel's verdict, and the line is not cut."""
    import io

    from rich.console import Console

    from evoattn.progress import EventLog, LiveView

    out = io.StringIO()
    view = LiveView(Console(file=out, width=80), True, EventLog(tmp_path / "events.jsonl"),
                    "cpu")
    cfg = RunConfig(iterations=25, random_seed=5)
    store = RunStore.open(tmp_path / "run", config_to_dict(cfg), create=True)
    ev = FakeEvaluator()
    s = Search(cfg, store, ev, [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py",
               on_progress=view.update)
    try:
        result = s.run()
    finally:
        store.close()
    crowned = [ln for ln in out.getvalue().splitlines() if ln.endswith(": new best")]
    assert crowned, out.getvalue()[-2000:]
    best = result.best
    assert any(f"({best.change}) -> " in ln for ln in crowned), (best.change, crowned)
    assert any(len(ln) > 120 for ln in crowned)           # wider than the console: not cut
    # a note that quotes a server's answer stays one line, of bounded length
    from evoattn.progress import log_note
    assert log_note("llm: rejected: HTTP 500: oops\n<html>...") == "llm: rejected: HTTP 500: oops"
    assert len(log_note("x" * 1000)) == 400 and log_note("") == ""


@dataclasses.dataclass
class _WideEvaluator(FakeEvaluator):
    """Every program is as fast as the seed; a child's plain evaluation reads 2% above the
    truth with an interval of +-5%: it reads above the seed, but its interval reaches the
    seed's figure, so it is never re-measured and never crowned."""

    def score(self, source: str) -> float:
        return 1.0

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        r = super().evaluate(source, suffix, label, rival)
        if rival is not None or not r.correct or source == TOY_SEED:
            return r
        f = r.fitness * 1.02
        return dataclasses.replace(r, fitness=f, fitness_ci=(f * 0.95, f * 1.05))


def test_export_and_report_take_the_champion_not_an_unconfirmed_higher_reading(
        tmp_path: Path) -> None:
    from evoattn.export import export_run
    from evoattn.report_data import load_run

    ev = _WideEvaluator()
    s, out = _search(tmp_path, ev, 12)
    above = [p for p in s.programs.values() if p.correct and p.fitness > out.best.fitness]
    assert above, "the run should hold a child that read above the champion"
    assert not ev.duels and out.best.id == out.seed.id
    summary = export_run(tmp_path, tmp_path / "out")
    assert summary.best_id == out.best.id
    assert (tmp_path / "out" / f"best{out.best.suffix}").read_text() == out.best.source
    rows = json.loads(summary.leaderboard_json.read_text())
    assert rows[0]["id"] in {p.id for p in above} and not rows[0]["exported"]
    assert [r["id"] for r in rows if r["exported"]] == [out.best.id]
    md = summary.leaderboard_md.read_text()
    assert f"`{out.best.id}` (**best**)" in md and "read faster only in its own evaluation" in md
    assert load_run(tmp_path).best.id == out.best.id


def test_a_resumed_run_holds_plain_children_to_the_same_bar(tmp_path: Path) -> None:
    """The crowned best's plain figure is kept with the population: after a resume, children
    as fast as it are not sent to duels for reading above its stored (duel) figure."""
    ev = _HeatEvaluator()
    first, out = _search(tmp_path, ev, 25)
    assert out.best.id != out.seed.id
    bar = first._plain_fitness[out.best.id]
    with RunStore.open_readonly(tmp_path) as st:
        assert st.load_state()["population"]["plain_bar"] == {out.best.id: bar}
    champ = first.programs[out.best.id]
    stages = re.search(r"STAGES = (\d)", champ.source).group(1)
    peer = champ.source.replace(f"STAGES = {stages}", f"STAGES = {'3' if stages != '3' else '4'}")
    ev2 = _HeatEvaluator()
    assert ev2.score(peer) == ev2.score(champ.source)         # as fast as the best
    cfg = RunConfig(iterations=60, random_seed=5)
    store = RunStore.open(tmp_path, config_to_dict(cfg), create=False)
    try:
        second = Search(cfg, store, ev2, [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py")
        pop, _ = second._start()                              # the resume
        assert second._plain_fitness[out.best.id] == bar
        plain = ev2.evaluate(peer, ".py")                     # reads 2% above the truth
        second._challenge(pop, "peer", peer, plain)
        assert not ev2.duels
        second._plain_fitness.clear()                         # the bar forgotten: a duel
        second._challenge(pop, "peer", peer, plain)
        assert ev2.duels
    finally:
        store.close()


def test_lost_duels_raise_the_bar_so_the_same_noise_costs_one_duel(tmp_path: Path) -> None:
    """Children that run the best's code read 1-3% above it in their plain evaluations (the
    noise of their processes). Each duel shows one within noise of the best, which could have
    read as high: only a reading above every earlier one is sent to a duel. A child faster in
    truth, reading above them all, still gets its duel and is crowned."""
    ev = FakeEvaluator()
    cfg = RunConfig(iterations=10, random_seed=5)
    store = RunStore.open(tmp_path, config_to_dict(cfg), create=True)
    try:
        s = Search(cfg, store, ev, [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py")
        pop, seed = s._start()
        truth = ev.score(seed.source)

        def plain(source: str, reading: float) -> EvalResult:
            return dataclasses.replace(ev.evaluate(source, ".py"), fitness=reading,
                                       fitness_ci=(reading * 0.998, reading * 1.002))
        sent = []
        for i, up in enumerate((1.02, 1.01, 1.015, 1.03, 1.025)):
            before = len(ev.duels)
            s._challenge(pop, f"peer{i}", seed.source, plain(seed.source, truth * up))
            sent.append(len(ev.duels) > before)
        assert sent == [True, False, False, True, False]
        assert s._plain_fitness[seed.id] == pytest.approx(truth * 1.03)
        assert pop.best().id == seed.id
        faster = TOY_SEED.replace("STAGES = 2", "STAGES = 4")
        assert ev.score(faster) > truth * 1.03
        _, won, _ = s._challenge(pop, "faster", faster, plain(faster, ev.score(faster)))
        assert won and len(ev.duels) == 3
    finally:
        store.close()


def test_a_duel_within_noise_is_not_a_win() -> None:
    assert not beats(duel_result(1.004, 1.0, 0.01))        # 1.004 [0.994, 1.014]
    assert beats(duel_result(1.05, 1.0, 0.01))
    assert not beats(dataclasses.replace(duel_result(1.05, 1.0, 0.01),
                                         verdict=Verdict.EVALUATOR_FAULT))


def test_the_end_of_run_summary_says_when_there_is_no_gain_beyond_noise() -> None:
    from evoattn.report import side_by_side_lines
    same = side_by_side_lines(duel_result(1.002, 1.0, 0.01), "seed1", "best1")
    assert any("no gain beyond noise" in line for line in same)
    assert any("seed 1.0000 -> best 1.0020" in line for line in same)
    faster = side_by_side_lines(duel_result(1.1, 1.0, 0.01), "seed1", "best1")
    assert any("the best is faster" in line for line in faster)


def test_a_kernel_time_loss_that_call_time_hides_is_named_per_config() -> None:
    """A best as fast as the seed in call time (the loss sits at a config whose call is the
    host's) but 0.70x in kernel time there: the summary and `eval --rival` name that config
    in kernel time, not in call time; a loss within noise is not named."""
    from evoattn.report import duel_lines
    from evoattn.report import side_by_side_lines
    lines = side_by_side_lines(duel_with_a_hidden_kernel_loss(0.0163), "seed1", "best1")
    text = "\n".join(lines)
    kernel_at = next(i for i, line in enumerate(lines) if line.startswith("  kernel time"))
    assert "slower than the seed beyond noise, by 3% or more, at (1,8,512,64) 0.699x" in \
        lines[kernel_at + 1]
    assert "(4,16,4096,128)" not in text
    call_at = next(i for i, line in enumerate(lines) if line.startswith("  call time"))
    assert "slower than the seed beyond noise" not in lines[call_at + 1]
    assert any("in kernel time the candidate is slower beyond noise, by 3% or more, at "
               "(1,8,512,64)" in line
               for line in duel_lines(duel_with_a_hidden_kernel_loss(0.0163)))
    within = duel_with_a_hidden_kernel_loss(0.0116)      # 0.983x, each side +-2%
    assert not any("slower than the seed beyond noise" in line
                   for line in side_by_side_lines(within, "s", "b"))
    assert not any("candidate is slower beyond noise" in line for line in duel_lines(within))
    # beyond noise but under MATERIAL_LOSS: 0.980x, each side +-0.2%, as identical code read once
    slight = dataclasses.replace(within, configs=tuple(
        dataclasses.replace(c, times=timed(c.times.call_ms, 0.0114 / 0.98, 0.002),
                            rival_times=timed(c.rival_times.call_ms, 0.0114, 0.002))
        if c.params["S"] == 512 else c for c in within.configs))
    from evoattn.contract.scoring import config_gain_in_mode
    gain, ci = config_gain_in_mode(slight.configs[0], "kernel")
    assert round(gain, 3) == 0.980 and ci[1] < 1.0
    assert not any("slower than the seed beyond noise" in line
                   for line in side_by_side_lines(slight, "s", "b"))


def test_the_end_of_run_re_measurement_is_kept_and_exported_with_its_best(
        tmp_path: Path) -> None:
    """The seed and best re-measured side by side at the end are stored in the run (the
    terminal's summary is not the only copy) and the export carries them, for that best only."""
    from evoattn.export import export_run
    ev = _HeatEvaluator()
    cfg = RunConfig(iterations=25, random_seed=5)
    store = RunStore.open(tmp_path, config_to_dict(cfg), create=True)
    try:
        s = Search(cfg, store, ev, [(KnobMutator(0.0), 1.0)], TOY_SEED, ".py")
        out = s.run()
        assert out.best.id != out.seed.id
        duel = s.remeasure(out.best, out.seed)
        assert duel is not None and duel.rival_fitness
        assert s.remeasure(out.seed, out.seed) is None                 # nothing to compare
    finally:
        store.close()
    with RunStore.open_readonly(tmp_path) as st:
        seed_id, stored = st.side_by_side(out.best.id)
        assert seed_id == out.seed.id and stored.gain == duel.gain
        assert st.side_by_side(out.seed.id) is None                    # another best: none
    summary = export_run(tmp_path, tmp_path / "out")
    kept = json.loads((tmp_path / "out" / "side_by_side.json").read_text())
    assert (kept["seed"], kept["best"]) == (out.seed.id, out.best.id)
    assert kept["gain"] == duel.gain and kept["rival_fitness"] == duel.rival_fitness
    readme = summary.readme.read_text()
    assert "## Beside the run's seed" in readme
    assert f"seed ({out.seed.id}) and best ({out.best.id}) re-measured side by side" in readme
    assert f"best vs seed {duel.gain:.3f}x" in readme
    assert (summary.package_dir / "evidence" / "side_by_side.json").is_file()


def test_an_export_without_an_end_of_run_re_measurement_says_nothing_of_one(
        tmp_path: Path) -> None:
    from evoattn.export import export_run
    _search(tmp_path, _HeatEvaluator(), 25)                             # no remeasure called
    summary = export_run(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out" / "side_by_side.json").exists()
    assert "Beside the run's seed" not in summary.readme.read_text()
    assert not (tmp_path / "out" / "set_back.json").exists()                # nor of setting back
    assert "Changes set back" not in summary.readme.read_text()


def test_the_summary_headline_is_the_side_by_side_re_measurement() -> None:
    """The run's own figures (the seed measured once, the best measured at its best) are
    printed as "during the search"; the headline and per-config lines are the duel's."""
    from types import SimpleNamespace

    from rich.console import Console

    from evoattn.runner import _summary
    seed = SimpleNamespace(id="seed1", fitness=0.8282, result=None)
    best = SimpleNamespace(id="best1", fitness=0.9040, result=duel_result(0.9040, 0.8282, 0.01))
    outcome = SimpleNamespace(seed=seed, best=best, iterations_done=32, stop_reason="wall time",
                              elapsed_s=480.0, run_elapsed_s=480.0)
    search = SimpleNamespace(challenges=(2, 2), programs={}, evaluated_this_session=0,
                             llm_totals=dict, set_back=(3, 2))
    console = Console(record=True, width=200)
    _summary(console, outcome, search, SimpleNamespace(device="cuda"),
             duel_result(0.8853, 0.8238, 0.01))
    text = console.export_text()
    assert "seed fitness 0.8238 -> best fitness 0.8853 (best1, call time, re-measured side by " \
           "side)" in text
    assert "during the search 0.8282 -> 0.9040" in text
    assert "0.824x -> 0.885x vs baseline\n" in text        # the duel's per-config speedups
    # a config whose call times the host set says so
    import dataclasses

    from evoattn.contract.types import Times
    duel = duel_result(0.8853, 0.8238, 0.01)
    launch_bound = dataclasses.replace(duel, configs=tuple(
        dataclasses.replace(c, times=Times(call_ms=0.02, issue_us=19.0)) for c in duel.configs))
    marked = Console(record=True, width=200)
    _summary(marked, outcome, search, SimpleNamespace(device="cuda"), launch_bound)
    assert "0.824x -> 0.885x vs baseline (host-bound: the host's speed sets it)" in \
        marked.export_text()
    assert "changes from the seed set back at the end: 2 of 3 cost nothing" in text
    alone = Console(record=True, width=200)
    _summary(alone, outcome, search, SimpleNamespace(device="cuda"), None)
    assert "seed fitness 0.8282 -> best fitness 0.9040 (best1, call time)" in alone.export_text()


# ---- a busy GPU --------------------------------------------------------------------------------
class _BusyTimer:
    """Reports event times that the host clock contradicts: for the candidate only (hidden
    work), or for every function (another process keeps the GPU busy)."""

    def __init__(self, everyone: bool) -> None:
        self.everyone = everyone
        self.measures = 0

    def measure(self, fns, inputs, random_names, refill, plan, keep, rng, *_, **__):  # noqa: ANN001, ANN002, ANN003
        from evoattn.child.timing import Measurement
        from evoattn.contract.types import Times
        self.measures += 1
        slow = {n for n in fns if self.everyone or n == "candidate"}
        times = {n: Times(kernel_ms=1.0, call_ms=1.0, host_us=10.0) for n in fns}
        return Measurement(times, [], {n: None for n in fns},
                           {n: (3.0 if n in slow else 1.0) for n in fns},
                           {n: 0.01 for n in fns})


def _time_on(timer: _BusyTimer):  # noqa: ANN202
    import torch

    from evoattn.child import measure
    from evoattn.child.cases import prepare_case
    from evoattn.child.checking import Fail
    from evoattn.child.measure import TimingContext, time_case
    from evoattn.problems import get_problem
    from evoattn.contract.request import EvalRequest
    from evoattn.contract.types import ConfigResult

    problem = get_problem("sdpa")
    cfg = dict(problem.cpu_configs[0])
    rng = random.Random(7)
    case = prepare_case(problem, cfg, False, torch.float16, torch.device("cpu"), rng, 1,
                        problem.tolerance)
    ctx = TimingContext(problem, EvalRequest(device="cuda"), timer, problem.tolerance, "float16",
                        None, None, problem.baselines(), {})
    checked = ConfigResult(cfg, "float16", Verdict.PASS)
    old = measure.CONTENTION_PAUSE_S
    measure.CONTENTION_PAUSE_S = 0.0
    try:
        time_case(ctx, case, lambda inp, c: problem.baseline(inp, c), rng, checked, [])
    except Fail as f:
        return f
    finally:
        measure.CONTENTION_PAUSE_S = old
    return None


def test_a_busy_gpu_is_an_evaluator_condition_not_a_verdict() -> None:
    timer = _BusyTimer(everyone=True)
    fail = _time_on(timer)
    assert fail is not None and fail.verdict is Verdict.EVALUATOR_FAULT
    assert "busy with other work" in fail.reason and "sdpa" in fail.reason
    assert timer.measures == 3                    # measured again before giving up


def test_hidden_work_the_baseline_does_not_show_is_still_caught() -> None:
    fail = _time_on(_BusyTimer(everyone=False))
    assert fail is not None and fail.verdict is Verdict.HIDDEN_WORK


class _DisturbedTimer:
    """The first `disturbed` measurements show a disturbance in the baseline's own times (as
    on an H100: kernel-mode medians of every function 12-16x their usual value); later ones
    are steady. The candidate's times are steady throughout."""

    def __init__(self, disturbed: int) -> None:
        self.disturbed = disturbed
        self.measures = 0

    def measure(self, fns, inputs, random_names, refill, plan, keep, rng, *_, **__):  # noqa: ANN001, ANN002, ANN003
        from evoattn.child.timing import Measurement
        from evoattn.contract.types import Times
        self.measures += 1
        bad = self.measures <= self.disturbed
        times = {n: Times(kernel_ms=0.8, call_ms=0.8, host_us=10.0) for n in fns}
        times["baseline:sdpa"] = Times(kernel_ms=12.0 if bad else 1.0, call_ms=1.2 if bad else 1.0,
                                       host_us=10.0)
        return Measurement(times, [], {n: None for n in fns},
                           {n: t.kernel_ms for n, t in times.items()}, {n: 0.01 for n in fns})


class _HostBoundTimer:
    """Host-bound measurements (call mode issues at about the calls' rate) or GPU-bound ones
    (issuing takes a tenth of the time per call); steady times either way."""

    def __init__(self, host_bound: bool) -> None:
        self.issue_us = 780.0 if host_bound else 80.0
        self.measures = 0

    def measure(self, fns, inputs, random_names, refill, plan, keep, rng, *_, **__):  # noqa: ANN001, ANN002, ANN003
        from evoattn.child.timing import Measurement
        from evoattn.contract.types import Times
        self.measures += 1
        times = {n: Times(kernel_ms=0.5, call_ms=0.8, host_us=700.0, issue_us=self.issue_us)
                 for n in fns}
        return Measurement(times, [], {n: None for n in fns},
                           {n: t.kernel_ms for n, t in times.items()}, {n: 0.01 for n in fns})


@pytest.mark.parametrize("host_bound, slowed_reads, measures", [
    (True, [None], 1),                          # its CPU kept its speed: measured once
    (True, ["slowed 1.5x", None], 2),           # it slowed: measured again once it had not
    (True, ["slowed"] * 10, 3),                 # never more than the tries
    (False, ["slowed"] * 10, 1)])               # GPU-bound: the host's speed sets no time
def test_a_host_bound_config_timed_while_its_cpu_slowed_is_measured_again(
        host_bound: bool, slowed_reads: list, measures: int) -> None:
    from evoattn.child.measure import CONTENTION_TRIES
    timer = _HostBoundTimer(host_bound)
    reads = iter(slowed_reads)
    asked: list[int] = []

    def host_slowed() -> str | None:
        asked.append(1)
        return next(reads)
    result, remeasured, label = _time_with(timer, host_slowed)
    assert timer.measures == measures <= CONTENTION_TRIES
    assert asked == ([1] * measures if host_bound else [])
    assert remeasured == ({label: slowed_reads[measures - 2]} if measures > 1 else {})
    assert result.verdict is Verdict.PASS


def _time_with(timer, host_slowed=None):  # noqa: ANN001, ANN202
    import torch

    from evoattn.child import measure
    from evoattn.child.cases import prepare_case
    from evoattn.problems import get_problem
    from evoattn.contract.request import EvalRequest
    from evoattn.contract.types import ConfigResult
    problem = get_problem("sdpa")
    cfg = dict(problem.cpu_configs[0])
    rng = random.Random(7)
    case = prepare_case(problem, cfg, False, torch.float16, torch.device("cpu"), rng, 1,
                        problem.tolerance)
    ctx = measure.TimingContext(problem, EvalRequest(device="cuda"), timer, problem.tolerance,
                                "float16", None, None, problem.baselines(), {},
                                host_slowed=host_slowed)
    old = measure.CONTENTION_PAUSE_S
    measure.CONTENTION_PAUSE_S = 0.0
    try:
        result = measure.time_case(ctx, case, lambda inp, c: problem.baseline(inp, c), rng,
                                   ConfigResult(cfg, "float16", Verdict.PASS), [])
    finally:
        measure.CONTENTION_PAUSE_S = old
    return result, ctx.remeasured, problem.label(cfg)


def test_a_config_whose_baseline_shows_a_disturbance_is_measured_again() -> None:
    timer = _DisturbedTimer(disturbed=1)
    result, remeasured, label = _time_with(timer)
    assert timer.measures == 2
    assert list(remeasured) == [label] and "sdpa: GPU time 12.0000 ms" in remeasured[label]
    assert result.baseline_ms == 1.0 and result.speedup == pytest.approx(1.0 / 0.8)


def test_a_steady_config_is_measured_once_and_a_lasting_disturbance_no_more_than_the_tries() -> None:
    from evoattn.child.measure import CONTENTION_TRIES
    timer = _DisturbedTimer(disturbed=0)
    assert _time_with(timer)[1] == {} and timer.measures == 1
    timer = _DisturbedTimer(disturbed=100)
    result, remeasured, label = _time_with(timer)
    assert timer.measures == CONTENTION_TRIES and list(remeasured) == [label]
    assert result.verdict is Verdict.PASS         # no verdict on the candidate for it


def _cpu_time_with_a_busy_baseline(busy_calls: int, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    """Times SDPA's first CPU config with the real CPU timer on a fake clock: the baseline's
    first `busy_calls` calls read 10 ms (another process had the CPU), later ones 0.1 ms;
    the candidate's read 1 ms. Returns (result, remeasured, label, measurements)."""
    import torch

    from evoattn.child import measure, timing
    from evoattn.child.cases import prepare_case
    from evoattn.problems import get_problem
    from evoattn.contract.request import EvalRequest
    from evoattn.contract.types import ConfigResult
    clock = [0.0]
    monkeypatch.setattr(timing, "_perf", lambda: clock[0])
    monkeypatch.setattr(measure, "CONTENTION_PAUSE_S", 0.0)
    problem = get_problem("sdpa")
    cfg = dict(problem.cpu_configs[0])
    calls = [0]

    def baseline(inputs, c):  # noqa: ANN001, ANN202
        calls[0] += 1
        clock[0] += 0.010 if calls[0] <= busy_calls else 0.0001
        return problem.baseline(inputs, c)

    def candidate(inputs, c):  # noqa: ANN001, ANN202
        clock[0] += 0.001
        return problem.baseline(inputs, c)

    timer = timing.CpuTimer()
    measured = []
    real = timer.measure
    timer.measure = lambda *a, **k: measured.append(1) or real(*a, **k)  # type: ignore[method-assign]
    rng = random.Random(7)
    case = prepare_case(problem, cfg, False, torch.float16, torch.device("cpu"), rng, 1,
                        problem.tolerance)
    ctx = measure.TimingContext(problem, EvalRequest(device="cpu"), timer, problem.tolerance,
                                "float16", None, None, {"sdpa": baseline}, {})
    result = measure.time_case(ctx, case, candidate, rng,
                               ConfigResult(cfg, "float16", Verdict.PASS), [])
    return result, ctx.remeasured, problem.label(cfg), len(measured)


def test_a_cpu_config_whose_baseline_was_busy_in_its_first_rounds_keeps_the_quiet_figure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # busy through the warm-up, kernel mode and the first call-mode rounds: without the
    # re-measure the call-mode baseline would read ~5 ms and the speedup ~5x
    result, remeasured, label, measured = _cpu_time_with_a_busy_baseline(12, monkeypatch)
    assert measured == 2 and list(remeasured) == [label]
    assert "sdpa: one call 10.0000 ms per call" in remeasured[label]
    assert result.baseline_ms == pytest.approx(0.1)
    assert result.speedup == pytest.approx(0.1)


def test_a_quiet_cpu_config_is_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    result, remeasured, _, measured = _cpu_time_with_a_busy_baseline(0, monkeypatch)
    assert measured == 1 and remeasured == {}
    assert result.speedup == pytest.approx(0.1)


@pytest.mark.parametrize("kernel_ms, call_ms, on_gpu, disturbed", [
    (1.0, 1.0, False, False),
    (1.5, 1.0, False, True),        # one call slowed: both ways on the CPU ...
    (1.0, 1.5, False, True),
    (1.0, 1.5, True, False),        # ... while on a GPU back-to-back calls may add host cost
    (1.5, 1.0, True, True)])
def test_a_disturbance_is_two_modes_disagreeing(kernel_ms: float, call_ms: float,
                                                on_gpu: bool, disturbed: bool) -> None:
    from evoattn.child.measure import disturbance
    from evoattn.contract.types import Times
    times = {"sdpa": Times(kernel_ms=kernel_ms, call_ms=call_ms, host_us=1000.0 * kernel_ms)}
    assert (disturbance(times, on_gpu) is not None) is disturbed


@dataclasses.dataclass
class _HeatEvaluator(FakeEvaluator):
    """Plain evaluations read 2% above the truth (a plain protocol without the duel's heat);
    duels measure the truth; STAGES does not change the speed."""

    def score(self, source: str) -> float:
        return super().score(re.sub(r"STAGES = \d", "STAGES = 2", source))

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        r = super().evaluate(source, suffix, label, rival)
        if rival is None:
            return dataclasses.replace(r, fitness=r.fitness * 1.02,
                                       fitness_ci=(r.fitness * 1.015, r.fitness * 1.025))
        return r


def test_after_a_crowning_plain_children_are_held_to_the_best_s_plain_figure(
        tmp_path: Path) -> None:
    """A crowned best is stored with its duel's (lower) figure; a child as fast as it, read by
    the plain protocol, is not sent to a duel for reading above that."""
    ev = _HeatEvaluator()
    s, out = _search(tmp_path, ev, 40)
    crowned = [p.id for p in s.programs.values()
               if p.result is not None and p.result.gain_ci and p.result.gain_ci[0] > 1.0]
    assert out.best.id != out.seed.id and out.best.id in crowned
    # children exactly as fast as a crowned best (other knobs that do not change the speed)
    # are met, and never duel it
    met = 0
    for pid in crowned:
        champ = s.programs[pid]
        peers = [p for p in s.programs.values() if p.iteration > champ.iteration and p.correct
                 and ev.score(p.source) == ev.score(champ.source) and p.id != pid]
        met += len(peers)
        assert not [src for src, riv in ev.duels if riv == champ.source
                    and any(src == p.source for p in peers)]
    assert met, "the run should have met children as fast as a crowned best"


def test_eval_output_says_what_was_measured_again_and_why() -> None:
    from rich.console import Console

    from evoattn.contract.types import EvalResult
    from evoattn.report import print_eval
    info = {"configs_remeasured": {"(16,16,1024,128)": "sdpa: GPU time 0.4797 ms per call, "
                                                      "above its back-to-back 0.2527 ms"},
            "call_rounds_redone": 2}
    console = Console(record=True, width=200)
    print_eval(console, EvalResult(Verdict.PASS, "all configs correct", 0.97, (),
                                   device_info=info))
    text = console.export_text()
    assert "measured again: (16,16,1024,128) (sdpa: GPU time 0.4797 ms per call" in text
    assert "measured again: 2 call-mode rounds whose launches lost their CPU" in text
    quiet = Console(record=True, width=200)
    print_eval(quiet, EvalResult(Verdict.PASS, "all configs correct", 0.97, ()))
    assert "measured again" not in quiet.export_text()
