"""Write a directory of generated files in one step: a reader sees the old one or the new one.

Exports and reports are regenerated into the same directory; a crash half-way must not leave
a mix, and files the user put there must never be deleted by us. An export is a package the
user installs in place (`pip install RUN/best`), and a build leaves its own files beside ours;
those are the package's, stale once it is exported again, and go with the old export.
"""

from __future__ import annotations

import shutil
import tempfile
import re
from pathlib import Path
from typing import Callable

from .errors import RunDirError


def replace_directory(out_dir: Path, files: dict[str, str | bytes],
                      ours: Callable[[Path], set[str]], what: str, hint: str) -> None:
    """Put `files` (relative name -> content) at `out_dir`, replacing a previous output.

    `ours(out_dir)` names the entries a previous run of this writer may have left there;
    anything else means the directory is the user's, and we refuse with one line.
    """
    if out_dir.exists():
        if not out_dir.is_dir():
            raise RunDirError(f"{out_dir}: exists and is not a directory")
        allowed = ours(out_dir)
        foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in allowed)
        if foreign:
            raise RunDirError(f"{out_dir}: exists and holds files {what} did not write "
                              f"({', '.join(foreign[:3])}); {hint}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for name, content in files.items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
        tmp.chmod(0o755)                    # mkdtemp's 0700 would hide the files from others
        if out_dir.exists():
            # A directory cannot be renamed over a non-empty one: move the old output
            # aside, put the new one in place, then drop the old one.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            old.rmdir()
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# What setuptools puts under build/ (build_py's lib, bdist_wheel's staging, build_ext's temp).
_BUILD_ENTRY = re.compile(r"(lib|bdist|temp)(\..*)?")
_ARCHIVE = re.compile(r".+\.(whl|tar\.gz)")


def build_leftovers(out_dir: Path, dist: str) -> set[str]:
    """Returns the entries of out_dir that a pip build of the package `dist` there left.

    `build/` holding only setuptools' staging, `<dist>.egg-info/` and a `dist/` of wheels and
    sdists; anything else in them makes them the user's, and they are not named.
    """
    found: set[str] = set()
    for entry in out_dir.iterdir() if dist and out_dir.is_dir() else ():
        if not entry.is_dir() or entry.is_symlink():
            continue
        names = [e.name for e in entry.iterdir()]
        if (entry.name == "build" and all(_BUILD_ENTRY.fullmatch(n) for n in names)) or \
                entry.name == _normal(dist) + ".egg-info" or \
                (entry.name == "dist" and all(_ARCHIVE.fullmatch(n) for n in names)):
            found.add(entry.name)
    return found


def _normal(name: str) -> str:
    """Returns a distribution name as setuptools spells it in file names (PEP 503, with _)."""
    return re.sub(r"[-_.]+", "_", name).lower()
