"""The run's SQLite database, RUN_DIR/run.sqlite: programs, rejections, LLM calls, state.

Every iteration is written by `commit_iteration` in ONE transaction: the new
program (or the rejection), the LLM call and the search state (iteration, RNG,
population). A `kill -9` at any instant therefore leaves the database at the
previous iteration or the next, never between, and resume continues from it.

Durability: WAL with synchronous=FULL. NORMAL would keep the database
consistent too, but a power loss could drop the last commits, i.e. LLM calls
already paid for; FULL costs one fsync per iteration, nothing next to an
iteration's seconds of LLM and GPU time.

One process writes a run at a time: `open` holds an exclusive `flock` on
RUN_DIR/.lock until `close` (the kernel drops it if the process dies).
Readers (`open_readonly`: export, report) take no lock; WAL lets them read
while a run is writing.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable

from evoattn.contract.types import EvalResult

from .config import ENV_NAME
from .errors import RunDirError
from .store_reads import RunReads
from .types import LlmUsage, Program

SCHEMA_VERSION = 1
DB_NAME = "run.sqlite"
LOCK_NAME = ".lock"

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE programs (
    id TEXT PRIMARY KEY, source TEXT NOT NULL, suffix TEXT NOT NULL,
    parent_id TEXT, second_parent_id TEXT, iteration INTEGER NOT NULL,
    island INTEGER NOT NULL, mutator TEXT NOT NULL, change TEXT NOT NULL,
    verdict TEXT, fitness REAL, result_json TEXT, created_at TEXT NOT NULL);
CREATE INDEX programs_verdict_fitness ON programs (verdict, fitness);
CREATE TABLE rejections (
    iteration INTEGER NOT NULL, parent_id TEXT, mutator TEXT NOT NULL,
    reason TEXT NOT NULL, created_at TEXT NOT NULL, change TEXT NOT NULL DEFAULT '');
CREATE TABLE llm_calls (
    iteration INTEGER NOT NULL, model TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL, cost_usd REAL NOT NULL, latency_s REAL NOT NULL,
    attempts INTEGER NOT NULL, status TEXT NOT NULL, created_at TEXT NOT NULL);
CREATE TABLE state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

# Config keys that could hold a credential; their values must be env var NAMES.
_SECRET_KEY = re.compile(r"(api[_-]?key|token|secret|password|passwd|credential)", re.I)


def scrub_secrets(obj: Any) -> Any:
    """Returns a copy of a config dict without values that look like credentials."""
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if (_SECRET_KEY.search(str(key)) and isinstance(value, str)
                    and not ENV_NAME.match(value)):
                continue                # a literal key, not the name of an env var: drop it
            out[key] = scrub_secrets(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [scrub_secrets(v) for v in obj]
    return obj


def rng_state_to_json(state: Any) -> list[Any]:
    """Returns random.Random.getstate() as nested lists (JSON-safe)."""
    version, internal, gauss_next = state
    return [version, list(internal), gauss_next]


class RunStore(RunReads):
    """One run directory's database; the search loop is its only writer."""

    def __init__(self, run_dir: Path, conn: sqlite3.Connection, lock_fd: int | None,
                 clock: Callable[[], float]) -> None:
        self.run_dir = run_dir
        self._conn = conn
        self._lock_fd = lock_fd
        self._clock = clock

    # ---- opening -----------------------------------------------------------
    @classmethod
    def open(cls, run_dir: str | Path, config_dict: dict[str, Any] | None, create: bool,
             clock: Callable[[], float] = time.time) -> "RunStore":
        """Returns the locked store of a new (create=True) or existing run directory."""
        run_dir = Path(run_dir)
        db = run_dir / DB_NAME
        if create:
            if config_dict is None:
                raise ValueError("a new run needs its config")
            run_dir.mkdir(parents=True, exist_ok=True)
        elif not db.is_file():
            raise RunDirError(f"{run_dir}: not a run directory (no {DB_NAME})")
        lock_fd = _lock(run_dir)
        try:
            if create and _holds_run(db):
                raise RunDirError(f"{run_dir}: already holds a run; resume it or choose "
                                  "another output directory")
            store = cls(run_dir, _connect(db, readonly=False), lock_fd, clock)
        except BaseException:
            os.close(lock_fd)
            raise
        try:
            if create:
                store._create(config_dict or {})
            else:
                store._check_schema()
                store._add_rejection_change()
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def open_readonly(cls, run_dir: str | Path) -> "RunStore":
        """Returns a read-only store (no lock: a running search may keep writing)."""
        run_dir = Path(run_dir)
        db = run_dir / DB_NAME
        if not db.is_file():
            raise RunDirError(f"{run_dir}: not a run directory (no {DB_NAME})")
        store = cls(run_dir, _connect(db, readonly=True), None, time.time)
        try:
            store._check_schema()
        except BaseException:
            store.close()
            raise
        return store

    def _create(self, config_dict: dict[str, Any]) -> None:
        config = scrub_secrets(config_dict)
        meta = {"schema_version": str(SCHEMA_VERSION), "created_at": self._now(),
                "config": json.dumps(config, sort_keys=True),
                "problem": str(config.get("problem", "")), "seed": str(config.get("seed", ""))}
        with self._transaction() as c:   # DDL is transactional in SQLite: all or nothing
            for statement in filter(str.strip, _SCHEMA.split(";")):
                c.execute(statement)
            c.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", meta.items())

    def _check_schema(self) -> None:
        try:
            row = self._conn.execute(
                "SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        except sqlite3.DatabaseError as e:
            raise RunDirError(f"{self.run_dir}: {DB_NAME} is not a run database ({e})") from None
        if row is None or row[0] != str(SCHEMA_VERSION):
            found = row[0] if row else "none"
            raise RunDirError(f"{self.run_dir}: run database schema version {found}, "
                              f"this evoattn reads version {SCHEMA_VERSION}")

    def _add_rejection_change(self) -> None:
        # Runs created before rejections kept the change they proposed gain the column.
        if "change" not in self._columns("rejections"):
            with self._transaction() as c:
                c.execute("ALTER TABLE rejections ADD COLUMN change TEXT NOT NULL DEFAULT ''")

    def close(self) -> None:
        """Closes the database and releases the run directory's lock."""
        self._conn.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)     # closing the descriptor drops the flock
            self._lock_fd = None

    def __enter__(self) -> "RunStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- writing -------------------------------------------------------------
    def commit_iteration(self, *, iteration: int, program: Program | None,
                         rejection: tuple[str | None, str, str] | None,
                         llm_usage: LlmUsage | None, rng_state: Any,
                         population_snapshot: dict[str, Any], elapsed_s: float = 0.0,
                         rejection_change: str = "") -> None:
        """Writes one iteration's program/rejection (with the change it proposed), LLM call and
        search state atomically."""
        now = self._now()
        with self._transaction() as c:
            if program is not None:
                self._insert_program(c, program, now)
            if rejection is not None:
                parent_id, mutator, reason = rejection
                c.execute("INSERT INTO rejections (iteration, parent_id, mutator, reason, "
                          "created_at, change) VALUES (?, ?, ?, ?, ?, ?)",
                          (iteration, parent_id, mutator, reason, now, rejection_change))
            if llm_usage is not None:
                status = llm_usage.status or ("rejected" if program is None else "ok")
                u = llm_usage
                c.execute("INSERT INTO llm_calls VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                          (iteration, u.model, u.prompt_tokens, u.completion_tokens,
                           u.cost_usd, u.latency_s, u.attempts, status, now))
            # Serialised inside the transaction: a failure here rolls back the rows above.
            state = {"iteration": iteration, "rng_state": rng_state_to_json(rng_state),
                     "population": population_snapshot, "elapsed_s": round(elapsed_s, 3)}
            c.executemany("INSERT OR REPLACE INTO state (key, value) VALUES (?, ?)",
                          [(k, json.dumps(v, allow_nan=False)) for k, v in state.items()])

    def record_stop(self, reason: str | None) -> None:
        """Records why the run stopped (None clears it when a run resumes)."""
        with self._transaction() as c:
            c.execute("INSERT OR REPLACE INTO state (key, value) VALUES ('stop_reason', ?)",
                      (json.dumps(reason),))

    def record_side_by_side(self, seed_id: str, best_id: str, result: EvalResult) -> None:
        """Records the end-of-run duel of the best (candidate) beside the seed (rival), which
        an export shows for that best."""
        value = {"seed": seed_id, "best": best_id, "result": result.to_json()}
        with self._transaction() as c:
            c.execute("INSERT OR REPLACE INTO state (key, value) VALUES ('side_by_side', ?)",
                      (json.dumps(value, allow_nan=False),))

    def record_pruned(self, before_id: str, best_id: str, steps: list[dict[str, Any]],
                      complete: bool = True) -> None:
        """Records the end-of-run setting back of changes (prune.py): the best it started from,
        the best it ended with, each step's duel (change, program, kept_back, verdict, gain,
        gain_ci), and whether every change was tried (a resumed run that adds no iterations
        holds the duels of a whole phase only once)."""
        value = {"before": before_id, "best": best_id, "steps": steps, "complete": complete}
        with self._transaction() as c:
            c.execute("INSERT OR REPLACE INTO state (key, value) VALUES ('pruned', ?)",
                      (json.dumps(value, allow_nan=False),))

    def _insert_program(self, c: sqlite3.Connection, p: Program, now: str) -> None:
        result_json = json.dumps(p.result.to_json(), allow_nan=False) if p.result else None
        verdict = p.result.verdict.value if p.result else None
        fitness = p.result.fitness if p.result else None
        try:
            c.execute("INSERT INTO programs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (p.id, p.source, p.suffix, p.parent_id, p.second_parent_id, p.iteration,
                       p.island, p.mutator, p.change, verdict, fitness, result_json, now))
        except sqlite3.IntegrityError:
            raise ValueError(f"program {p.id} is already stored (the search must skip "
                             "duplicates)") from None

    def update_config(self, config_dict: dict[str, Any]) -> None:
        """Replaces the stored config (a resumed run whose llm section changed)."""
        with self._transaction() as c:
            c.execute("UPDATE meta SET value = ? WHERE key = 'config'",
                      (json.dumps(scrub_secrets(config_dict), sort_keys=True),))

    # ---- plumbing --------------------------------------------------------------
    def _transaction(self) -> "_Transaction":
        return _Transaction(self._conn)

    def _now(self) -> str:
        return datetime.datetime.fromtimestamp(self._clock(), datetime.timezone.utc).isoformat(
            timespec="milliseconds")


class _Transaction:
    """BEGIN IMMEDIATE … COMMIT, or ROLLBACK if the body raises."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self._conn.execute("BEGIN IMMEDIATE")
        return self._conn

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            try:
                self._conn.execute("COMMIT")
                return
            except BaseException:
                # A failed COMMIT (disk full, I/O error) leaves the transaction open.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")


def _connect(db: Path, readonly: bool) -> sqlite3.Connection:
    try:
        return _connect_unchecked(db, readonly)
    except sqlite3.DatabaseError as e:
        raise RunDirError(f"{db}: cannot open the run database ({e})") from None


def _connect_unchecked(db: Path, readonly: bool) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None)
    else:
        # isolation_level=None: no implicit transactions; _Transaction draws every boundary.
        conn = sqlite3.connect(db, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


def _holds_run(db: Path) -> bool:
    # A database without a meta table is what a crash during creation leaves: reusable.
    if not db.exists():
        return False
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone() is not None
    except sqlite3.DatabaseError as e:
        raise RunDirError(f"{db}: exists and is not a run database ({e})") from None
    finally:
        conn.close()


def _lock(run_dir: Path) -> int:
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirError(f"{run_dir}: run directory is in use by another evoattn process") \
            from None
    return fd
