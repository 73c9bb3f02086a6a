"""The timing protocol, in one place: every function is timed in three modes.

kernel  Per repetition: L2 flushed (a 256 MB buffer written), inputs refilled with fresh values
        at the same addresses, the device synchronised, a 0.5 ms spin queued that holds every
        SM (spin.py), then CUDA events around exactly one call. The spin lets the host's launch
        work finish before the call's kernels can start, so this is the call's GPU time with
        its host cost hidden. Candidate and baselines alternate repetition by repetition, so
        both see the same clocks; the median counts. A host-clock cross-check (back-to-back
        calls, device-wide sync) catches work hidden from the events on other streams or
        threads: a round that trips it is measured again, each time on fresh inputs (a host
        stall is transient, hidden work shows every round; see settled_host_time).
call    What a model's layer loop sees in eager mode: K back-to-back calls, each on its own
        input set (fresh values at their own addresses, filled before the batch), bracketed by
        a device-wide synchronisation and the host clock. A round in which the timing thread
        did not have its CPU while launching (its CPU time under HOST_SHARE of the launches'
        wall time: another process or tenant on that CPU) is measured again, after the CPU is
        picked again (up to ROUND_TRIES; counted in `rounds_redone`): such a round times the
        host's contention, not the calls. K is chosen so that a batch lasts
        at least CALL_BATCH_MS: the synchronisation at its two ends costs 10-20 µs, which a
        short batch would spread over few calls (it read 11% high at (8,32,512,64) on an
        H100 with 8 calls a batch). Per call it costs max(host cost, GPU time) plus any gap
        between them; work on any stream counts. The batch's last output is checked after
        the batch: work deferred into a later call would leave it unfinished. On a GPU a
        batch of heavy calls (HEAT_MIN_MS or more each) follows HEAT_MS of untimed calls on an
        input set of their own (the heat; one of them checked where timed outputs are, so a
        candidate cannot skip it): after the refill's memory-bound work the GPU runs
        the next few milliseconds of tensor-core work at boost clocks (1.8-2.0 GHz on an
        H200) where a model's loop of heavy calls runs at its power limit (1.5-1.6 GHz), and
        without the heat long head-dim-128 calls read 5-14% faster than a sustained eager
        loop of the same calls (benchmarks/protocol_check.py).
graph   The same K calls captured once in a CUDA graph and replayed (after the spin, between
        CUDA events): the GPU time of calls with no host cost at all. A call that cannot be
        captured gets no graph time, and the reason.
host_us The host time of one call while the GPU is busy (a long sleep kernel queued first):
        the CPU cost a model pays per call whatever the GPU does.
issue_us  Call mode's own host side: per call, the time the timing thread took to issue a
        batch's calls (median over rounds). Near the call time, the calls were host-bound
        in those rounds (the host's speed then decides the ratio); well below it, the GPU was
        the bottleneck. Unlike host_us, it is taken in the timed rounds, on their inputs.

Rounds interleave the functions (candidate and baselines alternate, their order reversed
every round), so all see the GPU and the host in the same state. Two rounds make a unit, in
which each function ran once in each position; the median over units counts, and its 95%
bootstrap interval travels with it; a speedup is the median of the units' own ratios
(evoattn/contract/stats.py). Rounds are taken two at a time: floors and caps are even, and a mode
stops only after a pair. The fitness mode's rounds adapt: after a floor,
measuring stops once `converged` (given by the caller: the fitness ratio's interval is narrow
enough) or at the plan's cap; the other modes get a fixed few rounds. Launch-bound configs thus
get more rounds, long ones fewer.

CPU (Triton's interpreter): kernel and call modes by the host clock, host_us the same as a
call, no graph mode; every such figure is labelled a CPU timing.
"""
from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from typing import Any, Callable

from ..contract import stats
from .hidden_work import settled_host_time
# The rounds' plan and records, used here and named through this module by its callers.
from .rounds import (CALL_BATCH_MS, CALL_MAX_BYTES, CALL_SETS, FLOOR, OTHER,  # noqa: F401
                     Converged, Fn, InputSets, Kept, LazyOutput, Measurement, Plan, Samples,
                     adapt, own_width, plain, set_bytes, snapshot)
from ..contract.types import Times

_perf = time.perf_counter          # captured before any candidate is imported
_thread_cpu = time.thread_time     # this thread's CPU time (Linux: excludes a VM's steal)
SPIN_NS = 500_000                  # 0.5 ms: longer than a few Python launches take
HOST_CALLS = 20                    # calls measured for host_us
HEAT_MS, HEAT_MIN_MS = 10.0, 0.15  # call mode on a GPU: untimed calls before each batch of
                                   # calls this long or longer, for about this long
HOST_SHARE = 0.9                   # call mode: a batch's launches got at least this share of
ROUND_TRIES = 3                    # their CPU, or the round is measured again (at most this often)


class _Timer:
    """What both timers share: back-to-back calls on distinct input sets (call mode)."""

    torch: Any
    sync: Callable[[], None]
    heat = False                       # call mode: untimed calls before heavy batches (GPU)
    watch_host = False                 # call mode: rounds whose launches lost their CPU again
    rounds_redone = 0                  # call-mode rounds measured again (the host was busy)
    # called before a round is measured again (the harness: pick the fastest CPU again)
    on_busy_host: Callable[[], Any] | None = None

    # ---- call mode ------------------------------------------------------------------
    def _call_mode(self, fns: dict[str, Fn], sets: InputSets, plan: Plan, keep: str,
                   rng: random.Random, kept: list[Kept],
                   converged: Converged | None = None, per_call_ms: float = 0.0) -> Samples:
        torch = self.torch
        last = len(sets.sets) - 1
        heat = math.ceil(HEAT_MS / per_call_ms) \
            if self.heat and plan.heat and per_call_ms >= HEAT_MIN_MS else 0

        def batch(name: str, fn: Fn, watch: tuple[int, ...]) -> tuple[float, float, float]:
            """Returns (ms per call, the share of the launches' wall time this thread ran,
            ms per call to issue the calls)."""
            sets.refill()
            before = {i: snapshot(sets.sets[i]) for i in watch}
            outs: dict[int, Any] = {}
            # The heat: the GPU at the clocks of sustained calls. Where timed outputs are
            # kept, one heat call's is too: skipping the untimed calls would time the batch at
            # boost clocks.
            checked = rng.randrange(heat) if heat and watch else -1
            heat_inputs = snapshot(sets.heat) if checked >= 0 else None
            for j in range(heat):
                out = fn(sets.heat)
                if j == checked:
                    plain(name, out, torch.Tensor)
                    kept.append(Kept(f"untimed call {j + 1} of {heat} before a timed batch",
                                     out.clone(), heat_inputs))
            self.sync()
            c0, t0 = _thread_cpu(), _perf()
            for i, s in enumerate(sets.sets):
                out = fn(s)
                if i in before:
                    outs[i] = out
            launched, cpu = _perf() - t0, _thread_cpu() - c0
            self.sync()
            elapsed = _perf() - t0
            plain(name, out, torch.Tensor)
            for i, o in outs.items():
                plain(name, o, torch.Tensor)
                kept.append(Kept(f"timed call {i + 1} of {last + 1} back to back",
                                 o.clone(), before[i], last_of_batch=i == last))
            n = len(sets.sets)
            return (elapsed * 1e3 / n, min(1.0, cpu / launched) if launched else 1.0,
                    launched * 1e3 / n)

        for name, fn in fns.items():                   # a warm-up batch each, untimed
            batch(name, fn, ())

        issued: Samples = {n: [] for n in fns}          # ms per call to issue, per round

        def one_round(r: int, order: list[str], samples: Samples) -> None:
            for attempt in range(ROUND_TRIES):
                got = {}
                for name in order:
                    # `keep`'s last output is checked in the first two rounds, one other in
                    # the first.
                    watch: tuple[int, ...] = ()
                    if name == keep and r < 2:
                        watch = (last,) if r or not last else (rng.randrange(last), last)
                    got[name] = batch(name, fns[name], watch)
                if not self.watch_host or attempt == ROUND_TRIES - 1 or \
                        min(share for _, share, _ in got.values()) >= HOST_SHARE:
                    break
                self.rounds_redone += 1
                if self.on_busy_host is not None:
                    self.on_busy_host()
            for name, (ms, _, issue) in got.items():
                samples[name].append(ms)
                issued[name].append(issue)
        return adapt("call", list(fns), plan, converged, one_round), issued


class GpuTimer(_Timer):
    """Times functions on CUDA in every mode (see the module docstring)."""

    heat = True
    watch_host = True

    def __init__(self, cache_dir: str | None = None) -> None:
        import torch
        self.torch = torch
        self.Event = torch.cuda.Event
        self.elapsed = torch.cuda.Event.elapsed_time
        self.record = torch.cuda.Event.record
        self.sync = torch.cuda.synchronize
        self.sleep = torch.cuda._sleep
        self.flush_buf = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
        from .spin import FullGpuSpin
        self.spin = FullGpuSpin(SPIN_NS, cache_dir)   # built and captured before candidate import
        self.max_mem = torch.cuda.max_memory_allocated
        self.mem = torch.cuda.memory_allocated
        self.reset_peak = torch.cuda.reset_peak_memory_stats
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.cycles_per_ms = max(getattr(props, "clock_rate", 2_000_000), 1_000_000)  # kHz

    def measure(self, fns: dict[str, Fn], inputs: dict[str, Any], random_names: tuple[str, ...],
                refill: Callable[[dict[str, Any]], None], plan: Plan, keep: str,
                rng: random.Random, converged: Converged | None = None,
                refill_all: Callable[[dict[str, Any]], None] | None = None) -> Measurement:
        """Times every function in every mode; keeps some of `keep`'s outputs for re-checks."""
        kernel_s, kept = self._kernel_mode(fns, inputs, refill, plan, keep, rng, converged)
        kernel = {n: statistics.median(v) for n, v in kernel_s.items()}
        host_launch = self.cross_check(fns, inputs, refill, kernel)
        mem = {n: self._peak_mem(fn, inputs) for n, fn in fns.items()}
        per_call = min(max(kernel[n], *host_launch[n]) for n in fns)
        sets = InputSets(inputs, random_names, plan.call_sets(per_call), refill, refill_all)
        call_s, issued = self._call_mode(fns, sets, plan, keep, rng, kept, converged,
                                         per_call)
        call = {n: statistics.median(v) for n, v in call_s.items()}
        host = {n: self._host_us(fn, inputs, host_launch[n][1]) for n, fn in fns.items()}
        graph_s, graph_err = self._graph_mode(fns, sets, plan, keep, kept, converged) \
            if plan.graph else ({}, {n: "not measured" for n in fns})
        del sets
        samples = {"kernel": kernel_s, "call": call_s, "graph": graph_s}
        times = {n: _times(n, samples, graph_err.get(n, ""), host[n], issued[n]) for n in fns}
        return Measurement(times, kept, mem, {n: v[0] for n, v in host_launch.items()},
                           {n: v[1] for n, v in host_launch.items()}, samples)

    def cross_check(self, fns: dict[str, Fn], inputs: dict[str, Any],
                    refill: Callable[[dict[str, Any]], None],
                    kernel_ms: dict[str, float]) -> dict[str, tuple[float, float]]:
        """Returns name -> (host ms per call back to back, ms to return): the hidden-work check."""
        return {n: settled_host_time(lambda fn=fn: self._host_per_call(fn, inputs, refill),
                                     kernel_ms[n]) for n, fn in fns.items()}

    def probe(self, fn: Fn, inputs: dict[str, Any],
              refill: Callable[[dict[str, Any]], None]) -> tuple[float, float, float]:
        """Returns one function's kernel-mode median over a few rounds and its host
        cross-check (ms per call, ms to return): a trusted witness of a busy GPU."""
        plan = Plan(warmup=2, reps=OTHER["kernel"], rounds=1, graph_rounds=1, sets=2,
                    graph=False, mode="none")
        samples, _ = self._kernel_mode({"probe": fn}, inputs, refill, plan, "",
                                       random.Random(0), lambda m, s: False)
        event_ms = statistics.median(samples["probe"])
        host, launch = self.cross_check({"probe": fn}, inputs, refill, {"probe": event_ms})["probe"]
        return event_ms, host, launch

    # ---- kernel mode ----------------------------------------------------------------
    def _kernel_mode(self, fns: dict[str, Fn], inputs: dict[str, Any],
                     refill: Callable[[dict[str, Any]], None], plan: Plan, keep: str,
                     rng: random.Random, converged: Converged | None = None
                     ) -> tuple[Samples, list[Kept]]:
        torch = self.torch
        for _ in range(plan.warmup):
            for fn in fns.values():
                fn(inputs)
        self.sync()
        kept: list[Kept] = []
        keep_round = rng.randrange(plan.bounds("kernel")[0])

        def one_round(r: int, order: list[str], samples: Samples) -> None:
            events = []
            for name in order:
                self.flush_buf.zero_()
                refill(inputs)
                self.sync()          # an idle GPU: the spin below takes every SM before any
                self.spin()          # work the call launches (on any stream) can start
                start, end = self.Event(enable_timing=True), self.Event(enable_timing=True)
                self.record(start)
                out = fns[name](inputs)
                self.record(end)
                plain(name, out, torch.Tensor)
                events.append((name, start, end))
                if name == keep and r == keep_round:
                    self.sync()
                    kept.append(Kept(f"timed call {r}", out.clone(), snapshot(inputs)))
                del out
            self.sync()
            for name, start, end in events:
                samples[name].append(self.elapsed(start, end))
        return adapt("kernel", list(fns), plan, converged, one_round), kept

    def _host_per_call(self, fn: Fn, inputs: dict[str, Any],
                       refill: Callable[[dict[str, Any]], None], n: int = 10
                       ) -> tuple[float, float]:
        """Returns (ms per call for n back-to-back calls and a device sync, median ms to return).

        The inputs are refilled first (outside the measured window): each round's first call
        sees values no earlier call saw.
        """
        refill(inputs)
        self.sync()
        returns = []
        t0 = _perf()
        for _ in range(n):
            t = _perf()
            fn(inputs)
            returns.append((_perf() - t) * 1e3)
        self.sync()
        return (_perf() - t0) * 1e3 / n, statistics.median(returns)

    def _peak_mem(self, fn: Fn, inputs: dict[str, Any]) -> int:
        self.sync()
        base = self.mem()
        self.reset_peak()
        out = fn(inputs)
        self.sync()
        peak = self.max_mem() - base - out.numel() * out.element_size()
        del out
        return max(0, int(peak))

    def _host_us(self, fn: Fn, inputs: dict[str, Any], launch_ms: float) -> float:
        """Returns the median host time of one call (µs) while a sleep kernel holds the GPU
        (at first for three times as long as the calls take to return in the cross-check,
        longer if they outlast it: the sleep covers the launches, not the calls' GPU time)."""
        sleep_ms = max(2.0, 3 * HOST_CALLS * launch_ms)
        for _ in range(3):
            self.sync()
            self.sleep(int(sleep_ms * self.cycles_per_ms))
            stamps = []
            for _ in range(HOST_CALLS):
                t = _perf()
                fn(inputs)
                stamps.append((_perf() - t) * 1e6)
            busy = not self.torch.cuda.current_stream().query()   # the sleep outlasted the calls
            self.sync()
            if busy or sum(stamps) > 1e3 * sleep_ms * 4:
                return statistics.median(stamps)
            sleep_ms *= 4
        return statistics.median(stamps)

    # ---- graph mode -----------------------------------------------------------------
    def _graph_mode(self, fns: dict[str, Fn], sets: InputSets, plan: Plan, keep: str,
                    kept: list[Kept], converged: Converged | None = None
                    ) -> tuple[Samples, dict[str, str]]:
        """Returns the replays' per-call times of every capturable function, and why the
        others have none."""
        torch = self.torch
        calls = sets.sets[:min(len(sets.sets), 16)]
        graphs: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for name, fn in fns.items():
            self.sync()
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):          # capture needs warm, allocated kernels
                    for s in calls[:2]:
                        fn(s)
                torch.cuda.current_stream().wait_stream(side)
                self.sync()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = [fn(s) for s in calls]
            except Exception as e:  # noqa: BLE001 - a call that cannot be captured is data
                self.sync()
                first = str(e).splitlines()[0][:200] if str(e) else ""
                errors[name] = f"not capturable: {type(e).__name__}: {first}"
                continue
            for out in outs:
                plain(name, out, torch.Tensor)
            graphs[name] = (graph, outs)

        def replay(name: str) -> float:
            for s in calls:
                sets._refill(s)
            self.flush_buf.zero_()
            self.sync()
            self.spin()
            start, end = self.Event(enable_timing=True), self.Event(enable_timing=True)
            self.record(start)
            graphs[name][0].replay()
            self.record(end)
            self.sync()
            return self.elapsed(start, end) / len(calls)

        for name in graphs:                            # one untimed replay each
            replay(name)

        def one_round(r: int, order: list[str], samples: Samples) -> None:
            for name in order:
                samples[name].append(replay(name))
        samples = adapt("graph", list(graphs), plan, converged, one_round) if graphs else {}
        if keep in graphs:
            replay(keep)            # last, so that its outputs belong to the inputs now in place
            kept.append(Kept(f"timed call {len(calls)} of {len(calls)} in a CUDA graph replay",
                             graphs[keep][1][-1].clone(), snapshot(calls[-1]),
                             last_of_batch=True))
        graphs.clear()
        return samples, errors


def _times(name: str, samples: dict[str, Samples], graph_error: str,
           host_us: float | None, issued_ms: list[float]) -> Times:
    """Returns one function's Times (medians, intervals, rounds) from its samples per mode,
    with call mode's issue time per call (`issued_ms`: per round)."""
    kw: dict[str, Any] = {}
    rounds = {}
    for mode, by_name in samples.items():
        v = by_name.get(name)
        if v:
            kw[f"{mode}_ms"], kw[f"{mode}_ci"] = stats.center(v)
            rounds[mode] = len(v)
    return Times(graph_error=graph_error if not kw.get("graph_ms") else "", host_us=host_us,
                 issue_us=statistics.median(issued_ms) * 1e3 if issued_ms else None,
                 rounds=rounds, **kw)


class CpuTimer(_Timer):
    """Times functions on the CPU with perf_counter (interpreter timings; labelled as CPU)."""

    def __init__(self) -> None:
        import torch
        self.torch = torch
        self.sync = lambda: None

    def measure(self, fns: dict[str, Fn], inputs: dict[str, Any], random_names: tuple[str, ...],
                refill: Callable[[dict[str, Any]], None], plan: Plan, keep: str,
                rng: random.Random, converged: Converged | None = None,
                refill_all: Callable[[dict[str, Any]], None] | None = None) -> Measurement:
        torch = self.torch
        for _ in range(plan.warmup):
            for fn in fns.values():
                fn(inputs)
        kept: list[Kept] = []
        keep_rounds = set(rng.sample(range(plan.reps), k=min(2, plan.reps)))

        def one_round(r: int, order: list[str], samples: Samples) -> None:
            for name in order:
                refill(inputs)
                t0 = _perf()
                out = fns[name](inputs)
                samples[name].append((_perf() - t0) * 1e3)
                plain(name, out, torch.Tensor)
                if name == keep and r in keep_rounds:
                    kept.append(Kept(f"timed call {r}", out.clone(), snapshot(inputs)))
        kernel_s = adapt("kernel", list(fns), dataclasses.replace(plan, mode="kernel"),
                         lambda m, s: False, one_round)
        call_s, issued = self._call_mode(fns, InputSets(inputs, random_names, plan.sets,
                                                        refill),
                                 dataclasses.replace(plan, mode="call"), keep, rng, kept,
                                 lambda m, s: False)
        samples = {"kernel": kernel_s, "call": call_s}
        times = {n: dataclasses.replace(_times(n, samples, "CUDA graphs need a GPU", None,
                                               issued[n]),
                                        host_us=statistics.median(kernel_s[n]) * 1e3)
                 for n in fns}
        kernel = {n: t.kernel_ms for n, t in times.items()}
        return Measurement(times, kept, {n: None for n in fns}, dict(kernel), {}, samples)
