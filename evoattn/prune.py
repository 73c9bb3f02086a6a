"""The end of a run: the best's changes from the seed, each set back unless it pays.

A champion challenge judges a whole child, not each of its changes: a knob turned beside the
one that won the duel rides along unproven, and so does one that pays nothing in the fitness
mode but costs in another (on an H200, NUM_WARPS_D64 = 8 is even with 4 in call time and
0.70x in kernel time at (1,8,512,64)). So at the end of a run each knob in which the best
differs from the seed is set back to the seed's value, one at a time, and stays set back when a
duel of the result (candidate) beside the best (rival) shows it costs nothing: not in the
fitness mode's geometric mean beyond noise, nor by MATERIAL_LOSS or more at any config in any
mode measured. Every step is measured beside the best the phase started from, so what it ends
with is within noise of that best, with only the changes that pay. Knobs whose code runs no
call in the best (their when(...) conditions do not hold: a routing change left them behind)
are set back together first, in one duel, where that wakes or silences no other knob; should
that duel say they cost something, they are tried one at a time like the rest. The search
(search.py) holds the duels and commits their results; this module decides what to try and
what to keep.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from evoattn.contract.knobs import active, find_knobs, set_knobs
from evoattn.contract.request import TIMING_MODES
from evoattn.contract.scoring import slower_configs
from evoattn.contract.types import EvalResult

from .mutators.knobs import describe

PRUNE = "prune"          # the mutator name of a program with one change set back


@dataclasses.dataclass(frozen=True)
class Setback:
    """One knob of the best set back to the seed's value."""

    key: str
    best: str            # the value in the best
    seed: str            # the seed's value


def setbacks(best_source: str, seed_source: str) -> list[Setback]:
    """Returns the knobs, in the best's order, whose value differs from the seed's where the
    best's choices allow the seed's value (an LLM's edit may have changed a knob's choices)."""
    seed = {k.key: k.value for k in find_knobs(seed_source)}
    return [Setback(k.key, k.value, seed[k.key]) for k in find_knobs(best_source)
            if k.key in seed and seed[k.key] != k.value and seed[k.key] in k.choices]


def asleep(steps: list[Setback], best_source: str,
           facts: Mapping[str, str] | None = None) -> list[Setback]:
    """Returns the steps whose knobs' code runs no call in the best (knobs.active, for these
    facts), provided that setting them all back leaves every running knob running, at its
    value, and wakes none: by the knobs' conditions, a program that runs the same code. Else
    (or with fewer than two such steps: one is a duel either way) none."""
    running = {(k.key, k.value) for k in active(find_knobs(best_source), facts)}
    keys = {key for key, _ in running}
    found = [s for s in steps if s.key not in keys]
    if len(found) < 2:
        return []
    after = apply_setbacks(best_source, found)
    return found if {(k.key, k.value) for k in active(find_knobs(after), facts)} == running else []


def duels(steps: list[Setback], best_source: str,
          facts: Mapping[str, str] | None = None) -> list[list[Setback]]:
    """Returns the duels the end of the run begins with, in order: the sleeping knobs together
    (asleep), then each other change on its own."""
    quiet = asleep(steps, best_source, facts)
    return ([quiet] if quiet else []) + [[s] for s in steps if s not in quiet]


def change_of(group: list[Setback]) -> str:
    """The change line of a group of set-backs ("KEY: BEST -> SEED, KEY: ...")."""
    return describe({s.key: (s.best, s.seed) for s in group}, False)


def apply_setbacks(source: str, group: list[Setback]) -> str:
    """Returns the program with the group's knobs at the seed's values."""
    return set_knobs(source, {s.key: s.seed for s in group})


def costs_nothing(duel: EvalResult) -> bool:
    """Returns whether a duel's candidate (the best with a change set back) is as fast as its
    rival (the best) within the noise: correct, the fitness gain's interval reaching 1 or above
    it, and no config slower by MATERIAL_LOSS or more beyond noise in any mode measured."""
    if not duel.correct or duel.gain_ci is None or duel.gain_ci[1] < 1.0:
        return False
    return not any(slower_configs(duel, mode) for mode in TIMING_MODES)
