"""What was already tried on a parent, read from the run's store, and how fresh it is.

The search commits iterations in order, and an LLM request is sent while earlier iterations
are still being evaluated. So a prompt would miss the outcome of a sibling (an earlier child
of the same parent) that is in flight. The trade-off, `llm.feedback_wait_s`: a request waits
up to that long for those siblings to be committed before its prompt is built (0: never
waits; the prompt then has what is committed). Waiting keeps a failed edit from being sent
again; not waiting keeps the LLM requests ahead of the evaluator. Reading from the store
makes the feedback survive a resume.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable, Protocol, Sequence

from evoattn.types import Attempt

POLL_S = 0.2
# How the LLM mutator's rejections that say nothing about an answer's content start (the
# call failed, the budget ran out, ...): kept out of prompts, like a knob mutator's.
CALL_FAILED = "LLM call failed"
BUDGET_EXHAUSTED = "LLM budget exhausted"
NO_FIT = "the prompt does not fit"
LLM_STOPPED = "the LLM stopped the run"
_NOT_ABOUT_AN_ANSWER = re.compile("^(" + "|".join(re.escape(s) for s in (
    CALL_FAILED, BUDGET_EXHAUSTED, NO_FIT, LLM_STOPPED, "mutator raised", "no unevaluated knob",
    "no '# evoattn: choice")) + ")")
_DUPLICATE = re.compile(r"^duplicate of program (?P<id>\w+)")


class History(Protocol):
    """Where the earlier attempts on a parent are read from."""

    def committed_iteration(self) -> int: ...

    def attempts(self, parent_id: str, limit: int) -> Sequence[Attempt]: ...


class StoreHistory:
    """History read from a run directory's database (one short read-only connection a read,
    so the search's threads never share one)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)

    def committed_iteration(self) -> int:
        from evoattn.store import RunStore
        with RunStore.open_readonly(self.run_dir) as st:
            return st.committed_iteration()

    def attempts(self, parent_id: str, limit: int) -> list[Attempt]:
        from evoattn.store import RunStore
        with RunStore.open_readonly(self.run_dir) as st:
            raw = st.recent_attempts(parent_id, limit * 3)
            return [_resolved(a, st) for a in raw if _about_an_answer(a)][-limit:]

    def recent_changes(self, mutator: str, limit: int) -> list[str]:
        from evoattn.store import RunStore
        with RunStore.open_readonly(self.run_dir) as st:
            return st.recent_changes(mutator, limit)

    def recent_gains(self, mutator: str, limit: int) -> list[str]:
        from evoattn.store import RunStore
        with RunStore.open_readonly(self.run_dir) as st:
            return st.recent_gains(mutator, limit)


def _about_an_answer(a: Attempt) -> bool:
    if a.outcome == "rejected":
        return not _NOT_ABOUT_AN_ANSWER.match(a.reason)
    return a.outcome not in ("evaluator_fault", "unevaluated")


def _resolved(a: Attempt, store: object) -> Attempt:
    """Returns a duplicate's attempt with what the program it repeats got."""
    m = _DUPLICATE.match(a.reason) if a.outcome == "rejected" else None
    if m is None:
        return a
    other = store.get_program(m["id"])   # type: ignore[attr-defined]
    if other is None or other.result is None:
        got = "not evaluated yet"
    else:
        got = f"{other.result.verdict.value}, fitness {other.fitness:.3g}"
    return Attempt(a.iteration, a.mutator, "duplicate", f"program {m['id']}: {got}", a.change,
                   other.fitness if other else None)


def wait_for(history: History, iterations: Sequence[int], bound_s: float,
             clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> bool:
    """Waits until every iteration listed is committed, at most bound_s; returns whether they
    all were."""
    if not iterations:
        return True
    last = max(iterations)
    deadline = clock() + bound_s
    while history.committed_iteration() < last:
        if clock() >= deadline:
            return False
        sleep(POLL_S)
    return True
