"""Where an evaluation's time goes: runs the harness in this process under cProfile.

    python benchmarks/profile_eval.py seeds/sdpa/flash_triton.py [--problem sdpa] [--top 40]

For trusted files only (the seeds): unlike `evoattn eval`, the candidate runs in this
process, with the harness's guards but without the child process around it. Prints the
stage timings and the functions with the most cumulative and own time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import secrets
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("candidate")
    ap.add_argument("--problem", default="sdpa")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timing", choices=("call", "kernel", "graph"), default="call")
    ap.add_argument("--dtypes", default=None,
                    help="comma-separated, the timed one first (default: the problem's)")
    a = ap.parse_args()
    cache = os.environ.get("EVOATTN_CACHE") or tempfile.mkdtemp(prefix="evoattn-prof-")
    work = tempfile.mkdtemp(prefix="evoattn-prof-work-")
    from evoattn.childenv import child_env
    from evoattn.watch import stage_seconds as _stage_seconds
    os.environ.update(child_env(dict(os.environ), work, cache, a.device))   # as a child has it
    tempfile.tempdir = None
    candidate = os.path.abspath(a.candidate)
    problem = os.path.abspath(a.problem) if a.problem.endswith(".py") else a.problem
    os.chdir(work)                     # relative paths resolve where a child's would
    from evaluator.request import EvalRequest
    req = EvalRequest(candidate=candidate, problem=problem, device=a.device, cache_dir=cache,
                      allowed_dirs=(work, cache, os.environ["TRITON_CACHE_DIR"]),
                      secret_seed=secrets.randbits(62), reps=a.reps, warmup=a.warmup,
                      timing=a.timing,
                      dtypes=tuple(a.dtypes.split(",")) if a.dtypes else None)
    marks: list[tuple[str, float]] = [("start", time.perf_counter())]
    from evaluator.harness import evaluate
    prof = cProfile.Profile()
    prof.enable()
    result = evaluate(req, lambda s: marks.append((s, time.perf_counter())))
    prof.disable()
    end = time.perf_counter()
    print(f"verdict {result.verdict.value} fitness {result.fitness:.4f} {result.reason}")
    print("stages: " + ", ".join(f"{n} {sec:.2f} s"
                                 for n, sec in _stage_seconds(marks, end).items()))
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(a.top)
        print(f"---- by {key}\n" + buf.getvalue()[-12000:])


if __name__ == "__main__":
    main()
