"""Write a directory of generated files in one step: a reader sees the old one or the new one.

Exports and reports are regenerated into the same directory; a crash half-way must not leave
a mix, and files the user put there must never be deleted by us.
"""

from __future__ import annotations

import shutil
import tempfile
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
