"""The LLM mutator: asks an OpenAI-compatible chat endpoint for an edit of the parent.

    LlmMutator.propose ─ build_messages ─ call_with_retries ─ ChatClient.complete
                       └─ apply_answer (edits.py)          └─ CostMeter.record

What can go wrong, and what the caller sees:
    the answer is unusable (no edits, SEARCH not found, no-op) ... rejected Proposal
    429 / 5xx / timeout / connection error, retries exhausted ... rejected Proposal
    any other 4xx (400: prompt too long, ...) ................... rejected Proposal
    401 / 403 / 404 (bad key, no access, wrong model or URL) .... ChatError raised
                                                                  (an LlmError: the run cannot succeed)
    the budget is spent ......................................... rejected Proposal, reason
                                                                  BUDGET_EXHAUSTED, no request made

Every request made is one CallRecord in the shared CostMeter (drain it to
persist the call log); each propose makes at most one logical call, so its
Proposal.usage describes that call. The API key is kept only inside
OpenAIChatClient and scrubbed from every error text.
"""
from __future__ import annotations

import collections
import dataclasses
import email.utils
import logging
import os
import random
import re
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence
from urllib.parse import urlparse

from evoattn.config import LlmConfig, ModelConfig
from evoattn.errors import LlmError, UsageError
from evoattn.mutators.edits import apply_answer, language_for, summarise_change
from evoattn.mutators.prompts import Message, build_messages
from evoattn.types import LlmUsage, MutationRequest, Proposal

log = logging.getLogger(__name__)

BUDGET_EXHAUSTED = "LLM budget exhausted"
MAX_BACKOFF_S = 60.0                   # cap on one exponential-backoff sleep
MAX_RETRY_AFTER_S = 300.0              # cap on a server's Retry-After
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


# ---- transport seam -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChatReply:
    """A model's answer and what it cost in tokens."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""            # "stop", "length" (cut off at max_tokens), ...


class ChatError(LlmError):
    """A failed chat request: retryable (429, 5xx, timeout), fatal (401/403/404) or neither."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False,
                 fatal: bool = False, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.fatal = fatal
        self.retry_after_s = retry_after_s


class ChatClient(Protocol):
    """Sends one chat completion request; raises ChatError on failure."""

    def complete(self, model: ModelConfig, messages: Sequence[Message], *, temperature: float,
                 max_tokens: int, timeout_s: float) -> ChatReply: ...


class OpenAIChatClient:
    """ChatClient over the `openai` package: one client per model, made on first use."""

    def __init__(self, models: Sequence[ModelConfig], environ: Mapping[str, str] | None = None) -> None:
        self._env = os.environ if environ is None else environ
        self._keys: dict[ModelConfig, str] = {}
        self._clients: dict[ModelConfig, Any] = {}
        self._lock = threading.Lock()
        for m in models:                # a missing key is a usage error now, not mid-run
            self._keys[m] = self._resolve_key(m)

    def __repr__(self) -> str:
        return f"OpenAIChatClient(models={[m.name for m in self._keys]})"

    def _resolve_key(self, model: ModelConfig) -> str:
        key = self._env.get(model.api_key_env, "")
        if key:
            return key
        if is_local(model.base_url):
            return "no-key-needed-locally"
        where = model.base_url or "the OpenAI API"
        raise UsageError(f"model {model.name}: environment variable {model.api_key_env} is not set; "
                         f"it must hold the API key for {where}")

    def _client(self, model: ModelConfig, timeout_s: float) -> Any:
        import openai

        with self._lock:
            if model not in self._clients:
                if model not in self._keys:
                    self._keys[model] = self._resolve_key(model)
                kw: dict[str, Any] = {"api_key": self._keys[model], "max_retries": 0, "timeout": timeout_s}
                if model.base_url is not None:
                    kw["base_url"] = model.base_url
                self._clients[model] = openai.OpenAI(**kw)
            return self._clients[model]

    def complete(self, model: ModelConfig, messages: Sequence[Message], *, temperature: float,
                 max_tokens: int, timeout_s: float) -> ChatReply:
        """Returns the model's reply; raises ChatError (key scrubbed) on any failure."""
        import openai

        client = self._client(model, timeout_s)
        kw: dict[str, Any] = {"model": model.name, "messages": list(messages), "timeout": timeout_s}
        if model.reasoning:             # o-series: no temperature, a different token cap
            kw["max_completion_tokens"] = max_tokens
        else:
            kw["max_tokens"] = max_tokens
            kw["temperature"] = temperature
        error: ChatError | None = None
        try:
            resp = client.chat.completions.create(**kw)
            choice = resp.choices[0]
            usage = resp.usage
            return ChatReply(
                text=choice.message.content or "",
                prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
                finish_reason=str(choice.finish_reason or ""),
            )
        except openai.APITimeoutError:
            error = ChatError(f"request timed out after {timeout_s:g} s", retryable=True)
        except openai.APIConnectionError as e:
            error = ChatError(f"connection error: {self._scrub(str(e), model)}", retryable=True)
        except openai.APIStatusError as e:
            error = self._status_error(e, model)
        except (openai.OpenAIError, IndexError, AttributeError, TypeError, ValueError) as e:
            error = ChatError(f"malformed response: {self._scrub(str(e), model)[:300]}")
        # Raised outside the except blocks, so no chained exception (whose request
        # object carries the Authorization header) travels with it.
        raise error

    def _status_error(self, e: Any, model: ModelConfig) -> ChatError:
        status = int(e.status_code)
        if status in (401, 403):
            return ChatError(f"HTTP {status}: the endpoint refused the key in {model.api_key_env} "
                             f"for model {model.name}", status=status, fatal=True)
        body = e.body
        detail = body.get("message") if isinstance(body, dict) else body
        text = self._scrub(str(detail or e.message), model)[:300]
        if status == 404:
            return ChatError(f"HTTP 404 (is the model name {model.name!r} or the base_url "
                             f"right?): {text}", status=status, fatal=True)
        retryable = status in (408, 409, 429) or status >= 500
        return ChatError(f"HTTP {status}: {text}", status=status, retryable=retryable,
                         retry_after_s=parse_retry_after(e.response.headers))

    def _scrub(self, text: str, model: ModelConfig) -> str:
        key = self._keys.get(model, "")
        return scrub(text, key)


def scrub(text: str, secret: str) -> str:
    """Returns text with the secret, and anything that looks like a masked key, removed."""
    if secret and len(secret) >= 4:
        text = text.replace(secret, "***")
    return re.sub(r"\S*\*{3,}\S*", "***", text)   # "sk-ab***yz" style echoes of the key


def is_local(base_url: str | None) -> bool:
    """Returns whether an endpoint runs on this machine (no API key needed)."""
    return bool(base_url) and urlparse(base_url).hostname in _LOCAL_HOSTS


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Returns the wait a response asks for (retry-after-ms, or Retry-After seconds or date)."""
    ms = headers.get("retry-after-ms")
    try:
        if ms is not None:
            return min(max(float(ms) / 1000.0, 0.0), MAX_RETRY_AFTER_S)
    except ValueError:
        pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


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
                      sleep: Callable[[float], None] = time.sleep) -> CallOutcome:
    """Returns the outcome of one call, retrying 429/5xx/timeouts up to cfg.max_retries times."""
    attempts, latency = 0, 0.0
    while True:
        attempts += 1
        t0 = time.monotonic()
        try:
            reply = client.complete(model, messages, temperature=cfg.temperature,
                                    max_tokens=cfg.max_tokens, timeout_s=cfg.timeout_s)
            return CallOutcome(reply, None, attempts, latency + time.monotonic() - t0)
        except ChatError as e:
            latency += time.monotonic() - t0
            if not e.retryable or attempts > cfg.max_retries:
                return CallOutcome(None, e, attempts, latency)
            wait = e.retry_after_s if e.retry_after_s is not None else backoff_s(attempts, cfg.backoff_s, rng)
            log.warning("llm %s: attempt %d of %d failed: %s; retrying in %.1f s",
                        model.name, attempts, cfg.max_retries + 1, e, wait)
            sleep(wait)


# ---- cost ---------------------------------------------------------------

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


# ---- the mutator --------------------------------------------------------

class LlmMutator:
    """Proposes a child by asking a model (picked by weight) to edit the parent."""

    name = "llm"
    blocking_io = True     # the search prepares these requests ahead, in a thread pool

    def __init__(self, cfg: LlmConfig, meter: CostMeter, client: ChatClient | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not cfg.models:
            raise UsageError("llm.models must list at least one model")
        if any(m.weight < 0 for m in cfg.models) or sum(m.weight for m in cfg.models) <= 0:
            raise UsageError("llm.models weights must be >= 0 and not all 0")
        self.cfg = cfg
        self.meter = meter
        self.client: ChatClient = client if client is not None else OpenAIChatClient(cfg.models)
        self._sleep = sleep

    def pick_model(self, rng: random.Random) -> ModelConfig:
        """Returns a model drawn by weight."""
        return rng.choices(self.cfg.models, weights=[m.weight for m in self.cfg.models])[0]

    def propose(self, request: MutationRequest) -> Proposal:
        """Returns a child of the parent, or a rejection saying why; raises ChatError only when fatal."""
        parent = request.parent
        if self.meter.exhausted:
            return Proposal(parent.id, self.name, None, rejected_reason=BUDGET_EXHAUSTED)
        rng = random.Random(request.seed)
        model = self.pick_model(rng)
        tag = f"llm:{model.name}"
        messages = build_messages(request, output_format=self.cfg.output_format,
                                  inspirations=self.cfg.inspirations)
        out = call_with_retries(self.client, model, messages, self.cfg, rng, self._sleep)

        if out.reply is None:
            assert out.error is not None
            self.meter.record(CallRecord(model.name, "fatal" if out.error.fatal else "failed",
                                         latency_s=out.latency_s, attempts=out.attempts,
                                         error=str(out.error), parent_id=parent.id,
                                         iteration=request.iteration))
            if out.error.fatal:
                raise out.error
            usage = LlmUsage(model.name, latency_s=out.latency_s, attempts=out.attempts,
                             status="failed")
            reason = f"LLM call failed after {out.attempts} attempt(s): {out.error}"
            return Proposal(parent.id, tag, None, rejected_reason=reason, usage=usage)

        reply = out.reply
        cost = cost_usd(model, reply.prompt_tokens, reply.completion_tokens)
        usage = LlmUsage(model.name, reply.prompt_tokens, reply.completion_tokens, cost,
                         out.latency_s, out.attempts)
        self.meter.record(CallRecord(model.name, "ok", reply.prompt_tokens, reply.completion_tokens,
                                     cost, out.latency_s, out.attempts, parent_id=parent.id,
                                     iteration=request.iteration))
        outcome = apply_answer(parent.source, reply.text, language_for(parent.suffix))
        if outcome.new_source is None:
            reason = outcome.reason or "rejected"
            if reply.finish_reason == "length":
                reason += " (the answer was cut off at max_tokens)"
            return Proposal(parent.id, tag, None, rejected_reason=reason, usage=usage)
        return Proposal(parent.id, tag, outcome.new_source,
                        change=summarise_change(parent.source, outcome.new_source), usage=usage)
