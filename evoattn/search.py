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
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import random
import time
from typing import Any, Callable, Mapping, Sequence

from evaluator.names import Stage
from evaluator.types import EXIT_INTERRUPTED, EvalResult, Verdict

from .config import RunConfig
from .errors import ClusterError, LlmError
from .pool import as_pool
from .population import Population
from .prune import PRUNE, apply_setbacks, change_of, costs_nothing, duels, setbacks
from .report import beats, ci_text, set_back_line
from .store import RunStore
from .types import Evaluator, MutationRequest, Mutator, Program, Proposal, program_id

# Where an evaluation has its GPU to itself (evaluator/gpu_turn.py when slots share one): the
# share of the wall time the GPUs spend in it is what more slots per GPU would raise.
TIMING_STAGE = Stage.TIME
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


# The end-of-run duels' time over the estimate from the search's duels: on an H200 they ran
# about 1.2x the search's challenges.
END_MARGIN = 1.25


@dataclasses.dataclass
class _InFlight:
    """One iteration in the window."""

    iteration: int
    request: MutationRequest
    mutator: Mutator
    proposal: cf.Future[Proposal]
    evaluation: cf.Future[EvalResult] | None = None
    decided: bool = False                # rejected, a duplicate, or sent to the evaluator
    program_id: str | None = None
    note: str | None = None              # why it is not evaluated


class Search:
    """Runs the evolutionary loop over a store, an evaluator and weighted mutators."""

    def __init__(self, cfg: RunConfig, store: RunStore, evaluator: Evaluator | Any,
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
        self.window = window
        self.stop_requested = False
        self.rng = random.Random(cfg.random_seed)
        self.programs: dict[str, Program] = {}
        self.iteration = 0
        self.gpu_info: dict[str, Any] = {}
        self.evaluated_this_session = 0
        self._stats: collections.Counter[str] = collections.Counter()
        self._gpu_s = 0.0
        self._prior_elapsed = 0.0
        self._in_flight: set[str] = set()
        self._llm_stop: str | None = None    # why the LLM cannot go on (LlmUnavailable)
        # A crowned best's fitness as a plain candidate (before its duel): the bar that plain
        # children are held to, measured by the same protocol as theirs (a run's plain
        # protocol may leave out the duel's heat, which reads lower). Kept with the population
        # (PLAIN_BAR), so a resumed run holds children to the same bar; lost duels raise it
        # (_raise_bar).
        self._plain_fitness: dict[str, float] = {}
        self._pop: Population | None = None
        self._t0 = clock()
        self._duel_s: list[float] = []       # seconds this session's duels took
        self._end_duels = ("", 0)            # (best id, its setting-back duels) for the wall time
        self._first_iteration = 0            # the iteration this session's loop started from
        self._loop_t0 = self._t0             # when it started (the seed evaluated or restored)

    def known(self, pid: str) -> bool:
        """Returns whether a program was evaluated or is being evaluated (mutators skip it)."""
        return pid in self.programs or pid in self._in_flight or self.store.has_program(pid)

    # ---- setup ---------------------------------------------------------------
    def _start(self) -> tuple[Population, Program]:
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
        t0 = self.clock()
        self._t0 = t0
        exit_code = 0
        window: collections.deque[_InFlight] = collections.deque()
        pool = cf.ThreadPoolExecutor(max_workers=self.lookahead) if self.lookahead else None
        seed: Program | None = None
        interrupted: KeyboardInterrupt | None = None
        try:
            pop, seed = self._start()
            self._pop = pop
            self._gpu_info_from(seed)
            if seed.correct:
                self.evaluator.calibrate(seed.result)
            stop = self._stop_reason(pop, t0)
            if not seed.correct and stop is None:
                r = seed.result
                stop = f"the seed is not correct ({r.verdict.value if r else '?'}: " \
                       f"{r.reason if r else ''})"
            next_iter = self.iteration + 1
            self._first_iteration, self._loop_t0 = self.iteration, self.clock()
            while stop is None:
                next_iter = self._fill(window, pop, next_iter, pool)
                if not window:
                    stop = "iterations"
                    break
                self._commit_head(window, pop, seed, t0)
                stop = self._llm_stop or self._stop_reason(pop, t0)
            # LLM calls under way finish, and those paid for are not thrown away: the window
            # is committed up to the last of them (at most `lookahead` calls).
            cf.wait([e.proposal for e in window])
            while any(_holds_a_paid_call(e) for e in window):
                self._commit_head(window, pop, seed, t0)
            exit_code = 1 if self._llm_stop else 0
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
            for entry in window:
                entry.proposal.cancel()
                if entry.evaluation is not None:
                    entry.evaluation.cancel()
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if seed is None:                       # interrupted while the seed was evaluated
            raise interrupted or KeyboardInterrupt()
        self.store.record_stop(stop)
        elapsed = self.clock() - t0
        return Outcome(pop.best(), seed, self.iteration, stop, elapsed,
                       self._prior_elapsed + elapsed, exit_code, self._timing_share(elapsed))

    def _commit_head(self, window: collections.deque[_InFlight], pop: Population, seed: Program,
                     t0: float) -> None:
        """Waits for the oldest iteration in flight, commits it and reports it."""
        self._dispatch(window)
        head = window[0]
        proposal = self._proposal_of(head)
        self._dispatch(window)
        result = head.evaluation.result() if head.evaluation is not None else None
        window.popleft()
        note = self._step(pop, head, proposal, result)
        self.iteration = head.iteration
        self._report(pop, seed, t0, note)

    def _proposal_of(self, entry: _InFlight) -> Proposal:
        """Returns an entry's proposal; an LlmError becomes a rejection and stops the run."""
        try:
            return entry.proposal.result()
        except LlmError as e:
            self._llm_stop = self._llm_stop or str(e)
            return Proposal(entry.request.parent.id, getattr(entry.mutator, "name", "llm"), None,
                            rejected_reason=str(e), usage=getattr(e, "usage", None))

    def _fill(self, window: collections.deque[_InFlight], pop: Population, next_iter: int,
              pool: cf.ThreadPoolExecutor | None) -> int:
        """Prepares iterations until the window is full; returns the next iteration number."""
        # A pool that builds ahead (nvcc on CPU cores) gets `prefetch` iterations more than its
        # slots even without LLM lookahead: their builds overlap the GPU work of the others.
        ahead = self.lookahead or int(getattr(self.evaluator, "prefetch", 0))
        depth = self.window or max(1, self.evaluator.slots) + ahead
        while next_iter <= self.cfg.iterations and len(window) < depth and not self._llm_stop:
            req, mut = self._prepare(pop, next_iter, window)
            fut: cf.Future[Proposal]
            if pool is None or not getattr(mut, "blocking_io", False):
                # Local mutators answer here, in order, seeing the state as it is now: only
                # requests that wait on the network go to the pool.
                fut = cf.Future()
                try:
                    fut.set_result(_safe_propose(mut, req))
                except LlmError as e:        # committed in order, as from the pool
                    fut.set_exception(e)
            else:
                fut = pool.submit(_safe_propose, mut, req)
            window.append(_InFlight(next_iter, req, mut, fut))
            next_iter += 1
        return next_iter

    def _dispatch(self, window: collections.deque[_InFlight]) -> None:
        """Sends answered proposals to the evaluator, in order, up to the first unanswered one
        (so which earlier program a later one duplicates never depends on timing)."""
        for entry in window:
            if entry.decided:
                continue
            if not entry.proposal.done():
                return
            entry.decided = True
            proposal = self._proposal_of(entry)
            if proposal.source is None:
                entry.note = proposal.rejected_reason or "rejected"
                continue
            pid = program_id(proposal.source)
            entry.program_id = pid
            if pid in self.programs or pid in self._in_flight:
                entry.note = f"{DUPLICATE} {pid} (not evaluated again)"
                continue
            self._in_flight.add(pid)
            entry.evaluation = self.evaluator.submit(proposal.source, self.suffix, pid)

    def _prepare(self, pop: Population, iteration: int,
                 window: Sequence[_InFlight] = ()) -> tuple[MutationRequest, Mutator]:
        island = pop.island_of_next(iteration)
        parent = pop.select_parent(island, self.rng)
        insp = pop.inspirations(island, self.cfg.llm.inspirations, self.rng, exclude_id=parent.id)
        weights = [w for _, w in self.mutators]
        mutator = self.rng.choices([m for m, _ in self.mutators], weights=weights)[0]
        req = MutationRequest(parent=parent, inspirations=tuple(insp),
                              seed=self.rng.getrandbits(32), iteration=iteration,
                              problem_contract=self.contract, gpu_info=self.gpu_info,
                              pending=tuple(e.iteration for e in window
                                            if e.request.parent.id == parent.id))
        return req, mutator

    def _step(self, pop: Population, entry: _InFlight, proposal: Proposal,
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
        self._in_flight.discard(pid)
        self._count(result)
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
        return (f"{proposal.mutator}: {result.verdict.value} fitness {result.fitness:.3f} "
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
        if champ is None or not result.correct or champ.id == pid or \
                floor <= self._plain_fitness.get(champ.id, champ.fitness):
            return result, False, ""
        started = self.clock()
        duel = self.evaluator.submit(source, self.suffix, f"{pid} vs {champ.id}",
                                     rival=champ.source).result()
        # The duel's own time, not its wait behind the candidates queued before it: the end
        # of the run's duels queue behind nothing.
        self._duel_s.append(duel.duration_s or self.clock() - started)
        self._gpu_s += duel.stage_s.get(TIMING_STAGE, 0.0)
        self._stats["challenges"] += 1
        if not duel.correct:
            return result, False, f" (challenge: {duel.verdict.value}: {duel.reason[:60]})"
        gain = duel.gain or 0.0
        won = beats(duel)
        if won:
            self._stats["crowned"] += 1
            self._plain_fitness[pid] = result.fitness
        elif gain > 0:
            self._raise_bar(champ, result.fitness / max(gain, 1.0))
        note = (f" -> {duel.fitness:.3f} re-measured beside the best ({champ.id}: "
                f"{duel.rival_fitness or 0:.3f}), {gain:.3f}x"
                f"{ci_text(duel.gain_ci)}: {'new best' if won else 'not beyond noise'}")
        return duel, won, note

    def _raise_bar(self, champ: Program, reading: float) -> None:
        """After a duel the child lost: its plain reading, over its gain where it was faster
        within noise, is a plain reading the best itself could have had in that evaluation.
        The bar rises to the highest such reading, so that children as fast as the best do
        not send duel after duel to the GPU for the same noise; a child faster than the spread
        of plain readings still reads above it."""
        if reading > self._plain_fitness.get(champ.id, champ.fitness):
            self._plain_fitness[champ.id] = reading

    @property
    def challenges(self) -> tuple[int, int]:
        """Returns (duels held, duels won) this session."""
        return self._stats["challenges"], self._stats["crowned"]

    def prune(self, best: Program, seed: Program,
              say: Callable[[str], None] = lambda line: None) -> Program:
        """The end of a run (prune.py): sets back each knob in which the best differs from the
        seed, one at a time, keeping it set back when the duel of the result beside `best`
        shows it costs nothing. Each step is committed as it is measured (its program, the
        champion after it); `say` gets a line per step. Returns the champion after the phase:
        `best` when every change pays, when nothing differs, or when this best was pruned
        already (a resumed run that had finished)."""
        if not self.cfg.population.prune or best.id == seed.id or \
                not (best.correct and seed.correct) or self._pruned(best):
            return best
        pop, current = self._pop, best
        assert pop is not None, "prune() follows run()"
        steps = setbacks(best.source, seed.source)
        queue = duels(steps, best.source, self.facts)
        if steps:
            quiet = len(queue[0]) if len(queue[0]) > 1 else 0
            say(f"setting back the best's {len(steps)} changes from the seed, one at a time, "
                "each kept only if it pays beyond noise"
                + (f" ({quiet} whose code runs no call together first)" if quiet else "")
                + " ...")
        record: list[dict[str, Any]] = []
        complete = True
        while queue:
            group = queue.pop(0)
            joint = len(group) > 1           # knobs whose code runs no call, together
            source = apply_setbacks(current.source, group)
            change = change_of(group)
            pid = program_id(source)
            known = self.programs.get(pid) or self.store.get_program(pid)
            if known is not None and not known.correct:
                say(f"  {change}: {pid} failed its checks in the search; "
                    + ("each tried alone" if joint else "kept"))
                queue[:0] = [[s] for s in group] if joint else []
                continue
            if self._past_wall_time():
                say(f"  setting back stopped: wall time {self.cfg.max_wall_s:.0f} s reached; "
                    "the best is what it reached; a resumed run goes on from it")
                complete = False
                break
            try:
                duel = self.evaluator.submit(source, self.suffix, f"{pid} vs {best.id}",
                                             rival=best.source).result()
            except Exception as e:  # noqa: BLE001 - a lost cluster, say: keep what was set back
                say(f"  setting back stopped ({type(e).__name__}: {first_line(str(e), 120)}); "
                    "the best is what it reached; a resumed run goes on from it")
                complete = False
                break
            self._gpu_s += duel.stage_s.get(TIMING_STAGE, 0.0)    # a duel, as a challenge's
            kept = costs_nothing(duel)
            # A program the search met (the best's parent, the seed, ...) keeps its stored
            # record; the duel is kept in the phase's record below.
            child = known or Program(pid, source, self.suffix, current.id, self.iteration,
                                     current.island, PRUNE, change, duel)
            if known is None:
                self.programs[pid] = child
                pop.add(child)
            if kept or not joint:           # a group that costs is tried again knob by knob
                self._stats["set_back_tried"] += len(group)
            if kept:
                pop.crown(child)
                self._stats["set_back"] += len(group)
                # Within noise of the best: children of a resumed run face the best's bar.
                self._plain_fitness[pid] = self._plain_fitness.get(best.id, best.fitness)
                current = child
            elif joint:                      # asleep by their conditions, yet they cost
                queue[:0] = [[s] for s in group]
            record.append({"change": change, "program": pid, "met": known is not None,
                           "kept_back": kept, "verdict": duel.verdict.value,
                           "reason": "" if duel.correct else first_line(duel.reason, 80),
                           "gain": duel.gain,
                           "gain_ci": list(duel.gain_ci) if duel.gain_ci else None,
                           **({"runs_no_call": True} if joint else {})})
            self.store.commit_iteration(
                iteration=self.iteration, program=None if known else child, rejection=None,
                llm_usage=None, rng_state=self.rng.getstate(),
                population_snapshot=self._snapshot(pop),
                elapsed_s=self._prior_elapsed + self.clock() - self._t0)
            say("  " + set_back_line(record[-1]))
        self.store.record_pruned(best.id, current.id, record, complete)
        return current

    @property
    def set_back(self) -> tuple[int, int]:
        """Returns (changes tried, changes set back) at the end of the run."""
        return self._stats["set_back_tried"], self._stats["set_back"]

    def remeasure(self, best: Program, seed: Program) -> EvalResult | None:
        """Returns the best re-measured beside the seed (a duel in one process), recorded in the
        run for its export, or None when there is nothing to compare (the best is the seed, or
        either is not correct)."""
        if best.id == seed.id or not (best.correct and seed.correct):
            return None
        try:
            duel = self.evaluator.submit(best.source, self.suffix, f"{best.id} vs seed",
                                         rival=seed.source).result()
        except Exception:  # noqa: BLE001 - the summary then shows the run's own figures only
            return None
        self.store.record_side_by_side(seed.id, best.id, duel)
        return duel

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
        end = self._end_of_run_s(pop)
        if now - t0 + step + end < wall:
            return None
        if end and now - t0 < wall:
            return (f"wall time {wall:.0f} s (its last {end:.0f} s kept for the end of the "
                    "run: setting back the best's changes and re-measuring it)")
        return f"wall time {wall:.0f} s"

    def _end_of_run_s(self, pop: Population) -> float:
        """Returns the seconds the end of the run would take now: the duels setting back the
        best's changes from the seed (prune.duels) and one re-measuring it beside the seed, at
        this session's mean duel time (before any, the duel that crowned the best, else the
        best's and the seed's evaluations together), with a margin (END_MARGIN)."""
        best, seed = pop.best(), pop.seed
        if best is None or best.id == seed.id or not (best.correct and seed.correct):
            return 0.0
        if self._end_duels[0] != best.id:      # read once per best, not per iteration
            planned = 0
            if self.cfg.population.prune and not self._pruned(best):
                planned = len(duels(setbacks(best.source, seed.source), best.source, self.facts))
            self._end_duels = (best.id, planned)
        count = 1 + self._end_duels[1]
        if self._duel_s:
            per = sum(self._duel_s) / len(self._duel_s)
        elif best.result is not None and best.result.rival:
            per = best.result.duration_s
        else:
            per = sum(p.result.duration_s for p in (best, seed) if p.result)
        return count * per * END_MARGIN

    def _pruned(self, best: Program) -> bool:
        """Returns whether the run's end already tried every change of this best."""
        return bool((self.store.pruned(best.id) or {}).get("complete"))

    def _past_wall_time(self) -> bool:
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
            llm=self.llm_totals(),
            gpu_busy=self._timing_share(elapsed)))

    def _timing_share(self, elapsed: float) -> float:
        """Timing seconds / (wall seconds × the GPUs, or CPU slots, the evaluations run on)."""
        gpus = max(1, getattr(self.evaluator, "gpus", self.evaluator.slots))
        return self._gpu_s / (elapsed * gpus) if elapsed > 0 else 0.0

    def _gpu_info_from(self, seed: Program) -> None:
        if seed.result is not None:
            self.gpu_info = {"name": seed.result.device, **seed.result.device_info}


DUPLICATE = "duplicate of program"    # how a rejection for an already-stored program starts


def first_line(text: str, limit: int) -> str:
    """Returns the first line of a text (an LLM's change may be a diff, a rejection may quote a
    server's answer), cut to `limit` characters."""
    lines = (text or "").strip().splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[:limit - 3] + "..."


_INTEGRITY = {Verdict.POLICY, Verdict.TAMPERING, Verdict.HIDDEN_WORK, Verdict.NONDETERMINISTIC,
              Verdict.IMPLAUSIBLE, Verdict.SANDBOX}


def _holds_a_paid_call(entry: _InFlight) -> bool:
    """Returns whether an iteration's (finished) proposal carries an LLM call's usage."""
    if entry.proposal.exception() is not None:
        return getattr(entry.proposal.exception(), "usage", None) is not None
    return entry.proposal.result().usage is not None


def _safe_propose(mutator: Mutator, request: MutationRequest) -> Proposal:
    """Calls a mutator; an unexpected exception becomes a rejection, except fatal tool errors."""
    from .errors import EvoattnError
    try:
        return mutator.propose(request)
    except EvoattnError:
        raise
    except Exception as e:  # noqa: BLE001 - a mutator bug must not kill a long run
        return Proposal(request.parent.id, getattr(mutator, "name", "?"), None,
                        rejected_reason=f"mutator raised {type(e).__name__}: {e}")
