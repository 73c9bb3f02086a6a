#!/usr/bin/env python3
"""float16 and bfloat16 on the CUDA paths of the default sdpa program (GPU only; wgmma: Hopper).

    python -m benchmarks.check_bf16_cuda [PROGRAM] [--set KNOB=VALUE ...]
        [--rival PROGRAM [--rival-set KNOB=VALUE ...]] [--cu SEED.cu ...] [--trials N]
        [--no-timing] [--no-routes] [--json FILE]

For trusted files only (the seeds): builds, as the evaluator does (evoattn/child/loader.py and
evoattn/contract/runtime.py: the same nvcc flags, arch and companion conditions), the CUDA companions of
PROGRAM (default seeds/sdpa/flash_hybrid.py, whose wgmma_flash.cu serves the head dims its
CUDA_* knobs route there) and loads the program in this process; and builds each --cu seed on
its own in the fast form (default seeds/sdpa/wgmma_flash.cu, which then serves D=64 and
D=128), called through ctypes as the evaluator calls it. Then, in float16 and bfloat16:
  check  the 14 default sdpa configs, the problem's domain shapes and more odd lengths
         (S = 1, 77, 700, 1000, 1100, 1300, 4099; D = 64 and 128; causal and not) against
         the float32 reference, with the evaluator's rule and inputs (evoattn/child/cases.py:
         error <= 2 x PyTorch's own error in the dtype + 1e-5). Each case's first call runs
         under the profiler, which names the kernel that ran (the route: wgmma-ws, wgmma,
         cuda-core, triton, ...); a bfloat16 case routed otherwise than its float16 twin is a
         FAIL (bfloat16 must go where float16 goes), and so is a route other than a
         tensor-core one for a 16-bit call to a --cu seed on Hopper.
  time   the default configs with triton.testing.do_bench (median ms, L2 flushed before every
         rep), against SDPA as the evaluator calls it (PyTorch's default backend: cuDNN on
         Hopper): ms, TFLOP/s, speedup, and the geomean per dtype and implementation.
         With --rival, a second program (the same file with other --rival-set knobs, or
         another) is loaded, checked and timed beside PROGRAM in the same process, and the
         geomean of PROGRAM's speedup over it is printed per dtype: the do_bench cross-check
         of an `evoattn eval PROGRAM --rival OTHER`.
Prints one line per check and per timing, a summary, and exits 0 when every check passes,
1 on a failure, 2 when it cannot run (no CUDA GPU, a build that fails, a bad --set).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from benchmarks import common
from benchmarks.common import ROOT, label
from evoattn.child import cases, checks
from evoattn.contract import program, runtime as build
from evoattn.child.loader import LoadFailure, companion_headers
from evoattn.problems import get_problem
from evoattn.contract.types import geometric_mean

DTYPES = ("float16", "bfloat16")          # float16 first: its route is the one to match
# Odd lengths beyond the problem's own domain shapes: S = 1, a partial last tile, lengths
# past TMA_STORE_MAX_S's default (the st.global epilogue), more work items than SMs (the
# persistent schedule), a long odd causal S, and non-causal D=64 calls whose last wave of work
# items SPLIT_TAIL_D64 splits by key tiles on 132 SMs (2, 3 and, with the knob at 4, 4 parts).
EXTRA = [(1, 1, 1, 128, False), (1, 3, 77, 128, True), (2, 2, 1000, 64, True),
         (1, 2, 1300, 128, False), (1, 2, 1300, 128, True), (2, 3, 1100, 128, True),
         (4, 16, 1000, 128, True), (4, 24, 700, 64, False), (4, 24, 700, 64, True),
         (1, 4, 4099, 128, True), (1, 4, 4099, 128, False), (1, 4, 4099, 64, False),
         (1, 12, 2719, 64, False), (1, 12, 2497, 64, False), (1, 12, 2127, 64, False)]
# Kernel-name fragments, most specific first: the route a call took.
ROUTES = (("wgmma_ws_kernel", "wgmma-ws"), ("wgmma_flash_kernel", "wgmma"),
          ("cuda_core_flash_kernel", "cuda-core"), ("mma_flash_kernel", "mma"),
          ("_attn_fwd", "triton"))
TENSOR_CORE = {"wgmma-ws", "wgmma", "mma"}

Run = Callable[[dict[str, Any], dict[str, Any]], Any]


def load_program(path: Path, sets: list[str], tmp: Path, module: str = "check_bf16_program"
                 ) -> Run:
    """The program with its knobs set and its CUDA companions built, as the evaluator does."""
    mod, libs = common.load_program(path, sets, tmp, module)
    print(f"built {path.name}'s companions: {sorted(libs) or 'none (no condition holds)'}")
    problem = get_problem("sdpa")
    return lambda inputs, cfg: problem.call(mod.attention, inputs, cfg)


def load_seed(path: Path, tmp: Path) -> Run:
    """A fast-form .cu seed built as the evaluator builds it, called as the evaluator calls it."""
    import torch
    problem = get_problem("sdpa")
    res = build.build_fast(path, tmp / "cache", build.detect_arch(), 600,
                           extra_files=companion_headers(path, path.read_text()))
    if not res.ok:
        raise LoadFailure("build", f"{path.name}: build failed", res.log)
    print(f"built {path.name} ({'cached' if res.cached else f'{res.seconds:.0f}s'})")
    fn = build.load_fast(res.path, problem.cuda_symbol)

    def run(inputs: dict[str, Any], cfg: dict[str, Any]) -> Any:
        out = problem.output_like(inputs, cfg)
        rc = problem.call_cuda(fn, inputs, cfg, out, torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"{path.name}: evoattn_sdpa returned CUDA error {rc}")
        return out
    return run


def route_of(run: Run, inputs: dict[str, Any], cfg: dict[str, Any]) -> tuple[str, Any]:
    """Runs one call under the profiler; returns the route (named by its kernels) and the output."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = run(inputs, cfg)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
    for fragment, route in ROUTES:
        if any(fragment in n for n in names):
            return route, out
    return ("other:" + names[0][:40]) if names else "none", out


def no_route(run: Run, inputs: dict[str, Any], cfg: dict[str, Any]) -> tuple[str, Any]:
    """--no-routes: the call without the profiler; every route reads "-" and is not checked."""
    return "-", run(inputs, cfg)


def all_cases() -> list[tuple[dict[str, Any], bool]]:
    """(config, correctness-only?) for the default configs, the domain shapes and EXTRA."""
    problem = get_problem("sdpa")
    return [(c, False) for c in problem.default_configs] + \
           [(c, True) for c in problem.domain_configs] + \
           [({"B": b, "H": h, "S": s, "D": d, "causal": c}, True) for b, h, s, d, c in EXTRA]


def check(impls: dict[str, Run], seeds: set[str], trials: int, hopper: bool,
          cfgs: list[tuple[dict[str, Any], bool]], device: Any = "cuda",
          route: Callable[[Run, dict[str, Any], dict[str, Any]], tuple[str, Any]] = route_of
          ) -> list[dict]:
    """Every case in both dtypes for every implementation; one row per (impl, case, dtype).
    A row passes when the error is within the bound, the route is a tensor-core one for the
    `seeds` on Hopper, and a bfloat16 row took its float16 twin's route."""
    import torch
    problem = get_problem("sdpa")
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    routes: dict[tuple[str, str], str] = {}     # (impl, case) -> the float16 call's route
    for n, (cfg, domain) in enumerate(cfgs):
        for dname in DTYPES:
            # the same secret-free seed per (config, dtype) for every implementation
            case = cases.prepare_case(problem, cfg, domain, getattr(torch, dname), device,
                                      random.Random(1000 * n + DTYPES.index(dname)), trials,
                                      problem.tolerance)
            for name, run in impls.items():
                row = {"impl": name, "cfg": cfg, "dtype": dname, "bound": case.bound,
                       "torch_err": case.torch_err}
                try:
                    worst = 0.0
                    for t, trial in enumerate(case.trials):
                        if t == 0:
                            row["route"], out = route(run, trial.inputs, cfg)
                        else:
                            out = run(trial.inputs, cfg)
                        sync()
                        if out.dtype != trial.inputs["q"].dtype or out.shape != trial.ref.shape:
                            raise RuntimeError(f"output {out.dtype} {tuple(out.shape)}")
                        worst = max(worst, checks.max_abs_err(out, trial.ref))
                        del out
                    row["err"] = worst
                    row["ok"] = math.isfinite(worst) and worst <= case.bound
                    row["why"] = "" if row["ok"] else f"error {worst:.3g} > bound {case.bound:.3g}"
                except Exception as e:  # noqa: BLE001 - reported as a failed check
                    row.update(err=float("inf"), ok=False, why=f"{type(e).__name__}: {e}"[:200])
                    row.setdefault("route", "?")
                if row["ok"] and row["route"] == "none":
                    row.update(ok=False, why="the profiler saw no kernel (rerun with --no-routes)")
                elif (row["ok"] and name in seeds and hopper
                        and row["route"] not in TENSOR_CORE | {"-"}):
                    row.update(ok=False, why=f"16-bit call on Hopper took {row['route']}")
                # float16's route, first
                twin = routes.setdefault((name, label("sdpa", cfg)), row["route"])
                if row["ok"] and row["route"] != twin:                        # bf16 goes there too
                    row.update(ok=False, why=f"route {row['route']}, float16 took {twin}")
                rows.append(row)
                print(f"{'PASS' if row['ok'] else 'FAIL'}  {name:<18} {label('sdpa', cfg):<26} "
                      f"{dname:<8} "
                      f"{row['route']:<10} err {row['err']:.2e} bound {row['bound']:.2e}"
                      f"{'  ' + row['why'] if row['why'] else ''}", flush=True)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def time_all(impls: dict[str, Run], pair: tuple[str, str] | None = None) -> list[dict]:
    """do_bench of every implementation and of SDPA on the default configs, in both dtypes."""
    import torch
    from triton.testing import do_bench
    problem = get_problem("sdpa")
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows = []
    for cfg in problem.default_configs:
        for dname in DTYPES:
            inputs = problem.make_inputs(cfg, getattr(torch, dname), torch.device("cuda"), gen)
            flops = problem.flops(cfg)
            sdpa_ms = do_bench(lambda: problem.baseline(inputs, cfg), return_mode="median")
            for name, run in impls.items():
                ms = do_bench(lambda run=run: run(inputs, cfg), return_mode="median")
                row = {"impl": name, "cfg": cfg, "dtype": dname, "ms": ms, "sdpa_ms": sdpa_ms,
                       "tflops": flops / ms / 1e9, "sdpa_tflops": flops / sdpa_ms / 1e9,
                       "speedup": sdpa_ms / ms}
                rows.append(row)
                print(f"time  {name:<18} {label('sdpa', cfg):<26} {dname:<8} {ms:8.4f} ms "
                      f"{row['tflops']:6.1f} TFLOP/s  SDPA {sdpa_ms:8.4f} ms "
                      f"{row['sdpa_tflops']:6.1f}  x{row['speedup']:.3f}", flush=True)
            del inputs
    for name in impls:
        for dname in DTYPES:
            sp = [r["speedup"] for r in rows if r["impl"] == name and r["dtype"] == dname]
            d128 = [r["speedup"] for r in rows if r["impl"] == name and r["dtype"] == dname
                    and r["cfg"]["D"] == 128]
            print(f"geomean speedup vs SDPA  {name:<18} {dname:<8} "
                  f"all {geometric_mean(sp):.3f}  D=128 {geometric_mean(d128):.3f}  "
                  f"min {min(sp):.3f}")
    if pair:
        for dname in DTYPES:
            gains = pair_gains(rows, *pair, dname)
            print(f"geomean speedup {pair[0]} over {pair[1]}  {dname:<8} "
                  f"{geometric_mean(gains):.3f}"
                  f"  (min {min(gains):.3f}, max {max(gains):.3f})")
    return rows


def pair_gains(rows: list[dict], program: str, rival: str, dtype: str) -> list[float]:
    """PROGRAM's speedup over RIVAL per config in DTYPE (rival's time / program's time)."""
    ms = {(r["impl"], label("sdpa", r["cfg"])): r["ms"] for r in rows if r["dtype"] == dtype}
    return [ms[(rival, cfg)] / t for (impl, cfg), t in ms.items()
            if impl == program and (rival, cfg) in ms]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("program", nargs="?", default=str(ROOT / "seeds/sdpa/flash_hybrid.py"))
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="KNOB=VALUE for PROGRAM (e.g. CUDA_D64=True)")
    ap.add_argument("--rival", help="a second program, timed beside PROGRAM in this process")
    ap.add_argument("--rival-set", dest="rival_sets", action="append", default=[],
                    help="KNOB=VALUE for --rival")
    ap.add_argument("--cu", action="append", default=None,
                    help="a fast-form seed to check on its own (default: wgmma_flash.cu)")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-routes", action="store_true",
                    help="no profiler: check the outputs only, not which kernel ran")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("check_bf16_cuda: needs a CUDA GPU", file=sys.stderr)
        return 2
    cap = torch.cuda.get_device_capability()
    hopper = cap == (9, 0)
    seeds = a.cu if a.cu is not None else [str(ROOT / "seeds/sdpa/wgmma_flash.cu")]
    print(f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}"
          + ("" if hopper else "  [not Hopper: no wgmma, the route checks are skipped]"))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            name = Path(a.program).name
            impls = {name: load_program(Path(a.program), a.sets, Path(tmp) / "program")}
            programs = {name}
            if a.rival:
                rival = f"rival:{Path(a.rival).name}"
                impls[rival] = load_program(Path(a.rival), a.rival_sets, Path(tmp) / "rival",
                                            module="check_bf16_rival")
                programs.add(rival)
            for s in seeds:
                impls[Path(s).name] = load_seed(Path(s), Path(tmp))
        except (LoadFailure, ValueError, program.ProgramError) as e:
            print(f"check_bf16_cuda: {e}\n{getattr(e, 'log', '')[-3000:]}", file=sys.stderr)
            return 2
        rows = check(impls, set(impls) - programs, a.trials, hopper, all_cases(),
                     route=no_route if a.no_routes else route_of)
        times = [] if a.no_timing else time_all(
            impls, (name, rival) if a.rival else None)
    failed = [r for r in rows if not r["ok"]]
    print("ALL PASS" if not failed else f"{len(failed)} FAILED")
    if a.json:
        Path(a.json).write_text(json.dumps(
            {"program": a.program, "sets": a.sets, "rival": a.rival,
             "rival_sets": a.rival_sets, "seeds": seeds, "checks": rows,
             "times": times, "device": torch.cuda.get_device_name(),
             "torch": torch.__version__}, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
