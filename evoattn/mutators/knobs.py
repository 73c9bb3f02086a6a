"""The offline mutator: rewrites values of the tunable choices marked in the source.

The knob grammar, `when(...)` conditions included, is evoattn/contract/knobs.py. A gated knob whose
condition fails in the parent changes nothing that runs, so the mutator neither mutates nor
crosses it (an evaluation spent there would time the parent again).

Coverage first: given the run's history, a mutation's first knob is one of the live knobs its
latest proposals turned *alone* least often, and while some live knob has never been turned
alone the mutation turns only that one: a one-at-a-time pass over the live knobs, then one to
three knobs at a time with the least-turned first. Drawn at random, some of a few dozen knobs
go untried for a whole short run: with 44 live knobs and about 70 knob changes, each knob is
missed with probability (1 - 1/44)^70, about 0.2. Turned only beside others, a knob's gain can
hide behind another's cost (three-warpgroup tiles beside a setting that spills: BENCHMARKS.md,
"what a default search finds"). The counts are the run's, not the parent's: a search's parents
change often (a neutral child ties its parent), so a parent's own children are too few.

Gains meet: one knob's gain is often found on a parent other than the best (the one-at-a-time
pass turns each knob from whichever parent is drawn), and crossing two elites takes it with
only even odds per knob. So with chance `transplant_rate` a mutation carries to its parent one
of the run's one-knob settings that beat their own parent beyond noise and that this parent
lacks (StoreHistory.recent_gains).
"""
from __future__ import annotations

import random
from typing import Callable, Iterable, Protocol

from evoattn.contract.knobs import Knob, active, find_knobs, set_knobs, space_size

from ..types import MutationRequest, Proposal, program_id

__all__ = ["Knob", "KnobMutator", "active", "find_knobs", "parse_settings", "set_knobs",
           "space_size"]


def parse_settings(label: str, source: str, items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Returns {name: value} for NAME=VALUE items (as `evoattn eval --set` takes them), checked
    against the source's knobs; a bad item raises ValueError with one line naming `label`."""
    knobs = {k.key: k for k in find_knobs(source)}
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


class Changes(Protocol):
    """Where the changes the run's proposals made are read from (StoreHistory)."""

    def recent_changes(self, mutator: str, limit: int) -> list[str]: ...

    def recent_gains(self, mutator: str, limit: int) -> list[str]: ...


class KnobMutator:
    """Mutates one to three knobs (neighbours preferred, the run's least turned alone first;
    alone until each live knob has been) or crosses knobs with another elite."""

    name = "knobs"

    def __init__(self, crossover_rate: float = 0.2, is_known: Callable[[str], bool] | None = None,
                 attempts: int = 20, facts: dict[str, str] | None = None,
                 history: Changes | None = None, history_limit: int = 400,
                 transplant_rate: float = 0.25) -> None:
        self.crossover_rate = crossover_rate
        self.transplant_rate = transplant_rate  # a gain found on another parent, onto this one
        self.is_known = is_known or (lambda pid: False)
        self.attempts = attempts
        self.facts = dict(facts or {})         # e.g. {"target": "sm90"}: see when(...) above
        self.history = history                 # the run's earlier proposals: coverage first
        self.history_limit = history_limit

    def propose(self, request: MutationRequest) -> Proposal:
        """Returns a child with changed knob values, or a rejection saying why none was found."""
        parent = request.parent
        knobs = find_knobs(parent.source)
        if not knobs:
            return Proposal(parent.id, self.name, None,
                            rejected_reason="no '# evoattn: choice(...)' knobs in the parent")
        rng = random.Random(request.seed)
        keys = {k.key for k in knobs}
        partner, partner_knobs = next(
            ((p, pk) for p in request.inspirations if p.id != parent.id
             for pk in [find_knobs(p.source)] if {k.key for k in pk} == keys), (None, []))
        live = active(knobs, self.facts)      # knobs whose code runs some call
        tried = (turned(self.history.recent_changes(self.name, self.history_limit), keys,
                        alone=True) if self.history is not None else None)
        gains = (self.history.recent_gains(self.name, self.history_limit)
                 if self.history is not None and rng.random() < self.transplant_rate else [])
        moves = transplants(gains, live)
        for knob, new in rng.sample(moves, k=len(moves)):
            child = set_knobs(parent.source, {knob.key: new})
            if not self.is_known(program_id(child)):
                return Proposal(parent.id, self.name, child,
                                change=describe({knob.key: (knob.value, new)}, False))
        for attempt in range(self.attempts):
            use_cross = partner is not None and rng.random() < self.crossover_rate
            # the later half of the attempts drops the preference: the least-tried knobs'
            # settings may all be known already (children still being evaluated)
            values = (self._crossover(knobs, live, partner_knobs, rng) if use_cross
                      else self._mutate(knobs, live, rng,
                                        tried if attempt < self.attempts // 2 else None))
            changed = {k.key: (k.value, values[k.key]) for k in knobs
                       if values.get(k.key, k.value) != k.value}
            if not changed:
                continue
            child = set_knobs(parent.source, values)
            if self.is_known(program_id(child)):
                continue
            return Proposal(parent.id, self.name, child, change=describe(changed, use_cross),
                            second_parent_id=partner.id if use_cross and partner else None)
        return Proposal(parent.id, self.name, None,
                        rejected_reason=f"no unevaluated knob setting found near the parent "
                                        f"in {self.attempts} attempts")

    @staticmethod
    def _mutate(knobs: list[Knob], live: list[Knob], rng: random.Random,
                tried: dict[str, int] | None = None) -> dict[str, str]:
        values = {k.key: k.value for k in knobs}
        n = 1 if rng.random() < 0.6 else 2 if rng.random() < 0.75 else 3
        picked = rng.sample(live, k=min(n, len(live)))
        if tried is not None and live:        # the first knob: one the run turned alone least
            fewest = min(tried.get(k.key, 0) for k in live)
            first = rng.choice([k for k in live if tried.get(k.key, 0) == fewest])
            picked = [first] + ([k for k in picked if k.key != first.key][:len(picked) - 1]
                                if fewest else [])   # never turned alone: alone now
        for k in picked:
            others = [c for c in k.choices if c != k.value]
            if not others:
                continue
            if k.value in k.choices and rng.random() < 0.6:   # prefer a neighbouring value
                i = k.choices.index(k.value)
                near = [k.choices[j] for j in (i - 1, i + 1) if 0 <= j < len(k.choices)]
                values[k.key] = rng.choice(near)
            else:
                values[k.key] = rng.choice(others)
        return values

    @staticmethod
    def _crossover(knobs: list[Knob], live: list[Knob], other: list[Knob],
                   rng: random.Random) -> dict[str, str]:
        theirs = {k.key: k.value for k in other}
        keys = {k.key for k in live}
        return {k.key: (theirs[k.key] if k.key in keys and rng.random() < 0.5 else k.value)
                for k in knobs}


_CROSS, _SEP, _ARROW = "crossover: ", ", ", " -> "


def describe(changed: dict[str, tuple[str, str]], crossover: bool) -> str:
    """Returns a proposal's change line: "[crossover: ]KEY: OLD -> NEW, KEY: OLD -> NEW"."""
    what = _SEP.join(f"{key}: {old}{_ARROW}{new}" for key, (old, new) in changed.items())
    return (_CROSS if crossover else "") + what


def transplants(gains: Iterable[str], live: list[Knob]) -> list[tuple[Knob, str]]:
    """Returns the (parent's knob, new value) settings of these gaining change lines that a
    parent with these live knobs lacks: one-knob mutations only (a gain of several knobs or of
    a crossover is not one knob's), each once, in the order given."""
    by_key = {k.key: k for k in live}
    moves: list[tuple[Knob, str]] = []
    for change in gains:
        if change.startswith(_CROSS) or _SEP in change or _ARROW not in change:
            continue
        head, new = change.rsplit(_ARROW, 1)
        knob = by_key.get(head.rpartition(": ")[0])
        if knob is not None and new in knob.choices and knob.value != new \
                and (knob, new) not in moves:
            moves.append((knob, new))
    return moves


def turned(changes: Iterable[str], keys: set[str], alone: bool = False) -> dict[str, int]:
    """Returns how many of these change lines (describe's) turned each knob (with `alone`, only
    the mutations that turned that knob and no other); a change not in that form (an LLM's
    diff) counts for no knob."""
    counts: dict[str, int] = {}
    for change in changes:
        parts = change.removeprefix(_CROSS).split(_SEP)
        if alone and (change.startswith(_CROSS) or len(parts) != 1):
            continue
        for part in parts:
            key = part.rsplit(_ARROW, 1)[0].rpartition(": ")[0]
            if _ARROW in part and key in keys:
                counts[key] = counts.get(key, 0) + 1
    return counts
