"""Rich renderings of results: the eval table, the closing block, baselines, problems."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from evaluator.types import EvalResult, Verdict


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None or isinstance(x, str) else format(x, fmt)


def label(params: dict[str, Any]) -> str:
    """Returns a short label for a config's params."""
    if {"B", "H", "S", "D"} <= params.keys():
        c = " causal" if params.get("causal") else ""
        rest = "".join(f" {k}={v}" for k, v in params.items()
                       if k not in ("B", "H", "S", "D", "causal"))
        return f"({params['B']},{params['H']},{params['S']},{params['D']}){c}{rest}"
    return ",".join(f"{k}={v}" for k, v in params.items())


def eval_table(result: EvalResult) -> Table:
    """Returns the per-config table of one evaluation."""
    cpu = result.timing_device == "cpu"
    t = Table(title=f"{result.candidate} on {result.device}, baseline: {result.baseline}"
                    + (" — CPU timings (Triton interpreter), not GPU performance" if cpu else ""))
    for col in ("config", "dtype", "verdict", "max err", "tol", "ms", "baseline ms", "TFLOP/s",
                "baseline TFLOP/s", "speedup", "% peak", "mem MB", "baseline mem MB"):
        t.add_column(col, justify="left" if col in ("config", "verdict", "dtype") else "right")
    for c in result.configs:
        style = "green" if c.verdict is Verdict.PASS else "red"
        t.add_row(label(c.params), c.dtype, f"[{style}]{c.verdict.value}[/{style}]",
                  _f(c.max_abs_err, ".2e"), _f(c.tolerance, ".2e"), _f(c.ms, ".4f"),
                  _f(c.baseline_ms, ".4f"), _f(c.tflops, ".1f"), _f(c.baseline_tflops, ".1f"),
                  _f(c.speedup, ".3f") + ("x" if c.speedup else ""),
                  _f(c.frac_peak * 100 if c.frac_peak else None, ".1f"),
                  _f(c.peak_mem_bytes / 2**20 if c.peak_mem_bytes is not None else None, ".1f"),
                  _f(c.baseline_peak_mem_bytes / 2**20
                     if c.baseline_peak_mem_bytes is not None else None, ".1f"))
    return t


def extra_backends_table(result: EvalResult) -> Table | None:
    """Returns a table of every SDPA backend's time per config, if they were timed."""
    names = sorted({n for c in result.configs for n in c.extra_baselines_ms})
    if not names:
        return None
    t = Table(title="every backend (ms; speedup of the candidate over it)")
    t.add_column("config")
    t.add_column("candidate", justify="right")
    for n in names:
        t.add_column(n, justify="right")
    for c in result.configs:
        cells = []
        for n in names:
            ms = c.extra_baselines_ms.get(n)
            cells.append("-" if ms is None or not c.ms else f"{ms:.4f} ({ms / c.ms:.2f}x)")
        t.add_row(label(c.params), _f(c.ms, ".4f"), *cells)
    return t


def cost_summary(results: list[EvalResult]) -> str:
    """Returns one line on what the evaluations cost: count, mean seconds, the main stages."""
    timed = [r for r in results if r.stage_s]
    if not timed:
        return ""
    mean = sum(r.duration_s for r in timed) / len(timed)
    stages: dict[str, float] = {}
    for r in timed:
        for name, sec in r.stage_s.items():
            stages[name] = stages.get(name, 0.0) + sec / len(timed)
    top = sorted(stages.items(), key=lambda kv: -kv[1])[:4]
    return (f"evaluations: {len(timed)}, {mean:.1f} s each on average ("
            + ", ".join(f"{name} {sec:.1f}" for name, sec in top) + ")")


def print_eval(console: Console, result: EvalResult) -> None:
    """Prints the table and the closing block (Correctness / Speedup / Score)."""
    if result.configs:
        console.print(eval_table(result))
        extra = extra_backends_table(result)
        if extra is not None:
            console.print(extra)
    if result.build_cached is not None:
        console.print(f"build: {'cached (skipped)' if result.build_cached else 'built'}"
                      + (f" in {result.build_seconds:.1f} s" if result.build_seconds else ""))
    if result.stage_s:
        console.print(f"time: {result.duration_s:.1f} s (" + ", ".join(
            f"{k} {v:.1f}" for k, v in result.stage_s.items()) + ")")
    for flag in result.flags:
        console.print(f"[yellow]flag[/yellow]: {flag}")
    ok = result.correct
    console.print(f"Correctness: {'[green]PASS[/green]' if ok else '[red]FAIL[/red]'}"
                  + ("" if ok else f" ({result.verdict.value}: {result.reason})"))
    timed = [c.speedup for c in result.configs if c.speedup]
    if ok and timed:
        unit = " (CPU timing)" if result.timing_device == "cpu" else ""
        console.print(f"Speedup: {result.fitness:.2f}x vs {result.baseline} (geometric mean over "
                      f"{len(timed)} configs){unit}")
    console.print(f"Score: {result.fitness:.4f}")


def baseline_table(rows: list[dict[str, Any]], device: str) -> Table:
    """Returns the table of every PyTorch implementation per config."""
    names = sorted({n for r in rows for n in r["ms"]} - {"default"})
    t = Table(title=f"PyTorch baselines on {device} (TFLOP/s; speedup vs SDPA default)")
    t.add_column("config")
    t.add_column("default", justify="right")
    for n in names:
        t.add_column(n, justify="right")
    for r in rows:
        d = r["ms"].get("default")
        cells = []
        for n in names:
            ms = r["ms"].get(n)
            cells.append("n/a" if ms is None else
                         f"{r['flops'] / ms / 1e9:.1f} ({d / ms:.2f}x)" if d else f"{ms:.3f} ms")
        t.add_row(label(r["cfg"]), "n/a" if d is None else f"{r['flops'] / d / 1e9:.1f}", *cells)
    return t
