"""What of a program a prompt shows, and how an answer about the shown part is applied.

A program of several files (evoattn/contract/program.py) shows the files that can run for the
run's facts (`@target`: a `.cu` companion gated `when(@target=sm90)` is hidden on the CPU),
each after its `#### evoattn file: NAME ####` line; hidden files are listed by name with why.
To fit a model's context a view may also hide companions and, last, leave out the middle
lines of its largest file (then only SEARCH/REPLACE edits can apply).

An answer is applied to the real text of the shown files, never to hidden ones: a SEARCH
that quotes a hidden file is rejected, saying so, and the file headers must stay as they are.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from evoattn.contract import program
from evoattn.contract.knobs import find_knobs, values_of
from evoattn.mutators.edits import EditOutcome, apply_answer, language_for, parse_answer
from evoattn.types import normalise_source

ELIDED = "[... lines {first}-{last} of {name} are not shown: they cannot be edited ...]"


@dataclasses.dataclass(frozen=True)
class Hidden:
    """A file of the program the prompt does not show, and why."""

    name: str
    lines: int
    why: str


@dataclasses.dataclass(frozen=True)
class ProgramView:
    """The program, which of its files a prompt shows, and which lines of them it leaves out."""

    files: tuple[tuple[str, str], ...]   # every file, the main one first
    bundle: bool                         # several files, carried with header lines
    shown: tuple[str, ...]
    hidden: tuple[Hidden, ...] = ()
    elided: tuple[str, int, int] | None = None   # (file, first, last line; 1-based) left out

    @classmethod
    def of(cls, source: str, suffix: str, facts: Mapping[str, str] | None = None
           ) -> "ProgramView":
        """Returns the view of a program that shows what can run for these facts."""
        files = program.split(source, "program" + suffix)
        if not program.is_bundle(source):
            return cls(files.files, False, files.names)
        live = program.live_names(files, facts, values_of(find_knobs(source)))
        declared = {c.name: c for c in files.companions()}
        hidden = tuple(Hidden(n, _lines(files.text(n)), _why(declared[n].when, facts))
                       for n in files.names if n not in live)
        return cls(files.files, True, live, hidden)

    @property
    def language(self) -> str:
        """Returns the fence language answers use ('any' for a program of several files)."""
        return "any" if self.bundle else language_for(_suffix(self.files[0][0]))

    @property
    def whole_answers(self) -> bool:
        """Returns whether a whole-file answer can apply (no lines left out)."""
        return self.elided is None

    def text(self, name: str) -> str:
        return dict(self.files)[name]

    def editable(self) -> str:
        """Returns the real text of the shown files: what SEARCH text must match."""
        if not self.bundle:
            return self.files[0][1]
        return _with_headers([(n, self.text(n)) for n in self.shown])

    def presented(self) -> str:
        """Returns the shown text as the prompt gives it (left-out lines as one marker)."""
        if self.elided is None:
            return self.editable()
        name, first, last = self.elided
        lines = self.text(name).split("\n")
        marker = ELIDED.format(first=first, last=last, name=name)
        cut = "\n".join(lines[:first - 1] + [marker] + lines[last:])
        if not self.bundle:
            return cut
        return _with_headers([(n, cut if n == name else self.text(n)) for n in self.shown])

    def hide(self, name: str, why: str) -> "ProgramView":
        """Returns the view without one shown companion."""
        return dataclasses.replace(
            self, shown=tuple(n for n in self.shown if n != name),
            hidden=self.hidden + (Hidden(name, _lines(self.text(name)), why),))

    def elide(self, chars: int) -> "ProgramView | None":
        """Returns the view with at least `chars` characters of the middle of its largest shown
        file left out, or None when that file is too small."""
        name = max(self.shown, key=lambda n: len(self.text(n)))
        lines = self.text(name).split("\n")
        keep = max(len(self.text(name)) - chars - 200, 0)   # 200: the marker and rounding
        head = tail = size = 0
        while head + tail < len(lines):    # whole lines from both ends, alternately
            line = lines[head] if head <= tail else lines[-1 - tail]
            if size + len(line) + 1 > keep:
                break
            size += len(line) + 1
            head, tail = (head + 1, tail) if head <= tail else (head, tail + 1)
        first, last = head + 1, len(lines) - tail
        if last - first < 2:
            return None
        return dataclasses.replace(self, elided=(name, first, last))

    def apply(self, answer: str) -> EditOutcome:
        """Returns the whole program an answer makes of the shown files, or why it makes none."""
        before = self.editable()
        if not self.whole_answers and not parse_answer(answer, self.language).blocks:
            return EditOutcome(None, "some lines of the program were not shown, so only "
                               "SEARCH/REPLACE edits can apply, not a whole program")
        out = apply_answer(before, answer, self.language)
        if out.new_source is None:
            return EditOutcome(None, self._quoted_hidden(answer) or out.reason, out.applied)
        if not self.bundle:
            return out
        new = out.new_source
        if not program.is_bundle(new):
            if len(self.shown) != 1 or parse_answer(answer, "any").blocks:
                return EditOutcome(None, "a whole-file answer for a program of several files "
                                   "must start each file with its '#### evoattn file: NAME "
                                   "####' line")
            new = _with_headers([(self.shown[0], new)])
        try:
            changed = dict(program.split(new, "x").files)
        except program.ProgramError as e:
            return EditOutcome(None, f"the answer breaks the file header lines: {e}")
        if parse_answer(answer, "any").blocks and list(changed) != list(self.shown):
            return EditOutcome(None, "the edits change the file header lines ('#### evoattn "
                               f"file: NAME ####'; files shown: {', '.join(self.shown)}): "
                               "keep them")
        unknown = [n for n in changed if n not in self.shown]
        if unknown:
            return EditOutcome(None, f"the answer writes {', '.join(unknown)}, which is not "
                               f"shown (shown: {', '.join(self.shown)}); edit only those")
        files = [(n, changed.get(n, t)) for n, t in self.files]
        if all(normalise_source(changed.get(n, t)) == normalise_source(t) for n, t in self.files):
            return EditOutcome(None, "no-op: the files returned are the shown files unchanged")
        return EditOutcome(program.join(files), applied=out.applied)

    def _quoted_hidden(self, answer: str) -> str | None:
        """Returns why an answer fails when one of its SEARCH texts quotes a hidden file."""
        hidden = {h.name: h for h in self.hidden}
        for i, block in enumerate(parse_answer(answer, "any").blocks, 1):
            text = block.search.strip()
            for name, h in hidden.items():
                if text and text in self.text(name) and text not in self.editable():
                    return (f"edit block {i} quotes {name}, which is not shown ({h.why}): "
                            f"edit only the files shown ({', '.join(self.shown)})")
        return None


def _with_headers(files: list[tuple[str, str]]) -> str:
    return "".join(program.HEADER.format(name=n) + "\n" + (t if t.endswith("\n") else t + "\n")
                   for n, t in files)


def _lines(text: str) -> int:
    return text.count("\n") + (0 if text.endswith("\n") else 1)


def _suffix(name: str) -> str:
    return name[name.rfind("."):] if "." in name else ""


def _why(when: tuple, facts: Mapping[str, str] | None) -> str:
    cond = " ".join("when(" + ", ".join(f"{n}{op}{v}" for n, op, v in group) + ")"
                    for group in when)
    target = (facts or {}).get("target")
    return f"its condition {cond} does not hold here" + (f" (target {target})" if target else "")
