"""Checks the evaluator's timing protocol against harnesses it does not share code with.

For each config of a problem (GPU only), in one process:
  eager        a plain loop of back-to-back baseline calls on one input set, the host clock
               around N calls and a device sync (what a user's layer loop pays per call)
  eager_rot    the same over the evaluator's rotating input sets
  do_bench     triton.testing.do_bench of one call (median; L2 flushed between calls)
  rot-long     the rotating loop again, over at least 400 calls (the steady state)
  evaluator    the evaluator's call mode for the same baseline (evoattn/child/timing.py), and
               with each call-mode heat length of --heat-ms (ms of untimed calls before a
               batch of heavy calls) in turn
and the same again after the child's guards are installed (`--guards`), to show what the
sandbox costs per call. Pinned (`--stages pinned`), the thread's CPU is checked as the
evaluator checks it: before each config (picked again if it slowed), and after one (all of
that config measured again, as many times as the evaluator would, if it slowed meanwhile: a
host-bound time then tells the host's state, not the protocol's). Prints a table and writes
JSON (--out).

    python -m benchmarks.protocol_check --out protocol.json [--configs "1,8,512,64;..."]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def per_call_loop(fn, sets, calls: int, repeats: int, sync) -> float:
    """Returns the median over `repeats` of (host time of `calls` back-to-back calls) / calls, µs."""
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(sets[i % len(sets)])
        sync()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(out)


@dataclasses.dataclass(frozen=True)
class Bench:
    """What every config's measurement shares: the problem, the timer and the arguments."""

    problem: Any
    dtype: Any
    timer: Any                         # evoattn.child.timing.GpuTimer
    request: Any                       # evoattn.contract.request.EvalRequest: warm-up and reps
    rng: random.Random
    heat_ms: tuple[float, ...]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", default="sdpa")
    ap.add_argument("--configs", default="")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--stages", default="plain",
                    help="comma list of process states to measure in, in order: plain, "
                         "profiled (after one torch.profiler call, as the evaluator's policy "
                         "check runs), guards (the child's sandbox guards installed), "
                         "pinned (this thread on the fastest CPU, as the evaluator times)")
    ap.add_argument("--heat-ms", default="",
                    help="comma list of call mode's heat lengths (ms) to time the evaluator's "
                         "call mode with as well (evoattn.child.timing.HEAT_MS; default: its own)")
    ap.add_argument("--out", default="")
    return ap.parse_args()


def plain_loops(fn: Any, inputs: dict, sets: list[dict]) -> dict[str, float]:
    """Returns the plain loops' µs per call: on one input set, rotating, bursts of 8, and
    long runs of both."""
    import torch
    sync = torch.cuda.synchronize
    for _ in range(10):
        fn(inputs)
    return {"eager_us": per_call_loop(fn, [inputs], 100, 9, sync),
            "eager_rot_us": per_call_loop(fn, sets, len(sets) * 2, 9, sync),
            "burst8_us": per_call_loop(fn, sets[:8], 8, 15, sync),
            "eager400_us": per_call_loop(fn, [inputs], 400, 3, sync)}


def evaluator_times(b: Bench, name: str, fn: Any, inputs: dict, plan: Any, refill: Any
                    ) -> tuple[Any, dict[float, float]]:
    """Returns the evaluator's times of one baseline, and its call µs per --heat-ms length."""
    from evoattn.child import timing
    t = b.timer.measure({name: fn}, inputs, b.problem.random_inputs, refill, plan, "",
                        b.rng).times[name]
    by_heat = {}
    for heat_ms in b.heat_ms:
        own, timing.HEAT_MS = timing.HEAT_MS, heat_ms
        try:
            h = b.timer.measure({name: fn}, inputs, b.problem.random_inputs, refill, plan, "",
                                b.rng)
        finally:
            timing.HEAT_MS = own
        by_heat[heat_ms] = h.times[name].call_ms * 1e3
    return t, by_heat


def print_row(row: dict[str, Any]) -> None:
    by_heat = row["evaluator_call_us_by_heat_ms"]
    print(f"{row['tag']:6} {row['label']:22} eager {row['eager_us']:7.1f}  "
          f"rot {row['eager_rot_us']:7.1f}  burst8 {row['burst8_us']:7.1f}  "
          f"eager400 {row['eager400_us']:7.1f}  do_bench {row['do_bench_us']:7.1f}  "
          f"evaluator call {row['evaluator_call_us']:7.1f} "
          f"({row['evaluator_call_us'] / row['eager_us'] - 1:+.1%})  kernel "
          f"{row['evaluator_kernel_us']:7.1f}  host {row['host_us']:6.1f}  rot-long "
          f"{row['eager_rot_long_us']:7.1f}" + "".join(f"  heat {h:g} ms {us:7.1f}"
                                                      for h, us in by_heat.items()), flush=True)


def one(b: Bench, tag: str, cfg: dict) -> dict[str, Any]:
    """Returns one config's row: the plain loops, do_bench and the evaluator's times."""
    import torch
    import triton.testing

    from evoattn.child.timing import InputSets, Plan, set_bytes
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(b.rng.getrandbits(62))
    inputs = b.problem.make_inputs(cfg, b.dtype, dev, gen)
    name, base = next(iter(b.problem.baselines().items()))
    fn = lambda inp, f=base, c=cfg: f(inp, c)     # noqa: E731
    fn(inputs)
    plan = Plan.for_device(True, b.request.resolved_warmup(), b.request.resolved_reps(),
                           set_bytes(inputs, b.problem.random_inputs), "call")
    refill = lambda inp: b.problem.refill(inp, gen)   # noqa: E731
    sets = InputSets(inputs, b.problem.random_inputs, plan.sets, refill)
    row: dict[str, Any] = {"tag": tag, "cfg": cfg, "label": b.problem.label(cfg),
                           **plain_loops(fn, inputs, sets.sets)}
    row["do_bench_us"] = triton.testing.do_bench(lambda: fn(inputs), warmup=25, rep=200,
                                                 return_mode="median") * 1e3
    t, by_heat = evaluator_times(b, name, fn, inputs, plan, refill)
    row["eager_rot_long_us"] = per_call_loop(fn, sets.sets, max(400, len(sets.sets)), 3,
                                             torch.cuda.synchronize)
    row.update(evaluator_call_us=t.call_ms * 1e3, evaluator_kernel_us=t.kernel_ms * 1e3,
               evaluator_graph_us=(t.graph_ms or 0) * 1e3, host_us=t.host_us,
               sets=len(sets.sets), evaluator_call_us_by_heat_ms=by_heat, call_ci=t.call_ci)
    print_row(row)
    del sets, inputs
    torch.cuda.empty_cache()
    return row


def measure(b: Bench, tag: str, configs: list[dict], cpu: Any) -> list[dict[str, Any]]:
    """Returns every config's row in one stage; with a pinned CPU, a config is measured again
    when the CPU slowed meanwhile, as the evaluator measures it again."""
    from evoattn.child.measure import CONTENTION_TRIES
    rows = []
    for cfg in configs:
        if cpu is not None:
            cpu.refresh()
        for attempt in range(CONTENTION_TRIES):
            row = one(b, tag, cfg)
            why = cpu.slowed() if cpu is not None else None
            if why is None:
                break
            print(f"       measured again: {why}", flush=True)
        row["remeasured"] = attempt
        rows.append(row)
    return rows


def enter_stage(stage: str, out: str, cpu: Any) -> Any:
    """Puts the process in a stage's state; returns the pinned TimingCpu (or `cpu`, the one
    pinned before)."""
    import torch
    if stage == "profiled":
        from evoattn.child.checking import library_kernels
        x = torch.randn(64, 64, device="cuda")
        library_kernels(lambda: x @ x)
    elif stage == "pinned":
        from evoattn.child.cpu_pin import TimingCpu
        pinned = TimingCpu()
        print(f"pinned to CPU {pinned.pick()} of {len(pinned.probe)} (their speeds differ "
              f"{pinned.spread():.2f}x)", flush=True)
        return pinned if pinned.cpu is not None else cpu
    elif stage == "guards":
        from evoattn.child import guards
        v = guards.Violations()
        guards.install_library_guard(v)
        guards.install_sandbox(v, [tempfile.mkdtemp(), str(Path(out).parent)])
    return cpu


def main() -> None:
    args = parse_args()
    import torch

    from evoattn.problems import get_problem
    from evoattn.contract.request import EvalRequest
    from evoattn.child.timing import GpuTimer
    problem = get_problem(args.problem)
    configs = problem.parse_configs(args.configs) if args.configs else problem.default_configs
    b = Bench(problem, getattr(torch, args.dtype), GpuTimer(), EvalRequest(), random.Random(0),
              tuple(float(h) for h in args.heat_ms.split(",") if h))
    rows: list[dict[str, Any]] = []
    cpu = None
    for stage in args.stages.split(","):
        cpu = enter_stage(stage, args.out, cpu)
        rows += measure(b, stage, configs, cpu)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                              "torch": torch.__version__, "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
