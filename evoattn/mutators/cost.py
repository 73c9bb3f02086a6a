"""What LLM calls cost: one record per logical call, and the run's totals against a budget."""
from __future__ import annotations

import collections
import dataclasses
import threading

from evoattn.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One logical LLM call, for the run's call log."""

    model: str
    status: str                        # "ok" (a reply came back), "failed" or "fatal"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    latency_s: float = 0.0
    attempts: int = 1
    error: str | None = None           # the last error, key scrubbed
    parent_id: str = ""
    iteration: int = -1


def cost_usd(model: ModelConfig, prompt_tokens: int, completion_tokens: int) -> float:
    """Returns the price of a call from the model's per-million-token prices."""
    return (prompt_tokens * model.price_in_per_mtok + completion_tokens * model.price_out_per_mtok) / 1e6


class CostMeter:
    """Totals of LLM calls and spend against an optional budget; safe to share between threads.

    The budget is checked before a call, so calls already in flight when it is
    reached may overshoot it by at most `concurrency` calls.
    """

    KEEP_RECORDS = 1024

    def __init__(self, budget_usd: float | None = None) -> None:
        self.budget_usd = budget_usd
        self._lock = threading.Lock()
        self._spent, self._calls, self._attempts = 0.0, 0, 0
        self._prompt, self._completion = 0, 0
        # The latest records for `drain` (bounded: a run that never drains must not grow).
        self._pending: collections.deque[CallRecord] = collections.deque(
            maxlen=self.KEEP_RECORDS)

    def record(self, rec: CallRecord) -> None:
        """Adds one call to the totals and to the records awaiting `drain`."""
        with self._lock:
            self._spent += rec.cost_usd
            self._calls += 1
            self._attempts += rec.attempts
            self._prompt += rec.prompt_tokens
            self._completion += rec.completion_tokens
            self._pending.append(rec)

    def carry_over(self, calls: int, prompt_tokens: int, completion_tokens: int,
                   cost_usd: float) -> None:
        """Adds the totals of a resumed run's earlier sessions (nothing to drain)."""
        with self._lock:
            self._calls += calls
            self._prompt += prompt_tokens
            self._completion += completion_tokens
            self._spent += cost_usd

    def drain(self) -> tuple[CallRecord, ...]:
        """Returns the calls recorded since the last drain, and forgets them."""
        with self._lock:
            out = tuple(self._pending)
            self._pending.clear()
            return out

    @property
    def spent_usd(self) -> float:
        with self._lock:
            return self._spent

    @property
    def calls(self) -> int:
        with self._lock:
            return self._calls

    @property
    def attempts(self) -> int:
        with self._lock:
            return self._attempts

    @property
    def prompt_tokens(self) -> int:
        with self._lock:
            return self._prompt

    @property
    def completion_tokens(self) -> int:
        with self._lock:
            return self._completion

    @property
    def exhausted(self) -> bool:
        with self._lock:
            return self.budget_usd is not None and self._spent >= self.budget_usd

    @property
    def remaining(self) -> float | None:
        """Returns the USD left in the budget (None when there is no budget)."""
        with self._lock:
            return None if self.budget_usd is None else max(self.budget_usd - self._spent, 0.0)

    def __repr__(self) -> str:
        return (f"CostMeter(spent_usd={self.spent_usd:.4f}, budget_usd={self.budget_usd}, "
                f"calls={self.calls})")
