"""The transport seam of the LLM mutator: one chat request, one model listing.

`ChatClient` is the narrow interface (tests use a real HTTP server on 127.0.0.1 behind
`OpenAIChatClient`). Every ChatError names the model and the endpoint; the API key lives
only inside OpenAIChatClient and is scrubbed from every error text.
"""
from __future__ import annotations

import dataclasses
import email.utils
import os
import re
import threading
import time
from typing import Any, Mapping, Protocol, Sequence

from evoattn.config import ModelConfig
from evoattn.errors import LlmError
from evoattn.mutators.keys import NO_KEY, display_url, endpoint, key_env, resolve_key

Message = dict[str, str]               # {"role": ..., "content": ...}, the OpenAI wire form
MAX_RETRY_AFTER_S = 300.0              # cap on a server's Retry-After
LISTING_TIMEOUT_S = 10.0               # GET /models and /props
# Where servers report a model's context length in their model listing: vLLM, OpenRouter
# and others, LM Studio, Groq.
_CONTEXT_KEYS = ("max_model_len", "context_length", "max_context_length", "context_window")
_CONTEXT_IN_MESSAGE = re.compile(r"(?:maximum context length|context (?:length|window|size))"
                                 r"\D{0,40}?(\d{3,7})", re.I)
_CONTEXT_ERROR = re.compile(r"context.{0,20}(length|window|size)|too many tokens|prompt is too "
                            r"long|exceeds the available context", re.I)


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
                 fatal: bool = False, retry_after_s: float | None = None,
                 timed_out: bool = False, context_exceeded: bool = False,
                 context_tokens: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.fatal = fatal
        self.retry_after_s = retry_after_s
        self.timed_out = timed_out
        self.context_exceeded = context_exceeded   # the prompt did not fit the model
        self.context_tokens = context_tokens       # the context the server said it has


class ChatClient(Protocol):
    """Sends one chat completion request; raises ChatError on failure."""

    def complete(self, model: ModelConfig, messages: Sequence[Message], *, temperature: float,
                 max_tokens: int, timeout_s: float) -> ChatReply: ...


def where(model: ModelConfig) -> str:
    """Returns 'model NAME at URL', the prefix of every message about a model."""
    return f"model {model.name} at {display_url(endpoint(model))}"


class OpenAIChatClient:
    """ChatClient over the `openai` package: one client per model, made on first use."""

    def __init__(self, models: Sequence[ModelConfig], environ: Mapping[str, str] | None = None) -> None:
        self._env = os.environ if environ is None else environ
        self._keys: dict[ModelConfig, str] = {}
        self._clients: dict[ModelConfig, Any] = {}
        self._lock = threading.Lock()
        for i, m in enumerate(models):   # a missing or misdirected key: a usage error now
            self._keys[m] = resolve_key(m, self._env, f"llm.models[{i}] ({m.name})")

    def __repr__(self) -> str:
        return f"OpenAIChatClient(models={[m.name for m in self._keys]})"

    def _client(self, model: ModelConfig, timeout_s: float) -> Any:
        import openai

        with self._lock:
            if model not in self._clients:
                if model not in self._keys:
                    self._keys[model] = resolve_key(model, self._env, model.name)
                # base_url always given: the package would otherwise read OPENAI_BASE_URL.
                self._clients[model] = openai.OpenAI(api_key=self._keys[model],
                                                     base_url=endpoint(model),
                                                     max_retries=0, timeout=timeout_s)
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
            error = ChatError(f"{where(model)}: no answer within timeout_s = {timeout_s:g} s",
                              retryable=True, timed_out=True)
        except openai.APIConnectionError as e:
            cause = f" ({e.__cause__})" if e.__cause__ else ""
            error = ChatError(f"{where(model)}: cannot connect: "
                              f"{self._scrub(str(e) + cause, model)}", retryable=True)
        except openai.APIStatusError as e:
            error = self._status_error(e, model)
        except (openai.OpenAIError, IndexError, AttributeError, TypeError, ValueError) as e:
            error = ChatError(f"{where(model)}: malformed response: "
                              f"{self._scrub(str(e), model)[:300]}")
        # Raised outside the except blocks, so no chained exception (whose request
        # object carries the Authorization header) travels with it.
        raise error

    def _status_error(self, e: Any, model: ModelConfig) -> ChatError:
        status = int(e.status_code)
        if status in (401, 403):
            env = key_env(model) or "(no key variable: api_key_env is unset)"
            return ChatError(f"{where(model)}: HTTP {status}: the endpoint refused the key in "
                             f"{env}", status=status, fatal=True)
        body = e.body
        detail = body.get("message") if isinstance(body, dict) else body
        text = self._scrub(str(detail or e.message), model)[:300]
        if status == 404:
            return ChatError(f"{where(model)}: HTTP 404 (is the model name {model.name!r} or "
                             f"the base_url right?): {text}", status=status, fatal=True)
        if status in (400, 413, 422) and _CONTEXT_ERROR.search(text):
            m = _CONTEXT_IN_MESSAGE.search(text)
            return ChatError(f"{where(model)}: HTTP {status}: the prompt does not fit the "
                             f"model's context: {text}", status=status, context_exceeded=True,
                             context_tokens=int(m.group(1)) if m else None)
        retryable = status in (408, 409, 429) or status >= 500
        return ChatError(f"{where(model)}: HTTP {status}: {text}", status=status,
                         retryable=retryable, retry_after_s=parse_retry_after(e.response.headers))

    def _scrub(self, text: str, model: ModelConfig) -> str:
        key = self._keys.get(model, "")
        return scrub(text, "" if key == NO_KEY else key)

    def context_tokens(self, model: ModelConfig) -> int | None:
        """Returns the context length the server reports for the model, or None."""
        import openai

        client = self._client(model, LISTING_TIMEOUT_S)
        try:
            listing = client.models.list(timeout=LISTING_TIMEOUT_S)
            found = context_from_listing([m.to_dict() for m in listing.data], model.name)
            if found is None:           # llama.cpp's server says it under /props
                props = client.get(_root(endpoint(model)) + "/props", cast_to=object,
                                   options={"timeout": LISTING_TIMEOUT_S})
                found = context_from_props(props)
            return found
        except (openai.OpenAIError, ValueError, TypeError, AttributeError):
            return None


def _root(url: str) -> str:
    return re.sub(r"/v1/?$", "", url.rstrip("/"))


def context_from_listing(entries: Sequence[Mapping[str, Any]], name: str) -> int | None:
    """Returns the context length a /models listing gives for a model (or its only entry)."""
    mine = [e for e in entries if e.get("id") == name] or (list(entries)
                                                             if len(entries) == 1 else [])
    for entry in mine:
        for key in _CONTEXT_KEYS:
            value = entry.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def context_from_props(props: Any) -> int | None:
    """Returns n_ctx from a llama.cpp server's /props answer, or None."""
    if not isinstance(props, dict):
        return None
    settings = props.get("default_generation_settings")
    value = settings.get("n_ctx") if isinstance(settings, dict) else props.get("n_ctx")
    return value if isinstance(value, int) and value > 0 else None


def scrub(text: str, secret: str) -> str:
    """Returns text with the secret, and anything that looks like a masked key, removed."""
    if secret and len(secret) >= 4:
        text = text.replace(secret, "***")
    return re.sub(r"\S*\*{3,}\S*", "***", text)   # "sk-ab***yz" style echoes of the key


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
