"""The knob grammar: finding, rewriting, mutating and crossing tunable choices."""
from __future__ import annotations

from evoattn.mutators.knobs import (KnobMutator, active, find_knobs, set_knobs, space_size,
                                   transplants, turned)
from evoattn.types import MutationRequest, Program, program_id

from fakes import TOY_SEED

CUDA = """\
#define BLOCK_M 64  // evoattn: choice(32, 64, 128)
constexpr int WARPS = 4;  // evoattn: choice(4, 8)
static constexpr bool USE_CP_ASYNC = true;  // evoattn: choice(true, false)
#define NOT_A_KNOB 3
int x = 5;  // evoattn: nothing
"""


def _prog(src: str, pid: str | None = None) -> Program:
    return Program(pid or program_id(src), src, ".py", None, 0, 0, "seed", "")


def test_finds_python_and_cuda_knobs_with_their_choices() -> None:
    py = find_knobs(TOY_SEED)
    assert [(k.name, k.value) for k in py] == [("BLOCK_M", "64"), ("BLOCK_N", "32"),
                                               ("STAGES", "2"), ("SPLIT", "False")]
    assert py[0].choices == ("16", "32", "64", "128")
    cu = find_knobs(CUDA)
    assert [(k.name, k.value) for k in cu] == [("BLOCK_M", "64"), ("WARPS", "4"),
                                               ("USE_CP_ASYNC", "true")]
    assert space_size(CUDA) == 3 * 2 * 2


def test_set_knobs_rewrites_only_the_value() -> None:
    out = set_knobs(CUDA, {"BLOCK_M": "128", "WARPS": "8", "USE_CP_ASYNC": "false"})
    assert "#define BLOCK_M 128  // evoattn: choice(32, 64, 128)" in out
    assert "constexpr int WARPS = 8;  // evoattn: choice(4, 8)" in out
    assert "static constexpr bool USE_CP_ASYNC = false;" in out
    assert out.count("\n") == CUDA.count("\n")
    assert "int x = 5;" in out


def test_mutation_changes_a_knob_to_an_allowed_value_deterministically() -> None:
    m = KnobMutator()
    req = MutationRequest(parent=_prog(TOY_SEED), inspirations=(), seed=7, iteration=1)
    a, b = m.propose(req), m.propose(req)
    assert a.source == b.source and a.source is not None and a.source != TOY_SEED
    before = {k.name: k for k in find_knobs(TOY_SEED)}
    after = {k.name: k.value for k in find_knobs(a.source)}
    changed = [n for n in after if after[n] != before[n].value]
    assert changed and all(after[n] in before[n].choices for n in changed)
    assert all(n in a.change for n in changed)


def test_skips_settings_already_evaluated() -> None:
    seen: set[str] = set()
    m = KnobMutator(is_known=lambda pid: pid in seen, attempts=200)
    parent = _prog(TOY_SEED)
    for i in range(30):
        p = m.propose(MutationRequest(parent=parent, inspirations=(), seed=i, iteration=i))
        assert p.source is not None
        pid = program_id(p.source)
        assert pid not in seen
        seen.add(pid)


def test_crossover_takes_values_from_both_parents() -> None:
    other = set_knobs(TOY_SEED, {"BLOCK_M": "16", "BLOCK_N": "64", "STAGES": "4", "SPLIT": "True"})
    m = KnobMutator(crossover_rate=1.0)
    req = MutationRequest(parent=_prog(TOY_SEED), inspirations=(_prog(other),), seed=3,
                          iteration=1)
    p = m.propose(req)
    assert p.source is not None and p.change.startswith("crossover")
    assert p.second_parent_id == program_id(other)
    vals = {k.name: k.value for k in find_knobs(p.source)}
    mine = {k.name: k.value for k in find_knobs(TOY_SEED)}
    theirs = {k.name: k.value for k in find_knobs(other)}
    assert all(vals[n] in (mine[n], theirs[n]) for n in vals)
    assert all(mine[n] != theirs[n] for n in vals)          # so the next line means a mix:
    assert 0 < sum(vals[n] == theirs[n] for n in vals) < len(vals)


def test_a_source_without_knobs_is_rejected_with_a_reason() -> None:
    p = KnobMutator().propose(MutationRequest(parent=_prog("def attention(q,k,v): pass\n"),
                                              inspirations=(), seed=1, iteration=1))
    assert p.rejected and "knobs" in (p.rejected_reason or "")


GATED = """\
PATH = "a"  # evoattn: choice("a", "b")
TILE = 64  # evoattn: choice(32, 64, 128) when(PATH="b")
#define DEPTH 2  // evoattn: choice(1, 2, 3) when(PATH="a", PATH="c")
X = 1  # evoattn: choice(1, 2)
"""


def _changes(src: str, seeds: range) -> list[str]:
    m = KnobMutator()
    return [m.propose(MutationRequest(parent=_prog(src), inspirations=(), seed=s,
                                      iteration=1)).change for s in seeds]


def test_gated_knobs_parse_their_conditions_and_survive_rewrites() -> None:
    knobs = {k.name: k for k in find_knobs(GATED)}
    assert knobs["TILE"].when == ((("PATH", "=", '"b"'),),)
    assert knobs["DEPTH"].when == ((("PATH", "=", '"a"'), ("PATH", "=", '"c"')),)
    assert knobs["PATH"].when == () and knobs["X"].when == ()
    out = set_knobs(GATED, {"TILE": "32", "DEPTH": "3"})
    assert 'TILE = 32  # evoattn: choice(32, 64, 128) when(PATH="b")' in out
    assert {k.name: k.when for k in find_knobs(out)} == {k: v.when for k, v in knobs.items()}


def test_a_knob_whose_condition_fails_is_never_mutated() -> None:
    changes = _changes(GATED, range(300))
    assert not any("TILE" in c for c in changes)          # PATH is "a": TILE is dead code
    assert any("DEPTH" in c for c in changes) and any("PATH" in c for c in changes)
    live = set_knobs(GATED, {"PATH": '"b"'})
    changes = _changes(live, range(300))
    assert any("TILE" in c for c in changes)
    assert not any("DEPTH" in c for c in changes)


def test_crossover_leaves_knobs_whose_condition_fails() -> None:
    other = set_knobs(GATED, {"TILE": "128", "DEPTH": "1", "X": "2"})
    m = KnobMutator(crossover_rate=1.0)
    children = [m.propose(MutationRequest(parent=_prog(GATED), inspirations=(_prog(other),),
                                          seed=s, iteration=1)) for s in range(40)]
    crossed = [{k.name: k.value for k in find_knobs(c.source)} for c in children if c.source]
    assert crossed and all(v["TILE"] == "64" for v in crossed)   # dead in the parent: kept
    assert any(v["DEPTH"] == "1" for v in crossed) and any(v["X"] == "2" for v in crossed)


FACTS = """\
PATH = "a"  # evoattn: choice("a", "b")
T_TILE = 64  # evoattn: choice(32, 64) when(PATH="a", @target!=sm90)
#define C_TILE 2  // evoattn: choice(1, 2) when(@target=sm90) when(PATH="b")
"""


def test_facts_and_groups_decide_which_knobs_are_live() -> None:
    knobs = find_knobs(FACTS)
    assert knobs[2].when == ((("@target", "=", "sm90"),), (("PATH", "=", '"b"'),))

    def live(src: str, **facts: str) -> set[str]:
        return {k.name for k in active(find_knobs(src), facts)}

    b = set_knobs(FACTS, {"PATH": '"b"'})
    assert live(FACTS, target="sm90") == {"PATH", "T_TILE"}      # PATH a: the first kernel
    assert live(b, target="sm90") == {"PATH", "C_TILE"}          # PATH b: the second one
    assert live(b, target="sm80") == {"PATH", "T_TILE"}          # only the first runs there
    assert live(b, target="cpu") == {"PATH", "T_TILE"}
    assert live(b) == {"PATH", "T_TILE", "C_TILE"}               # no facts: nothing ruled out
    changes = [KnobMutator(facts={"target": "sm80"}).propose(
        MutationRequest(parent=_prog(b), inspirations=(), seed=s, iteration=1)).change
        for s in range(200)]
    assert not any("C_TILE" in c for c in changes) and any("T_TILE" in c for c in changes)


def test_a_condition_on_a_knob_the_file_lacks_leaves_the_knob_live() -> None:
    """A typo in when(...) (or a knob an edit removed) must not freeze a knob for the run."""
    src = ('A = 1  # evoattn: choice(1, 2)\n'
           'B = 1  # evoattn: choice(1, 2) when(A_TYPO=2)\n'
           'C = 1  # evoattn: choice(1, 2) when(A=2)\n')
    assert {k.name for k in active(find_knobs(src), {"target": "sm90"})} == {"A", "B"}


_SEP = ", "                                 # between a change line's knob settings
WIDE = "import torch\n" + "".join(f"K{i:02d} = False  # evoattn: choice(True, False)\n"
                                  for i in range(24))


class _Tried:
    """A history that keeps what the mutator proposed, as the store would once committed."""

    def __init__(self) -> None:
        self.kept: list[str] = []
        self.gains: list[str] = []           # the changes whose child beat its parent

    def recent_changes(self, mutator: str, limit: int) -> list[str]:
        return self.kept[::-1][:limit]

    def recent_gains(self, mutator: str, limit: int) -> list[str]:
        return self.gains[::-1][:limit]


def test_turned_reads_knob_changes_from_change_lines() -> None:
    keys = {"BLOCK_M", "STAGES", "wgmma_flash.cu:BLOCK_N", "SPLIT"}
    got = turned(["BLOCK_M: 64 -> 128, STAGES: 2 -> 3",
                  "crossover: wgmma_flash.cu:BLOCK_N: 64 -> 128", "BLOCK_M: 128 -> 64",
                  "@@ -1,2 +1,2 @@\n-SPLIT = 1\n+SPLIT = 2", ""], keys)
    assert got == {"BLOCK_M": 2, "STAGES": 1, "wgmma_flash.cu:BLOCK_N": 1}


def test_with_history_each_mutation_turns_an_untried_knob_while_there_is_one() -> None:
    parent = _prog(WIDE)
    keys = {k.key for k in find_knobs(WIDE)}
    for seed0 in (0, 100, 200):
        history = _Tried()
        m = KnobMutator(0.0, history=history)
        for i in range(len(keys)):
            p = m.propose(MutationRequest(parent=parent, inspirations=(), seed=seed0 + i,
                                          iteration=i))
            assert p.source is not None
            history.kept.append(p.change)
        counts = turned(history.kept, keys)
        assert set(counts) == keys              # 24 proposals turned all 24 knobs
        # without the history the same draws leave knobs untried
        blind = KnobMutator(0.0)
        changes = [blind.propose(MutationRequest(parent=parent, inspirations=(), seed=seed0 + i,
                                                 iteration=i)).change for i in range(len(keys))]
        assert set(turned(changes, keys)) < keys


def test_turned_alone_counts_only_mutations_of_that_knob_and_no_other() -> None:
    keys = {"A", "B", "C"}
    changes = ["A: 1 -> 2, B: 1 -> 2", "crossover: C: 1 -> 2", "B: 1 -> 2", "B: 2 -> 1", ""]
    assert turned(changes, keys) == {"A": 1, "B": 3, "C": 1}
    assert turned(changes, keys, alone=True) == {"B": 2}


def test_a_knob_turned_only_beside_others_is_turned_alone_first() -> None:
    """One knob's gain hides behind another's cost in a joint turn: every live knob is turned
    alone once (one knob per mutation) before mutations of several knobs."""
    parent = _prog(WIDE)
    keys = sorted(k.key for k in find_knobs(WIDE))
    for seed0 in (0, 100, 200):
        history = _Tried()
        # the run so far turned every knob, each only in pairs
        history.kept = [f"{a}: False -> True, {b}: False -> True"
                        for a, b in zip(keys[::2], keys[1::2])]
        m = KnobMutator(0.0, history=history)
        for i in range(len(keys)):
            p = m.propose(MutationRequest(parent=parent, inspirations=(), seed=seed0 + i,
                                          iteration=i))
            assert p.source is not None and _SEP not in p.change, p.change
            history.kept.append(p.change)
        assert set(turned(history.kept, set(keys), alone=True)) == set(keys)
        # then some mutations turn several knobs again (the least turned alone first)
        later = [m.propose(MutationRequest(parent=parent, inspirations=(), seed=seed0 + 50 + i,
                                           iteration=50 + i)).change for i in range(40)]
        assert any(_SEP in c for c in later)


def test_transplants_are_one_knob_gains_the_parent_lacks() -> None:
    src = ("A = 1  # evoattn: choice(1, 2, 3)\nB = 1  # evoattn: choice(1, 2)\n"
           "C = 1  # evoattn: choice(1, 2)\nD = 1  # evoattn: choice(1, 2) when(C=2)\n")
    live = active(find_knobs(src))
    gains = ["A: 2 -> 3", "B: 1 -> 2, C: 1 -> 2", "crossover: C: 1 -> 2", "A: 1 -> 3",
             "C: 2 -> 1", "D: 1 -> 2", "E: 1 -> 2", "A: 1 -> 9", "@@ -1 +1 @@\n-A\n+B", ""]
    # A=3 once; not a pair, a crossover, a value the parent has, a knob not live or not in
    # the file, a value not among the choices, an LLM's diff
    assert [(k.key, k.value, new) for k, new in transplants(gains, live)] == [("A", "1", "3")]


def test_a_gain_found_on_another_parent_is_carried_to_this_one() -> None:
    """Two gains found in separate lineages meet: a parent lacking a one-knob gain the run
    found elsewhere gets it, alone."""
    parent = _prog(WIDE)
    history = _Tried()
    history.kept = ["K03: False -> True", "K07: False -> True"]
    history.gains = ["K03: False -> True", "K05: True -> False, K09: False -> True"]
    m = KnobMutator(0.0, history=history, transplant_rate=1.0)
    for seed in range(5):
        p = m.propose(MutationRequest(parent=parent, inspirations=(), seed=seed, iteration=3))
        assert p.change == "K03: False -> True" and p.source == set_knobs(WIDE, {"K03": "True"})
    # a parent that has it already, or a child known, gets an ordinary mutation
    has = _prog(set_knobs(WIDE, {"K03": "True"}))
    assert "K03" not in m.propose(MutationRequest(parent=has, inspirations=(), seed=1,
                                                  iteration=3)).change
    known = {program_id(set_knobs(WIDE, {"K03": "True"}))}
    m = KnobMutator(0.0, history=history, transplant_rate=1.0, is_known=lambda pid: pid in known)
    assert m.propose(MutationRequest(parent=parent, inspirations=(), seed=1,
                                     iteration=3)).change != "K03: False -> True"
    # at rate 0 the one-at-a-time pass goes on: K03 was turned alone already
    m = KnobMutator(0.0, history=history, transplant_rate=0.0)
    assert all("K03" not in m.propose(MutationRequest(parent=parent, inspirations=(), seed=s,
                                                      iteration=3)).change for s in range(5))


def test_the_preference_gives_way_when_the_least_tried_settings_are_known() -> None:
    two = "A = 1  # evoattn: choice(1, 2)\nB = 1  # evoattn: choice(1, 2)\n"
    history = _Tried()
    history.kept = ["A: 1 -> 2"]
    # every child that turns B (the untried knob) is already known: being evaluated
    known = {program_id(set_knobs(two, {"B": "2"})),
             program_id(set_knobs(two, {"A": "2", "B": "2"}))}
    m = KnobMutator(0.0, is_known=lambda pid: pid in known, history=history)
    for seed in range(5):
        p = m.propose(MutationRequest(parent=_prog(two), inspirations=(), seed=seed, iteration=2))
        assert p.source == set_knobs(two, {"A": "2"}), p.rejected_reason
