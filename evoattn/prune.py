"""The end of a run: the best's changes from the seed, each set back unless it pays.

A champion challenge judges a whole child, not each of its changes: a knob turned beside the
one that won the duel rides along unproven, and so does one that pays nothing in the fitness
mode but costs in another (on an H200, NUM_WARPS_D64 = 8 is even with 4 in call time and
0.70x in kernel time at (1,8,512,64)). So at the end of a run each knob in which the best
differs from the seed is set back to the seed's value, one at a time, and stays set back when a
duel of the result (candidate) beside the best (rival) shows it costs nothing: not in the
fitness mode's geometric mean beyond noise, nor by MATERIAL_LOSS or more at any config in any
mode measured. Every step is measured beside the best the phase started from, so what it ends
with is within noise of that best, with only the changes that pay. The search (search.py)
holds the duels and commits their results; this module decides what to try and what to keep.
"""
from __future__ import annotations

import dataclasses

from evaluator.knobs import find_knobs, set_knobs
from evaluator.request import TIMING_MODES
from evaluator.scoring import slower_configs
from evaluator.types import EvalResult

from .mutators.knobs import describe

PRUNE = "prune"          # the mutator name of a program with one change set back


@dataclasses.dataclass(frozen=True)
class Setback:
    """One knob of the best set back to the seed's value."""

    key: str
    best: str            # the value in the best
    seed: str            # the seed's value

    @property
    def change(self) -> str:
        """The change line of the program it makes ("KEY: BEST -> SEED")."""
        return describe({self.key: (self.best, self.seed)}, False)

    def apply(self, source: str) -> str:
        """Returns the program with this knob at the seed's value."""
        return set_knobs(source, {self.key: self.seed})


def setbacks(best_source: str, seed_source: str) -> list[Setback]:
    """Returns the knobs, in the best's order, whose value differs from the seed's where the
    best's choices allow the seed's value (an LLM's edit may have changed a knob's choices)."""
    seed = {k.key: k.value for k in find_knobs(seed_source)}
    return [Setback(k.key, k.value, seed[k.key]) for k in find_knobs(best_source)
            if k.key in seed and seed[k.key] != k.value and seed[k.key] in k.choices]


def costs_nothing(duel: EvalResult) -> bool:
    """Returns whether a duel's candidate (the best with a change set back) is as fast as its
    rival (the best) within the noise: correct, the fitness gain's interval reaching 1 or above
    it, and no config slower by MATERIAL_LOSS or more beyond noise in any mode measured."""
    if not duel.correct or duel.gain_ci is None or duel.gain_ci[1] < 1.0:
        return False
    return not any(slower_configs(duel, mode) for mode in TIMING_MODES)
