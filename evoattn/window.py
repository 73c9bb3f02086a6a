"""The search's in-flight window: the iterations prepared and not yet committed, in order.

Each holds its mutator's proposal (a future: an LLM call may still be under way on one of the
`lookahead` threads) and, once that has answered, its evaluation on the pool. Proposals go to
the pool in iteration order, up to the first unanswered one, so which earlier program a later
one duplicates never depends on timing; the search takes the oldest iteration, whatever order
the evaluations finish in.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
from typing import Callable, Iterator, Sequence

from evoattn.contract.types import EvalResult

from .errors import EvoattnError, LlmError
from .types import MutationRequest, Mutator, Pool, Proposal, program_id

DUPLICATE = "duplicate of program"    # how a rejection for an already-stored program starts


@dataclasses.dataclass
class InFlight:
    """One iteration in the window."""

    iteration: int
    request: MutationRequest
    mutator: Mutator
    proposal: cf.Future[Proposal]
    evaluation: cf.Future[EvalResult] | None = None
    decided: bool = False                # rejected, a duplicate, or sent to the evaluator
    program_id: str | None = None
    note: str | None = None              # why it is not evaluated


# (an iteration's number, the window before it) -> its request and mutator
Prepare = Callable[[int, Sequence[InFlight]], tuple[MutationRequest, Mutator]]


class Window:
    """The iterations in flight, oldest first, and the evaluations they started."""

    def __init__(self, pool: Pool, suffix: str, lookahead: int, depth: int | None) -> None:
        """`lookahead`: LLM requests sent ahead on threads; `depth`: the window's size (None:
        the pool's slots plus the lookahead, or the pool's prefetch without it)."""
        self.pool, self.suffix = pool, suffix
        self.lookahead, self._depth = lookahead, depth
        self.llm_stop: str | None = None     # why the LLM cannot go on (LlmUnavailable)
        self.evaluating: set[str] = set()    # program ids sent to the pool, not yet taken
        self._entries: collections.deque[InFlight] = collections.deque()
        self._threads = cf.ThreadPoolExecutor(max_workers=lookahead) if lookahead else None

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(self._entries)

    def depth(self) -> int:
        """Returns how many iterations the window holds when full."""
        # A pool that builds ahead (nvcc on CPU cores) gets `prefetch` iterations more than
        # its slots even without LLM lookahead: their builds overlap the GPU work of others.
        return self._depth or max(1, self.pool.slots) + (self.lookahead or self.pool.prefetch)

    def fill(self, next_iter: int, last_iter: int, prepare: Prepare) -> int:
        """Prepares iterations until the window is full; returns the next iteration number."""
        while next_iter <= last_iter and len(self._entries) < self.depth() and \
                not self.llm_stop:
            req, mut = prepare(next_iter, self._entries)
            fut: cf.Future[Proposal]
            if self._threads is None or not getattr(mut, "blocking_io", False):
                # Local mutators answer here, in order, seeing the state as it is now: only
                # requests that wait on the network go to the threads.
                fut = cf.Future()
                try:
                    fut.set_result(safe_propose(mut, req))
                except LlmError as e:        # committed in order, as from the threads
                    fut.set_exception(e)
            else:
                fut = self._threads.submit(safe_propose, mut, req)
            self._entries.append(InFlight(next_iter, req, mut, fut))
            next_iter += 1
        return next_iter

    def take(self, known: Callable[[str], bool]
             ) -> tuple[InFlight, Proposal, EvalResult | None]:
        """Waits for the oldest iteration; returns it with its proposal and its evaluation's
        result (None: rejected or a duplicate). `known`: whether a program was evaluated."""
        self.dispatch(known)
        head = self._entries[0]
        proposal = self.proposal_of(head)
        self.dispatch(known)
        result = head.evaluation.result() if head.evaluation is not None else None
        self._entries.popleft()
        if head.evaluation is not None and head.program_id is not None:
            self.evaluating.discard(head.program_id)
        return head, proposal, result

    def dispatch(self, known: Callable[[str], bool]) -> None:
        """Sends answered proposals to the pool, in order, up to the first unanswered one."""
        for entry in self._entries:
            if entry.decided:
                continue
            if not entry.proposal.done():
                return
            entry.decided = True
            proposal = self.proposal_of(entry)
            if proposal.source is None:
                entry.note = proposal.rejected_reason or "rejected"
                continue
            pid = program_id(proposal.source)
            entry.program_id = pid
            if known(pid) or pid in self.evaluating:
                entry.note = f"{DUPLICATE} {pid} (not evaluated again)"
                continue
            self.evaluating.add(pid)
            entry.evaluation = self.pool.submit(proposal.source, self.suffix, pid)

    def proposal_of(self, entry: InFlight) -> Proposal:
        """Returns an entry's proposal; an LlmError becomes a rejection and stops the run."""
        try:
            return entry.proposal.result()
        except LlmError as e:
            self.llm_stop = self.llm_stop or str(e)
            return Proposal(entry.request.parent.id, getattr(entry.mutator, "name", "llm"), None,
                            rejected_reason=str(e), usage=getattr(e, "usage", None))

    def holds_a_paid_call(self) -> bool:
        """Returns whether an iteration in the window holds an LLM call already made (after
        waiting for the calls under way)."""
        cf.wait([e.proposal for e in self._entries])
        return any(_paid(e) for e in self._entries)

    def cancel(self) -> None:
        """Drops every iteration still in flight and the threads' queued requests."""
        for entry in self._entries:
            entry.proposal.cancel()
            if entry.evaluation is not None:
                entry.evaluation.cancel()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)


def _paid(entry: InFlight) -> bool:
    """Returns whether an iteration's (finished) proposal carries an LLM call's usage."""
    if entry.proposal.exception() is not None:
        return getattr(entry.proposal.exception(), "usage", None) is not None
    return entry.proposal.result().usage is not None


def safe_propose(mutator: Mutator, request: MutationRequest) -> Proposal:
    """Calls a mutator; an unexpected exception becomes a rejection, except fatal tool errors."""
    try:
        return mutator.propose(request)
    except EvoattnError:
        raise
    except Exception as e:  # noqa: BLE001 - a mutator bug must not kill a long run
        return Proposal(request.parent.id, getattr(mutator, "name", "?"), None,
                        rejected_reason=f"mutator raised {type(e).__name__}: {e}")
