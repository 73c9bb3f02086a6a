"""The offline mutator: rewrites values of the tunable choices marked in the source.

Grammar (one knob per line; the mutator changes only the value):
    BLOCK_M = 128  # evoattn: choice(64, 128, 256)             Python / Triton
    USE_TMA = True  # evoattn: choice(True, False)             structural switch
    #define BLOCK_N 64  // evoattn: choice(32, 64, 128)        CUDA macro
    constexpr int WARPS = 4;  // evoattn: choice(4, 8)         CUDA constant
    TILE = 64  # evoattn: choice(32, 64) when(PATH=a, PATH=b)  gated: used only when some
                                                               listed knob has its value
    #define N 2  // evoattn: choice(1, 2) when(@target=sm90) when(PATH=b, @target!=sm90)
Terms inside one when(...) are alternatives, separate when(...) groups must all hold, `!=`
negates, and an @name is a fact about the run that the mutator is given (`@target`: "cpu" or
"smXY", the GPU's compute capability); a fact it was not given counts as holding, and so does a
term naming a knob the file does not have (a typo, or a knob an edit removed, leaves the knob
live: a wasted evaluation, never a knob frozen for the whole run). A gated knob
whose condition fails in the parent changes nothing that runs, so the mutator neither mutates
nor crosses it (an evaluation spent there would time the parent again).
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Callable

from ..types import MutationRequest, Proposal, program_id

_PY = re.compile(r"^(?P<pre>\s*(?P<name>[A-Za-z_]\w*)\s*(?::\s*[\w\[\]., ]+)?=\s*)"
                 r"(?P<val>[^#\n]+?)(?P<post>\s*#\s*evoattn:\s*choice\((?P<choices>[^)]*)\)[^\n]*)$")
_DEFINE = re.compile(r"^(?P<pre>\s*#\s*define\s+(?P<name>\w+)\s+)(?P<val>\S+)"
                     r"(?P<post>\s*//\s*evoattn:\s*choice\((?P<choices>[^)]*)\)[^\n]*)$")
_CONST = re.compile(r"^(?P<pre>\s*(?:static\s+)?(?:constexpr|const)\s+[\w:<> ]+?\s+(?P<name>\w+)"
                    r"\s*=\s*)(?P<val>[^;\n]+?)(?P<post>\s*;\s*//\s*evoattn:\s*choice\("
                    r"(?P<choices>[^)]*)\)[^\n]*)$")


@dataclasses.dataclass(frozen=True)
class Knob:
    """One marked choice: its name, line index, current value and allowed values."""

    name: str
    line: int
    value: str
    choices: tuple[str, ...]
    # when(...) groups, all of which must hold; each a tuple of (name, op, value) alternatives
    when: tuple[tuple[tuple[str, str, str], ...], ...] = ()


_WHEN = re.compile(r"\bwhen\((?P<conds>[^)]*)\)")
_TERM = re.compile(r"^\s*(?P<name>@?\w+)\s*(?P<op>!=|=)\s*(?P<value>\S+?)\s*$")


def _conditions(post: str) -> tuple[tuple[tuple[str, str, str], ...], ...]:
    groups = []
    for m in _WHEN.finditer(post):
        terms = [t for t in (_TERM.match(c) for c in m.group("conds").split(",")) if t]
        if terms:
            groups.append(tuple((t["name"], t["op"], t["value"]) for t in terms))
    return tuple(groups)


def active(knobs: list[Knob], facts: dict[str, str] | None = None) -> list[Knob]:
    """The knobs whose `when(...)` groups all hold at the knobs' own values and the facts."""
    values = {k.name: k.value for k in knobs}
    facts = facts or {}

    def holds(name: str, op: str, value: str) -> bool:
        have = facts.get(name[1:]) if name.startswith("@") else values.get(name)
        if have is None:
            return True                       # a fact not given, or an unknown knob: holds
        return (have == value) == (op == "=")

    return [k for k in knobs if all(any(holds(*t) for t in group) for group in k.when)]


def find_knobs(source: str) -> list[Knob]:
    """Returns the knobs marked in a source, in file order."""
    knobs = []
    for i, line in enumerate(source.split("\n")):
        m = _DEFINE.match(line) or _CONST.match(line) or _PY.match(line)
        if m:
            choices = tuple(c.strip() for c in m.group("choices").split(",") if c.strip())
            knobs.append(Knob(m.group("name"), i, m.group("val").strip(), choices,
                              _conditions(m.group("post"))))
    return knobs


def set_knobs(source: str, values: dict[str, str]) -> str:
    """Returns the source with the named knobs set to the given values."""
    lines = source.split("\n")
    for k in find_knobs(source):
        if k.name in values:
            line = lines[k.line]
            m = _DEFINE.match(line) or _CONST.match(line) or _PY.match(line)
            assert m is not None
            lines[k.line] = m.group("pre") + values[k.name] + m.group("post")
    return "\n".join(lines)


def parse_settings(label: str, source: str, items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Returns {name: value} for NAME=VALUE items (as `evoattn eval --set` takes them), checked
    against the source's knobs; a bad item raises ValueError with one line naming `label`."""
    knobs = {k.name: k for k in find_knobs(source)}
    values: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ValueError(f"--set {item!r}: expected NAME=VALUE")
        if name not in knobs:
            raise ValueError(f"{label}: --set {name}: no such knob (knobs: "
                             f"{', '.join(knobs) or 'none'})")
        if value not in knobs[name].choices:
            raise ValueError(f"{label}: --set {name}={value}: not among its choices "
                             f"({', '.join(knobs[name].choices)})")
        if values.get(name, value) != value:
            raise ValueError(f"{label}: --set {name} given twice ({values[name]}, {value})")
        values[name] = value
    return values


def space_size(source: str) -> int:
    """Returns the number of knob settings a source allows."""
    n = 1
    for k in find_knobs(source):
        n *= max(1, len(k.choices))
    return n


class KnobMutator:
    """Mutates one or two knobs (neighbours preferred) or crosses knobs with another elite."""

    name = "knobs"

    def __init__(self, crossover_rate: float = 0.2, is_known: Callable[[str], bool] | None = None,
                 attempts: int = 20, facts: dict[str, str] | None = None) -> None:
        self.crossover_rate = crossover_rate
        self.is_known = is_known or (lambda pid: False)
        self.attempts = attempts
        self.facts = dict(facts or {})         # e.g. {"target": "sm90"}: see when(...) above

    def propose(self, request: MutationRequest) -> Proposal:
        """Returns a child with changed knob values, or a rejection saying why none was found."""
        parent = request.parent
        knobs = find_knobs(parent.source)
        if not knobs:
            return Proposal(parent.id, self.name, None,
                            rejected_reason="no '# evoattn: choice(...)' knobs in the parent")
        rng = random.Random(request.seed)
        names = {k.name for k in knobs}
        partner, partner_knobs = next(
            ((p, pk) for p in request.inspirations if p.id != parent.id
             for pk in [find_knobs(p.source)] if {k.name for k in pk} == names), (None, []))
        live = active(knobs, self.facts)      # knobs whose code runs some call
        for _ in range(self.attempts):
            use_cross = partner is not None and rng.random() < self.crossover_rate
            values = (self._crossover(knobs, live, partner_knobs, rng) if use_cross
                      else self._mutate(knobs, live, rng))
            changed = {k.name: (k.value, values[k.name]) for k in knobs
                       if values.get(k.name, k.value) != k.value}
            if not changed:
                continue
            child = set_knobs(parent.source, values)
            if self.is_known(program_id(child)):
                continue
            what = ", ".join(f"{n}: {a} -> {b}" for n, (a, b) in changed.items())
            return Proposal(parent.id, self.name, child,
                            change=("crossover: " if use_cross else "") + what,
                            second_parent_id=partner.id if use_cross and partner else None)
        return Proposal(parent.id, self.name, None,
                        rejected_reason=f"no unevaluated knob setting found near the parent "
                                        f"in {self.attempts} attempts")

    @staticmethod
    def _mutate(knobs: list[Knob], live: list[Knob], rng: random.Random) -> dict[str, str]:
        values = {k.name: k.value for k in knobs}
        n = 1 if rng.random() < 0.6 else 2 if rng.random() < 0.75 else 3
        for k in rng.sample(live, k=min(n, len(live))):
            others = [c for c in k.choices if c != k.value]
            if not others:
                continue
            if k.value in k.choices and rng.random() < 0.6:   # prefer a neighbouring value
                i = k.choices.index(k.value)
                near = [k.choices[j] for j in (i - 1, i + 1) if 0 <= j < len(k.choices)]
                values[k.name] = rng.choice(near)
            else:
                values[k.name] = rng.choice(others)
        return values

    @staticmethod
    def _crossover(knobs: list[Knob], live: list[Knob], other: list[Knob],
                   rng: random.Random) -> dict[str, str]:
        theirs = {k.name: k.value for k in other}
        names = {k.name for k in live}
        return {k.name: (theirs[k.name] if k.name in names and rng.random() < 0.5 else k.value)
                for k in knobs}
