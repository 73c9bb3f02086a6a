"""Builds the chat messages that ask a model for a child of the parent, sized to its context.

The wording lives in `prompts/*.md` (package data, `$name` placeholders); sections.py renders
the parts. A prompt that would not fit the model's share of its context (budget.py) is made
smaller, in this order, until it fits:
    1. other programs, the last first;
    2. earlier attempts (to 4, 2, then none) and log excerpts (to 800 characters);
    3. companion files of the parent, the largest first (listed as not shown);
    4. the middle lines of the parent's largest shown file (then only edits can apply).
After steps 3 and 4 the room they free is filled again in the order 2, 1 is taken away
(attempts first, then other programs). A prompt that still does not fit is None: no call.
"""
from __future__ import annotations

import dataclasses
import functools
import string
from importlib import resources
from typing import Mapping, Sequence

from evoattn.mutators import sections
from evoattn.mutators.budget import CHARS_PER_TOKEN, TokenBudget, estimate_tokens
from evoattn.mutators.client import Message
from evoattn.mutators.sections import PromptLimits, excerpt
from evoattn.mutators.view import ProgramView
from evoattn.types import Attempt, MutationRequest

__all__ = ["Message", "Prompt", "PromptLimits", "PromptSettings", "build_messages",
           "build_prompt", "excerpt"]
_LEAN_LOG_CHARS = 800
_NO_ROOM = "left out to fit the model's context"


@dataclasses.dataclass(frozen=True)
class PromptSettings:
    """What shapes every prompt of a run."""

    output_format: str = "diff"        # "diff" (SEARCH/REPLACE) or "full"
    inspirations: int = 3
    facts: Mapping[str, str] | None = None   # {"target": "cpu" | "sm90" ...}: what can run
    knobs_tuned: bool = False          # a knob mutator tunes the `choice(...)` lines
    limits: PromptLimits = PromptLimits()


@dataclasses.dataclass(frozen=True)
class Prompt:
    """The messages of one call, the view of the parent they show, and their size."""

    messages: list[Message]
    view: ProgramView
    chars: int
    est_tokens: int
    trimmed: tuple[str, ...] = ()      # what was left out to fit, in words


def build_prompt(request: MutationRequest, settings: PromptSettings,
                 attempts: Sequence[Attempt] = (),
                 budget: TokenBudget | None = None) -> Prompt | None:
    """Returns the prompt for a request that fits the budget (None: none fits)."""
    parent = request.parent
    ratio = budget.chars_per_token if budget else CHARS_PER_TOKEN
    limit = budget.prompt_tokens if budget else None
    others = [p for p in request.inspirations if p.id != parent.id][:max(settings.inspirations, 0)]
    lim = settings.limits
    lean = [dataclasses.replace(lim, attempts=min(keep, lim.attempts),
                                log_chars=min(lim.log_chars, _LEAN_LOG_CHARS)) for keep in (4, 2, 0)]

    def make(view: ProgramView, n_insp: int, lim: PromptLimits) -> Prompt:
        msgs = _messages(request, settings, view, others[:n_insp], attempts, lim,
                         budget.answer_tokens if budget else None)
        chars = sum(len(m["content"]) for m in msgs)
        trimmed = [f"{len(others) - n_insp} of {len(others)} other programs"] * (n_insp < len(others))
        trimmed += [f"attempts beyond {lim.attempts}, log excerpts"] * (lim is not settings.limits)
        trimmed += [f"file {h.name}" for h in view.hidden if h.why == _NO_ROOM]
        if view.elided is not None:
            trimmed.append(f"lines {view.elided[1]}-{view.elided[2]} of {view.elided[0]}")
        return Prompt(msgs, view, chars, estimate_tokens(chars, ratio), tuple(trimmed))

    def fitting(view: ProgramView) -> Prompt:
        """The largest prompt for this view that fits, else its smallest (which does not)."""
        tries = [(n, lim) for n in range(len(others), -1, -1)] + [(0, x) for x in lean]
        for n, limits in tries:
            p = make(view, n, limits)
            if limit is None or p.est_tokens <= limit:
                return p
        return p

    view = ProgramView.of(parent.source, parent.suffix, settings.facts)
    p = fitting(view)
    for name in sorted(view.shown[1:], key=lambda n: -len(view.text(n))):
        if limit is None or p.est_tokens <= limit:
            return p
        view = view.hide(name, _NO_ROOM)
        p = fitting(view)
    if limit is None or p.est_tokens <= limit:
        return p
    if settings.output_format == "full":
        return None
    for _ in range(3):                 # the estimate is per character: converges in 1-2
        over = int((p.est_tokens - limit) * ratio) + 400
        cut = view.elide(over + len(view.editable()) - len(view.presented()))
        if cut is None:
            return None
        view, p = cut, fitting(cut)
        if p.est_tokens <= limit:
            return p
    return None


def build_messages(request: MutationRequest, *, output_format: str = "diff",
                   inspirations: int = 3, limits: PromptLimits = PromptLimits(),
                   facts: Mapping[str, str] | None = None,
                   attempts: Sequence[Attempt] = ()) -> list[Message]:
    """Returns the system and user messages for one request, with no size limit."""
    settings = PromptSettings(output_format, inspirations, facts, limits=limits)
    prompt = build_prompt(request, settings, attempts)
    assert prompt is not None          # no budget: always built
    return prompt.messages


def _messages(request: MutationRequest, settings: PromptSettings, view: ProgramView,
              others: Sequence, attempts: Sequence[Attempt], lim: PromptLimits,
              answer_tokens: int | None) -> list[Message]:
    parent = request.parent
    rules = _template(f"format_{settings.output_format}.md").substitute(
        whole=_whole_rule(view, settings.output_format))
    system = _template("system.md").substitute(format_rules=rules)
    user = _template("user.md").substitute(
        contract=request.problem_contract.strip() or "(no contract given)",
        target=sections.target(parent.result, request.gpu_info, settings.facts),
        program_note=_program_note(view),
        language="" if view.bundle else view.language,
        source=view.presented().rstrip("\n"),
        results=sections.results(parent.result, lim),
        knobs=sections.knobs(view, settings.knobs_tuned, settings.facts),
        attempts=sections.attempts(attempts, parent.fitness, lim),
        inspirations=sections.inspirations(parent, view, others, lim),
        task=_task(request, settings, answer_tokens),
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@functools.cache
def _template(name: str) -> string.Template:
    text = resources.files("evoattn.mutators").joinpath("prompts", name).read_text("utf-8")
    return string.Template(text)


def _whole_rule(view: ProgramView, output_format: str) -> str:
    fence = f"```{view.language}" if not view.bundle else "```"
    if output_format == "full":
        if not view.bundle:
            return f"the complete new program in a {fence} block"
        return ("the complete new text of each file you change, each file starting with its "
                "`#### evoattn file: NAME ####` line (files you leave out stay as they are)")
    if not view.whole_answers:
        return "- Answer with edit blocks only: some lines of the program are not shown."
    if not view.bundle:
        return ("- If the change touches most of the program, you may instead return the whole "
                f"program in one fenced {fence} code block.")
    return ("- If the change touches most of a file, you may instead return whole files in one "
            "fenced code block, each starting with its `#### evoattn file: NAME ####` line; "
            "files you leave out stay as they are.")


def _program_note(view: ProgramView) -> str:
    notes = []
    if view.bundle:
        notes.append(f"A program of {len(view.files)} files, each after its "
                     f"`#### evoattn file: NAME ####` line; shown: {', '.join(view.shown)}. "
                     "Edit only the files shown and keep their header lines.")
        notes += [f"- Not shown: {h.name} ({h.lines} lines): {h.why}." for h in view.hidden]
    if view.elided is not None:
        name, first, last = view.elided
        notes.append(f"Lines {first}-{last} of {name} are left out to fit the model's context: "
                     "they cannot be edited, and SEARCH text must not span them.")
    return "\n".join(notes) + "\n\n" if notes else ""


def _task(request: MutationRequest, settings: PromptSettings, answer_tokens: int | None) -> str:
    parent = request.parent
    room = f" Your answer may be at most {answer_tokens} tokens long." if answer_tokens else ""
    if parent.result is not None and not parent.correct:
        return ("The current program does not pass (see above). Fix it so that every config "
                "passes, keeping it as fast as you can." + room)
    where = sections.where_short(parent.result, settings.facts)
    return (f"Propose one change that makes the current program faster {where} while "
            "keeping every config correct." + room)
