"""Data that crosses the orchestrator's internal boundaries: programs, proposals, usage."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import re
from typing import Any, Protocol, runtime_checkable

from evoattn.contract.types import EvalResult


def normalise_source(source: str) -> str:
    """Returns the source with trailing whitespace and blank-line runs removed (cache key)."""
    lines = [ln.rstrip() for ln in source.replace("\r\n", "\n").split("\n")]
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text) + "\n"


def program_id(source: str) -> str:
    """Returns the id of a program: a hash of its normalised source."""
    return hashlib.sha256(normalise_source(source).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Program:
    """A candidate program and, once evaluated, its result."""

    id: str
    source: str
    suffix: str                         # ".py" or ".cu"
    parent_id: str | None
    iteration: int                      # the iteration that created it (0 = seed)
    island: int
    mutator: str                        # "seed", "knobs", "llm:<model>", ...
    change: str                         # what the mutation changed, in words or a diff
    result: EvalResult | None = None
    second_parent_id: str | None = None  # crossover partner

    @property
    def fitness(self) -> float:
        return self.result.fitness if self.result else 0.0

    @property
    def correct(self) -> bool:
        return bool(self.result and self.result.correct)


@dataclasses.dataclass(frozen=True)
class LlmUsage:
    """Tokens and cost of one LLM call."""

    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    latency_s: float = 0.0
    attempts: int = 1
    status: str = ""         # "failed" when no answer came; else the store says ok/rejected


@dataclasses.dataclass(frozen=True)
class MutationRequest:
    """Everything a mutator may look at to propose a child of `parent`."""

    parent: Program
    inspirations: tuple[Program, ...]   # a few top programs (other islands / elites)
    seed: int                            # the mutator's own randomness, drawn by the search
    iteration: int
    problem_contract: str = ""
    gpu_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Earlier iterations still in flight with the same parent: an LLM prompt may wait for
    # their outcomes (llm.feedback_wait_s), which the store then holds.
    pending: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One earlier proposal for a parent and what became of it, as the store recorded it."""

    iteration: int
    mutator: str
    outcome: str                         # a verdict ("pass", "incorrect", ...), "rejected"
                                         # (never evaluated) or "duplicate"
    reason: str = ""
    change: str = ""                     # the diff (or knob change) it made, if any
    fitness: float | None = None         # of the child, or of the program it duplicates


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A mutator's answer: a new source, or a rejection with its reason (never silent)."""

    parent_id: str
    mutator: str
    source: str | None                   # None when rejected
    change: str = ""
    rejected_reason: str | None = None
    usage: LlmUsage | None = None
    second_parent_id: str | None = None

    @property
    def rejected(self) -> bool:
        return self.source is None


class Mutator(Protocol):
    """Proposes a variant of a parent program. Must not raise for a bad answer: reject."""

    name: str

    def propose(self, request: MutationRequest) -> Proposal: ...


class Evaluator(Protocol):
    """One evaluation slot: evaluates one candidate at a time, in isolation."""

    def evaluate(self, source: str, suffix: str, label: str,
                 rival: str | None = None) -> EvalResult:
        """Returns the verdict on `source` (beside `rival`, timed in the same rounds: a duel)."""

    def calibrate(self, seed: EvalResult) -> None:
        """Derives the later candidates' deadlines from the seed's evaluation."""

    def prestart(self) -> None:
        """Starts now what the first evaluation would wait for (a zygote), if anything."""

    def abort(self) -> None:
        """Ends the evaluation in progress, if any, for good (the run is ending)."""

    def close(self) -> None:
        """Releases what the evaluator holds (its zygote process, say)."""


@runtime_checkable
class Pool(Protocol):
    """Where the search's evaluations run (evoattn/pool.py, evoattn/backends/dask.py)."""

    slots: int                          # evaluations at once
    gpus: int                           # the devices they share (a CPU run: its slots)
    prefetch: int                       # jobs worth queueing beyond the slots (builds ahead)

    def submit(self, source: str, suffix: str, label: str,
               rival: str | None = None) -> cf.Future[EvalResult]:
        """Starts one evaluation (a duel with `rival`); its result arrives on the future."""

    def calibrate(self, seed: EvalResult) -> None:
        """Derives every later candidate's deadlines from the seed's evaluation."""

    def close(self) -> None:
        """Drops queued jobs, stops running ones and releases the slots."""
