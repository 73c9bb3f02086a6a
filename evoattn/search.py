"""The search loop: the only place that changes the population and writes the run.

Each iteration: pick an island, a parent and inspirations; ask a mutator for a
child; evaluate it in the sandbox unless it is a known program; offer it to the
population; commit the iteration to SQLite in one transaction. Mutations are
prepared ahead (LLM requests in flight while the GPU evaluates) but always
consumed in the order they were prepared, and every random choice is drawn here
from one seeded RNG, so the same seed and the same evaluation results give the
same run.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import random
import time
from typing import Any, Callable, Sequence

from evaluator.types import Verdict

from .config import RunConfig
from .population import Population
from .store import RunStore
from .types import Evaluator, MutationRequest, Mutator, Program, Proposal, program_id


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
    evaluated: int
    llm: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a search ended."""

    best: Program | None
    seed: Program
    iterations_done: int
    stop_reason: str
    elapsed_s: float


class Search:
    """Runs the evolutionary loop over a store, an evaluator and weighted mutators."""

    def __init__(self, cfg: RunConfig, store: RunStore, evaluator: Evaluator,
                 mutators: Sequence[tuple[Mutator, float]], seed_source: str, seed_suffix: str,
                 contract: str = "", on_progress: Callable[[Progress], None] = lambda p: None,
                 clock: Callable[[], float] = time.monotonic,
                 budget_exhausted: Callable[[], bool] = lambda: False,
                 llm_totals: Callable[[], dict[str, float]] = dict,
                 lookahead: int = 0) -> None:
        self.cfg = cfg
        self.store = store
        self.evaluator = evaluator
        self.mutators = list(mutators)
        self.seed_source = seed_source
        self.suffix = seed_suffix
        self.contract = contract
        self.on_progress = on_progress
        self.clock = clock
        self.budget_exhausted = budget_exhausted
        self.llm_totals = llm_totals
        self.lookahead = lookahead
        self.stop_requested = False
        self.rng = random.Random(cfg.random_seed)
        self.programs: dict[str, Program] = {}
        self.feedback: dict[str, collections.deque[str]] = {}
        self.iteration = 0
        self.gpu_info: dict[str, Any] = {}
        self._stats = collections.Counter()

    # ---- setup ---------------------------------------------------------------
    def _start(self) -> tuple[Population, Program]:
        state = self.store.load_state()
        self.programs = self.store.load_programs()
        if state is not None:
            self.iteration = int(state["iteration"])
            self.rng.setstate(state["rng_state"])
            # The view's counters cover the whole run, not only this session.
            cached = self.store.rejection_count(_DUPLICATE)
            self._stats.update(rejected=self.store.rejection_count() - cached, cached=cached)
            pop = Population.restore(state["population"], self.programs, self.cfg.population)
            return pop, pop.seed
        result = self.evaluator.evaluate(self.seed_source, self.suffix, "seed")
        seed = Program(program_id(self.seed_source), self.seed_source, self.suffix, None, 0, 0,
                       "seed", "the seed program", result)
        self.programs[seed.id] = seed
        pop = Population(self.cfg.population, seed)
        self.store.commit_iteration(iteration=0, program=seed, rejection=None, llm_usage=None,
                                    rng_state=self.rng.getstate(),
                                    population_snapshot=pop.snapshot())
        return pop, seed

    # ---- the loop ------------------------------------------------------------
    def run(self) -> Outcome:
        """Runs until iterations, wall time, target fitness, budget or a stop request."""
        t0 = self.clock()
        pop, seed = self._start()
        self._gpu_info_from(seed)
        stop = self._stop_reason(pop, t0)
        if not seed.correct and stop is None:
            stop = f"the seed is not correct ({seed.result.verdict.value if seed.result else '?'}" \
                   f": {seed.result.reason if seed.result else ''})"
        pending: collections.deque[tuple[int, MutationRequest, Mutator, cf.Future[Proposal]]] = \
            collections.deque()
        pool = cf.ThreadPoolExecutor(max_workers=self.lookahead) if self.lookahead else None
        next_iter = self.iteration + 1
        try:
            while stop is None:
                while next_iter <= self.cfg.iterations and len(pending) <= self.lookahead:
                    req, mut = self._prepare(pop, next_iter)
                    fut: cf.Future[Proposal]
                    if pool is None or not getattr(mut, "blocking_io", False):
                        # Local mutators answer here, in order, seeing the state as it is
                        # now: only requests that wait on the network go to the pool.
                        fut = cf.Future()
                        fut.set_result(_safe_propose(mut, req))
                    else:
                        fut = pool.submit(_safe_propose, mut, req)
                    pending.append((next_iter, req, mut, fut))
                    next_iter += 1
                if not pending:
                    stop = "iterations"
                    break
                it, req, mut, fut = pending.popleft()
                proposal = fut.result()
                note = self._step(pop, it, req, proposal)
                self.iteration = it
                self._report(pop, seed, t0, note)
                stop = self._stop_reason(pop, t0)
        except KeyboardInterrupt:
            stop = "interrupted (Ctrl-C); in-flight candidates were not recorded"
        finally:
            if pool is not None:
                for *_, fut in pending:
                    fut.cancel()
                pool.shutdown(wait=False, cancel_futures=True)
        self.store.record_stop(stop)
        return Outcome(pop.best(), seed, self.iteration, stop, self.clock() - t0)

    def _prepare(self, pop: Population, iteration: int) -> tuple[MutationRequest, Mutator]:
        island = pop.island_of_next(iteration)
        parent = pop.select_parent(island, self.rng)
        insp = pop.inspirations(island, self.cfg.llm.inspirations, self.rng, exclude_id=parent.id)
        weights = [w for _, w in self.mutators]
        mutator = self.rng.choices([m for m, _ in self.mutators], weights=weights)[0]
        req = MutationRequest(parent=parent, inspirations=tuple(insp),
                              seed=self.rng.getrandbits(32), iteration=iteration,
                              problem_contract=self.contract, gpu_info=self.gpu_info,
                              feedback=tuple(self.feedback.get(parent.id, ())))
        return req, mutator

    def _step(self, pop: Population, iteration: int, req: MutationRequest,
              proposal: Proposal) -> str:
        """Evaluates one proposal and commits the iteration; returns a note for the view."""
        island = pop.island_of_next(iteration)
        parent = req.parent
        if proposal.source is None:        # a rejection
            reason = proposal.rejected_reason or "rejected"
            self._remember(parent.id, reason)
            self._stats["rejected"] += 1
            self._commit(pop, iteration, None, (parent.id, proposal.mutator, reason), proposal)
            return f"{proposal.mutator}: rejected: {reason}"
        pid = program_id(proposal.source)
        if pid in self.programs:
            self._stats["cached"] += 1
            reason = f"{_DUPLICATE} {pid} (not evaluated again)"
            self._commit(pop, iteration, None, (parent.id, proposal.mutator, reason), proposal)
            return f"{proposal.mutator}: {reason}"
        result = self.evaluator.evaluate(proposal.source, self.suffix, pid)
        self._stats["evaluated"] += 1
        child = Program(pid, proposal.source, self.suffix, parent.id, iteration, island,
                        proposal.mutator, proposal.change, result, proposal.second_parent_id)
        self.programs[pid] = child
        pop.add(child)
        if not child.correct:
            self._remember(parent.id, f"a child ({proposal.change[:200]}) failed: "
                                      f"{result.verdict.value}: {result.reason[:300]}")
        self._commit(pop, iteration, child, None, proposal)
        return (f"{proposal.mutator}: {result.verdict.value} fitness {result.fitness:.3f} "
                f"({proposal.change[:80]})")

    def _remember(self, parent_id: str, text: str) -> None:
        """Keeps the last few failures of a parent's children for its next prompts."""
        self.feedback.setdefault(parent_id, collections.deque(maxlen=3)).append(text)

    def _commit(self, pop: Population, iteration: int, program: Program | None,
                rejection: tuple[str, str, str] | None, proposal: Proposal) -> None:
        # Every iteration counts towards migration, whether or not its child was evaluated.
        if self.cfg.population.migration_interval and \
                iteration % self.cfg.population.migration_interval == 0:
            pop.migrate()
        self.store.commit_iteration(iteration=iteration, program=program, rejection=rejection,
                                    llm_usage=proposal.usage, rng_state=self.rng.getstate(),
                                    population_snapshot=pop.snapshot())

    # ---- stopping and reporting -------------------------------------------------
    def _stop_reason(self, pop: Population, t0: float) -> str | None:
        best = pop.best()
        if self.stop_requested:
            return "stopped by request"
        if self.iteration >= self.cfg.iterations:
            return "iterations"
        if self.cfg.max_wall_s is not None and self.clock() - t0 >= self.cfg.max_wall_s:
            return f"wall time {self.cfg.max_wall_s:.0f} s"
        if self.cfg.target_fitness is not None and best and best.fitness >= self.cfg.target_fitness:
            return f"target fitness {self.cfg.target_fitness} reached"
        if self.budget_exhausted():
            return "LLM budget exhausted"
        return None

    def _report(self, pop: Population, seed: Program, t0: float, note: str) -> None:
        counts = collections.Counter(p.result.verdict.value for p in self.programs.values()
                                     if p.result)
        flagged = sum(1 for p in self.programs.values() if p.result and
                      (p.result.flags or p.result.verdict in _INTEGRITY))
        self.on_progress(Progress(
            iteration=self.iteration, iterations=self.cfg.iterations, best=pop.best(),
            seed_fitness=seed.fitness, last_note=note, counts=dict(counts),
            flags=flagged, rejected=self._stats["rejected"], cached=self._stats["cached"],
            elapsed_s=self.clock() - t0, evaluated=self._stats["evaluated"],
            llm=self.llm_totals()))

    def _gpu_info_from(self, seed: Program) -> None:
        if seed.result is not None:
            self.gpu_info = {"name": seed.result.device, **seed.result.device_info}


_DUPLICATE = "duplicate of program"    # how a rejection for an already-stored program starts
_INTEGRITY = {Verdict.POLICY, Verdict.TAMPERING, Verdict.HIDDEN_WORK, Verdict.NONDETERMINISTIC,
              Verdict.IMPLAUSIBLE, Verdict.SANDBOX}


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
