"""`evoattn llm check`: one short request to each model a config names, before a run spends.

For each model: whether it answers, how fast, the context length (the server's model listing,
else the config's, else the default assumed), and the prices; with the run's seed, what its
first prompt would take in tokens and cost.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

from rich.console import Console
from rich.table import Table

from evoattn.config import LlmConfig, ModelConfig
from evoattn.mutators import budget as tokens
from evoattn.mutators.client import ChatClient, ChatError, OpenAIChatClient
from evoattn.mutators.keys import check_models, display_url, endpoint

PING = [{"role": "user", "content": "Reply with the single word OK."}]
PING_TOKENS, PING_TOKENS_REASONING = 16, 512    # a reasoning model thinks before it answers


@dataclasses.dataclass(frozen=True)
class ModelCheck:
    """What one short request to a model showed."""

    model: str
    url: str
    ok: bool
    latency_s: float
    context_tokens: int
    context_from: str                  # "server", "config" or "default"
    price_in_per_mtok: float
    price_out_per_mtok: float
    detail: str                        # the answer's start, or the error


def check(cfg: LlmConfig, client: ChatClient | None = None,
          environ: Mapping[str, str] | None = None) -> list[ModelCheck]:
    """Returns one ModelCheck per configured model (UsageError first for a key problem)."""
    import os
    env = os.environ if environ is None else environ
    check_models(cfg.models, env)
    client = client or OpenAIChatClient(cfg.models, env)
    return [_check_one(cfg, m, client) for m in cfg.models]


def _check_one(cfg: LlmConfig, m: ModelConfig, client: ChatClient) -> ModelCheck:
    t0 = time.monotonic()
    try:
        reply = client.complete(m, PING, temperature=0.0,
                                max_tokens=PING_TOKENS_REASONING if m.reasoning else PING_TOKENS,
                                timeout_s=cfg.timeout_s)
        ok, detail = True, (reply.text.strip()[:40] or f"(empty, {reply.finish_reason})") + \
            f"; {reply.prompt_tokens} + {reply.completion_tokens} tokens"
    except ChatError as e:
        ok, detail = False, str(e)
    latency = time.monotonic() - t0
    asked = getattr(client, "context_tokens", None)
    reported = asked(m) if ok and asked else None
    context, source = ((reported, "server") if reported else
                       (m.context_tokens, "config") if m.context_tokens else
                       (tokens.DEFAULT_CONTEXT_TOKENS, "default"))
    if reported and m.context_tokens and m.context_tokens != reported:
        source = f"server; the config says {m.context_tokens}"
    return ModelCheck(m.name, display_url(endpoint(m)), ok, latency, context, source,
                      m.price_in_per_mtok, m.price_out_per_mtok, detail)


def render(console: Console, checks: Sequence[ModelCheck], seed_chars: int | None,
           cfg: LlmConfig) -> None:
    """Prints the checks as a table, and what a seed prompt would cost with each model."""
    t = Table(title="LLM endpoints")
    for col in ("model", "endpoint", "answer", "latency", "context (tokens)", "price in/out $/M"):
        t.add_column(col)
    for c in checks:
        t.add_row(c.model, c.url, ("[green]ok[/green] " if c.ok else "[red]failed[/red] ") +
                  c.detail, f"{c.latency_s:.2f} s", f"{c.context_tokens} ({c.context_from})",
                  f"{c.price_in_per_mtok:g} / {c.price_out_per_mtok:g}")
    console.print(t)
    if seed_chars is None:
        return
    for c in checks:
        b = tokens.split_context(c.context_tokens, cfg.max_tokens)
        est = min(tokens.estimate_tokens(seed_chars), b.prompt_tokens)
        usd = est * c.price_in_per_mtok / 1e6
        console.print(f"{c.model}: the seed's prompt is about {est} tokens (at most "
                      f"{b.prompt_tokens} fit, {b.answer_tokens} kept for the answer), "
                      f"${usd:.4f} a call before the answer")
