"""Turns `evoattn eval --json` / `evoattn baseline --json` files into BENCHMARKS.md tables.

    python benchmarks/tables.py eval RESULT.json [...]     # per-config table per file
    python benchmarks/tables.py baseline BASELINE.json
    python benchmarks/tables.py stability A.json B.json    # per-config median spread
    python benchmarks/tables.py compare SEED.json BEST.json  # per-config seed vs best
    python benchmarks/tables.py summary A.json [...]       # one row per file: fitness, speedups
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from evoattn.report import label  # noqa: E402  (one config label for the tool and its tables)


def _label(c: dict) -> str:
    return label(c.get("params") or c)


def _num(x: object, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def eval_table(path: str) -> str:
    """Returns a markdown table of one evaluation."""
    d = json.loads(Path(path).read_text())
    head = (f"**{d['candidate']}** — {d['verdict']} ({d.get('reason', '')}), fitness "
            f"{d['fitness']:.3f}, {d['device']}, torch {d['versions'].get('torch')}, "
            f"triton {d['versions'].get('triton')}\n\n")
    extra = sorted({n for c in d["configs"] for n in c.get("extra_baselines_ms", {})})
    cols = ["config", "verdict", "max err / tol", "ms", "baseline ms", "TFLOP/s", "baseline TFLOP/s",
            "speedup", "mem MB (baseline)"] + [f"{n} ms" for n in extra]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in d["configs"]:
        mem = (f"{c['peak_mem_bytes'] / 2**20:.1f} ({c['baseline_peak_mem_bytes'] / 2**20:.1f})"
               if isinstance(c.get("peak_mem_bytes"), int) and
               isinstance(c.get("baseline_peak_mem_bytes"), int) else "-")
        cells = [_label(c), c["verdict"],
                 f"{_num(c.get('max_abs_err'), '.1e')} / {_num(c.get('tolerance'), '.1e')}",
                 _num(c.get("ms"), ".4f"), _num(c.get("baseline_ms"), ".4f"),
                 _num(c.get("tflops"), ".1f"), _num(c.get("baseline_tflops"), ".1f"),
                 _num(c.get("speedup"), ".3f"), mem]
        cells += [_num(c.get("extra_baselines_ms", {}).get(n), ".4f") for n in extra]
        rows.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(rows) + "\n"


def baseline_table(path: str) -> str:
    """Returns a markdown table of `evoattn baseline --json`."""
    d = json.loads(Path(path).read_text())
    names = ["default"] + sorted({n for r in d["rows"] for n in r["ms"]} - {"default"})
    rows = [f"{d['device']}, torch {d['versions'].get('torch')} (TFLOP/s)\n",
            "| config | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for r in d["rows"]:
        cells = [f"{r['flops'] / r['ms'][n] / 1e9:.1f}" if r["ms"].get(n) else "n/a"
                 for n in names]
        rows.append(f"| {_label(r['cfg'])} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def stability(a: str, b: str) -> str:
    """Returns per-config relative differences of candidate medians between two evaluations."""
    da, db = (json.loads(Path(p).read_text()) for p in (a, b))
    rows = ["| config | run 1 ms | run 2 ms | difference |", "|---|---|---|---|"]
    worst = 0.0
    for ca, cb in zip(da["configs"], db["configs"]):
        if ca.get("ms") and cb.get("ms"):
            diff = abs(ca["ms"] - cb["ms"]) / min(ca["ms"], cb["ms"])
            worst = max(worst, diff)
            rows.append(f"| {_label(ca)} | {ca['ms']:.4f} | {cb['ms']:.4f} | {diff * 100:.2f}% |")
    return "\n".join(rows) + f"\n\nlargest difference: {worst * 100:.2f}%\n"


def compare(seed: str, best: str) -> str:
    """Returns per-config seed and best times and speedups (each against the SDPA of its run)."""
    ds, db = (json.loads(Path(p).read_text()) for p in (seed, best))
    rows = ["| config | seed ms | seed speedup | best ms | best speedup | best TFLOP/s | "
            "baseline TFLOP/s (best's run) | best / seed |", "|" + "---|" * 8]
    for cs, cb in zip(ds["configs"], db["configs"]):
        gain = cs["ms"] / cb["ms"] if cs.get("ms") and cb.get("ms") else None
        rows.append(f"| {_label(cb)} | {_num(cs.get('ms'), '.4f')} | {_num(cs.get('speedup'), '.3f')}"
                    f" | {_num(cb.get('ms'), '.4f')} | {_num(cb.get('speedup'), '.3f')} | "
                    f"{_num(cb.get('tflops'), '.1f')} | {_num(cb.get('baseline_tflops'), '.1f')} | "
                    f"{_num(gain, '.2f')}× |")
    return (f"seed fitness {ds['fitness']:.3f} -> best fitness {db['fitness']:.3f}\n\n"
            + "\n".join(rows) + "\n")


def summary(files: list[str]) -> str:
    """Returns one row per evaluation: candidate, verdict, fitness, per-config speedups."""
    rows = ["| file | candidate | verdict | fitness | per-config speedups |", "|---|---|---|---|---|"]
    for f in files:
        d = json.loads(Path(f).read_text())
        sp = " / ".join(_num(c.get("speedup"), ".3f") for c in d["configs"])
        rows.append(f"| `{Path(f).name}` | {d['candidate']} | {d['verdict']} | "
                    f"{d['fitness']:.4f} | {sp} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    kind, *files = sys.argv[1:]
    if kind == "eval":
        print("\n".join(eval_table(f) for f in files))
    elif kind == "baseline":
        print(baseline_table(files[0]))
    elif kind == "stability":
        print(stability(*files))
    elif kind == "compare":
        print(compare(*files))
    elif kind == "summary":
        print(summary(files))
    else:
        sys.exit(f"unknown kind {kind!r}")
