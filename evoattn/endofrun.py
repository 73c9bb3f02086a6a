"""The end of a run: the best's changes set back one at a time (prune.py decides which and
what to keep), then the champion re-measured beside the seed, each duel committed as it is
measured. The search (search.py) holds the duels and the run's state; this module orders
them, and estimates their time so that a wall-time limit leaves room for them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from evoattn.contract.types import EvalResult

from .population import Population
from .prune import PRUNE, Setback, apply_setbacks, change_of, costs_nothing, duels, setbacks
from .report import set_back_line
from .types import Program, program_id

if TYPE_CHECKING:
    from .search import Search

# The end-of-run duels' time over the estimate from the search's duels: on an H200 they ran
# about 1.2x the search's challenges.
END_MARGIN = 1.25


class EndOfRun:
    """Sets back the best's changes from the seed, re-measures the champion beside the seed."""

    def __init__(self, search: Search) -> None:
        self.search = search
        self.tried = 0                     # changes tried, this session
        self.set_back = 0                  # changes set back (they cost nothing)
        self._planned = ("", 0)            # (best id, its setting-back duels), read once

    def prune(self, pop: Population, best: Program, seed: Program,
              say: Callable[[str], None]) -> Program:
        """Returns the champion after setting back each change of `best` that costs nothing
        (see Search.prune); commits each step; `say` gets a line per step."""
        s = self.search
        if not s.cfg.population.prune or best.id == seed.id or \
                not (best.correct and seed.correct) or self.pruned(best):
            return best
        steps = setbacks(best.source, seed.source)
        queue = duels(steps, best.source, s.facts)
        if steps:
            quiet = len(queue[0]) if len(queue[0]) > 1 else 0
            say(f"setting back the best's {len(steps)} changes from the seed, one at a time, "
                "each kept only if it pays beyond noise"
                + (f" ({quiet} whose code runs no call together first)" if quiet else "")
                + " ...")
        record: list[dict[str, Any]] = []
        current, complete = best, True
        while queue:
            group = queue.pop(0)
            joint = len(group) > 1           # knobs whose code runs no call, together
            source = apply_setbacks(current.source, group)
            pid = program_id(source)
            known = s.programs.get(pid) or s.store.get_program(pid)
            if known is not None and not known.correct:
                say(f"  {change_of(group)}: {pid} failed its checks in the search; "
                    + ("each tried alone" if joint else "kept"))
                queue[:0] = [[step] for step in group] if joint else []
                continue
            duel = self._duel_or_stop(source, pid, best)
            if isinstance(duel, str):
                say(f"  setting back stopped{duel}; "
                    "the best is what it reached; a resumed run goes on from it")
                complete = False
                break
            current, kept = self._keep(pop, group, source, current, best, known, duel)
            if not kept and joint:           # asleep by their conditions, yet they cost
                queue[:0] = [[step] for step in group]
            record.append(_line(group, pid, known is not None, kept, duel))
            s.commit_step(pop, None if known else s.programs[pid])
            say("  " + set_back_line(record[-1]))
        s.store.record_pruned(best.id, current.id, record, complete)
        return current

    def _duel_or_stop(self, source: str, pid: str, best: Program) -> EvalResult | str:
        """Returns the duel of a set-back program beside the best, or why there is none now
        (the wall time, a lost cluster: the text that follows 'setting back stopped')."""
        s = self.search
        if s.past_wall_time():
            return f": wall time {s.cfg.max_wall_s:.0f} s reached"
        try:
            return s.duel(source, f"{pid} vs {best.id}", best.source)
        except Exception as e:  # noqa: BLE001 - a lost cluster, say: keep what was set back
            return f" ({type(e).__name__}: {first_line(str(e), 120)})"

    def _keep(self, pop: Population, group: list[Setback], source: str, current: Program,
              best: Program, known: Program | None, duel: EvalResult) -> tuple[Program, bool]:
        """Adds the program with `group` set back to the population, crowned when it costs
        nothing; returns the champion and whether the group was kept set back."""
        s = self.search
        pid = program_id(source)
        kept = costs_nothing(duel)
        # A program the search met (the best's parent, the seed, ...) keeps its stored
        # record; the duel is kept in the phase's record.
        child = known or Program(pid, source, s.suffix, current.id, s.iteration,
                                 current.island, PRUNE, change_of(group), duel)
        if known is None:
            s.programs[pid] = child
            pop.add(child)
        if kept or len(group) == 1:        # a group that costs is tried again knob by knob
            self.tried += len(group)
        if not kept:
            return current, False
        pop.crown(child)
        self.set_back += len(group)
        s.hold_to_bar(pid, best)           # within noise of the best: the best's bar
        return child, True

    def remeasure(self, best: Program, seed: Program) -> EvalResult | None:
        """Returns the best re-measured beside the seed (see Search.remeasure)."""
        if best.id == seed.id or not (best.correct and seed.correct):
            return None
        try:
            duel = self.search.evaluator.submit(best.source, self.search.suffix,
                                                f"{best.id} vs seed", rival=seed.source).result()
        except Exception:  # noqa: BLE001 - the summary then shows the run's own figures only
            return None
        self.search.store.record_side_by_side(seed.id, best.id, duel)
        return duel

    def estimate_s(self, pop: Population, duel_s: list[float]) -> float:
        """Returns the seconds the end of the run would take now: the duels setting back the
        best's changes from the seed (prune.duels) and one re-measuring it beside the seed, at
        the mean of `duel_s` (before any, the duel that crowned the best, else the best's and
        the seed's evaluations together), with a margin (END_MARGIN)."""
        best, seed = pop.best(), pop.seed
        if best is None or best.id == seed.id or not (best.correct and seed.correct):
            return 0.0
        if self._planned[0] != best.id:      # read once per best, not per iteration
            planned = 0
            if self.search.cfg.population.prune and not self.pruned(best):
                planned = len(duels(setbacks(best.source, seed.source), best.source,
                                    self.search.facts))
            self._planned = (best.id, planned)
        count = 1 + self._planned[1]
        if duel_s:
            per = sum(duel_s) / len(duel_s)
        elif best.result is not None and best.result.rival:
            per = best.result.duration_s
        else:
            per = sum(p.result.duration_s for p in (best, seed) if p.result)
        return count * per * END_MARGIN

    def pruned(self, best: Program) -> bool:
        """Returns whether the run's end already tried every change of this best."""
        return bool((self.search.store.pruned(best.id) or {}).get("complete"))


def _line(group: list[Setback], pid: str, met: bool, kept: bool,
          duel: EvalResult) -> dict[str, Any]:
    """The phase's record of one duel (report.set_back_line shows it)."""
    return {"change": change_of(group), "program": pid, "met": met, "kept_back": kept,
            "verdict": duel.verdict.value,
            "reason": "" if duel.correct else first_line(duel.reason, 80),
            "gain": duel.gain, "gain_ci": list(duel.gain_ci) if duel.gain_ci else None,
            **({"runs_no_call": True} if len(group) > 1 else {})}


def first_line(text: str, limit: int) -> str:
    """Returns the first line of a text (an LLM's change may be a diff, a rejection may quote a
    server's answer), cut to `limit` characters."""
    lines = (text or "").strip().splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[:limit - 3] + "..."
