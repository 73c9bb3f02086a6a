"""Checks the evaluator's timing protocol against harnesses it does not share code with.

For each config of a problem (GPU only), in one process:
  eager        a plain loop of back-to-back baseline calls on one input set, the host clock
               around N calls and a device sync (what a user's layer loop pays per call)
  eager_rot    the same over the evaluator's rotating input sets
  do_bench     triton.testing.do_bench of one call (median; L2 flushed between calls)
  rot-long     the rotating loop again, over at least 400 calls (the steady state)
  evaluator    the evaluator's call mode for the same baseline (evaluator/timing.py), and
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
import json
import random
import statistics
import tempfile
import time
from pathlib import Path



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


def main() -> None:
    ap = argparse.ArgumentParser()
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
                         "call mode with as well (evaluator.timing.HEAT_MS; default: its own)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import torch
    import triton.testing

    from evaluator.problems import get_problem
    from evaluator.request import EvalRequest
    from evaluator import timing
    from evaluator.measure import CONTENTION_TRIES
    from evaluator.timing import GpuTimer, InputSets, Plan, set_bytes

    problem = get_problem(args.problem)
    configs = problem.parse_configs(args.configs) if args.configs else problem.default_configs
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    timer = GpuTimer()
    req = EvalRequest()
    rng = random.Random(0)
    rows = []
    pinned: list = []                  # the stage's TimingCpu, once pinned

    def measure(tag: str) -> None:
        for cfg in configs:
            cpu = pinned[0] if pinned else None
            if cpu is not None:
                cpu.refresh()
            for attempt in range(CONTENTION_TRIES):     # as the evaluator re-measures
                row = one(tag, cfg)
                why = cpu.slowed() if cpu is not None else None
                if why is None:
                    break
                print(f"       measured again: {why}", flush=True)
            row["remeasured"] = attempt
            rows.append(row)

    def one(tag: str, cfg: dict) -> dict:
        gen = torch.Generator(device=dev)
        gen.manual_seed(rng.getrandbits(62))
        inputs = problem.make_inputs(cfg, dtype, dev, gen)
        name, base = next(iter(problem.baselines().items()))
        fn = lambda inp, f=base, c=cfg: f(inp, c)     # noqa: E731
        fn(inputs)
        sb = set_bytes(inputs, problem.random_inputs)
        plan = Plan.for_device(True, req.resolved_warmup(), req.resolved_reps(), sb, "call")
        sets = InputSets(inputs, problem.random_inputs, plan.sets,
                         lambda inp: problem.refill(inp, gen))
        for _ in range(10):
            fn(inputs)
        eager = per_call_loop(fn, [inputs], 100, 9, torch.cuda.synchronize)
        rot = per_call_loop(fn, sets.sets, len(sets.sets) * 2, 9, torch.cuda.synchronize)
        burst = per_call_loop(fn, sets.sets[:8], 8, 15, torch.cuda.synchronize)
        long = per_call_loop(fn, [inputs], 400, 3, torch.cuda.synchronize)
        bench = triton.testing.do_bench(lambda: fn(inputs), warmup=25, rep=200,
                                        return_mode="median") * 1e3
        m = timer.measure({name: fn}, inputs, problem.random_inputs,
                          lambda inp: problem.refill(inp, gen), plan, "", rng)
        t = m.times[name]
        by_heat = {}
        for heat_ms in [float(h) for h in args.heat_ms.split(",") if h]:
            own, timing.HEAT_MS = timing.HEAT_MS, heat_ms
            try:
                h = timer.measure({name: fn}, inputs, problem.random_inputs,
                                  lambda inp: problem.refill(inp, gen), plan, "", rng)
            finally:
                timing.HEAT_MS = own
            by_heat[heat_ms] = h.times[name].call_ms * 1e3
        rot_long = per_call_loop(fn, sets.sets, max(400, len(sets.sets)), 3,
                                 torch.cuda.synchronize)
        row = {"tag": tag, "cfg": cfg, "label": problem.label(cfg), "eager_us": eager,
               "eager_rot_us": rot, "burst8_us": burst, "eager400_us": long,
               "do_bench_us": bench,
               "evaluator_call_us": t.call_ms * 1e3, "evaluator_kernel_us": t.kernel_ms * 1e3,
               "evaluator_graph_us": (t.graph_ms or 0) * 1e3, "host_us": t.host_us,
               "sets": len(sets.sets), "eager_rot_long_us": rot_long,
               "evaluator_call_us_by_heat_ms": by_heat}
        row["call_ci"] = t.call_ci
        print(f"{tag:6} {row['label']:22} eager {eager:7.1f}  rot {rot:7.1f}  "
              f"burst8 {burst:7.1f}  eager400 {long:7.1f}  "
              f"do_bench {bench:7.1f}  evaluator call {row['evaluator_call_us']:7.1f} "
              f"({row['evaluator_call_us'] / eager - 1:+.1%})  kernel "
              f"{row['evaluator_kernel_us']:7.1f}  host {t.host_us:6.1f}  rot-long "
              f"{rot_long:7.1f}" + "".join(f"  heat {h:g} ms {us:7.1f}"
                                          for h, us in by_heat.items()), flush=True)
        del sets, inputs
        torch.cuda.empty_cache()
        return row

    for stage in args.stages.split(","):
        if stage == "profiled":
            from evaluator.checking import library_kernels
            x = torch.randn(64, 64, device=dev)
            library_kernels(lambda: x @ x)
        elif stage == "pinned":
            from evaluator.cpu_pin import TimingCpu
            cpu = TimingCpu()
            print(f"pinned to CPU {cpu.pick()} of {len(cpu.probe)} (their speeds differ "
                  f"{cpu.spread():.2f}x)", flush=True)
            if cpu.cpu is not None:
                pinned[:] = [cpu]
        elif stage == "guards":
            from evaluator import guards
            v = guards.Violations()
            guards.install_library_guard(v)
            guards.install_sandbox(v, [tempfile.mkdtemp(), str(Path(args.out).parent)])
        measure(stage)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                              "torch": torch.__version__, "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
