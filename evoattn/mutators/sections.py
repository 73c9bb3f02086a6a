"""The parts of a prompt, each rendered from data: where it runs, results, knobs, what was
tried, other programs as diffs. Each part caps its own size (PromptLimits)."""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Sequence

from evoattn.contract import program
from evoattn.contract.knobs import active, find_knobs
from evoattn.contract.runtime import perf_notes
from evoattn.contract.types import EvalResult
from evoattn.mutators.view import ProgramView
from evoattn.problems.base import plain_label
from evoattn.types import Attempt, Program


@dataclasses.dataclass(frozen=True)
class PromptLimits:
    """Size caps, in characters or items, for the variable parts of a prompt."""

    log_chars: int = 3000              # build log and child log excerpts, each
    reason_chars: int = 600            # one verdict reason or rejection reason
    attempts: int = 8                  # earlier attempts on the parent shown
    change_lines: int = 14             # changed lines quoted per attempt
    inspiration_diff_chars: int = 2500  # each other program's diff against the parent
    configs: int = 24                  # rows of a results table
    notes: int = 5                     # ptxas notes on a correct parent's build


def excerpt(text: str, max_chars: int) -> str:
    """Returns text cut to about max_chars, keeping its head and tail."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters cut ...]\n{text[-half:]}"


def num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


label = plain_label        # a config in a prompt: every key, as the problem's --configs take it


# ---- where it runs ---------------------------------------------------------

def target(result: EvalResult | None, gpu_info: Mapping[str, Any],
           facts: Mapping[str, str] | None) -> str:
    """Returns what the program runs on, truthfully: a GPU, or the CPU's Triton interpreter."""
    facts = facts or {}
    versions = dict(result.versions) if result else {}
    info = dict(result.device_info) if result and result.device_info else \
        {k: v for k, v in gpu_info.items() if k != "name"}
    name = result.device if result and result.device else gpu_info.get("name", "")
    on_cpu = (result.timing_device == "cpu") if result else facts.get("target") == "cpu"
    vers = ", ".join(f"{k} {versions[k]}" for k in ("torch", "triton", "cuda", "python")
                     if versions.get(k) not in (None, "", "None"))
    if on_cpu:
        text = (f"The CPU ({name or 'no GPU'}), not a GPU: Triton kernels run through Triton's "
                "interpreter (TRITON_INTERPRET=1) on the problem's small CPU configs, and the "
                "times are the interpreter's. CUDA code does not run here. Make changes that "
                "would also be right on a GPU.")
    else:
        facts_text = ", ".join(f"{k} {v}" for k, v in info.items() if v is not None)
        cap = facts.get("target")
        text = f"GPU: {name or '(not given)'}" + (f" (target {cap})" if cap else "") + \
            (f"; {facts_text}" if facts_text else "") + "."
    return text + (f"\nVersions: {vers}." if vers else "")


def where_short(result: EvalResult | None, facts: Mapping[str, str] | None) -> str:
    on_cpu = (result.timing_device == "cpu") if result else (facts or {}).get("target") == "cpu"
    return "where it runs (the CPU, through Triton's interpreter)" if on_cpu else "on this GPU"


# ---- results ---------------------------------------------------------------

def results(result: EvalResult | None, limits: PromptLimits) -> str:
    """Returns the parent's verdict, per-config table, failures and log excerpts."""
    if result is None:
        return "Not evaluated yet."
    lines = [f"Verdict: {result.verdict.value}; fitness {result.fitness:.3g} "
             "(geometric-mean speedup over the baseline; 0 unless every config passes)."]
    if result.reason:
        lines.append(f"Reason: {excerpt(result.reason, limits.reason_chars)}")
    if len(result.dtypes) > 1:
        lines.append(f"Checked in {', '.join(result.dtypes)}: a program must be correct in each "
                     f"(the times are {result.dtypes[0]}'s).")
    if result.configs:
        lines += ["", "| config | dtype | verdict | max_abs_err | tolerance | ms | baseline ms | speedup |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in result.configs[:limits.configs]:
            lines.append(f"| {label(c.params)} | {c.dtype} | {c.verdict.value} | {num(c.max_abs_err)} "
                         f"| {num(c.tolerance)} | {num(c.ms)} | {num(c.baseline_ms)} | {num(c.speedup)} |")
        if len(result.configs) > limits.configs:
            lines.append(f"({len(result.configs) - limits.configs} more configs not shown)")
    failed = [c for c in result.configs if not c.verdict.is_pass and c.verdict.value != "skipped"]
    if failed:
        lines.append("")
    for c in failed[:3]:
        over = ""
        if c.max_abs_err is not None and c.tolerance:
            over = (f": max_abs_err {num(c.max_abs_err)} vs tolerance {num(c.tolerance)} "
                    f"({c.max_abs_err / c.tolerance:.3g}x over)")
        why = f" ({excerpt(c.reason, limits.reason_chars)})" if c.reason else ""
        lines.append(f"- Config {label(c.params)} failed with {c.verdict.value}{over}{why}")
    if result.flags:
        lines.append(f"Integrity flags raised: {', '.join(result.flags)}")
    if result.build_log.strip() and not result.correct:
        lines += ["", "Build log (excerpt):", "```", excerpt(result.build_log, limits.log_chars), "```"]
    notes = perf_notes(result.build_log) if result.correct else []
    if notes:
        lines += ["", "Compiler notes (ptxas: the code runs, but slower than it is written to):",
                  *(f"- {excerpt(n, limits.reason_chars)}" for n in notes[:limits.notes])]
    if result.log_tail.strip() and not result.correct:
        lines += ["", "Program output (excerpt):", "```", excerpt(result.log_tail, limits.log_chars), "```"]
    return "\n".join(lines)


# ---- knobs -----------------------------------------------------------------

def knobs(view: ProgramView, knobs_tuned: bool, facts: Mapping[str, str] | None) -> str:
    """Returns what the knob lines are, and that the model should change structure instead."""
    found = find_knobs(view.editable())
    if not found:
        return ""
    live = len(active(found, facts))
    who = ("A separate knob mutator already tunes their values, so do not spend your answer "
           "on a knob's value: change the code's structure (the algorithm, the tiling, the "
           "memory traffic), which no knob reaches." if knobs_tuned else
           "Changing a value is allowed, but a change of structure reaches what no knob does.")
    return ("## Knobs\n"
            f"Lines marked `# evoattn: choice(...)` (`// evoattn: choice(...)` in CUDA) are "
            f"knobs: {len(found)} in the code shown, {live} of them take effect here (a "
            "`when(...)` says where one does). " + who + " You may add a knob line for a new "
            "choice of your own, e.g. `NAME = 2  # evoattn: choice(1, 2, 4)`.\n\n")


# ---- what was tried --------------------------------------------------------

def changed_lines(change: str, max_lines: int) -> str:
    """Returns the -/+ lines of a unified diff (or the change text when it is no diff)."""
    body = [ln for ln in change.splitlines()
            if ln[:1] in "-+" and not ln.startswith(("---", "+++"))]
    if not body:
        return change.strip().splitlines()[0][:200] if change.strip() else ""
    more = len(body) - max_lines
    body = body[:max_lines] + ([f"... ({more} more changed lines)"] if more > 0 else [])
    return "```diff\n" + "\n".join(body) + "\n```"


def attempts(items: Sequence[Attempt], parent_fitness: float, limits: PromptLimits) -> str:
    """Returns the earlier attempts on the parent, most recent last, with the lines changed."""
    shown = list(items)[-limits.attempts:] if limits.attempts else []
    if not shown:
        return ""
    out = ["## Already tried on this program (most recent last)",
           "Learn from these: do not repeat a change that failed or that gave a program "
           "already evaluated."]
    for a in shown:
        out.append(f"- iteration {a.iteration}, {a.mutator}: {_outcome(a, parent_fitness, limits)}")
        diff = changed_lines(a.change, limits.change_lines) if a.outcome != "rejected" else ""
        if diff.startswith("```"):
            out.append("  changed:\n" + "\n".join("  " + ln for ln in diff.splitlines()))
        elif diff:
            out[-1] += f" (change: {diff})"
    return "\n".join(out) + "\n\n"


def _outcome(a: Attempt, parent_fitness: float, limits: PromptLimits) -> str:
    reason = excerpt(a.reason, limits.reason_chars) if a.reason else ""
    if a.outcome == "rejected":
        return f"the answer was not applied: {reason}"
    if a.outcome == "duplicate":
        return f"gave a program that was already evaluated ({reason}): propose something new"
    if a.outcome == "pass":
        return f"pass, fitness {num(a.fitness)} (this program: {parent_fitness:.3g})"
    return f"{a.outcome}: {reason}"


# ---- other programs --------------------------------------------------------

def inspirations(parent: Program, view: ProgramView, others: Sequence[Program],
                 limits: PromptLimits) -> str:
    """Returns other programs as diffs against the shown part of the parent, with results."""
    parts: list[str] = []
    n = 0
    for p in others:
        diff = _diff_shown(parent, view, p, limits.inspiration_diff_chars)
        if not diff:
            continue                     # differs only in what is not shown: nothing to learn
        n += 1
        made = f", made by {p.mutator}" if p.mutator else ""
        parts += [f"### Program {n}: fitness {p.fitness:.3g} (the current program: "
                  f"{parent.fitness:.3g}){made}", _speedups(parent, p, limits),
                  "```diff", diff, "```"]
    if not parts:
        return ""
    head = ["## Other programs of the run, as diffs against the current program",
            "For ideas only: your edits apply to the current program, not to these."]
    return "\n".join(head + parts) + "\n\n"


def _diff_shown(parent: Program, view: ProgramView, other: Program, max_chars: int) -> str:
    mine = dict(view.files)
    theirs = dict(program.split(other.source, view.files[0][0]).files) if view.bundle \
        else {view.files[0][0]: other.source}
    lines: list[str] = []
    for name in view.shown:
        a, b = mine[name].splitlines(), theirs.get(name, "").splitlines()
        lines += difflib.unified_diff(a, b, f"current/{name}", f"other/{name}", n=2,
                                      lineterm="")
    text = "\n".join(lines)
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars].rsplit("\n", 1)[0]
    return cut + f"\n... ({text.count(chr(10)) - cut.count(chr(10))} more diff lines)"


def _speedups(parent: Program, other: Program, limits: PromptLimits) -> str:
    if not (other.result and other.result.configs):
        return ""
    mine = {label(c.params): c.speedup for c in (parent.result.configs if parent.result else ())}
    rows = ["| config | its speedup | the current program's |", "|---|---|---|"]
    for c in other.result.configs[:limits.configs]:
        rows.append(f"| {label(c.params)} | {num(c.speedup)} | {num(mine.get(label(c.params)))} |")
    return "\n".join(rows)
