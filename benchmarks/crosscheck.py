"""The independent cross-check of an `evoattn eval`: a trusted program against its problem's
baselines, timed by `triton.testing.do_bench` instead of the evaluator's timer.

    python -m benchmarks.crosscheck PROGRAM [--problem NAME|FILE] [--configs SPEC]
        [--dtype DTYPE] [--rounds 3] [--json FILE]

For trusted programs only (the seeds, the examples): PROGRAM is built and loaded in this process
as the evaluator loads a candidate (evoattn.child.loader.build_candidate: companions built, a
`prepare` honoured, a CUDA file through its fast form), without the sandbox. Per config of the
problem (its default configs on a GPU, its CPU configs on the CPU, or --configs): one input set
from the problem, PROGRAM's output checked against the float32 reference with the problem's
tolerance rule (PyTorch's own error in the dtype times the factor, plus the floor), each
baseline bound to the config as the evaluator binds it (a FlexAttention baseline's BlockMask
built once, as a user's model builds it) and called once (what it compiles or plans is ready
before timing), then --rounds rounds in which PROGRAM and every baseline are timed by
`do_bench` (median ms per call, L2 flushed before each call: GPU time, but for a call whose
host work outlasts the flush), the order reversed every round. Prints per config
each one's ms and PROGRAM's speedup over the fastest baseline (the median of the rounds'
ratios), then the geometric mean over the configs: the figure to set beside `evoattn eval`'s
kernel-time fitness. Without a GPU the same loop times a plain loop of calls on the CPU (the
CPU test's mode; a CPU figure says nothing about a GPU). Exits 1 when the program fails to
build, load or pass a check, 2 on a bad argument (one line naming it).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import interleaved_samples
from evoattn.child import checks
from evoattn.child.cases import prepare_case
from evoattn.child.loader import LoadFailure, build_candidate
from evoattn.child.measure import applies, bind
from evoattn.problems import get_problem
from evoattn.contract.names import DTYPES
from evoattn.contract.types import geometric_mean


def cpu_ms(fn: Callable[[], Any], reps: int = 5) -> float:
    """The median ms of `reps` calls on the CPU, after one more."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timer(on_gpu: bool) -> Callable[[Callable[[], Any]], float]:
    if not on_gpu:
        return cpu_ms
    from triton.testing import do_bench
    return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")


def setup(problem_name: str, configs: str, dtype_name: str | None,
          on_gpu: bool) -> tuple[Any, list[dict[str, Any]], str]:
    """Returns (the problem, its configs, the dtype's name) for the arguments; raises
    ValueError naming the argument that is wrong."""
    try:
        problem = get_problem(problem_name)
    except ValueError as e:
        raise ValueError(f"--problem: {e}") from None
    dtype_name = dtype_name or problem.default_dtype
    if dtype_name not in problem.dtypes:
        raise ValueError(f"--dtype: problem {problem.name} takes {', '.join(problem.dtypes)}")
    try:
        cfgs = problem.parse_configs(configs) if configs else \
            list(problem.default_configs if on_gpu else problem.cpu_configs)
    except ValueError as e:
        raise ValueError(f"--configs: {e}") from None
    return problem, cfgs, dtype_name


def crosscheck(path: Path, problem_name: str, configs: str, dtype_name: str | None, rounds: int,
               cache_dir: Path) -> dict[str, Any]:
    """Returns {"configs": [per config: label, max_err, bound, passed, ms {name: [per round]},
    speedup, fastest], "geomean": ...} (see the module docstring); dtype_name None: the
    problem's default dtype."""
    import torch
    on_gpu = torch.cuda.is_available()
    problem, cfgs, dtype_name = setup(problem_name, configs, dtype_name, on_gpu)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, dtype_name)
    try:
        run = build_candidate(path, problem, cache_dir, 600.0, None)().run
    except LoadFailure as e:
        raise SystemExit(f"{path}: {e}") from None
    baselines = problem.baselines()
    rows = []
    for cfg in cfgs:
        # one input set, its float32 reference and tolerance, as the evaluator prepares them
        case = prepare_case(problem, cfg, False, dtype, device, random.Random(0), 1,
                            problem.tolerance)
        inputs = case.trials[0].inputs
        err = checks.max_abs_err(run(inputs, cfg), case.trials[0].ref)
        row: dict[str, Any] = {"config": case.label, "params": cfg, "max_err": err,
                               "bound": case.bound, "passed": err <= case.bound}
        rows.append(row)
        if not row["passed"]:
            continue
        calls = {"program": lambda: run(inputs, cfg)}
        for name, fn in baselines.items():
            if not applies(fn, cfg):    # e.g. SDPA for a soft-capped score: not timed, as there
                continue
            call = bind(fn, cfg)        # as the evaluator and a user's model call it
            call(inputs)                # compiled or planned before timing
            calls[name] = lambda call=call: call(inputs)
        ms = interleaved_samples(calls, timer(on_gpu), rounds)
        fastest = min((n for n in baselines if n in ms), key=lambda n: statistics.median(ms[n]))
        row.update(ms=ms, fastest=fastest, speedup=statistics.median(
            b / p for b, p in zip(ms[fastest], ms["program"])))
        del case, inputs
    speedups = [r["speedup"] for r in rows if "speedup" in r]
    return {"program": str(path), "problem": problem.name, "dtype": dtype_name,
            "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
            "timer": "do_bench" if on_gpu else "cpu loop", "rounds": rounds, "configs": rows,
            "geomean": geometric_mean(speedups) or None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("program", type=Path)
    ap.add_argument("--problem", default="sdpa", help="built-in name or problem .py")
    ap.add_argument("--configs", default="", help="the problem's config syntax (default: its own)")
    ap.add_argument("--dtype", choices=DTYPES,
                    help="default: the problem's (float16 but for mha)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the result")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not a.program.is_file():
        ap.error(f"{a.program}: no such file")
    import torch
    try:
        setup(a.problem, a.configs, a.dtype, torch.cuda.is_available())
    except ValueError as e:
        ap.error(str(e))
    with tempfile.TemporaryDirectory(prefix="crosscheck-") as tmp:
        got = crosscheck(a.program, a.problem, a.configs, a.dtype, a.rounds, Path(tmp))
    for r in got["configs"]:
        if not r["passed"]:
            print(f"{r['config']}: FAIL, max error {r['max_err']:.3g} > {r['bound']:.3g}")
            continue
        times = ", ".join(f"{n} {statistics.median(v):.4f}" for n, v in r["ms"].items())
        print(f"{r['config']}: {r['speedup']:.3f}x {r['fastest']} ({got['timer']} ms, median of "
              f"{a.rounds}: {times})")
    g = got["geomean"]
    print(f"{got['program']} on {got['device']}, {got['dtype']}: "
          f"{'n/a' if g is None else f'{g:.3f}x'} the fastest baseline ({got['timer']}, "
          f"geometric mean over {sum('speedup' in r for r in got['configs'])} configs)")
    if a.json:
        a.json.write_text(json.dumps(got, indent=1))
    return 0 if all(r["passed"] for r in got["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
