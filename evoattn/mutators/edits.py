"""Turns a model's answer into a new source: SEARCH/REPLACE blocks or a whole program.

An answer that cannot be applied is never dropped silently: `EditOutcome.reason`
says why, in words the next prompt can quote back to the model.

Matching is line-based, so a SEARCH text never matches the tail of a longer
line. An exact match is tried first; failing that, a match that ignores
leading/trailing whitespace on each line is accepted only if it is unique, and
the replacement is re-indented by the indent difference found.
"""
from __future__ import annotations

import dataclasses
import difflib
import re

from evoattn.types import normalise_source

NO_ANSWER = "no edit blocks or program found"

_SEARCH = re.compile(r"^\s*<{5,}\s*SEARCH\s*$")
_DIVIDER = re.compile(r"^\s*={5,}\s*$")
_REPLACE = re.compile(r"^\s*>{5,}\s*REPLACE\s*$")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$")

# Fence tags accepted for each language; an untagged fence is accepted for both.
LANGUAGE_TAGS = {
    "python": ("python", "py", "python3", ""),
    "cuda": ("cuda", "cu", "cpp", "c++", "cxx", "c", ""),
}
LANGUAGE_TAGS["any"] = tuple(dict.fromkeys(t for tags in LANGUAGE_TAGS.values() for t in tags))


@dataclasses.dataclass(frozen=True)
class EditBlock:
    """One SEARCH/REPLACE pair (each text is whole lines, without the final newline)."""

    search: str
    replace: str


@dataclasses.dataclass(frozen=True)
class ParsedAnswer:
    """What an answer contains: edit blocks, a whole program, or why it has neither."""

    blocks: tuple[EditBlock, ...] = ()
    program: str | None = None
    reason: str | None = None          # set when nothing usable was found


@dataclasses.dataclass(frozen=True)
class EditOutcome:
    """The result of applying an answer: a new source, or the reason it was rejected."""

    new_source: str | None
    reason: str | None = None
    applied: int = 0                   # edit blocks applied (0 for a whole program)

    @property
    def ok(self) -> bool:
        return self.new_source is not None


def language_for(suffix: str) -> str:
    """Returns the fence language of a program suffix ('.py' -> 'python', else 'cuda')."""
    return "python" if suffix == ".py" else "cuda"


def parse_answer(text: str, language: str) -> ParsedAnswer:
    """Returns the edit blocks in an answer, or else its longest code block of `language`."""
    if any(_SEARCH.match(line) for line in text.splitlines()):
        return _parse_blocks(text)
    return _parse_program(text, language)


def apply_answer(source: str, text: str, language: str) -> EditOutcome:
    """Returns the source an answer produces from `source`, or why it produces none."""
    parsed = parse_answer(text, language)
    if parsed.reason is not None:
        return EditOutcome(None, parsed.reason)
    if parsed.blocks:
        return apply_edits(source, parsed.blocks)
    assert parsed.program is not None
    if normalise_source(parsed.program) == normalise_source(source):
        return EditOutcome(None, "no-op: the program returned is the parent unchanged")
    return EditOutcome(parsed.program)


def apply_edits(source: str, blocks: tuple[EditBlock, ...] | list[EditBlock]) -> EditOutcome:
    """Returns `source` with every block applied in order, or the first block's failure."""
    if not blocks:
        return EditOutcome(None, NO_ANSWER)
    lines = source.split("\n")
    for i, block in enumerate(blocks):
        where = f"edit block {i + 1} of {len(blocks)}" if len(blocks) > 1 else "edit block"
        lines_or_reason = _apply_one(lines, block)
        if isinstance(lines_or_reason, str):
            return EditOutcome(None, f"{where}: {lines_or_reason}", applied=i)
        lines = lines_or_reason
    new = "\n".join(lines)
    if normalise_source(new) == normalise_source(source):
        return EditOutcome(None, "no-op: the edits leave the source unchanged", applied=len(blocks))
    return EditOutcome(new, applied=len(blocks))


def summarise_change(old: str, new: str, max_lines: int = 60) -> str:
    """Returns a unified diff of old -> new, cut to `max_lines` lines."""
    diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(),
                                     "parent", "child", n=2, lineterm=""))
    if len(diff) > max_lines:
        more = len(diff) - max_lines
        diff = diff[:max_lines] + [f"... ({more} more diff lines)"]
    return "\n".join(diff)


def blocks_as_diff(answer: str, max_lines: int = 60) -> str:
    """Returns an answer's edit blocks as -/+ lines (what it tried), cut to max_lines."""
    lines: list[str] = []
    for b in parse_answer(answer, "any").blocks:
        lines += ["@@"] + [f"-{ln}" for ln in b.search.split("\n")] + \
            [f"+{ln}" for ln in b.replace.split("\n") if b.replace]
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)


# ---- parsing ------------------------------------------------------------

def _parse_blocks(text: str) -> ParsedAnswer:
    blocks: list[EditBlock] = []
    state, search, replace = "out", [], []   # state: out -> search -> replace -> out
    for line in text.splitlines():
        if state == "out":
            if _SEARCH.match(line):
                state, search, replace = "search", [], []
        elif state == "search":
            if _DIVIDER.match(line):
                state = "replace"
            elif _SEARCH.match(line) or _REPLACE.match(line):
                return ParsedAnswer(reason=f"malformed edit block {len(blocks) + 1}: "
                                    "expected '=======' between SEARCH and REPLACE")
            else:
                search.append(line)
        else:
            if _REPLACE.match(line):
                blocks.append(EditBlock("\n".join(search), "\n".join(replace)))
                state = "out"
            elif _SEARCH.match(line) or _DIVIDER.match(line):
                return ParsedAnswer(reason=f"malformed edit block {len(blocks) + 1}: "
                                    "expected '>>>>>>> REPLACE' to close it")
            else:
                replace.append(line)
    if state != "out":
        return ParsedAnswer(reason=f"edit block {len(blocks) + 1} is not closed with "
                            "'>>>>>>> REPLACE' (answer truncated?)")
    return ParsedAnswer(blocks=tuple(blocks))


def _parse_program(text: str, language: str) -> ParsedAnswer:
    tags = LANGUAGE_TAGS.get(language, ("",))
    found: list[str] = []
    fence, tag, body, unclosed = "", "", [], False
    for line in text.splitlines():
        m = _FENCE.match(line)
        if not fence:
            if m:
                fence, tag, body = m.group(1), m.group(2).lower(), []
        elif m and m.group(2) == "" and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
            if tag in tags and any(b.strip() for b in body):
                found.append("\n".join(body) + "\n")
            fence = ""
        else:
            body.append(line)
    if fence and tag in tags:
        unclosed = True
    if found:
        return ParsedAnswer(program=max(found, key=len))
    if unclosed:
        return ParsedAnswer(reason="code block is not closed (answer truncated?)")
    return ParsedAnswer(reason=NO_ANSWER)


# ---- applying -----------------------------------------------------------

def _apply_one(lines: list[str], block: EditBlock) -> list[str] | str:
    """Returns the lines with one block applied, or the reason it cannot be."""
    search = block.search.split("\n")
    replace = block.replace.split("\n") if block.replace else []
    if not block.search.strip():
        return "the SEARCH section is empty; quote the exact lines to replace"
    exact = _windows(lines, search, lambda a, b: a == b)
    if len(exact) == 1:
        i = exact[0]
        return lines[:i] + replace + lines[i + len(search):]
    if len(exact) > 1:
        return _ambiguous(search, exact)
    # Loose: per-line whitespace ignored, blank lines around the SEARCH dropped.
    core = _trim_blank(search)
    loose = _windows(lines, core, lambda a, b: a.strip() == b.strip())
    if len(loose) == 1:
        i = loose[0]
        return lines[:i] + _reindent(replace, core, lines[i:i + len(core)]) + lines[i + len(core):]
    if len(loose) > 1:
        return _ambiguous(core, loose)
    return _not_found(lines, core)


def _windows(lines: list[str], search: list[str], eq) -> list[int]:
    n = len(search)
    return [i for i in range(len(lines) - n + 1)
            if eq(lines[i], search[0]) and all(eq(lines[i + k], search[k]) for k in range(1, n))]


def _trim_blank(lines: list[str]) -> list[str]:
    start, end = 0, len(lines)
    while start < end and not lines[start].strip():
        start += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return lines[start:end]


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _reindent(replace: list[str], search: list[str], found: list[str]) -> list[str]:
    """Shifts `replace` by the indent difference between the SEARCH and the matched lines."""
    first = next((k for k, s in enumerate(search) if s.strip()), None)
    if first is None:
        return replace
    have, want = _indent(search[first]), _indent(found[first])
    if have == want:
        return replace
    if want.startswith(have):
        extra = want[len(have):]
        return [extra + r if r.strip() else r for r in replace]
    if have.startswith(want):
        cut = have[len(want):]
        return [r[len(cut):] if r.startswith(cut) else r for r in replace]
    return replace                      # tabs vs spaces: leave the model's indent alone


def _first_line(search: list[str]) -> str:
    return next((s.strip() for s in search if s.strip()), "")


def _ambiguous(search: list[str], at: list[int]) -> str:
    where = ", ".join(str(i + 1) for i in at[:5])
    return (f"ambiguous: the SEARCH text starting {_first_line(search)!r} matches "
            f"{len(at)} places (lines {where}); include more surrounding lines to make it unique")


def _not_found(lines: list[str], search: list[str]) -> str:
    first = _first_line(search)
    stripped = [ln.strip() for ln in lines]
    close = difflib.get_close_matches(first, [s for s in stripped if s], n=1, cutoff=0.0)
    hint = ""
    if close:
        no = stripped.index(close[0]) + 1
        hint = f"; the closest source line is {no}: {close[0]!r}"
    return (f"the SEARCH text starting {first!r} was not found in the source{hint}. "
            "SEARCH must copy the current source exactly")
