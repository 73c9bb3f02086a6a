"""Writes BENCHMARKS.md's tables from measured results.

    python -m benchmarks.make_page collect RESULTS_DIR... [-o benchmarks/current.json]
    python -m benchmarks.make_page page [benchmarks/current.json] [--page BENCHMARKS.md]

`collect` reads what benchmarks/gpu_session.sh left in each RESULTS_DIR (eval_<name>.json
from `evoattn eval --json`, cc_<name>.json from benchmarks/crosscheck.py, run.sqlite of the
default search, machine.txt) and writes one small JSON of the current results; `page`
rewrites the part of BENCHMARKS.md between the `<!-- tables -->` and `<!-- /tables -->` lines
from it. The prose around the tables is the page's own.
"""
from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
from pathlib import Path
from typing import Any

MODES = ("call", "kernel", "graph")
BEGIN, END = "<!-- tables -->", "<!-- /tables -->"


def _label(c: dict[str, Any]) -> str:
    p = c["params"]
    if {"B", "H", "S", "D"} <= p.keys():
        rest = "".join(f" {k}={v}" for k, v in p.items() if k not in ("B", "H", "S", "D", "causal"))
        return f"({p['B']},{p['H']},{p['S']},{p['D']}){' causal' if p.get('causal') else ''}{rest}"
    return ",".join(f"{k}={v}" for k, v in p.items())


def _geo(xs: list[float]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Returns the compact form of one evaluation: per config, every mode of the candidate and
    of each baseline, and the fitness each mode gives against the fastest baseline."""
    configs, by_mode = [], {m: [] for m in MODES}
    for c in result["configs"]:
        base = c.get("baseline_times") or {}
        row = {"config": _label(c), "flops_tflops": c.get("tflops"),
               "candidate": {m: c.get(f"{m}_ms") for m in MODES} | {"host_us": c.get("host_us")},
               "baselines": {n: {m: t.get(f"{m}_ms") for m in MODES} | {"host_us": t.get("host_us")}
                             for n, t in base.items()}}
        for m in MODES:
            times = [t[m] for t in row["baselines"].values() if t.get(m)]
            mine = row["candidate"][m]
            by_mode[m].append(min(times) / mine if times and mine else None)
        configs.append(row)
    return {"candidate": result.get("candidate"), "problem": result.get("problem"),
            "device": result.get("device"), "verdict": result.get("verdict"),
            "versions": result.get("versions"), "configs": configs,
            "fitness": {m: _geo(v) if all(v) else None for m, v in by_mode.items()},
            "timing": result.get("timing"),
            "reported": {"fitness": result.get("fitness"), "ci": result.get("fitness_ci")}}


def _fitness(ev: dict[str, Any], mode: str) -> str:
    """The fitness in one mode: the evaluator's own, with its interval, in the mode it timed
    fitness in (the median of paired rounds' ratios); else the geometric mean of the ratios
    of median times."""
    rep = ev.get("reported") or {}
    if mode == ev.get("timing") and rep.get("fitness") and rep.get("ci"):
        lo, hi = rep["ci"]
        return f"{rep['fitness']:.3f}× [{lo:.3f}, {hi:.3f}]"
    return f"{_f(ev['fitness'][mode])}×"


def crosscheck_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Returns the compact form of one crosscheck.py result: its timer, each config's speedup
    over its fastest baseline (labelled as the evaluations' configs are), and their geometric
    mean."""
    return {"timer": result.get("timer"), "geomean": result.get("geomean"),
            "configs": {_label(c): c.get("speedup") for c in result["configs"]}}


def collect(dirs: list[Path]) -> dict[str, Any]:
    out: dict[str, Any] = {"evals": {}, "crosschecks": {}, "machine": ""}
    for d in dirs:
        if (d / "machine.txt").is_file():
            out["machine"] = (d / "machine.txt").read_text().strip()
        for f in sorted(d.glob("eval_*.json")):
            out["evals"][f.stem[5:]] = summarise(json.loads(f.read_text()))
        for f in sorted(d.glob("cc_*.json")):
            out["crosschecks"][f.stem[3:]] = crosscheck_summary(json.loads(f.read_text()))
        if (d / "run.sqlite").is_file():
            db = sqlite3.connect(d / "run.sqlite")
            rows = db.execute("SELECT iteration, fitness, result_json FROM programs "
                              "ORDER BY iteration").fetchall()
            seed = json.loads(rows[0][2])
            best = max(rows, key=lambda r: r[1] or 0)
            out["run"] = {"evaluations": len(rows), "seed": summarise(seed),
                          "best_iteration": best[0], "best": summarise(json.loads(best[2]))}
    return out


def _f(x: Any, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def table(name: str, ev: dict[str, Any], cc: dict[str, Any] | None = None) -> str:
    """One problem's table: per config, the candidate's ms in each mode, its host µs, and its
    speedup over each baseline in each mode (call / kernel / graph); with `cc` (the program's
    crosscheck), its speedup over the fastest baseline by that harness."""
    names = list(dict.fromkeys(n for c in ev["configs"] for n in c["baselines"]))
    head = ["config", "call ms", "kernel ms", "graph ms", "host µs"] + \
        [f"vs {n} (call / kernel / graph)" for n in names] + \
        ([f"vs the fastest, {cc['timer']}"] if cc else [])
    lines = [f"**{name}** — `{ev['candidate']}` ({ev['problem']}); fitness against the fastest "
             "baseline: " + ", ".join(f"{m} time {_fitness(ev, m)}" for m in MODES), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in ev["configs"]:
        me = c["candidate"]
        cells = [c["config"], _f(me["call"], ".4f"), _f(me["kernel"], ".4f"),
                 _f(me["graph"], ".4f"), _f(me["host_us"], ".0f")]
        for n in names:
            b = c["baselines"].get(n, {})
            cells.append(" / ".join(_f(b[m] / me[m] if b.get(m) and me.get(m) else None, ".2f")
                                    for m in MODES) + f" (host {_f(b.get('host_us'), '.0f')})")
        if cc:
            cells.append(_f(cc["configs"].get(c["config"]), ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary(rows: list[tuple[str, dict[str, Any]]], crosschecks: dict[str, Any]) -> str:
    """One row per evaluation: its fitness in each mode against the fastest baseline (_fitness),
    and the geometric mean of its crosscheck where there is one (same name)."""
    lines = ["| problem | program | baselines (fitness takes the fastest per config) | "
             "call time | kernel time | graph time | independent harness |",
             "|---|---|---|---|---|---|---|"]
    for name, ev in rows:
        names = ", ".join(dict.fromkeys(n for c in ev["configs"] for n in c["baselines"]))
        cc = crosschecks.get(name)
        check = f"{_f(cc['geomean'])}× ({cc['timer']})" if cc else "–"
        lines.append(f"| {name} | `{ev['candidate']}` | {names} | "
                     + " | ".join(_fitness(ev, m) for m in MODES) + f" | {check} |")
    return "\n".join(lines) + "\n"


def page(current: dict[str, Any]) -> str:
    machine = "; ".join(current["machine"].splitlines()[:3])    # GPU, versions, date
    parts = [f"Machine: {machine}\n"]
    rows = [(n, ev) for n, ev in current["evals"].items() if n != "best"]
    if "best" in current["evals"]:
        rows.insert(0, ("sdpa (the default search's best)", current["evals"]["best"]))
    if current.get("run"):
        rows.insert(0, ("sdpa (the default seed, in the search)", current["run"]["seed"]))
    crosschecks = current.get("crosschecks", {})
    parts.append(summary(rows, crosschecks))
    run = current.get("run")
    if run:
        parts.append(table("sdpa, the default search's best (re-evaluated side by side)",
                           current["evals"]["best"]) if "best" in current["evals"] else "")
        parts.append(table("sdpa, the default seed (in the search: baselines from the "
                           "slot's station)", run["seed"]))
    for name, ev in current["evals"].items():
        if name != "best":
            parts.append(table(name, ev, crosschecks.get(name)))
    return "\n".join(p for p in parts if p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("dirs", nargs="+", type=Path)
    c.add_argument("-o", type=Path, default=Path("benchmarks/current.json"))
    p = sub.add_parser("page")
    p.add_argument("current", nargs="?", type=Path, default=Path("benchmarks/current.json"))
    p.add_argument("--page", type=Path, default=Path("BENCHMARKS.md"))
    a = ap.parse_args()
    if a.cmd == "collect":
        a.o.write_text(json.dumps(collect(a.dirs), indent=1) + "\n")
        return
    text = a.page.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"{a.page}: no {BEGIN} ... {END} lines to write the tables between")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    a.page.write_text(head + BEGIN + "\n" + page(json.loads(a.current.read_text())) + END + tail)


if __name__ == "__main__":
    main()
