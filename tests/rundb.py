"""Read a run's SQLite database the way an outside observer would: read-only, from its path."""
from __future__ import annotations

import sqlite3
from pathlib import Path


def query(path: Path, sql: str) -> list[tuple]:
    """Runs `sql` on a run's database; `path` is run.sqlite itself or the run directory."""
    db = path / "run.sqlite" if path.is_dir() else path
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()
