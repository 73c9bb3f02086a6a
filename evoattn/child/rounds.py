"""What a timing is made of: the plan of rounds per mode, the interleaved rounds, the input
sets of back-to-back calls, and what timing a config returns (evoattn/child/timing.py holds the
protocol and its timers)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from ..contract import stats
from ..contract.names import WIDTH
from ..contract.types import Times

CALL_BATCH_MS = 2.0                # call mode: a batch lasts at least this ...
CALL_SETS = (8, 256)               # ... with this many input sets (distinct inputs per call) ...
CALL_MAX_BYTES = 4 * 2 ** 30       # ... filling at most this, whatever the set's size
FLOOR = {"kernel": 10, "call": 6, "graph": 6}     # the fitness mode's rounds: at least these
OTHER = {"kernel": 6, "call": 4, "graph": 4}      # the other modes' rounds (all even: pairs)

Fn = Callable[[dict[str, Any]], Any]
Samples = dict[str, list[float]]   # function name -> one time (ms) per round
Converged = Callable[[str, Samples], bool]


def own_width(mode: str, samples: Samples, width: float = WIDTH) -> bool:
    """The default stopping rule: every function's own median is known within width / sqrt 2
    (two such medians make a ratio known within about `width`)."""
    return all(stats.rel_half_width(*stats.center(v)) <= width / 2 ** .5
               for v in samples.values())


class LazyOutput(Exception):
    """A timed call returned something other than a plain tensor: work could run after the timer."""


def plain(name: str, out: Any, tensor_type: Any) -> None:
    """Raises LazyOutput unless `out` is a plain tensor (a subclass can defer work to its use)."""
    if type(out) is not tensor_type:
        raise LazyOutput(f"{name} returned {type(out).__module__}.{type(out).__qualname__} from a "
                         "timed call, not a plain torch.Tensor (work deferred past the timer)")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much to measure: the rounds per mode and the call-mode input sets."""

    warmup: int
    reps: int                          # kernel mode: the cap on repetitions
    rounds: int                        # call mode: the cap on batches
    graph_rounds: int                  # graph mode: the cap on replays
    sets: int                          # call mode: the most input sets memory allows
    graph: bool                        # measure graph mode at all
    mode: str = "call"                 # the fitness mode: its rounds adapt
    width: float = WIDTH
    heat: bool = True                  # call mode: the heat before heavy batches (GPU timer)

    @classmethod
    def for_device(cls, on_gpu: bool, warmup: int, reps: int, set_bytes: int,
                   mode: str = "call", width: float = WIDTH, graph: bool = True,
                   heat: bool = True) -> "Plan":
        """Returns the plan for a config whose random inputs take `set_bytes`; `reps` caps the
        fitness mode's rounds (`mode` "all": every mode's); `graph` False leaves graph mode
        out unless it is the fitness mode; `heat` False leaves call mode's heat out."""
        if not on_gpu:
            return cls(warmup, reps, rounds=4, graph_rounds=0, sets=2, graph=False, mode=mode,
                       width=width, heat=False)
        sets = max(2, min(CALL_SETS[1], CALL_MAX_BYTES // max(set_bytes, 1)))
        cap = max(reps, max(FLOOR.values()))
        cap += cap % 2                                  # whole pairs of rounds
        return cls(warmup, cap, cap, cap, sets, graph=graph or mode in ("graph", "all"),
                   mode=mode, width=width, heat=heat)

    def bounds(self, mode: str) -> tuple[int, int]:
        """Returns (floor, cap) of a mode's rounds."""
        cap = {"kernel": self.reps, "call": self.rounds, "graph": self.graph_rounds}[mode]
        if self.mode in (mode, "all"):
            return min(FLOOR[mode], cap), cap
        return min(OTHER[mode], cap), min(OTHER[mode], cap)

    def call_sets(self, per_call_ms: float) -> int:
        """Returns the input sets (= calls) of a call-mode batch for calls of about this time."""
        want = math.ceil(CALL_BATCH_MS / max(per_call_ms, 1e-4))
        return max(2, min(self.sets, max(CALL_SETS[0], want)))


def adapt(mode: str, names: list[str], plan: Plan, converged: Converged | None,
          one_round: Callable[[int, list[str], Samples], None]) -> Samples:
    """Runs interleaved rounds of a mode (order reversed each round) until converged or capped,
    stopping only after a whole pair of rounds. Past the floor the rule is asked after every
    round, so that its pause comes before both rounds of a pair, each starting with another
    function."""
    samples: Samples = {n: [] for n in names}
    floor, cap = plan.bounds(mode)
    rule = converged or (lambda m, s: own_width(m, s, plan.width))
    order = list(names)
    for r in range(cap):
        one_round(r, order, samples)
        order.reverse()
        if r + 1 >= floor and rule(mode, samples) and (r + 1) % 2 == 0:
            break
    return samples


@dataclasses.dataclass(frozen=True)
class Kept:
    """A timed output kept for re-checking, with the inputs it was computed from."""

    what: str                          # e.g. "timed call 7"
    output: Any
    inputs: dict[str, Any]
    last_of_batch: bool = False        # the last call of a back-to-back batch


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What timing one config produced, per function name."""

    times: dict[str, Times]
    kept: list[Kept]                   # the kept function's outputs to re-check
    peak_mem_bytes: dict[str, int | None]
    host_ms_per_call: dict[str, float]     # kernel mode's cross-check (hidden work)
    launch_ms: dict[str, float]
    samples: dict[str, Samples] = dataclasses.field(default_factory=dict)  # mode -> samples


class InputSets:
    """Distinct copies of a config's inputs (fresh values, own addresses) for back-to-back calls.

    With `refill_all` (a refill that fills any tensor elementwise, as the problems' default
    does), each random input of every set is a slice of one buffer of `count` sets, filled
    by one launch per input: refilling 256 sets one tensor at a time took milliseconds of
    launches per batch."""

    def __init__(self, base: dict[str, Any], random_names: tuple[str, ...], count: int,
                 refill: Callable[[dict[str, Any]], None],
                 refill_all: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._refill = refill
        self._bulk: dict[str, Any] = {}
        total = count + 1                       # the last: the heat's (untimed calls)
        if refill_all is not None and all(
                getattr(base.get(n), "is_contiguous", lambda: False)() for n in random_names):
            import torch
            self._bulk = {n: torch.empty((total, *base[n].shape), dtype=base[n].dtype,
                                         device=base[n].device) for n in random_names}
            self._refill_all = refill_all
            every = [{k: (self._bulk[k][i] if k in self._bulk else v)
                      for k, v in base.items()} for i in range(total)]
            refill_all(self._bulk)
        else:
            every = [{k: (v.clone() if k in random_names else v) for k, v in base.items()}
                     for _ in range(total)]
        self.sets = every[:count]
        self.heat = every[count]

    def refill(self) -> None:
        if self._bulk:
            self._refill_all(self._bulk)
            return
        for s in self.sets:
            self._refill(s)


def snapshot(inputs: dict[str, Any]) -> dict[str, Any]:
    """Returns a copy of the input tensors (scalars as they are)."""
    import torch
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def set_bytes(inputs: dict[str, Any], random_names: tuple[str, ...]) -> int:
    """Returns the bytes of one input set's random tensors."""
    return sum(inputs[n].numel() * inputs[n].element_size() for n in random_names
               if hasattr(inputs.get(n), "numel"))
