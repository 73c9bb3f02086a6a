"""The knob grammar: finding, rewriting, mutating and crossing tunable choices."""
from __future__ import annotations

from evoattn.mutators.knobs import KnobMutator, find_knobs, set_knobs, space_size
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
