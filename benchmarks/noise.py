"""How much a fitness moves when nothing changes: one program evaluated again and again.

    python -m benchmarks.noise SEED.py --standalone 5 --in-run 5 --out noise.json [--config C]
                               [--no-pin-cpu]

standalone  `evoattn eval SEED.py --json` in a fresh process each time
in-run      the same program evaluated as a run's candidates are (the run's evaluation slots,
            `per_gpu` of them sharing each GPU in turns, its plain candidates' protocol, the
            zygote): the first alone, as a run's seed, then N - 1 submitted at once

Prints, per config and timing mode, each way's speedups and their spread (max / min - 1),
the geometric-mean fitness of each evaluation, and the in-run mean against the stand-alone
mean. --no-pin-cpu: both ways time on whatever CPU the scheduler gives (evaluator.pin_cpu
false). GPU only (on the CPU the figures are the interpreter's).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, label
from evoattn.contract.types import geometric_mean

MODES = ("call", "kernel", "graph")


def standalone(seed: Path, n: int, extra: list[str]) -> list[dict]:
    out = []
    for i in range(n):
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "r.json"
            subprocess.run([sys.executable, "-m", "evoattn.cli", "eval", str(seed), "--json",
                            str(path), *extra], cwd=ROOT, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if path.is_file():
                out.append(json.loads(path.read_text()))
        print(f"stand-alone {i + 1}/{n}: "
              f"{out[-1]['fitness'] if out else 'failed'}", flush=True)
    return out


def in_run(seed: Path, n: int, config: str, pin_cpu: bool = True) -> list[dict]:
    import dataclasses

    from evoattn.contract import program
    from evoattn import runner
    from evoattn.pool import make_evaluator
    with tempfile.TemporaryDirectory() as d:
        plan = runner.plan_run(config, None, d, None, None, None, None)
    request = plan.request if pin_cpu else dataclasses.replace(plan.request, pin_cpu=False)
    pool = make_evaluator(plan.cfg, request, ())
    source = program.read(seed)
    out = []
    try:
        first = pool.submit(source, seed.suffix, "seed").result()
        pool.calibrate(first)
        out.append(first.to_json())
        # All at once, as a run keeps its slots busy: slots sharing a GPU take turns on it.
        futures = [pool.submit(source, seed.suffix, f"again {i}") for i in range(n - 1)]
        for i, fut in enumerate(futures):
            out.append(fut.result().to_json())
            print(f"in-run {i + 2}/{n}: {out[-1]['fitness']}", flush=True)
    finally:
        pool.close()
    return out


def speedups(result: dict, mode: str) -> dict[str, float]:
    """Returns config label -> speedup in `mode` over the fitness baseline of the result."""
    from evoattn.contract.scoring import pick_baseline
    from evoattn.contract.types import Times
    out = {}
    for c in result["configs"]:
        base = {n: Times.from_json(t) for n, t in (c.get("baseline_times") or {}).items()}
        _, base_ms = pick_baseline(result.get("baseline", "best"), base, mode)
        ms = c.get(f"{mode}_ms")
        if base_ms and ms:
            out[label(result["problem"], c["params"])] = base_ms / ms
    return out


def spread(v: list[float]) -> float:
    return max(v) / min(v) - 1 if v else float("nan")


def _raw(result: dict) -> dict:
    """One evaluation's times per config (candidate and baselines: call, kernel, host µs,
    call mode's issue µs, rounds) and its timing CPU: what to look at when one evaluation
    stands out."""
    def times(t: dict) -> dict:
        return {k: t.get(k) for k in ("call_ms", "kernel_ms", "host_us", "issue_us", "rounds")}
    info = result.get("device_info") or {}
    return {"timing_cpu": info.get("timing_cpu"), "cpu_speed_spread": info.get("cpu_speed_spread"),
            "cpu_probe_us": info.get("cpu_probe_us"),
            "configs": {label(result["problem"], c["params"]):
                        {"candidate": times(c.get("times") or {}),
                         **{n: times(t) for n, t in (c.get("baseline_times") or {}).items()}}
                        for c in result.get("configs") or []}}


def summarise(name: str, results: list[dict]) -> dict:
    table: dict = {"evaluations": len(results), "modes": {},
                   "timing_cpus": [(r.get("device_info") or {}).get("timing_cpu")
                                   for r in results],
                   "time_stage_s": [(r.get("stage_s") or {}).get("time") for r in results],
                   "call_rounds_redone": [(r.get("device_info") or {}).get("call_rounds_redone", 0)
                                          for r in results]}
    table["raw"] = [_raw(r) for r in results]
    table["configs_remeasured"] = [(r.get("device_info") or {}).get("configs_remeasured", {})
                                   for r in results]
    print(f"{name:11} call rounds measured again (the host was busy): "
          f"{table['call_rounds_redone']}; configs measured again (a disturbance, or "
          f"their CPU slowed): "
          f"{[len(c) for c in table['configs_remeasured']]}")
    for mode in MODES:
        per = [speedups(r, mode) for r in results]
        labels = sorted(set().union(*per)) if per else []
        rows = {lab: [p[lab] for p in per if lab in p] for lab in labels}
        fits = [geometric_mean(list(p.values())) for p in per if p]
        table["modes"][mode] = {"fitness": fits, "fitness_spread": spread(fits),
                                "configs": {lab: {"speedups": v, "spread": spread(v)}
                                            for lab, v in rows.items()}}
        worst = max(rows.items(), key=lambda kv: spread(kv[1])) if rows else ("-", [1])
        print(f"{name:11} {mode:6} fitness {' '.join(f'{f:.4f}' for f in fits)}  spread "
              f"{spread(fits):.2%}; worst config {worst[0]} {spread(worst[1]):.2%}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("seed")
    ap.add_argument("--standalone", type=int, default=5)
    ap.add_argument("--in-run", type=int, default=5)
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--out", default="")
    ap.add_argument("--no-pin-cpu", action="store_true")
    args = ap.parse_args()
    seed = Path(args.seed).resolve()
    out = {}
    if args.standalone:
        out["standalone"] = summarise("stand-alone", standalone(
            seed, args.standalone, ["--no-pin-cpu"] if args.no_pin_cpu else []))
    if args.in_run:
        out["in_run"] = summarise("in-run", in_run(seed, args.in_run, args.config,
                                                   not args.no_pin_cpu))
    if args.standalone and args.in_run:
        for mode in MODES:
            a = out["standalone"]["modes"][mode]["fitness"]
            b = out["in_run"]["modes"][mode]["fitness"]
            if a and b:
                rel = (sum(b) / len(b)) / (sum(a) / len(a)) - 1
                out.setdefault("in_run_vs_standalone", {})[mode] = rel
                print(f"in-run mean vs stand-alone mean, {mode}: {rel:+.2%}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
