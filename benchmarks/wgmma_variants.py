#!/usr/bin/env python3
"""Knob settings of seeds/sdpa/wgmma_flash.cu side by side against SDPA (GPU only; Hopper).

    python -m benchmarks.wgmma_variants --variant seed: --variant old:OVERLAP_D128=0,TMA_STORE_MAX_S=1024
    python -m benchmarks.wgmma_variants --variant new: --variant prev:@/tmp/old.cu --head-dim 128 \\
        --do-bench 3 --json out.json

Each --variant is NAME:SETTINGS, SETTINGS a comma-separated list of KNOB=VALUE (checked as
`evoattn eval --set` checks them; empty: the seed's own values) or @FILE, another version of the
seed (for instance `git show REV:seeds/sdpa/wgmma_flash.cu > /tmp/old.cu`), optionally followed
by knob settings for it. For trusted files only. Every variant is built and checked as
benchmarks/check_bf16_cuda.py builds and checks a fast-form seed (the evaluator's build, its
inputs and tolerance rule, float16 and bfloat16, the default configs, the problem's domain
shapes and odd lengths); a failure is printed and the variant is still timed (a timing
experiment may be wrong on purpose). Then per default config (--config: these instead;
--head-dim: only those), SDPA as the problem calls it (cuDNN on Hopper), with --triton the
Triton seed (seeds/sdpa/flash_triton.py, D=64 configs), and every variant, in --dtype, in
interleaved rounds in a shuffled order: CUDA-graph replay of n back-to-back calls (the GPU time)
and the same n calls eager (launches included), medians; with --do-bench N also N rounds of
triton.testing.do_bench (L2 flushed by a write before every call).
Prints a line per config (speedup over SDPA and TFLOP/s per function, graph time; with two
or more variants also the first variant's paired gain over each other one, graph time: the
median of the ratios of pairs of rounds (evoattn/contract/stats.py) and its 95% bootstrap interval)
and the geometric means per mode over all, D=64 and D=128 configs, the paired gains with
their intervals. Two settings whose
gain's interval holds 1 are not told apart by this run; the interval covers the noise between
rounds, not what differs between processes, so a gain still wants a second process. Exits 0
when every check passes, 1 when one fails, 2 when it cannot run (no CUDA GPU, a bad --variant,
a build that fails).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import check_bf16_cuda as cb
from benchmarks.common import ROOT, label
from evoattn.contract import stats
from evoattn.contract.knobs import set_knobs
from evoattn.child.loader import LoadFailure, companion_headers
from evoattn.problems import get_problem
from evoattn.contract.types import geometric_mean
from evoattn.mutators.knobs import parse_settings

SEED = ROOT / "seeds" / "sdpa" / "wgmma_flash.cu"
TARGET_MS = 3.0                               # GPU time per timed batch of calls


@dataclass(frozen=True)
class Variant:
    name: str
    source: Path                              # the .cu file
    settings: tuple[str, ...]                 # KNOB=VALUE


def parse_variant(text: str) -> Variant:
    """'NAME:[@FILE][,]KNOB=V,...' -> Variant; ValueError with one line otherwise."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--variant {text!r}: expected NAME:SETTINGS (SETTINGS may be empty)")
    parts = [p.strip() for p in rest.split(",") if p.strip()]
    source = SEED
    if parts and parts[0].startswith("@"):
        source = Path(parts.pop(0)[1:])
        if not source.is_file():
            raise ValueError(f"--variant {text!r}: {source} is not a file")
    bad = [p for p in parts if "=" not in p]
    if bad:
        raise ValueError(f"--variant {text!r}: {bad[0]!r} is not KNOB=VALUE")
    return Variant(name.strip(), source, tuple(parts))


def parse_config(text: str) -> dict[str, Any]:
    """'B,H,S,D[,causal]' -> the problem's config dict; ValueError with one line otherwise."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (4, 5) or not all(p.isdigit() and int(p) > 0 for p in parts[:4]) \
            or parts[4:] not in ([], ["causal"]) or parts[3] not in ("64", "128"):
        raise ValueError(f"--config {text!r}: expected B,H,S,D[,causal] with D 64 or 128")
    b, h, s, d = (int(p) for p in parts[:4])
    return {"B": b, "H": h, "S": s, "D": d, "causal": len(parts) == 5}


def variant_source(variant: Variant) -> str:
    """The variant's source with its knobs set (ValueError on an unknown knob or value)."""
    source = variant.source.read_text()
    return set_knobs(source, parse_settings(str(variant.source), source, list(variant.settings)))


def load_variant(variant: Variant, tmp: Path) -> cb.Run:
    """The variant written beside the seed's companion headers, built and loaded by
    check_bf16_cuda.load_seed (LoadFailure when the build fails)."""
    work = tmp / variant.name
    work.mkdir()
    source = variant_source(variant)
    for name, data in companion_headers(SEED, SEED.read_text()).items():
        (work / name).write_bytes(data)
    (work / SEED.name).write_text(source)
    return cb.load_seed(work / SEED.name, work)


def time_config(fns: dict[str, cb.Run], cfg: dict[str, Any], dtype: Any, rounds: int,
                do_bench_rounds: int) -> dict[str, dict[str, list[float]]]:
    """Ms per call of each function per round, in graph and eager mode (and do_bench)."""
    import torch
    problem = get_problem("sdpa")
    inputs = problem.make_inputs(cfg, dtype, torch.device("cuda"),
                                 torch.Generator(device="cuda").manual_seed(7))
    event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    graphs, samples = {}, {}
    for name, fn in fns.items():
        fn(inputs, cfg)
        a, b = event(), event()
        a.record(); fn(inputs, cfg); b.record(); torch.cuda.synchronize()
        n = max(8, min(400, int(TARGET_MS / max(a.elapsed_time(b), 1e-3))))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(inputs, cfg)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn(inputs, cfg)
        graphs[name] = (graph, n)
        samples[name] = {"graph": [], "eager": [], "do_bench": []}
    names = list(fns)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            graph, n = graphs[name]
            graph.replay()
            a, b = event(), event()
            a.record(); graph.replay(); b.record(); torch.cuda.synchronize()
            samples[name]["graph"].append(a.elapsed_time(b) / n)
            a.record()
            for _ in range(n):
                fns[name](inputs, cfg)
            b.record(); torch.cuda.synchronize()
            samples[name]["eager"].append(a.elapsed_time(b) / n)
    if do_bench_rounds:
        import triton.testing
        for _ in range(do_bench_rounds):
            random.shuffle(names)
            for name in names:
                fn = fns[name]
                samples[name]["do_bench"].append(
                    triton.testing.do_bench(lambda: fn(inputs, cfg), warmup=25, rep=100))
    return {name: {mode: x for mode, x in modes.items() if x} for name, modes in samples.items()}


def medians(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {name: {mode: statistics.median(x) for mode, x in modes.items()}
            for name, modes in samples.items()}


Gain = tuple[float, "stats.Interval | None"]


def paired_gain(first: list[float], other: list[float]) -> Gain:
    """The first function's speed over the other's (other's time / first's), measured in the
    same interleaved rounds: the median of the pairs of rounds' ratios and its bootstrap
    interval (evoattn/contract/stats.py)."""
    return stats.ratio(other, first, paired=True)


def geomean_gain(gains: list[Gain]) -> Gain:
    """The geometric mean of per-config gains and its interval (the configs independent)."""
    points = [g for g, _ in gains]
    return geometric_mean(points), stats.geomean_ci(points, [ci for _, ci in gains])


def fmt_gain(gain: Gain) -> str:
    point, ci = gain
    return f"{point:.3f}x" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def summary_lines(rows: list[dict[str, Any]], names: list[str], first: str, others: list[str],
                  modes: tuple[str, ...]) -> list[str]:
    """Per mode, over all, D=64 and D=128 configs: each function's geometric mean speedup over
    SDPA, then the first variant's paired gain over each other one, with its interval."""
    lines = []
    for mode in modes:
        for subset, keep in (("all", lambda r: True), ("D=64", lambda r: r["cfg"]["D"] == 64),
                            ("D=128", lambda r: r["cfg"]["D"] == 128)):
            cells = [f"{n} {geometric_mean(ratios):.4f}x" for n in names
                     if (ratios := [r["ms"]["sdpa"][mode] / r["ms"][n][mode] for r in rows
                                    if keep(r) and n in r["ms"]])]
            if cells:
                lines.append(f"geomean vs sdpa, {mode}, {subset}: " + "  ".join(cells))
            kept = [r for r in rows if keep(r)]
            cells = [f"{first} vs {n} " + fmt_gain(geomean_gain(
                [paired_gain(r["samples"][first][mode], r["samples"][n][mode]) for r in kept]))
                     for n in others if kept and all(mode in r["samples"][n] for r in kept)]
            if cells:
                lines.append(f"paired gain, {mode}, {subset}: " + "  ".join(cells))
    return lines


def config_line(flops: float, row: dict[str, Any], first: str, others: list[str]) -> str:
    """One config's line: every function's speedup over SDPA and TFLOP/s (graph time), and the
    first variant's paired gain over each other one."""
    ms, samples = row["ms"], row["samples"]
    base = ms["sdpa"]["graph"]
    cells = " ".join(f"{n} {base / t['graph']:.3f}x ({flops / t['graph'] / 1e9:.0f})"
                     for n, t in ms.items() if n != "sdpa")
    gains = "".join(f"  {first} vs {n} " + fmt_gain(
        paired_gain(samples[first]["graph"], samples[n]["graph"])) for n in others)
    return (f"{label('sdpa', row['cfg']):26s} sdpa {base * 1e3:8.1f} us "
            f"({flops / base / 1e9:.0f} TFLOP/s)  {cells}{gains}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, metavar="NAME:SETTINGS")
    ap.add_argument("--dtype", choices=cb.DTYPES, default="float16", help="the timed dtype")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--do-bench", type=int, default=0, metavar="N", help="do_bench rounds")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), help="only these configs")
    ap.add_argument("--config", action="append", default=[], metavar="B,H,S,D[,causal]",
                    help="time these configs instead of the default ones (repeatable)")
    ap.add_argument("--triton", action="store_true", help="also time the Triton seed (D=64)")
    ap.add_argument("--json", type=Path, help="write every check, median and round's sample here")
    args = ap.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variant]
        for v in variants:
            variant_source(v)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.do_bench < 0:
        print("error: --rounds must be at least 1 and --do-bench at least 0", file=sys.stderr)
        return 2
    if len({v.name for v in variants}) != len(variants):
        print("error: --variant names must differ", file=sys.stderr)
        return 2
    try:
        configs = [parse_config(c) for c in args.config]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (Hopper for the wgmma kernels)", file=sys.stderr)
        return 2
    problem = get_problem("sdpa")
    configs = configs or list(problem.default_configs)
    wanted = lambda cfg: args.head_dim in (None, cfg["D"])  # noqa: E731
    tmp = Path(tempfile.mkdtemp(prefix="wgmma_variants_"))
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            fns = dict(zip((v.name for v in variants),
                           pool.map(lambda v: load_variant(v, tmp), variants)))
        triton = cb.load_program(ROOT / "seeds" / "sdpa" / "flash_triton.py", [], tmp) \
            if args.triton else None
    except LoadFailure as e:
        print(f"error: {e}\n{e.log[-3000:]}", file=sys.stderr)
        return 2
    checks = cb.check(fns, set(fns), 1, torch.cuda.get_device_capability() == (9, 0),
                      [(cfg, domain) for cfg, domain in cb.all_cases() if wanted(cfg)],
                      route=cb.no_route)
    failed = sum(not r["ok"] for r in checks)
    print(f"checks: {failed} failed", flush=True)
    rows = []
    first, others = variants[0].name, [v.name for v in variants[1:]]
    for cfg in filter(wanted, configs):
        timed = {"sdpa": problem.baseline}
        if triton is not None and cfg["D"] == 64:
            timed["triton"] = triton
        timed.update(fns)
        samples = time_config(timed, cfg, getattr(torch, args.dtype), args.rounds, args.do_bench)
        ms = medians(samples)
        rows.append({"cfg": cfg, "ms": ms, "samples": samples})
        print(config_line(problem.flops(cfg), rows[-1], first, others), flush=True)
    names = [n for n in ["triton", *fns] if any(n in r["ms"] for r in rows)]
    modes = ("graph", "eager") + (("do_bench",) if args.do_bench else ())
    for line in summary_lines(rows, names, first, others, modes):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
            "variants": {v.name: {"source": str(v.source), "settings": list(v.settings)}
                         for v in variants},
            "checks": checks, "rows": rows}, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
