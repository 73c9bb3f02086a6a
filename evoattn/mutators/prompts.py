"""Builds the chat messages that ask a model for a child of the parent program.

The wording lives in `prompts/*.md` (package data, `$name` placeholders);
this module only fills them in. Everything variable is capped in size except
the parent's source, which the model must be able to quote exactly.
"""
from __future__ import annotations

import dataclasses
import functools
import string
from importlib import resources
from typing import Any

from evaluator.types import EvalResult
from evoattn.mutators.edits import language_for
from evoattn.types import MutationRequest, Program

Message = dict[str, str]               # {"role": ..., "content": ...}, the OpenAI wire form


@dataclasses.dataclass(frozen=True)
class PromptLimits:
    """Size caps, in characters or items, for the variable parts of a prompt."""

    log_chars: int = 3000              # build log and child log excerpts, each
    reason_chars: int = 600            # one verdict reason or rejection reason
    feedback_items: int = 5            # most recent rejection reasons shown
    inspiration_chars: int = 12000     # each inspiration's source
    configs: int = 24                  # rows of the results table


def build_messages(request: MutationRequest, *, output_format: str = "diff",
                   inspirations: int = 3, limits: PromptLimits = PromptLimits()) -> list[Message]:
    """Returns the system and user messages for one mutation request."""
    parent = request.parent
    language = language_for(parent.suffix)
    rules = _template(f"format_{output_format}.md").substitute(language=language)
    system = _template("system.md").substitute(format_rules=rules)
    user = _template("user.md").substitute(
        contract=request.problem_contract.strip() or "(no contract given)",
        gpu=_gpu(request.gpu_info),
        suffix=parent.suffix,
        language=language,
        source=parent.source.rstrip("\n"),
        results=_results(parent.result, limits),
        feedback=_feedback(request.feedback, limits),
        inspirations=_inspirations(request, inspirations, limits),
        task=_task(parent),
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@functools.cache
def _template(name: str) -> string.Template:
    text = resources.files("evoattn.mutators").joinpath("prompts", name).read_text("utf-8")
    return string.Template(text)


def excerpt(text: str, max_chars: int) -> str:
    """Returns text cut to about max_chars, keeping its head and tail."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters cut ...]\n{text[-half:]}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _gpu(info: dict[str, Any]) -> str:
    if not info:
        return "(not given)"
    keys = sorted(info, key=lambda k: (k != "name", k))   # the name first, then the rest
    return "\n".join(f"- {k}: {info[k]}" for k in keys)


def _label(params: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items())


def _results(result: EvalResult | None, limits: PromptLimits) -> str:
    if result is None:
        return "Not evaluated yet."
    lines = [f"Verdict: {result.verdict.value}; fitness {result.fitness:.3g} "
             "(geometric-mean speedup over the baseline; 0 unless every config passes)."]
    if result.reason:
        lines.append(f"Reason: {excerpt(result.reason, limits.reason_chars)}")
    if result.configs:
        lines += ["", "| config | dtype | verdict | max_abs_err | tolerance | ms | baseline ms | speedup |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in result.configs[:limits.configs]:
            lines.append(f"| {_label(c.params)} | {c.dtype} | {c.verdict.value} | {_num(c.max_abs_err)} "
                         f"| {_num(c.tolerance)} | {_num(c.ms)} | {_num(c.baseline_ms)} | {_num(c.speedup)} |")
        if len(result.configs) > limits.configs:
            lines.append(f"({len(result.configs) - limits.configs} more configs not shown)")
    failed = [c for c in result.configs if not c.verdict.is_pass and c.verdict.value != "skipped"]
    if failed:
        lines.append("")
    for c in failed[:3]:
        over = ""
        if c.max_abs_err is not None and c.tolerance:
            over = (f": max_abs_err {_num(c.max_abs_err)} vs tolerance {_num(c.tolerance)} "
                    f"({c.max_abs_err / c.tolerance:.3g}x over)")
        why = f" ({excerpt(c.reason, limits.reason_chars)})" if c.reason else ""
        lines.append(f"- Config {_label(c.params)} failed with {c.verdict.value}{over}{why}")
    if result.flags:
        lines.append(f"Integrity flags raised: {', '.join(result.flags)}")
    if result.build_log.strip() and not result.correct:
        lines += ["", "Build log (excerpt):", "```", excerpt(result.build_log, limits.log_chars), "```"]
    if result.log_tail.strip() and not result.correct:
        lines += ["", "Program output (excerpt):", "```", excerpt(result.log_tail, limits.log_chars), "```"]
    return "\n".join(lines)


def _feedback(feedback: tuple[str, ...], limits: PromptLimits) -> str:
    if not feedback:
        return ""
    recent = feedback[-limits.feedback_items:]
    # Reasons are edits that did not apply and children that failed evaluation alike.
    lines = ["## Earlier answers for this program failed (most recent last)",
             "Your previous answers were rejected or produced failing programs. "
             "Avoid repeating these mistakes:"]
    lines += [f"- {excerpt(r, limits.reason_chars)}" for r in recent]
    return "\n".join(lines) + "\n\n"


def _inspirations(request: MutationRequest, n: int, limits: PromptLimits) -> str:
    others = [p for p in request.inspirations if p.id != request.parent.id][:max(n, 0)]
    if not others:
        return ""
    parts = ["## Other programs, for ideas (do not edit these: edit the current program)"]
    for i, p in enumerate(others, 1):
        parts += [f"### Program {i}: fitness {p.fitness:.3g}{_change_note(p)}",
                  f"```{language_for(p.suffix)}", excerpt(p.source, limits.inspiration_chars), "```"]
    return "\n".join(parts) + "\n\n"


def _change_note(p: Program) -> str:
    return f" (made by {p.mutator})" if p.mutator else ""


def _task(parent: Program) -> str:
    if parent.result is not None and not parent.correct:
        return ("The current program does not pass (see above). Fix it so that every config "
                "passes, keeping it as fast as you can.")
    return ("Propose one change that makes the current program faster on this GPU while "
            "keeping every config correct.")
