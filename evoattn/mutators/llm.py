"""The LLM mutator: asks an OpenAI-compatible chat endpoint for an edit of the parent.

    LlmMutator.propose ─ history.wait_for / attempts ─ prompts.build_prompt (sized to the model)
                       ─ call_with_retries ─ ChatClient.complete (client.py)
                       └─ ProgramView.apply (view.py)       └─ CostMeter.record (cost.py)

What can go wrong, and what the caller sees:
    the answer is unusable (no edits, SEARCH not found, no-op,
      an edit of a file not shown) ................................ rejected Proposal
    429 / 5xx / timeout / connection error, retries exhausted ..... rejected Proposal
    any other 4xx (400: prompt too long, ...) ..................... rejected Proposal
      (a 400 that names the model's context: the context is learnt
      and the call is made once more with a prompt that fits)
    llm.max_consecutive_failures failed calls in a row to one model,
      or 401 / 403 / 404 (bad key, no access, wrong model or URL) . LlmUnavailable raised:
                                                                    the search stops cleanly;
                                                                    every later propose raises
    the budget is spent ........................................... rejected Proposal, reason
                                                                    BUDGET_EXHAUSTED, no request

A timed-out request is retried once at most, so a hung server costs at most about
2 x timeout_s a call. Every request made is one CallRecord in the shared CostMeter.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from typing import Callable, Mapping, Sequence

from evoattn.config import LlmConfig, ModelConfig
from evoattn.errors import LlmUnavailable, UsageError
from evoattn.mutators import budget as tokens
from evoattn.mutators.client import (
    ChatClient, ChatError, ChatReply, Message, OpenAIChatClient, parse_retry_after, scrub, where,
)
from evoattn.mutators.cost import CallRecord, CostMeter, cost_usd
from evoattn.mutators.edits import blocks_as_diff, summarise_change
from evoattn.mutators.history import (
    BUDGET_EXHAUSTED, CALL_FAILED, LLM_STOPPED, NO_FIT, History, wait_for,
)
from evoattn.mutators.keys import is_local
from evoattn.mutators.prompts import Prompt, PromptSettings, build_prompt
from evoattn.types import Attempt, LlmUsage, MutationRequest, Proposal

__all__ = ["BUDGET_EXHAUSTED", "CallOutcome", "CallRecord", "ChatClient", "ChatError",
           "ChatReply", "CostMeter", "LlmMutator", "OpenAIChatClient", "call_with_retries",
           "cost_usd", "is_local", "parse_retry_after", "scrub"]

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0                   # cap on one exponential-backoff sleep
MAX_TIMEOUTS_PER_CALL = 2              # a server that timed out twice is not waited on again


# ---- retries ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CallOutcome:
    """One logical call: a reply or the last error, after `attempts` requests."""

    reply: ChatReply | None
    error: ChatError | None
    attempts: int
    latency_s: float                   # time spent in requests, not in backoff sleeps


def backoff_s(attempt: int, base_s: float, rng: random.Random) -> float:
    """Returns the sleep before retry number `attempt` (1-based): exponential, jittered."""
    return min(base_s * 2 ** (attempt - 1), MAX_BACKOFF_S) * rng.uniform(1.0, 1.5)


def call_with_retries(client: ChatClient, model: ModelConfig, messages: Sequence[Message],
                      cfg: LlmConfig, rng: random.Random,
                      sleep: Callable[[float], None] = time.sleep,
                      max_tokens: int | None = None) -> CallOutcome:
    """Returns the outcome of one call, retrying 429/5xx/timeouts up to cfg.max_retries times
    (a timeout once at most)."""
    attempts, timeouts, latency = 0, 0, 0.0
    while True:
        attempts += 1
        t0 = time.monotonic()
        try:
            reply = client.complete(model, messages, temperature=cfg.temperature,
                                    max_tokens=max_tokens or cfg.max_tokens,
                                    timeout_s=cfg.timeout_s)
            return CallOutcome(reply, None, attempts, latency + time.monotonic() - t0)
        except ChatError as e:
            latency += time.monotonic() - t0
            timeouts += e.timed_out
            if not e.retryable or attempts > cfg.max_retries or timeouts >= MAX_TIMEOUTS_PER_CALL:
                return CallOutcome(None, e, attempts, latency)
            wait = e.retry_after_s if e.retry_after_s is not None else backoff_s(attempts, cfg.backoff_s, rng)
            log.warning("llm: attempt %d of %d failed: %s; retrying in %.1f s",
                        attempts, cfg.max_retries + 1, e, wait)
            sleep(wait)


# ---- the mutator --------------------------------------------------------

class LlmMutator:
    """Proposes a child by asking a model (picked by weight) to edit the parent."""

    name = "llm"
    blocking_io = True     # the search prepares these requests ahead, in a thread pool

    def __init__(self, cfg: LlmConfig, meter: CostMeter, client: ChatClient | None = None,
                 sleep: Callable[[float], None] = time.sleep, *, history: History | None = None,
                 facts: Mapping[str, str] | None = None, knobs_tuned: bool = False) -> None:
        if not cfg.models:
            raise UsageError("llm.models must list at least one model")
        if any(m.weight < 0 for m in cfg.models) or sum(m.weight for m in cfg.models) <= 0:
            raise UsageError("llm.models weights must be >= 0 and not all 0")
        self.cfg = cfg
        self.meter = meter
        self.client: ChatClient = client if client is not None else OpenAIChatClient(cfg.models)
        self.history = history
        self.settings = PromptSettings(cfg.output_format, cfg.inspirations,
                                       dict(facts) if facts else None, knobs_tuned)
        self._sleep = sleep
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}        # failed calls in a row, per model
        self._stopped: str | None = None           # why every later propose raises
        self._context: dict[str, int] = {}        # per model: configured, reported or learnt
        self._ratio: dict[str, float] = {}         # per model: characters a token, measured

    def pick_model(self, rng: random.Random) -> ModelConfig:
        """Returns a model drawn by weight."""
        return rng.choices(self.cfg.models, weights=[m.weight for m in self.cfg.models])[0]

    def propose(self, request: MutationRequest) -> Proposal:
        """Returns a child of the parent, or a rejection saying why; raises LlmUnavailable when
        the LLM cannot serve the run."""
        parent = request.parent
        if self._stopped is not None:
            raise LlmUnavailable(self._stopped)
        if self.meter.exhausted:
            return Proposal(parent.id, self.name, None, rejected_reason=BUDGET_EXHAUSTED)
        rng = random.Random(request.seed)
        model = self.pick_model(rng)
        attempts = self._attempts(request)
        if self.meter.exhausted:               # spent while this request waited
            return Proposal(parent.id, self.name, None, rejected_reason=BUDGET_EXHAUSTED)
        prompt, out = self._call(request, model, attempts, rng)
        if out.reply is None:
            return self._failed(request, model, out)
        with self._lock:
            self._failures[model.name] = 0
        return self._answered(request, model, prompt, out)

    def _call(self, request: MutationRequest, model: ModelConfig, attempts: Sequence[Attempt],
              rng: random.Random) -> tuple[Prompt | None, CallOutcome]:
        """Returns the prompt sent and the call's outcome; a prompt the model says is too long
        is sent once more, made to fit the context the error gives."""
        tries, latency = 0, 0.0
        for again in (False, True):
            budget = self._budget(model)
            prompt = build_prompt(request, self.settings, attempts, budget)
            if prompt is None:
                error = ChatError(f"{NO_FIT} the context of {where(model)} "
                                  f"({budget.context_tokens} tokens, {budget.answer_tokens} kept "
                                  "for the answer): set its context_tokens, lower max_tokens, "
                                  "or use a model with a longer context")
                return None, CallOutcome(None, error, tries, latency)
            out = call_with_retries(self.client, model, prompt.messages, self.cfg, rng,
                                    self._sleep, budget.answer_tokens)
            tries, latency = tries + out.attempts, latency + out.latency_s
            if again or out.error is None or not out.error.context_exceeded:
                return prompt, CallOutcome(out.reply, out.error, tries, latency)
            self._learn_context(model, out.error, budget)
        raise AssertionError("unreachable")

    def _answered(self, request: MutationRequest, model: ModelConfig, prompt: Prompt | None,
                  out: CallOutcome) -> Proposal:
        parent, reply = request.parent, out.reply
        assert reply is not None and prompt is not None
        tag = f"llm:{model.name}"
        cost = cost_usd(model, reply.prompt_tokens, reply.completion_tokens)
        usage = LlmUsage(model.name, reply.prompt_tokens, reply.completion_tokens, cost,
                         out.latency_s, out.attempts)
        self.meter.record(CallRecord(model.name, "ok", reply.prompt_tokens, reply.completion_tokens,
                                     cost, out.latency_s, out.attempts, parent_id=parent.id,
                                     iteration=request.iteration))
        ratio = tokens.calibrated(prompt.chars, reply.prompt_tokens)
        if ratio is not None:
            with self._lock:
                self._ratio[model.name] = ratio
        outcome = prompt.view.apply(reply.text)
        if outcome.new_source is None:
            reason = outcome.reason or "rejected"
            if reply.finish_reason == "length":
                reason += " (the answer was cut off at max_tokens)"
            return Proposal(parent.id, tag, None, change=blocks_as_diff(reply.text),
                            rejected_reason=reason, usage=usage)
        return Proposal(parent.id, tag, outcome.new_source,
                        change=summarise_change(parent.source, outcome.new_source), usage=usage)

    def _failed(self, request: MutationRequest, model: ModelConfig, out: CallOutcome) -> Proposal:
        """Returns the rejection of a failed call, or raises LlmUnavailable when it is one
        failure too many (or one that no retry can mend)."""
        error = out.error
        assert error is not None
        usage = None                       # a prompt that did not fit: no request was made
        if out.attempts:
            self.meter.record(CallRecord(model.name, "fatal" if error.fatal else "failed",
                                         latency_s=out.latency_s, attempts=out.attempts,
                                         error=str(error), parent_id=request.parent.id,
                                         iteration=request.iteration))
            usage = LlmUsage(model.name, latency_s=out.latency_s, attempts=out.attempts,
                             status="failed")
        with self._lock:
            n = self._failures[model.name] = self._failures.get(model.name, 0) + 1
            if error.fatal or n >= self.cfg.max_consecutive_failures:
                self._stopped = (f"{LLM_STOPPED}: {error}" if error.fatal else
                                 f"{LLM_STOPPED}: {n} calls in a row failed "
                                 f"(llm.max_consecutive_failures); the last: {error}")
                raise LlmUnavailable(self._stopped, usage=usage)
        if str(error).startswith(NO_FIT):
            return Proposal(request.parent.id, f"llm:{model.name}", None,
                            rejected_reason=str(error), usage=usage)
        reason = f"{CALL_FAILED} after {out.attempts} attempt(s): {error}"
        return Proposal(request.parent.id, f"llm:{model.name}", None, rejected_reason=reason,
                        usage=usage)

    # ---- what the prompt is made of ------------------------------------------
    def _attempts(self, request: MutationRequest) -> Sequence[Attempt]:
        """Returns the earlier attempts on the parent, after waiting (feedback_wait_s at most)
        for the siblings still in flight."""
        if self.history is None:
            return ()
        try:
            if not wait_for(self.history, request.pending, self.cfg.feedback_wait_s):
                log.info("llm: iteration %d goes ahead without the outcome of iteration(s) %s",
                         request.iteration, request.pending)
            return self.history.attempts(request.parent.id, self.settings.limits.attempts)
        except Exception as e:  # noqa: BLE001 - a prompt without feedback beats no call
            log.warning("llm: the run's earlier attempts could not be read: %s", e)
            return ()

    def _budget(self, model: ModelConfig) -> tokens.TokenBudget:
        with self._lock:
            known = self._context.get(model.name)
            ratio = self._ratio.get(model.name, tokens.CHARS_PER_TOKEN)
        if known is None:
            asked = getattr(self.client, "context_tokens", None)
            known = model.context_tokens or (asked(model) if asked else None) \
                or tokens.DEFAULT_CONTEXT_TOKENS
            with self._lock:
                known = self._context.setdefault(model.name, known)
        return tokens.split_context(known, self.cfg.max_tokens, ratio)

    def _learn_context(self, model: ModelConfig, error: ChatError,
                       budget: tokens.TokenBudget) -> None:
        """Takes the smaller context a 'too long' error gives; else the tokens were more than
        estimated, and the estimate takes 3/4 of the characters a token."""
        with self._lock:
            if error.context_tokens and error.context_tokens < budget.context_tokens:
                self._context[model.name] = error.context_tokens
            else:
                self._ratio[model.name] = max(budget.chars_per_token * 0.75,
                                              tokens.MIN_CHARS_PER_TOKEN)
        log.warning("llm: %s; the next prompts are made smaller (set context_tokens in the "
                    "config)", error)
