"""Reading a run's database: programs, state, lineage, leaderboards, feedback, the report's
series. RunStore (store.py) inherits these; they never write."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3
from pathlib import Path
from typing import Any, Iterator

from evoattn.contract.types import EvalResult

from .errors import UsageError
from .types import Attempt, LlmUsage, Program


@dataclasses.dataclass(frozen=True)
class Judgement:
    """A stored program's change line, iteration and result, without its source (what
    report.crowned_changes reads of every program)."""

    change: str
    iteration: int
    result: EvalResult | None


_PROGRAM_COLUMNS = ("id, source, suffix, parent_id, second_parent_id, iteration, island, "
                    "mutator, change, result_json")


@dataclasses.dataclass(frozen=True)
class LlmTotals:
    """Sums over a run's LLM calls."""

    calls: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    latency_s: float


@dataclasses.dataclass(frozen=True)
class StoredRejection:
    """A proposal that was not evaluated (refused by its mutator, or a duplicate)."""

    iteration: int
    parent_id: str | None
    mutator: str
    reason: str
    created_at: str                     # ISO 8601, UTC


@dataclasses.dataclass(frozen=True)
class StoredLlmCall:
    """One recorded LLM call."""

    iteration: int
    usage: LlmUsage
    created_at: str                     # ISO 8601, UTC


def rng_state_from_json(data: list[Any]) -> tuple[Any, ...]:
    """Returns the tuple random.Random.setstate() takes from its JSON form."""
    version, internal, gauss_next = data
    return (version, tuple(internal), gauss_next)


class RunReads:
    """The read-only queries of a run database (`self._conn`, `self.run_dir`)."""

    _conn: sqlite3.Connection
    run_dir: Path

    def _columns(self, table: str) -> set[str]:
        return {row[1] for row in self._conn.execute(f"PRAGMA table_info({table})")}

    def load_programs(self) -> dict[str, Program]:
        """Returns every stored program by id, in the order they were stored."""
        rows = self._conn.execute(f"SELECT {_PROGRAM_COLUMNS} FROM programs ORDER BY rowid")
        return {row[0]: _program(row) for row in rows}

    def judgements(self) -> list[Judgement]:
        """Returns every stored program's change, iteration and result (not its source)."""
        rows = self._conn.execute("SELECT change, iteration, result_json FROM programs "
                                  "ORDER BY rowid")
        return [Judgement(change, iteration,
                          EvalResult.from_json(json.loads(rj)) if rj else None)
                for change, iteration, rj in rows]

    def get_program(self, program_id: str) -> Program | None:
        """Returns one stored program, or None."""
        row = self._conn.execute(f"SELECT {_PROGRAM_COLUMNS} FROM programs WHERE id = ?",
                                 (program_id,)).fetchone()
        return _program(row) if row else None

    def has_program(self, program_id: str) -> bool:
        """Returns whether a program with this id is stored."""
        return self._conn.execute("SELECT 1 FROM programs WHERE id = ?",
                                  (program_id,)).fetchone() is not None

    def load_state(self) -> dict[str, Any] | None:
        """Returns {iteration, rng_state, population, stop_reason, elapsed_s} (elapsed_s: the
        run's wall time over every session), or None before iteration 0."""
        values = {k: json.loads(v) for k, v in self._conn.execute("SELECT key, value FROM state")}
        if "iteration" not in values:
            return None
        return {"iteration": values["iteration"],
                "rng_state": rng_state_from_json(values["rng_state"]),
                "population": values["population"],
                "stop_reason": values.get("stop_reason"),
                "elapsed_s": values.get("elapsed_s", 0.0)}

    def side_by_side(self, best_id: str) -> tuple[str, EvalResult] | None:
        """Returns (the seed's id, the duel) of the last end-of-run re-measurement of this best
        beside the seed, or None when the run holds none for it."""
        row = self._conn.execute(
            "SELECT value FROM state WHERE key = 'side_by_side'").fetchone()
        if row is None:
            return None
        value = json.loads(row[0])
        if value.get("best") != best_id:
            return None
        return value["seed"], EvalResult.from_json(value["result"])

    def pruned(self, best_id: str) -> dict[str, Any] | None:
        """Returns the run's last end-of-run setting back of changes ({before, best, steps,
        complete}: store.record_pruned) when it ended with this best, else None."""
        row = self._conn.execute("SELECT value FROM state WHERE key = 'pruned'").fetchone()
        record = json.loads(row[0]) if row else None
        return record if record and record.get("best") == best_id else None

    def set_back(self, best_id: str) -> dict[str, Any] | None:
        """Returns pruned(best_id) where it holds a step (a change tried), else None: what the
        export and the report show."""
        record = self.pruned(best_id)
        return record if record and record["steps"] else None

    def committed_iteration(self) -> int:
        """Returns the last iteration committed (-1 before the seed's)."""
        row = self._conn.execute("SELECT value FROM state WHERE key = 'iteration'").fetchone()
        return int(json.loads(row[0])) if row else -1

    def recent_attempts(self, parent_id: str, limit: int) -> list[Attempt]:
        """Returns the latest children and rejected proposals of a parent, oldest first
        (outcome: the child's verdict, or "rejected"; reason: its verdict reason or why)."""
        change = "change" if "change" in self._columns("rejections") else "''"
        rows = self._conn.execute(
            "SELECT iteration, mutator, COALESCE(verdict, 'unevaluated'), fitness, change, "
            "COALESCE(json_extract(result_json, '$.reason'), '') FROM programs "
            "WHERE parent_id = ? UNION ALL "
            f"SELECT iteration, mutator, 'rejected', NULL, {change}, reason FROM rejections "
            "WHERE parent_id = ? ORDER BY 1 DESC, 3 LIMIT ?", (parent_id, parent_id, limit))
        return [Attempt(it, mut, outcome, reason, chg, fit)
                for it, mut, outcome, fit, chg, reason in reversed(rows.fetchall())]

    def recent_changes(self, mutator: str, limit: int) -> list[str]:
        """Returns the changes a mutator proposed in the run's latest iterations (evaluated or
        not), newest first."""
        change = "change" if "change" in self._columns("rejections") else "''"
        rows = self._conn.execute(
            "SELECT iteration, change FROM programs WHERE mutator = ? UNION ALL "
            f"SELECT iteration, {change} FROM rejections WHERE mutator = ? "
            "ORDER BY 1 DESC LIMIT ?", (mutator, mutator, limit))
        return [c for _, c in rows.fetchall() if c]

    def recent_gains(self, mutator: str, limit: int) -> list[str]:
        """Returns the changes of a mutator's latest correct children that beat their parent
        beyond the child's noise (the low end of its fitness interval above the parent's
        fitness; without an interval, the fitness above it), newest first."""
        rows = self._conn.execute(
            "SELECT c.change, c.fitness, json_extract(c.result_json, '$.fitness_ci[0]'), "
            "p.fitness FROM programs c JOIN programs p ON p.id = c.parent_id "
            "WHERE c.mutator = ? AND c.verdict = 'pass' AND c.fitness IS NOT NULL "
            "AND p.fitness IS NOT NULL ORDER BY c.iteration DESC LIMIT ?", (mutator, limit))
        return [change for change, fit, low, parent in rows.fetchall()
                if change and (fit if low is None else low) > parent]

    def stored_config(self) -> dict[str, Any]:
        """Returns the config dict the run was created with."""
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
        return json.loads(row[0])

    def meta(self) -> dict[str, str]:
        """Returns the meta table (schema version, created_at, config, problem, seed)."""
        return dict(self._conn.execute("SELECT key, value FROM meta"))

    def counts_by_verdict(self) -> dict[str, int]:
        """Returns how many stored programs got each verdict ("unevaluated" for none)."""
        rows = self._conn.execute(
            "SELECT COALESCE(verdict, 'unevaluated'), COUNT(*) FROM programs GROUP BY 1")
        return dict(rows)

    def rejection_count(self, reason_prefix: str = "") -> int:
        """Returns how many proposals were not evaluated (those whose reason starts so)."""
        return self._conn.execute(
            "SELECT COUNT(*) FROM rejections WHERE substr(reason, 1, ?) = ?",
            (len(reason_prefix), reason_prefix)).fetchone()[0]

    def llm_totals(self) -> LlmTotals:
        """Returns the sums over every recorded LLM call."""
        row = self._conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0),"
            " COALESCE(SUM(cost_usd), 0.0), COALESCE(SUM(latency_s), 0.0) FROM llm_calls"
        ).fetchone()
        return LlmTotals(row[0], row[1], row[2], float(row[3]), float(row[4]))

    def lineage(self, program_id: str) -> list[Program]:
        """Returns the chain of first parents from the seed to the program, seed first."""
        chain: list[Program] = []
        seen: set[str] = set()
        pid: str | None = program_id
        while pid is not None and pid not in seen:
            p = self.get_program(pid)
            if p is None:
                if not chain:
                    raise UsageError(f"{self.run_dir}: no program with id {program_id}")
                break                    # parent not stored (e.g. pruned): the chain starts here
            seen.add(pid)
            chain.append(p)
            pid = p.parent_id
        return chain[::-1]

    def champion(self) -> Program | None:
        """Returns the run's best: the champion of its last committed population (the program
        last crowned by a champion challenge, the seed until one is), or, for a run stored
        before champions were kept, the correct program of highest fitness. A child whose one
        plain evaluation read above the champion but was never confirmed beside it is not the
        best, however high its stored fitness."""
        row = self._conn.execute("SELECT value FROM state WHERE key = 'population'").fetchone()
        snapshot = json.loads(row[0]) if row else {}
        if isinstance(snapshot, dict) and "champion" in snapshot:
            champ = self.get_program(snapshot["champion"]) if snapshot["champion"] else None
            if champ is not None and champ.correct:
                return champ
        board = self.leaderboard(1)
        return board[0] if board else None

    def rank(self, program: Program) -> int:
        """Returns a correct program's place in the leaderboard's order (1: the first)."""
        row = self._conn.execute(
            "SELECT COUNT(*) FROM programs WHERE verdict = 'pass' AND "
            "(fitness > ? OR (fitness = ? AND id < ?))",
            (program.fitness, program.fitness, program.id)).fetchone()
        return int(row[0]) + 1

    def leaderboard(self, k: int) -> list[Program]:
        """Returns the k correct programs of highest fitness (ties broken by id)."""
        rows = self._conn.execute(
            f"SELECT {_PROGRAM_COLUMNS} FROM programs WHERE verdict = 'pass' "
            "ORDER BY fitness DESC, id ASC LIMIT ?", (k,))
        return [_program(row) for row in rows]

    # ---- reading the run over time (the HTML report) -------------------------------
    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """Holds one read transaction: every read inside sees the same committed iteration."""
        self._conn.execute("BEGIN")
        try:
            yield
        finally:
            self._conn.execute("COMMIT")   # a read transaction: ends it, writes nothing

    def program_times(self) -> dict[str, str]:
        """Returns when each program was stored (ISO 8601, UTC), by id."""
        return dict(self._conn.execute("SELECT id, created_at FROM programs"))

    def rejections(self) -> list[StoredRejection]:
        """Returns every proposal that was not evaluated, in the order they were stored."""
        rows = self._conn.execute("SELECT iteration, parent_id, mutator, reason, created_at "
                                  "FROM rejections ORDER BY rowid")
        return [StoredRejection(*row) for row in rows]

    def llm_calls(self) -> list[StoredLlmCall]:
        """Returns every recorded LLM call, in the order they were stored."""
        rows = self._conn.execute(
            "SELECT iteration, model, prompt_tokens, completion_tokens, cost_usd, latency_s, "
            "attempts, status, created_at FROM llm_calls ORDER BY rowid")
        return [StoredLlmCall(it, LlmUsage(model, pt, ct, cost, lat, att, status), at)
                for it, model, pt, ct, cost, lat, att, status, at in rows]


def _program(row: tuple[Any, ...]) -> Program:
    (pid, source, suffix, parent_id, second_parent_id, iteration, island, mutator, change,
     result_json) = row
    result = EvalResult.from_json(json.loads(result_json)) if result_json else None
    return Program(id=pid, source=source, suffix=suffix, parent_id=parent_id,
                   iteration=iteration, island=island, mutator=mutator, change=change,
                   result=result, second_parent_id=second_parent_id)
