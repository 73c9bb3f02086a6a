"""The series a run report shows, read from a run's database in one read-only snapshot.

Plain frozen data, no plotting: `charts.py` draws it and `html_report.py` lays it out.
Times are wall-clock minutes since the run was created (a resumed run's gap between
sessions included); speedups are baseline ms / candidate ms in one timing mode.
"""
from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any

from evoattn.contract.request import TIMING_MODES
from evoattn.contract.types import EvalResult

from .prune import PRUNE
from .report import crowned_changes, duel_of, duel_phrase, label
from .search import DUPLICATE
from .store import RunStore
from .store_reads import StoredLlmCall
from .types import Program


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One evaluated program: where it sits on the fitness and the throughput charts."""

    program_id: str
    iteration: int
    fitness: float                      # 0 unless correct
    verdict: str
    minute: float                       # when it was stored
    elite: bool                         # in the population now


@dataclasses.dataclass(frozen=True)
class Crowning:
    """The best from `iteration` on: the program crowned there and its re-measured fitness."""

    program_id: str
    iteration: int
    fitness: float


@dataclasses.dataclass(frozen=True)
class NotEvaluated:
    """A proposal that was not evaluated: "rejected" by its mutator, or a "duplicate"."""

    iteration: int
    kind: str


@dataclasses.dataclass(frozen=True)
class LineageNode:
    """One step from the seed to the best; `partner` is a crossover's second parent."""

    program_id: str
    iteration: int
    mutator: str
    fitness: float
    gain: float | None                  # fitness over its first parent's; None at the start
    change: str
    partner: "LineageNode | None" = None
    judged: str = ""                    # how it fared beside the best of its time (a duel)


@dataclasses.dataclass(frozen=True)
class Speedup:
    """The best against one baseline on one config in one timing mode."""

    config: str
    baseline: str
    mode: str
    baseline_ms: float | None
    candidate_ms: float | None
    fitness_term: bool                  # this mode and baseline are what fitness uses
    paired: float | None = None         # the fitness term's speedup over its paired rounds

    @property
    def speedup(self) -> float | None:
        if self.paired is not None:
            return self.paired
        if not self.baseline_ms or not self.candidate_ms:
            return None
        return self.baseline_ms / self.candidate_ms


@dataclasses.dataclass(frozen=True)
class LlmPoint:
    """Running totals after one LLM call."""

    minute: float
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float


@dataclasses.dataclass(frozen=True)
class RunData:
    """Everything a report shows about one run."""

    name: str
    problem: str
    seed_path: str
    device: str
    timing_device: str                  # "cuda" or "cpu"
    timing: str                         # the mode fitness uses
    baseline: str                       # "best" (fastest per config) or a baseline's name
    iterations_done: int
    iterations_planned: int
    stop_reason: str | None             # None while the run is in progress
    elapsed_s: float
    seed_fitness: float | None
    best: Program | None
    candidates: tuple[Candidate, ...]
    not_evaluated: tuple[NotEvaluated, ...]
    lineage: tuple[LineageNode, ...]    # seed first
    speedups: tuple[Speedup, ...]
    stage_mean_s: dict[str, float]      # mean wall seconds per evaluation stage
    llm: tuple[LlmPoint, ...]
    llm_failed: int
    # the best re-measured beside the seed at the end of the run (a duel), where the run holds
    # one for this best: (the seed's id, the duel)
    beside_seed: tuple[str, EvalResult] | None = None
    # the changes from the seed the end of the run set back, where it did so for this best
    # (store.record_pruned: {before, best, steps})
    set_back: dict[str, Any] | None = None
    # the best over the run: the seed, each child crowned by a duel, and the best it ends with
    # at best_fitness (the report's one figure for the best)
    best_line: tuple[Crowning, ...] = ()

    @property
    def best_fitness(self) -> float | None:
        """The best's fitness as the report states it: re-measured beside the seed at the end
        of the run where it was, else as stored (a crowned best's stored result is its duel)."""
        duel = self.beside_seed[1] if self.beside_seed else None
        if self.best is not None and duel is not None and duel.correct and duel.rival_fitness:
            return duel.fitness
        return self.best.fitness if self.best is not None else None


def load_run(run_dir: str | Path) -> RunData:
    """Returns a run's report data (read-only: a search may be writing the run)."""
    with RunStore.open_readonly(run_dir) as store, store.snapshot():
        programs = store.load_programs()
        times = store.program_times()
        state = store.load_state() or {}
        meta = store.meta()
        config = store.stored_config()
        best = store.champion()
        beside_seed = store.side_by_side(best.id) if best else None
        set_back = store.set_back(best.id) if best else None
        rejections = store.rejections()
        calls = store.llm_calls()
    start = _when(meta["created_at"])
    seed = next((p for p in programs.values() if p.parent_id is None and p.iteration == 0),
                None)
    shown = best or seed
    result = shown.result if shown else None
    elites = {pid for island in state.get("population", {}).get("islands", [])
              for pid in island}
    evaluator = config.get("evaluator", {})
    data = RunData(
        name=Path(run_dir).resolve().name, problem=meta.get("problem", ""),
        seed_path=meta.get("seed", ""),
        device=result.device if result else str(config.get("device", "")),
        timing_device=result.timing_device if result else
        ("cpu" if config.get("device") == "cpu" else "cuda"),
        timing=result.timing if result else str(evaluator.get("timing", "")),
        baseline=result.baseline if result else str(evaluator.get("baseline", "")),
        iterations_done=int(state.get("iteration", 0)),
        iterations_planned=int(config.get("iterations", 0)),
        stop_reason=state.get("stop_reason"), elapsed_s=float(state.get("elapsed_s", 0.0)),
        seed_fitness=seed.fitness if seed and seed.result else None, best=best,
        candidates=tuple(Candidate(p.id, p.iteration, p.fitness, p.result.verdict.value,
                                   _minutes(times.get(p.id), start), p.id in elites)
                         for p in programs.values() if p.result is not None),
        not_evaluated=tuple(NotEvaluated(r.iteration, "duplicate" if r.reason.startswith(
            DUPLICATE) else "rejected") for r in rejections),
        lineage=lineage(best.id, programs) if best else (),
        speedups=speedups(best.result) if best and best.result else (),
        stage_mean_s=stage_means([p.result for p in programs.values() if p.result]),
        llm=llm_series(calls, start),
        llm_failed=sum(1 for c in calls if c.usage.status == "failed"),
        beside_seed=beside_seed,
        set_back=set_back)
    return dataclasses.replace(data, best_line=best_line(programs, seed, best,
                                                         data.best_fitness))


def best_line(programs: dict[str, Program], seed: Program | None, best: Program | None,
              best_fitness: float | None) -> tuple[Crowning, ...]:
    """Returns the best over the run: the seed, then each child that won its duel beside the
    best of its time (at the duel's fitness), ending at `best` with `best_fitness`. A child's
    plain reading, never confirmed beside the best, is not on it however high it read."""
    steps = [Crowning(seed.id, seed.iteration, seed.fitness)] if seed and seed.correct else []
    for p in sorted(programs.values(), key=lambda q: q.iteration):
        duel = duel_of(p)
        if duel is not None and duel.won and p.mutator != PRUNE:
            steps.append(Crowning(p.id, p.iteration, p.fitness))
    if best is None or best_fitness is None:
        return tuple(steps)
    if steps and steps[-1].program_id == best.id:
        steps[-1] = dataclasses.replace(steps[-1], fitness=best_fitness)
    else:       # set back at the end of the run, or a run stored before champions were kept
        last = max([best.iteration] + [c.iteration for c in steps])
        steps.append(Crowning(best.id, last, best_fitness))
    return tuple(steps)


def lineage(best_id: str, programs: dict[str, Program]) -> tuple[LineageNode, ...]:
    """Returns the first-parent chain from the seed to the best, with each step's gain."""
    chain: list[Program] = []
    pid: str | None = best_id
    while pid is not None and pid in programs and all(p.id != pid for p in chain):
        chain.append(programs[pid])
        pid = programs[pid].parent_id
    chain.reverse()
    crowned = crowned_changes(programs.values())
    nodes = []
    for i, p in enumerate(chain):
        partner = programs.get(p.second_parent_id or "")
        nodes.append(LineageNode(
            p.id, p.iteration, p.mutator, p.fitness,
            p.fitness - chain[i - 1].fitness if i else None, p.change,
            _node(partner) if partner else None, duel_phrase(p, crowned) if i else ""))
    return tuple(nodes)


def _node(p: Program) -> LineageNode:
    return LineageNode(p.id, p.iteration, p.mutator, p.fitness, None, p.change)


def speedups(result: EvalResult) -> tuple[Speedup, ...]:
    """Returns the result's speedup against every baseline in every mode, per config."""
    rows = []
    for c in result.configs:
        if c.times is None:
            continue
        for name, base in c.baseline_times.items():
            for mode in TIMING_MODES:
                term = mode == result.timing and name == c.baseline_name
                rows.append(Speedup(label(c.params), name, mode, base.in_mode(mode),
                                    c.times.in_mode(mode), term,
                                    c.speedup if term else None))
    return tuple(rows)


def stage_means(results: list[EvalResult]) -> dict[str, float]:
    """Returns the mean wall seconds of each stage over the results that ran it."""
    totals: dict[str, list[float]] = {}
    for r in results:
        for stage, seconds in r.stage_s.items():
            totals.setdefault(stage, []).append(seconds)
    return {stage: sum(v) / len(v) for stage, v in totals.items()}


def llm_series(calls: list[StoredLlmCall], start: datetime.datetime) -> tuple[LlmPoint, ...]:
    """Returns the running token and cost totals after each LLM call."""
    points: list[LlmPoint] = []
    prompt = completion = 0
    cost = 0.0
    for c in calls:
        prompt += c.usage.prompt_tokens
        completion += c.usage.completion_tokens
        cost += c.usage.cost_usd
        points.append(LlmPoint(_minutes(c.created_at, start), prompt, completion, cost))
    return tuple(points)


def _when(iso: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(iso)


def _minutes(iso: Any, start: datetime.datetime) -> float:
    if not iso:
        return 0.0
    return (_when(iso) - start).total_seconds() / 60.0
