"""Writes BENCHMARKS.md's tables from measured results.

    python -m benchmarks.make_page collect RESULTS_DIR... [-o benchmarks/current.json]
    python -m benchmarks.make_page page [benchmarks/current.json] [--page BENCHMARKS.md]

`collect` reads what benchmarks/gpu_session.sh left in each RESULTS_DIR (eval_<name>.json
from `evoattn eval --json`, cc_<name>.json from benchmarks.crosscheck, run.sqlite of the
default search, machine.txt) and writes one small JSON of the current results; `page`
rewrites the part of BENCHMARKS.md between the `<!-- tables -->` and `<!-- /tables -->` lines
from it. The prose around the tables is the page's own.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import label
from evoattn.contract.scoring import rescore
from evoattn.contract.types import EvalResult, Times
from evoattn.store import RunStore

MODES = ("call", "kernel", "graph")
BEGIN, END = "<!-- tables -->", "<!-- /tables -->"


def _in_modes(t: Times | None) -> dict[str, float | None]:
    t = t or Times()
    return {m: t.in_mode(m) for m in MODES} | {"host_us": t.host_us}


def summarise(result: EvalResult) -> dict[str, Any]:
    """Returns the compact form of one evaluation: per config, every mode of the candidate and
    of each baseline, and the fitness the evaluator's rule gives in each mode (scoring.rescore:
    the result's baseline policy, ratios of median times)."""
    configs = [{"config": label(result.problem, c.params), "flops_tflops": c.tflops,
                "candidate": _in_modes(c.times),
                "baselines": {n: _in_modes(t) for n, t in c.baseline_times.items()}}
               for c in result.configs]
    fitness = {m: rescore(result.configs, m, result.baseline, lambda params: 0.0)[1] or None
               for m in MODES}
    return {"candidate": result.candidate, "problem": result.problem, "device": result.device,
            "verdict": result.verdict.value, "versions": result.versions, "configs": configs,
            "fitness": fitness, "timing": result.timing,
            "reported": {"fitness": result.fitness, "ci": result.fitness_ci}}


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
            "configs": {label(result["problem"], c["params"]): c.get("speedup")
                        for c in result["configs"]}}


def run_summary(run_dir: Path) -> dict[str, Any]:
    """Returns the default search's evaluations: how many, its seed and its best (the first of
    the fittest), read through the run store."""
    store = RunStore.open_readonly(run_dir)
    try:
        judged = sorted((j for j in store.judgements() if j.result), key=lambda j: j.iteration)
    finally:
        store.close()
    best = max(judged, key=lambda j: j.result.fitness)
    return {"evaluations": len(judged), "seed": summarise(judged[0].result),
            "best_iteration": best.iteration, "best": summarise(best.result)}


def collect(dirs: list[Path]) -> dict[str, Any]:
    out: dict[str, Any] = {"evals": {}, "crosschecks": {}, "machine": ""}
    for d in dirs:
        if (d / "machine.txt").is_file():
            out["machine"] = (d / "machine.txt").read_text().strip()
        for f in sorted(d.glob("eval_*.json")):
            out["evals"][f.stem[5:]] = summarise(EvalResult.from_json(json.loads(f.read_text())))
        for f in sorted(d.glob("cc_*.json")):
            out["crosschecks"][f.stem[3:]] = crosscheck_summary(json.loads(f.read_text()))
        if (d / "run.sqlite").is_file():
            out["run"] = run_summary(d)
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
