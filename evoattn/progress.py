"""Progress of a run: a rich live view, plain log lines (--quiet), and the JSON-lines event log."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from .report import label
from .search import Progress, first_line


class EventLog:
    """Appends one JSON object per event to RUN_DIR/events.jsonl (flushed each line)."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", encoding="utf-8")

    def write(self, event: str, **fields: Any) -> None:
        rec = {"t": round(time.time(), 3), "event": event, **fields}
        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()

    def progress(self, p: Progress) -> None:
        self.write("iteration", iteration=p.iteration, note=p.last_note,
                   best_id=p.best.id if p.best else None,
                   best_fitness=p.best.fitness if p.best else None, counts=p.counts,
                   flags=p.flags, rejected=p.rejected, cached=p.cached, llm=p.llm)

    def close(self) -> None:
        self._f.close()


def _fitness(program: Any) -> str:
    """Returns '0.9420 ± 0.0040' (the 95% interval's half-width), or the fitness alone."""
    if program is None:
        return "-"
    ci = program.result.fitness_ci if program.result else None
    half = max(ci[1] - program.fitness, program.fitness - ci[0]) if ci else None
    return f"{program.fitness:.4f}" + (f" ± {half:.4f}" if half is not None else "")


def render(p: Progress, device: str) -> Group:
    """Returns the live view: the headline numbers and the best's per-config speedups."""
    head = Table.grid(padding=(0, 2))
    rate = p.evaluated / (p.elapsed_s / 60) if p.elapsed_s > 0 else 0.0
    best = p.best
    head.add_row("iteration", f"{p.iteration}/{p.iterations}", "elapsed", f"{p.elapsed_s:.0f} s",
                 "candidates/min", f"{rate:.1f} ({'GPU' if device == 'cuda' else 'evaluator'} "
                 f"timing {100 * p.gpu_busy:.0f}%)")
    head.add_row("best fitness", _fitness(best), "seed fitness",
                 f"{p.seed_fitness:.4f}", "best id", best.id if best else "-")
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(p.counts.items()))
    head.add_row("verdicts", verdicts or "-", "flagged", str(p.flags),
                 "rejected/cached", f"{p.rejected}/{p.cached}")
    if p.llm:
        head.add_row("LLM calls", str(int(p.llm.get("calls", 0))), "tokens",
                     f"{int(p.llm.get('prompt_tokens', 0))} in / "
                     f"{int(p.llm.get('completion_tokens', 0))} out",
                     "cost", f"${p.llm.get('cost_usd', 0.0):.4f}")
    head.add_row("last", p.last_note[:110], "", "", "", "")
    parts: list[Any] = [head]
    if best and best.result and best.result.configs:
        t = Table(title=f"best vs the {best.result.baseline} baseline, {best.result.timing} time, "
                        f"on {device}" +
                  (" (CPU timings)" if best.result.timing_device == "cpu" else ""))
        t.add_column("config")
        t.add_column("ms", justify="right")
        t.add_column("baseline", justify="left")
        t.add_column("baseline ms", justify="right")
        t.add_column("speedup", justify="right")
        for c in best.result.configs:
            t.add_row(label(c.params), f"{c.ms:.4f}" if c.ms else "-", c.baseline_name or "-",
                      f"{c.baseline_ms:.4f}" if c.baseline_ms else "-",
                      f"{c.speedup:.3f}x" if c.speedup else "-")
        parts.append(t)
    return Group(*parts)


class LiveView:
    """Shows progress live (rich) or as one log line per iteration (quiet)."""

    def __init__(self, console: Console, quiet: bool, events: EventLog, device: str) -> None:
        self.console = console
        self.quiet = quiet or not console.is_terminal
        self.events = events
        self.device = device
        self.live: Live | None = None

    def __enter__(self) -> "LiveView":
        if not self.quiet:
            self.live = Live(console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, p: Progress) -> None:
        self.events.progress(p)
        if self.live is not None:
            self.live.update(render(p, self.device))
        else:
            best = _fitness(p.best)
            self.console.print(f"[{p.iteration}/{p.iterations}] best {best} | "
                               f"flagged {p.flags}{llm_line(p.llm)} | {log_note(p.last_note)}",
                               soft_wrap=True, markup=False)


def log_note(note: str) -> str:
    """Returns an iteration's note for its log line: one line, whole up to 400 characters (a
    duel's note with its change fits)."""
    return first_line(note, 400)


def llm_line(llm: dict[str, float]) -> str:
    """Returns ' | LLM n calls, x in / y out tokens, $z' ('' when no LLM is used)."""
    if not llm:
        return ""
    return (f" | LLM {int(llm.get('calls', 0))} calls, {int(llm.get('prompt_tokens', 0))} in / "
            f"{int(llm.get('completion_tokens', 0))} out tokens, ${llm.get('cost_usd', 0.0):.4f}")
