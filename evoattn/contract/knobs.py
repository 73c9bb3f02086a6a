"""Knobs: the tunable choices a program marks in its source, one per line.

    BLOCK_M = 128  # evoattn: choice(64, 128, 256)             Python / Triton
    USE_TMA = True  # evoattn: choice(True, False)             structural switch
    #define BLOCK_N 64  // evoattn: choice(32, 64, 128)        CUDA macro
    constexpr int WARPS = 4;  // evoattn: choice(4, 8)         CUDA constant
    TILE = 64  # evoattn: choice(32, 64) when(PATH=a, PATH=b)  gated (runtime.py): the knob's
                                                               code runs only when this holds
In a program of several files (program.py) a knob belongs to its file, and its key is its
name, or `file:name` where two files have a knob of that name. A when(...) term names a knob
of its own file first, else the one knob of that name in the program; an ambiguous or unknown
name counts as holding (a typo leaves the knob live, never frozen for a whole run).
The orchestrator's mutator rewrites values; the evaluator reads them (companion conditions).
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Mapping

from . import runtime

_PY = re.compile(r"^(?P<pre>\s*(?P<name>[A-Za-z_]\w*)\s*(?::\s*[\w\[\]., ]+)?=\s*)"
                 r"(?P<val>[^#\n]+?)(?P<post>\s*#\s*evoattn:\s*choice\((?P<choices>[^)]*)\)[^\n]*)$")
_DEFINE = re.compile(r"^(?P<pre>\s*#\s*define\s+(?P<name>\w+)\s+)(?P<val>\S+)"
                     r"(?P<post>\s*//\s*evoattn:\s*choice\((?P<choices>[^)]*)\)[^\n]*)$")
_CONST = re.compile(r"^(?P<pre>\s*(?:static\s+)?(?:constexpr|const)\s+[\w:<> ]+?\s+(?P<name>\w+)"
                    r"\s*=\s*)(?P<val>[^;\n]+?)(?P<post>\s*;\s*//\s*evoattn:\s*choice\("
                    r"(?P<choices>[^)]*)\)[^\n]*)$")
_FILE = re.compile(r"^#### evoattn file: (?P<name>\S+) ####$")


@dataclasses.dataclass(frozen=True)
class Knob:
    """One marked choice: its name, line index, current value and allowed values."""

    name: str
    line: int
    value: str
    choices: tuple[str, ...]
    when: runtime.Conditions = ()   # all groups must hold for the knob's code to run
    file: str = ""                     # its file in a program of several files
    key: str = ""                      # unique in the program: name, or "file:name"


def _match(line: str) -> re.Match[str] | None:
    return _DEFINE.match(line) or _CONST.match(line) or _PY.match(line)


def find_knobs(source: str) -> list[Knob]:
    """Returns the knobs marked in a program's text, in order."""
    found = []
    current = ""
    for i, line in enumerate(source.split("\n")):
        head = _FILE.match(line)
        if head:
            current = head["name"]
            continue
        m = _match(line)
        if m:
            choices = tuple(c.strip() for c in m["choices"].split(",") if c.strip())
            found.append((m["name"], i, m["val"].strip(), choices,
                          runtime.parse_conditions(m["post"]), current))
    counts = collections.Counter(name for name, *_ in found)
    return [Knob(name, i, val, ch, when, file, name if counts[name] == 1 else f"{file}:{name}")
            for name, i, val, ch, when, file in found]


def set_knobs(source: str, values: Mapping[str, str]) -> str:
    """Returns the text with the knobs named by key (or unique name) set to the given values."""
    lines = source.split("\n")
    for k in find_knobs(source):
        if k.key in values:
            m = _match(lines[k.line])
            assert m is not None
            lines[k.line] = m["pre"] + values[k.key] + m["post"]
    return "\n".join(lines)


def active(knobs: list[Knob], facts: Mapping[str, str] | None = None) -> list[Knob]:
    """Returns the knobs whose when(...) groups all hold at the knobs' own values and the facts."""
    own = {(k.file, k.name): k.value for k in knobs}
    counts = collections.Counter(k.name for k in knobs)
    unique = {k.name: k.value for k in knobs if counts[k.name] == 1}

    def values_for(file: str) -> dict[str, str]:
        v = dict(unique)
        v.update({name: value for (f, name), value in own.items() if f == file})
        return v

    cache: dict[str, dict[str, str]] = {}
    return [k for k in knobs
            if runtime.holds(k.when, cache.setdefault(k.file, values_for(k.file)), facts)]


def values_of(knobs: list[Knob]) -> dict[str, str]:
    """Returns {name: value} for names that one knob of the program holds (companion rules)."""
    counts = collections.Counter(k.name for k in knobs)
    return {k.name: k.value for k in knobs if counts[k.name] == 1}


def space_size(source: str) -> int:
    """Returns the number of knob settings a program allows."""
    n = 1
    for k in find_knobs(source):
        n *= max(1, len(k.choices))
    return n
