"""A candidate program: one file, or a main file with companion files, carried as one text.

A one-file program is that file's text. A program of several files is their texts, each
after a header line, the main file first:

    #### evoattn file: flash_hybrid.py ####
    ...the main file...
    #### evoattn file: wgmma_flash.cu ####
    ...

so the store, the mutators (knob lines and SEARCH/REPLACE edits work on the one text) and
program ids need nothing new. The main file names its companions, one per line:

    # evoattn: companion flash_triton.py
    # evoattn: companion wgmma_flash.cu when(@target=sm90)

(`//` instead of `#` in a CUDA main file). A companion's `when(...)` (evoattn/contract/runtime.py)
says where it can run: the evaluator builds a `.cu` companion of a Python main file only on
a GPU where its conditions hold, and hands the library's path to the main module before it
runs, as `EVOATTN_LIBRARIES = {"wgmma_flash.cu": "/path/lib.so"}` in its globals; anything
else (a `.py` the main file loads, a `.cuh` a `.cu` includes) is written beside the main file.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Mapping

from . import runtime

HEADER = "#### evoattn file: {name} ####"
_HEADER = re.compile(r"^#### evoattn file: (?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]*) ####$", re.M)
_COMPANION = re.compile(r"^\s*(?:#|//)\s*evoattn:\s*companion\s+(?P<name>[A-Za-z0-9_][\w.-]*)"
                        r"(?P<rest>[^\n]*)$", re.M)


class ProgramError(ValueError):
    """A program's files cannot be read or its text cannot be split (names the file)."""


@dataclasses.dataclass(frozen=True)
class Companion:
    """A file the main file declares it needs, and where it can run."""

    name: str
    when: runtime.Conditions = ()


@dataclasses.dataclass(frozen=True)
class ProgramFiles:
    """The files of a program, the main one first: ((name, text), ...)."""

    files: tuple[tuple[str, str], ...]

    @property
    def main_name(self) -> str:
        return self.files[0][0]

    @property
    def main_text(self) -> str:
        return self.files[0][1]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.files)

    def text(self, name: str) -> str:
        """Returns one file's text (KeyError if the program has no such file)."""
        return dict(self.files)[name]

    def companions(self) -> tuple[Companion, ...]:
        """Returns the companions the main file declares."""
        return declared_companions(self.main_text)


def declared_companions(main_text: str) -> tuple[Companion, ...]:
    """Returns the `evoattn: companion NAME [when(...)]` lines of a main file."""
    return tuple(Companion(m["name"], runtime.parse_conditions(m["rest"]))
                 for m in _COMPANION.finditer(main_text))


def is_bundle(source: str) -> bool:
    """Returns whether a program text holds several files."""
    return source.startswith("#### evoattn file: ")


def split(source: str, single_name: str) -> ProgramFiles:
    """Returns the files of a program text; a one-file text becomes the file `single_name`."""
    if not is_bundle(source):
        return ProgramFiles(((single_name, source),))
    heads = list(_HEADER.finditer(source))
    if not heads or heads[0].start() != 0:
        raise ProgramError("a program of several files must start with a "
                           f"'{HEADER.format(name='NAME')}' line")
    files = []
    for head, nxt in zip(heads, heads[1:] + [None]):
        body = source[head.end() + 1: nxt.start() if nxt else len(source)]
        files.append((head["name"], body))
    names = [n for n, _ in files]
    if len(set(names)) != len(names):
        raise ProgramError(f"a program names a file twice: {', '.join(names)}")
    return ProgramFiles(tuple(files))


def join(files: ProgramFiles | list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> str:
    """Returns the one text of a program (a one-file program is its file's text)."""
    items = files.files if isinstance(files, ProgramFiles) else tuple(files)
    if len(items) == 1:
        return items[0][1]
    parts = []
    for name, text in items:
        if _HEADER.search(text):
            raise ProgramError(f"{name}: holds a '#### evoattn file:' line")
        parts.append(HEADER.format(name=name) + "\n" + (text if text.endswith("\n") else text + "\n"))
    return "".join(parts)


def read(path: str | Path) -> str:
    """Returns the program text of a main file and the companions it declares (beside it)."""
    p = Path(path)
    try:
        main = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ProgramError(f"{p}: cannot read: {e}") from None
    files = [(p.name, main)]
    for comp in declared_companions(main):
        cp = p.parent / comp.name
        try:
            files.append((comp.name, cp.read_text()))
        except (OSError, UnicodeDecodeError) as e:
            raise ProgramError(f"{p}: companion {comp.name}: cannot read {cp}: {e}") from None
    return join(files)


def write(source: str, directory: str | Path, single_name: str) -> Path:
    """Writes a program's files into directory; returns the main file's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = split(source, single_name)
    for name, text in files.files:
        (d / name).write_text(text)
    return d / files.main_name


def live_names(files: ProgramFiles, facts: Mapping[str, str] | None = None,
               knob_values: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Returns the main file and the companions whose conditions hold for these facts."""
    values = knob_values or {}
    declared = {c.name: c for c in files.companions()}
    keep = [files.main_name]
    for name in files.names[1:]:
        comp = declared.get(name)
        if comp is None or runtime.holds(comp.when, values, facts):
            keep.append(name)
    return tuple(keep)


def suffix_of(source: str, single_suffix: str) -> str:
    """Returns the main file's suffix (a one-file program keeps `single_suffix`)."""
    if not is_bundle(source):
        return single_suffix
    return Path(split(source, "x").main_name).suffix
