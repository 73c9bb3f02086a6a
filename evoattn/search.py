"""The search loop: the only place that changes the population and writes the run.

Each iteration: pick an island, a parent and inspirations; ask a mutator for a child;
evaluate it in the sandbox unless it is a known program; offer it to the population; commit
the iteration to SQLite in one transaction.

Several iterations are in flight at once: a window of `window` iterations (by default
`slots + lookahead`; slots: the evaluations the evaluator runs at once, `per_gpu` per GPU;
lookahead: LLM requests sent ahead, or the pool's `prefetch` when it builds ahead so that
the next candidates' builds overlap the GPU's work). Iterations are prepared in order, each
right after the commit of the iteration `window` places before it, and committed in order
whatever order their evaluations finish in; every random choice is drawn here from one seeded
RNG. So a given seed, window and evaluation results give the same run, however many slots
evaluate it and however fast each one is (the default window grows with the slots, and so
changes it).

A stop (other than Ctrl-C) first commits the window up to its last iteration holding an LLM
call already made, so no paid answer is lost. An LlmError from a mutator (the LLM cannot serve
the run) is committed as that iteration's rejection and stops the run cleanly, exit code 1.

The window itself is window.py; the end of the run (the best's changes set back, the best
re-measured beside the seed) is endofrun.py, which commits through this class.
"""
from __future__ import annotations

import collections
import dataclasses
import random
import time
from typing import Any, Callable, Mapping, Sequence

from evoattn.contract.names import Stage
from evoattn.contract.types import EXIT_INTERRUPTED, EvalResult, Verdict

from .config import RunConfig
from .endofrun import EndOfRun, first_line
from .errors import ClusterError
from .pool import as_pool
from .population import Population
from .report import beats, ci_text
from .store import RunStore
from .types import Evaluator, MutationRequest, Mutator, Pool, Program, Proposal, program_id
from .window import DUPLICATE, InFlight, Window

# Where an evaluation has its GPU to itself (evoattn/child/gpu_turn.py when slots share one):
TIMING_STAGE = Stage.TIME   # the GPUs' share of wall time in it is what more slots would raise
PLAIN_BAR = "plain_bar"   # the snapshot key of the champion's plain fitness (see Search)


@dataclasses.dataclass(frozen=True)
class Progress:
    """What the live view shows after each iteration."""

    iteration: int
    iterations: int
    best: Program | None
    seed_fitness: float
    last_note: str
    counts: dict[str, int]
    flags: int
    rejected: int
    cached: int
    elapsed_s: float
    evaluated: int                       # this session
    llm: dict[str, float]
    gpu_busy: float = 0.0                # timing seconds / (wall seconds × GPUs)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a search ended."""

    best: Program | None
    seed: Program
    iterations_done: int
    stop_reason: str
    elapsed_s: float                     # this session
    run_elapsed_s: float = 0.0           # every session of the run
    exit_code: int = 0                   # 130 (or 128 + signal) after a clean stop on a signal;
                                         # 1 after one on a lost cluster
    gpu_busy: float = 0.0                # timing seconds / (wall seconds × GPUs), this session


class Search:
    """Runs the evolutionary loop over a store, an evaluator and weighted mutators."""

    def __init__(self, cfg: RunConfig, store: RunStore, evaluator: Pool | Evaluator,
                 mutators: Sequence[tuple[Mutator, float]], seed_source: str, seed_suffix: str,
                 contract: str = "", on_progress: Callable[[Progress], None] = lambda p: None,
                 clock: Callable[[], float] = time.monotonic,
                 budget_exhausted: Callable[[], bool] = lambda: False,
                 llm_totals: Callable[[], dict[str, float]] = dict,
                 lookahead: int = 0, window: int | None = None,
                 facts: Mapping[str, str] | None = None) -> None:
        self.cfg = cfg
        self.facts = dict(facts or {})     # e.g. {"target": "sm90"}: which knobs' code runs
        self.store = store
        self.evaluator = as_pool(evaluator)
        self.mutators = list(mutators)
        self.seed_source = seed_source
        self.suffix = seed_suffix
        self.contract = contract
        self.on_progress = on_progress
        self.clock = clock
        self.budget_exhausted = budget_exhausted
        self.llm_totals = llm_totals
        self.lookahead = lookahead
        self._depth = window                 # the window's size (None: Window.depth)
        self.stop_requested = False
        self.rng = random.Random(cfg.random_seed)
        self.programs: dict[str, Program] = {}
        self.iteration = 0
        self.gpu_info: dict[str, Any] = {}
        self.evaluated_this_session = 0
        self._stats: collections.Counter[str] = collections.Counter()
        self._gpu_s = 0.0
        self._prior_elapsed = 0.0
        self._window: Window | None = None   # the iterations in flight, while run() runs
        # A crowned best's plain fitness (before its duel): the bar plain children are held
        # to, by their protocol (which may leave out the duel's heat, which reads lower); kept
        # with the population (PLAIN_BAR) for a resume; lost duels raise it (_raise_bar).
        self._plain_fitness: dict[str, float] = {}
        self._pop: Population | None = None
        self._t0 = clock()
        self._duel_s: list[float] = []       # seconds this session's duels took
        self._end = EndOfRun(self)
        self._first_iteration = 0            # the iteration this session's loop started from
        self._loop_t0 = self._t0             # when it started (the seed evaluated or restored)

    def known(self, pid: str) -> bool:
        """Returns whether a program was evaluated or is being evaluated (mutators skip it)."""
        evaluating = self._window.evaluating if self._window is not None else ()
        return pid in self.programs or pid in evaluating or self.store.has_program(pid)

    # ---- setup ---------------------------------------------------------------
    def _start(self) -> tuple[Population, Program]:
        """Returns the population and the seed, restored or evaluated; sets the deadlines."""
        pop, seed = self._restore_or_seed()
        self._pop = pop
        if seed.result is not None:
            self.gpu_info = {"name": seed.result.device, **seed.result.device_info}
        if seed.correct:
            self.evaluator.calibrate(seed.result)
        return pop, seed

    def _restore_or_seed(self) -> tuple[Population, Program]:
        state = self.store.load_state()
        self.programs = self.store.load_programs()
        if state is not None:
            self.iteration = int(state["iteration"])
            self.rng.setstate(state["rng_state"])
            self._prior_elapsed = float(state.get("elapsed_s") or 0.0)
            # The view's counters cover the whole run, not only this session.
            cached = self.store.rejection_count(DUPLICATE)
            self._stats.update(rejected=self.store.rejection_count() - cached, cached=cached)
            pop = Population.restore(state["population"], self.programs, self.cfg.population)
            self._plain_fitness.update(state["population"].get(PLAIN_BAR) or {})
            return pop, pop.seed
        result = self.evaluator.submit(self.seed_source, self.suffix, "seed").result()
        self._count(result)
        seed = Program(program_id(self.seed_source), self.seed_source, self.suffix, None, 0, 0,
                       "seed", "the seed program", result)
        self.programs[seed.id] = seed
        pop = Population(self.cfg.population, seed)
        self.store.commit_iteration(iteration=0, program=seed, rejection=None, llm_usage=None,
                                    rng_state=self.rng.getstate(),
                                    population_snapshot=self._snapshot(pop), elapsed_s=0.0)
        return pop, seed

    # ---- the loop ------------------------------------------------------------
    def run(self) -> Outcome:
        """Runs until iterations, wall time, target fitness, budget or a stop request."""
        t0 = self._t0 = self.clock()
        window = self._window = Window(self.evaluator, self.suffix, self.lookahead, self._depth)
        seed: Program | None = None
        interrupted: KeyboardInterrupt | None = None
        try:
            pop, seed = self._start()
            stop = self._stop_reason(pop, t0) or _seed_fails(seed)
            next_iter = self.iteration + 1
            self._first_iteration, self._loop_t0 = self.iteration, self.clock()
            while stop is None:
                next_iter = window.fill(next_iter, self.cfg.iterations,
                                        lambda i, flying: self._prepare(pop, i, flying))
                if not window:
                    stop = "iterations"
                    break
                self._commit_head(window, pop, seed, t0)
                stop = window.llm_stop or self._stop_reason(pop, t0)
            # LLM calls under way finish, and those paid for are not thrown away: the window
            # is committed up to the last of them (at most `lookahead` calls).
            while window.holds_a_paid_call():
                self._commit_head(window, pop, seed, t0)
            exit_code = 1 if window.llm_stop else 0
        except KeyboardInterrupt as e:
            interrupted = e
            signum = getattr(e, "signum", 2)
            exit_code = 128 + signum if signum != 2 else EXIT_INTERRUPTED
            stop = (f"interrupted ({'Ctrl-C' if signum == 2 else f'signal {signum}'}); "
                    "in-flight candidates were not recorded")
        except ClusterError as e:              # the cluster went away: --resume goes on later
            if seed is None:
                raise
            exit_code, stop = 1, f"{e}; in-flight candidates were not recorded"
        finally:
            window.cancel()
        if seed is None:                       # interrupted while the seed was evaluated
            raise interrupted or KeyboardInterrupt()
        self.store.record_stop(stop)
        elapsed = self.clock() - t0
        return Outcome(pop.best(), seed, self.iteration, stop, elapsed,
                       self._prior_elapsed + elapsed, exit_code, self._timing_share(elapsed))

    def _commit_head(self, window: Window, pop: Population, seed: Program, t0: float) -> None:
        """Waits for the oldest iteration in flight, commits it and reports it."""
        head, proposal, result = window.take(lambda pid: pid in self.programs)
        note = self._step(pop, head, proposal, result)
        self.iteration = head.iteration
        self._report(pop, seed, t0, note)

    def _prepare(self, pop: Population, iteration: int,
                 window: Sequence[InFlight] = ()) -> tuple[MutationRequest, Mutator]:
        island = pop.island_of_next(iteration)
        parent = pop.select_parent(island, self.rng)
        insp = pop.inspirations(island, self.cfg.llm.inspirations, self.rng, exclude_id=parent.id)
        mutator = self.rng.choices([m for m, _ in self.mutators], [w for _, w in self.mutators])[0]
        req = MutationRequest(parent=parent, inspirations=tuple(insp),
                              seed=self.rng.getrandbits(32), iteration=iteration,
                              problem_contract=self.contract, gpu_info=self.gpu_info,
                              pending=tuple(e.iteration for e in window
                                            if e.request.parent.id == parent.id))
        return req, mutator

    def _step(self, pop: Population, entry: InFlight, proposal: Proposal,
              result: EvalResult | None) -> str:
        """Commits one iteration (its child, or why there is none); returns a note for the view."""
        iteration, parent = entry.iteration, entry.request.parent
        island = pop.island_of_next(iteration)
        if result is None:                   # a rejection or a duplicate
            reason = entry.note or "rejected"
            if reason.startswith(DUPLICATE):
                self._stats["cached"] += 1
            else:
                self._stats["rejected"] += 1
            self._commit(pop, iteration, None, (parent.id, proposal.mutator, reason), proposal)
            return f"{proposal.mutator}: {'' if reason.startswith(DUPLICATE) else 'rejected: '}" \
                   f"{reason}"
        pid = entry.program_id or program_id(proposal.source or "")
        self._count(result)
        reading = result.fitness                 # its plain evaluation's, before any duel
        result, crowned, verdict = self._challenge(pop, pid, proposal.source or "", result)
        child = Program(pid, proposal.source or "", self.suffix, parent.id, iteration, island,
                        proposal.mutator, proposal.change, result, proposal.second_parent_id)
        self.programs[pid] = child
        pop.add(child)
        if crowned:
            pop.crown(child)
        self._commit(pop, iteration, child, None, proposal)
        change = first_line(proposal.change, 160)   # a knob mutation's three settings fit
        if not child.correct:
            return f"{proposal.mutator}: {result.verdict.value}: {result.reason[:70]} ({change})"
        return (f"{proposal.mutator}: {result.verdict.value} fitness {reading:.3f} "
                f"({change}){verdict}")

    def _challenge(self, pop: Population, pid: str, source: str,
                   result: EvalResult) -> tuple[EvalResult, bool, str]:
        """The champion challenge: a correct child whose fitness reads above the best's is
        re-measured head to head with the best, in one process, in interleaved rounds, on
        fresh inputs; it becomes the best only if faster by more than their combined
        uncertainty (the gain's 95% interval lies above 1). Returns the result to store (the
        re-measured one), whether it won, and a note."""
        champ = pop.best()
        # "Reads above" means beyond its own noise: the lower end of its fitness interval
        # (the point where it has none), so that a child as fast as the best, which reads
        # above it half the time, does not cost a duel every other iteration.
        floor = result.fitness_ci[0] if result.fitness_ci else result.fitness
        if champ is None or not result.correct or champ.id == pid or floor <= self.bar(champ):
            return result, False, ""
        started = self.clock()
        duel = self.duel(source, f"{pid} vs {champ.id}", champ.source)
        # The duel's own time, not its wait behind the candidates queued before it: the end
        # of the run's duels queue behind nothing.
        self._duel_s.append(duel.duration_s or self.clock() - started)
        self._stats["challenges"] += 1
        if not duel.correct:
            return result, False, f" (challenge: {duel.verdict.value}: {duel.reason[:60]})"
        gain = duel.gain or 0.0
        won = beats(duel)
        raised = ""
        if won:
            self._stats["crowned"] += 1
            self._plain_fitness[pid] = result.fitness
        elif gain > 0 and self._raise_bar(champ, result.fitness / max(gain, 1.0)):
            # The figure that set the bar: this plain reading (over the gain), not the duel's.
            raised = (f"; a duel now takes a plain reading above {self.bar(champ):.3f}, set by "
                      f"this one's {result.fitness:.3f}" + (f" / {gain:.3f}" if gain > 1 else ""))
        note = (f" -> {duel.fitness:.3f} re-measured beside the best ({champ.id}: "
                f"{duel.rival_fitness or 0:.3f}), {gain:.3f}x"
                f"{ci_text(duel.gain_ci)}: {'new best' if won else 'not beyond noise'}{raised}")
        return duel, won, note

    def _raise_bar(self, champ: Program, reading: float) -> bool:
        """After a duel the child lost: its plain reading, over its gain where it was faster
        within noise, is a plain reading the best itself could have had in that evaluation.
        The bar rises to the highest such reading, so that children as fast as the best do
        not send duel after duel to the GPU for the same noise; a child faster than the spread
        of plain readings still reads above it. Returns whether it rose."""
        if reading <= self.bar(champ):
            return False
        self._plain_fitness[champ.id] = reading
        return True

    @property
    def challenges(self) -> tuple[int, int]:
        """Returns (duels held, duels won) this session."""
        return self._stats["challenges"], self._stats["crowned"]

    def bar(self, champ: Program) -> float:
        """Returns the plain fitness a child must read above to challenge `champ`."""
        return self._plain_fitness.get(champ.id, champ.fitness)

    def hold_to_bar(self, pid: str, best: Program) -> None:
        """Holds the challengers of program `pid` to the bar of `best` (within its noise)."""
        self._plain_fitness[pid] = self.bar(best)

    def duel(self, source: str, label: str, rival: str) -> EvalResult:
        """Returns `source` timed beside `rival` in one process (raises what the pool raises)."""
        duel = self.evaluator.submit(source, self.suffix, label, rival=rival).result()
        self._gpu_s += duel.stage_s.get(TIMING_STAGE, 0.0)
        return duel

    def commit_step(self, pop: Population, program: Program | None) -> None:
        """Commits a step of the end of the run under the last iteration's number."""
        self.store.commit_iteration(
            iteration=self.iteration, program=program, rejection=None, llm_usage=None,
            rng_state=self.rng.getstate(), population_snapshot=self._snapshot(pop),
            elapsed_s=self._prior_elapsed + self.clock() - self._t0)

    # ---- the end of the run (endofrun.py) -------------------------------------------
    def prune(self, best: Program, seed: Program,
              say: Callable[[str], None] = lambda line: None) -> Program:
        """Returns the champion after setting back, one at a time, each knob in which `best`
        differs from the seed that costs nothing beside it (prune.py): `best` when every change
        pays, nothing differs, or it was pruned already; each step is committed, `say` gets a
        line per step."""
        assert self._pop is not None, "prune() follows run()"
        return self._end.prune(self._pop, best, seed, say)

    @property
    def set_back(self) -> tuple[int, int]:
        """Returns (changes tried, changes set back) at the end of the run."""
        return self._end.tried, self._end.set_back

    def remeasure(self, best: Program, seed: Program) -> EvalResult | None:
        """Returns the best re-measured beside the seed (a duel), recorded for its export; None
        when the best is the seed or either is not correct."""
        return self._end.remeasure(best, seed)

    def _count(self, result: EvalResult) -> None:
        self._stats["evaluated"] += 1
        self.evaluated_this_session += 1
        self._gpu_s += result.stage_s.get(TIMING_STAGE, 0.0)

    def _commit(self, pop: Population, iteration: int, program: Program | None,
                rejection: tuple[str, str, str] | None, proposal: Proposal) -> None:
        # Every iteration counts towards migration, whether or not its child was evaluated.
        if self.cfg.population.migration_interval and \
                iteration % self.cfg.population.migration_interval == 0:
            pop.migrate()
        self.store.commit_iteration(iteration=iteration, program=program, rejection=rejection,
                                    llm_usage=proposal.usage, rng_state=self.rng.getstate(),
                                    population_snapshot=self._snapshot(pop),
                                    elapsed_s=self._prior_elapsed + self.clock() - self._t0,
                                    rejection_change=proposal.change if rejection else "")

    def _snapshot(self, pop: Population) -> dict[str, Any]:
        """The population's snapshot, with the plain bar of its champion (if it has one)."""
        snap = pop.snapshot()
        champ = snap.get("champion")
        if champ in self._plain_fitness:
            snap[PLAIN_BAR] = {champ: self._plain_fitness[champ]}
        return snap

    # ---- stopping and reporting -------------------------------------------------
    def _stop_reason(self, pop: Population, t0: float) -> str | None:
        best = pop.best()
        if self.stop_requested:
            return "stopped by request"
        if self.iteration >= self.cfg.iterations:
            return "iterations"
        wall = self._wall_stop(pop, t0)
        if wall:
            return wall
        if self.cfg.target_fitness is not None and best and best.fitness >= self.cfg.target_fitness:
            return f"target fitness {self.cfg.target_fitness} reached"
        if self.budget_exhausted():
            return "LLM budget exhausted"
        return None

    def _wall_stop(self, pop: Population, t0: float) -> str | None:
        """Returns why the wall time stops the run, once the next iteration (this session's
        mean) and the end of the run would not both fit in it; else None."""
        wall = self.cfg.max_wall_s
        if wall is None:
            return None
        now = self.clock()
        done = self.iteration - self._first_iteration
        step = (now - self._loop_t0) / done if done else 0.0
        end = self._end.estimate_s(pop, self._duel_s)
        if now - t0 + step + end < wall:
            return None
        if end and now - t0 < wall:
            return (f"wall time {wall:.0f} s (its last {end:.0f} s kept for the end of the "
                    "run: setting back the best's changes and re-measuring it)")
        return f"wall time {wall:.0f} s"

    def past_wall_time(self) -> bool:
        """Returns whether this session has reached the run's wall time."""
        return self.cfg.max_wall_s is not None and \
            self.clock() - self._t0 >= self.cfg.max_wall_s

    def _report(self, pop: Population, seed: Program, t0: float, note: str) -> None:
        counts = collections.Counter(p.result.verdict.value for p in self.programs.values()
                                     if p.result)
        flagged = sum(1 for p in self.programs.values() if p.result and
                      (p.result.flags or p.result.verdict in _INTEGRITY))
        elapsed = self.clock() - t0
        self.on_progress(Progress(
            iteration=self.iteration, iterations=self.cfg.iterations, best=pop.best(),
            seed_fitness=seed.fitness, last_note=note, counts=dict(counts),
            flags=flagged, rejected=self._stats["rejected"], cached=self._stats["cached"],
            elapsed_s=elapsed, evaluated=self.evaluated_this_session,
            llm=self.llm_totals(), gpu_busy=self._timing_share(elapsed)))

    def _timing_share(self, elapsed: float) -> float:
        """Timing seconds / (wall seconds × the GPUs, or CPU slots, the evaluations run on)."""
        gpus = max(1, self.evaluator.gpus)
        return self._gpu_s / (elapsed * gpus) if elapsed > 0 else 0.0


_INTEGRITY = {Verdict.POLICY, Verdict.TAMPERING, Verdict.HIDDEN_WORK, Verdict.NONDETERMINISTIC,
              Verdict.IMPLAUSIBLE, Verdict.SANDBOX}


def _seed_fails(seed: Program) -> str | None:
    """Returns why the search cannot start from this seed (it is not correct), or None."""
    if seed.correct:
        return None
    r = seed.result
    return f"the seed is not correct ({r.verdict.value if r else '?'}: {r.reason if r else ''})"
