"""Population: elite admission, selection, inspirations, migration, snapshot/restore."""
from __future__ import annotations

import random

import pytest

from evoattn.contract.types import ConfigResult, EvalResult, Verdict
from evoattn.config import PopulationConfig
from evoattn.errors import RunDirError
from evoattn.population import Population
from evoattn.types import Program

PARAMS = {"B": 1, "H": 2, "S": 128, "D": 64, "causal": False}


def make(pid: str, fitness: float, island: int = 0, verdict: Verdict = Verdict.PASS,
         flags: tuple[str, ...] = ()) -> Program:
    cfg = ConfigResult(params=PARAMS, dtype="float16", verdict=verdict, speedup=fitness)
    result = EvalResult(verdict=verdict, reason="", configs=(cfg,), flags=flags,
                        fitness=fitness if verdict is Verdict.PASS else 0.0)
    return Program(id=pid, source=f"# {pid}\n", suffix=".py", parent_id="seed",
                   iteration=1, island=island, mutator="knobs", change="", result=result)


SEED = Program(id="seed", source="# seed\n", suffix=".py", parent_id=None, iteration=0,
               island=0, mutator="seed", change="",
               result=EvalResult(verdict=Verdict.PASS, reason="", fitness=1.0))


def pop(islands: int = 2, k: int = 3, exploration: float = 0.3) -> Population:
    return Population(PopulationConfig(islands=islands, elites_per_island=k,
                                       exploration=exploration), SEED)


def test_seed_starts_in_every_island():
    p = pop(islands=3)
    assert [[e.id for e in p.elites(i)] for i in range(3)] == [["seed"]] * 3


def test_incorrect_seed_leaves_islands_empty_and_parent_falls_back_to_seed():
    bad_seed = make("badseed", 0.0, verdict=Verdict.INCORRECT)
    p = Population(PopulationConfig(islands=2), bad_seed)
    assert p.best() is None
    assert p.select_parent(1, random.Random(0)) is bad_seed


def test_elite_cap_keeps_the_fittest_best_first():
    p = pop(k=3)
    for pid, f in [("a", 2.0), ("b", 0.5), ("c", 3.0), ("d", 1.5)]:
        p.add(make(pid, f))
    assert [e.id for e in p.elites(0)] == ["c", "a", "d"]
    assert not p.add(make("e", 0.1))            # below the 3rd elite: rejected
    assert [e.id for e in p.elites(0)] == ["c", "a", "d"]


def test_ties_are_broken_by_program_id():
    p = pop(k=2)
    for pid in ["zz", "mm", "aa"]:
        p.add(make(pid, 5.0))
    assert [e.id for e in p.elites(0)] == ["aa", "mm"]


def test_incorrect_programs_never_enter():
    p = pop()
    for v in (Verdict.INCORRECT, Verdict.CRASH, Verdict.BUILD_ERROR):
        assert not p.add(make(f"x{v.value}", 9.0, verdict=v))
    assert [e.id for e in p.elites(0)] == ["seed"]


def test_unresolved_integrity_flag_never_enters_but_resolved_one_does():
    p = pop()
    flagged = make("flagged", 50.0, verdict=Verdict.IMPLAUSIBLE, flags=("implausible",))
    resolved = make("resolved", 4.0, flags=("implausible",))   # re-verified: verdict PASS
    assert not p.add(flagged)
    assert p.add(resolved)
    assert p.top().id == "resolved"


def test_same_id_twice_is_ignored():
    p = pop()
    assert p.add(make("a", 2.0))
    assert not p.add(make("a", 2.0))
    assert [e.id for e in p.elites(0)] == ["a", "seed"]


def test_add_goes_to_the_programs_island():
    p = pop(islands=2)
    assert p.add(make("a", 2.0, island=1))
    assert [e.id for e in p.elites(1)] == ["a", "seed"]
    assert [e.id for e in p.elites(0)] == ["seed"]


def test_migration_moves_each_best_one_step_round_the_ring():
    p = pop(islands=3, k=3)
    p.add(make("a", 5.0, island=0))
    p.add(make("b", 3.0, island=1))
    assert p.migrate() == 2                          # island 2's best (seed) is already in 0
    assert [e.id for e in p.elites(1)] == ["a", "b", "seed"]
    assert [e.id for e in p.elites(2)] == ["b", "seed"]   # b, not a: one step per migration
    assert [e.id for e in p.elites(0)] == ["a", "seed"]


def test_migration_with_one_island_does_nothing():
    p = pop(islands=1)
    p.add(make("a", 5.0))
    assert p.migrate() == 0


def test_top_is_the_fittest_over_all_islands():
    p = pop(islands=2)
    p.add(make("a", 2.0, island=0))
    p.add(make("b", 7.0, island=1))
    assert p.top().id == "b"


def test_the_best_is_the_champion_until_a_challenger_is_crowned_and_survives_resume():
    p = pop(islands=2)
    p.add(make("b", 7.0, island=1))
    assert p.best().id == "seed"                 # read higher once: not yet the best
    p.crown(make("bad", 9.0, verdict=Verdict.INCORRECT))
    assert p.best().id == "seed"                 # an incorrect program is never crowned
    b = next(e for e in p.elites(1) if e.id == "b")
    p.crown(b)
    assert p.best().id == "b"
    programs = {e.id: e for i in range(2) for e in p.elites(i)}
    again = Population.restore(p.snapshot(), programs, p.cfg)
    assert again.best().id == "b" and again.snapshot() == p.snapshot()


def test_island_of_next_is_round_robin():
    p = pop(islands=3)
    assert [p.island_of_next(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_selection_is_deterministic_with_a_seeded_rng():
    p = pop(k=8)
    for i in range(8):
        p.add(make(f"p{i}", 1.0 + i))
    first = [p.select_parent(0, random.Random(42)).id for _ in range(5)]
    rng_a, rng_b = random.Random(7), random.Random(7)
    seq_a = [p.select_parent(0, rng_a).id for _ in range(50)]
    seq_b = [p.select_parent(0, rng_b).id for _ in range(50)]
    assert seq_a == seq_b
    assert len(set(first)) == 1


def test_selection_favours_the_best_without_exploration():
    p = pop(k=8, exploration=0.0)
    for i in range(7):
        p.add(make(f"p{i}", 1.5 + i))
    assert len(p.elites(0)) == 8 and p.elites(0)[-1].id == "seed"
    rng = random.Random(0)
    picks = [p.select_parent(0, rng).id for _ in range(400)]
    # Tournament of 3 among 8: the best wins 3/8 of the time, the worst never.
    assert picks.count("p6") > 100
    assert "seed" not in picks


def test_full_exploration_picks_every_elite():
    p = pop(k=4, exploration=1.0)
    for i in range(3):
        p.add(make(f"p{i}", 2.0 + i))
    rng = random.Random(1)
    assert {p.select_parent(0, rng).id for _ in range(200)} == {"p0", "p1", "p2", "seed"}


def test_empty_island_falls_back_to_the_best_anywhere():
    bad_seed = make("badseed", 0.0, verdict=Verdict.INCORRECT)
    p = Population(PopulationConfig(islands=2), bad_seed)
    p.add(make("a", 3.0, island=0))
    assert p.select_parent(1, random.Random(0)).id == "a"


def test_inspirations_come_from_other_islands_first_then_own():
    p = pop(islands=2, k=4)
    p.add(make("own1", 9.0, island=0))
    p.add(make("other1", 2.0, island=1))
    got = [x.id for x in p.inspirations(0, 3, random.Random(0))]
    # other island: other1, seed; then own: own1 (seed already taken).
    assert got == ["other1", "seed", "own1"]


def test_inspirations_exclude_the_parent_and_have_no_duplicates():
    p = pop(islands=3, k=4)
    p.add(make("a", 5.0, island=1))
    p.add(make("b", 4.0, island=2))
    got = [x.id for x in p.inspirations(0, 10, random.Random(0), exclude_id="seed")]
    assert got == ["a", "b"]


def test_inspirations_sample_deterministically_among_top_others():
    p = pop(islands=2, k=8)
    for i in range(7):
        p.add(make(f"o{i}", 1.5 + i, island=1))
    a = [x.id for x in p.inspirations(0, 2, random.Random(3))]
    b = [x.id for x in p.inspirations(0, 2, random.Random(3))]
    assert a == b and len(a) == 2
    assert set(a) <= {"o6", "o5", "o4", "o3"}        # drawn from the top 2k = 4


def test_snapshot_restore_round_trip_is_exact():
    p = pop(islands=3, k=3)
    rng = random.Random(5)
    programs = {SEED.id: SEED}
    for i in range(20):
        prog = make(f"p{i:02d}", rng.uniform(0.5, 5.0), island=i % 3)
        programs[prog.id] = prog
        p.add(prog)
        if i % 6 == 5:
            p.migrate()
    q = Population.restore(p.snapshot(), programs, p.cfg)
    assert q.snapshot() == p.snapshot()
    assert [q.elites(i) for i in range(3)] == [p.elites(i) for i in range(3)]
    # ... and both continue identically.
    r1, r2 = random.Random(9), random.Random(9)
    assert [p.select_parent(i % 3, r1).id for i in range(30)] == \
           [q.select_parent(i % 3, r2).id for i in range(30)]
    extra = make("zz", 4.9, island=1)
    assert p.add(extra) == q.add(extra)
    assert q.snapshot() == p.snapshot()


def test_restore_rejects_unknown_ids_and_island_count_mismatch():
    p = pop(islands=2)
    p.add(make("a", 2.0))
    snap = p.snapshot()
    with pytest.raises(RunDirError, match="not in the database"):
        Population.restore(snap, {"seed": SEED}, p.cfg)
    with pytest.raises(RunDirError, match="2 islands"):
        Population.restore(snap, {"seed": SEED, "a": make("a", 2.0)},
                           PopulationConfig(islands=3))
