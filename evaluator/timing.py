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
        input set (K sets of fresh values, together several times L2, filled before the
        batch), bracketed by a device-wide synchronisation and the host clock. Per call it
        costs max(host cost, GPU time) plus any gap between them; work on any stream counts.
        The batch's last output is checked after the batch: work deferred into a later call
        would leave it unfinished. Rounds alternate between functions; the median counts.
graph   The same K calls captured once in a CUDA graph and replayed (after the spin, between
        CUDA events): the GPU time of calls with no host cost at all. A call that cannot be
        captured gets no graph time, and the reason.
host_us The host time of one call while the GPU is busy (a long sleep kernel queued first):
        the CPU cost a model pays per call whatever the GPU does.

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

from .hidden_work import settled_host_time
from .types import Times

_perf = time.perf_counter          # captured before any candidate is imported
SPIN_NS = 500_000                  # 0.5 ms: longer than a few Python launches take
CALL_SET_BYTES = 256 * 2 ** 20     # call mode: input sets filling at least this (5x an H100's L2)
CALL_MAX_BYTES = 4 * 2 ** 30       # ... and at most this, whatever the set's size
HOST_CALLS = 20                    # calls measured for host_us

Fn = Callable[[dict[str, Any]], Any]


class LazyOutput(Exception):
    """A timed call returned something other than a plain tensor: work could run after the timer."""


def plain(name: str, out: Any, tensor_type: Any) -> None:
    """Raises LazyOutput unless `out` is a plain tensor (a subclass can defer work to its use)."""
    if type(out) is not tensor_type:
        raise LazyOutput(f"{name} returned {type(out).__module__}.{type(out).__qualname__} from a "
                         "timed call, not a plain torch.Tensor (work deferred past the timer)")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much to measure: repetitions per mode and the call-mode batch size."""

    warmup: int
    reps: int                          # kernel mode repetitions
    rounds: int                        # call mode batches
    graph_rounds: int                  # graph mode replays
    sets: int                          # input sets per batch (distinct inputs per call)
    graph: bool                        # measure graph mode at all

    @classmethod
    def for_device(cls, on_gpu: bool, warmup: int, reps: int, set_bytes: int,
                   mode: str = "call") -> "Plan":
        """Returns the plan for a config whose random inputs take `set_bytes`. The timing
        mode fitness uses gets the full repetitions; the other two about a third (at least
        3 kernel repetitions, 3 batches): reported, not optimised."""
        if not on_gpu:
            return cls(warmup, reps, rounds=2, graph_rounds=0, sets=2, graph=False)
        size = max(set_bytes, 1)
        sets = min(64, max(8, math.ceil(CALL_SET_BYTES / size)))
        sets = max(2, min(sets, CALL_MAX_BYTES // size))
        rounds = max(3, min(15, reps // 4))

        def share(n: int, mine: str) -> int:
            return n if mode in (mine, "all") else max(3, n // 3)
        return cls(warmup, share(reps, "kernel"), share(rounds, "call"),
                   share(rounds, "graph"), sets, graph=True)


@dataclasses.dataclass(frozen=True)
class Kept:
    """A timed output kept for re-checking, with the inputs it was computed from."""

    what: str                          # e.g. "timed call 7"
    output: Any
    inputs: dict[str, Any]
    last_of_batch: bool = False        # the last call of a back-to-back batch


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What timing one config produced, per function name."""

    times: dict[str, Times]
    kept: list[Kept]                   # the kept function's outputs to re-check
    peak_mem_bytes: dict[str, int | None]
    host_ms_per_call: dict[str, float]     # kernel mode's cross-check (hidden work)
    launch_ms: dict[str, float]


class InputSets:
    """Distinct copies of a config's inputs (fresh values, own addresses) for back-to-back calls."""

    def __init__(self, base: dict[str, Any], random_names: tuple[str, ...], count: int,
                 refill: Callable[[dict[str, Any]], None]) -> None:
        self.sets = [{k: (v.clone() if k in random_names else v) for k, v in base.items()}
                     for _ in range(count)]
        self._refill = refill

    def refill(self) -> None:
        for s in self.sets:
            self._refill(s)


def snapshot(inputs: dict[str, Any]) -> dict[str, Any]:
    """Returns a copy of the input tensors (scalars as they are)."""
    import torch
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def set_bytes(inputs: dict[str, Any], random_names: tuple[str, ...]) -> int:
    """Returns the bytes of one input set's random tensors."""
    return sum(inputs[n].numel() * inputs[n].element_size() for n in random_names
               if hasattr(inputs.get(n), "numel"))


class _Timer:
    """What both timers share: back-to-back calls on distinct input sets (call mode)."""

    torch: Any
    sync: Callable[[], None]

    # ---- call mode ------------------------------------------------------------------
    def _call_mode(self, fns: dict[str, Fn], sets: InputSets, plan: Plan, keep: str,
                   rng: random.Random, kept: list[Kept]) -> dict[str, float]:
        torch = self.torch
        per_call: dict[str, list[float]] = {n: [] for n in fns}
        last = len(sets.sets) - 1
        for r in range(-1, plan.rounds):                # round -1 warms up, untimed
            for name, fn in fns.items():
                sets.refill()
                # `keep`'s last output is checked in the last round, one other in the first.
                watch = name == keep and r in (0, plan.rounds - 1)
                pick = rng.randrange(last) if watch and last and r == 0 else None
                ends = last if watch and r == plan.rounds - 1 else None
                before = {i: snapshot(sets.sets[i]) for i in (pick, ends) if i is not None}
                outs: dict[int, Any] = {}
                self.sync()
                t0 = _perf()
                for i, s in enumerate(sets.sets):
                    out = fn(s)
                    if i in before:
                        outs[i] = out
                self.sync()
                elapsed = _perf() - t0
                plain(name, out, torch.Tensor)
                if r >= 0:
                    per_call[name].append(elapsed * 1e3 / len(sets.sets))
                for i, o in outs.items():
                    plain(name, o, torch.Tensor)
                    kept.append(Kept(f"timed call {i + 1} of {last + 1} back to back (round {r})",
                                     o.clone(), before[i], last_of_batch=i == last))
                del out, outs
        return {n: statistics.median(v) for n, v in per_call.items()}



class GpuTimer(_Timer):
    """Times functions on CUDA in every mode (see the module docstring)."""

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
                rng: random.Random) -> Measurement:
        """Times every function in every mode; keeps some of `keep`'s outputs for re-checks."""
        kernel, kept = self._kernel_mode(fns, inputs, refill, plan, keep, rng)
        host_launch = {n: settled_host_time(lambda fn=fn: self._host_per_call(fn, inputs, refill),
                                            kernel[n]) for n, fn in fns.items()}
        mem = {n: self._peak_mem(fn, inputs) for n, fn in fns.items()}
        sets = InputSets(inputs, random_names, plan.sets, refill)
        call = self._call_mode(fns, sets, plan, keep, rng, kept)
        host = {n: self._host_us(fn, inputs, call[n]) for n, fn in fns.items()}
        graph = {n: self._graph_mode(n, fn, sets, plan, n == keep, kept) if plan.graph
                 else (None, "not measured") for n, fn in fns.items()}
        del sets
        times = {n: Times(kernel_ms=kernel[n], call_ms=call[n], graph_ms=graph[n][0],
                          graph_error=graph[n][1], host_us=host[n]) for n in fns}
        return Measurement(times, kept, mem, {n: v[0] for n, v in host_launch.items()},
                           {n: v[1] for n, v in host_launch.items()})

    # ---- kernel mode ----------------------------------------------------------------
    def _kernel_mode(self, fns: dict[str, Fn], inputs: dict[str, Any],
                     refill: Callable[[dict[str, Any]], None], plan: Plan, keep: str,
                     rng: random.Random) -> tuple[dict[str, float], list[Kept]]:
        torch = self.torch
        for _ in range(plan.warmup):
            for fn in fns.values():
                fn(inputs)
        self.sync()
        keep_reps = set(rng.sample(range(plan.reps), k=min(1, plan.reps)))
        samples: dict[str, list[float]] = {n: [] for n in fns}
        kept: list[Kept] = []
        events = []
        for rep in range(plan.reps):
            for name, fn in fns.items():
                self.flush_buf.zero_()
                refill(inputs)
                self.sync()          # an idle GPU: the spin below takes every SM before any
                self.spin()          # work the call launches (on any stream) can start
                start, end = self.Event(enable_timing=True), self.Event(enable_timing=True)
                self.record(start)
                out = fn(inputs)
                self.record(end)
                plain(name, out, torch.Tensor)
                events.append((name, start, end))
                if name == keep and rep in keep_reps:
                    self.sync()
                    kept.append(Kept(f"timed call {rep}", out.clone(),
                                     snapshot(inputs)))
                del out
        self.sync()
        for name, start, end in events:
            samples[name].append(self.elapsed(start, end))
        return {n: statistics.median(s) for n, s in samples.items()}, kept

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

    def _host_us(self, fn: Fn, inputs: dict[str, Any], call_ms: float) -> float:
        """Returns the median host time of one call (µs) while a sleep kernel holds the GPU
        (at first for twice the time the calls take back to back; longer if they outlast it)."""
        sleep_ms = max(2.0, 2 * HOST_CALLS * call_ms)
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
    def _graph_mode(self, name: str, fn: Fn, sets: InputSets, plan: Plan, watch: bool,
                    kept: list[Kept]) -> tuple[float | None, str]:
        torch = self.torch
        calls = sets.sets[:min(len(sets.sets), 16)]
        self.sync()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):              # capture needs warm, allocated kernels
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
            return None, f"not capturable: {type(e).__name__}: {first}"
        for out in outs:
            plain(name, out, torch.Tensor)
        samples = []
        for r in range(plan.graph_rounds + 1):
            for s in calls:
                sets._refill(s)
            self.flush_buf.zero_()
            self.sync()
            self.spin()
            start, end = self.Event(enable_timing=True), self.Event(enable_timing=True)
            self.record(start)
            graph.replay()
            self.record(end)
            self.sync()
            if r:
                samples.append(self.elapsed(start, end) / len(calls))
        if watch:
            kept.append(Kept(f"timed call {len(calls)} of {len(calls)} in a CUDA graph replay", outs[-1].clone(),
                             snapshot(calls[-1]), last_of_batch=True))
        del graph, outs
        return statistics.median(samples), ""


class CpuTimer(_Timer):
    """Times functions on the CPU with perf_counter (interpreter timings; labelled as CPU)."""

    def __init__(self) -> None:
        import torch
        self.torch = torch
        self.sync = lambda: None

    def measure(self, fns: dict[str, Fn], inputs: dict[str, Any], random_names: tuple[str, ...],
                refill: Callable[[dict[str, Any]], None], plan: Plan, keep: str,
                rng: random.Random) -> Measurement:
        torch = self.torch
        for _ in range(plan.warmup):
            for fn in fns.values():
                fn(inputs)
        keep_reps = set(rng.sample(range(plan.reps), k=min(2, plan.reps)))
        samples: dict[str, list[float]] = {n: [] for n in fns}
        kept: list[Kept] = []
        for rep in range(plan.reps):
            for name, fn in fns.items():
                refill(inputs)
                t0 = _perf()
                out = fn(inputs)
                samples[name].append((_perf() - t0) * 1e3)
                plain(name, out, torch.Tensor)
                if name == keep and rep in keep_reps:
                    kept.append(Kept(f"timed call {rep}", out.clone(), snapshot(inputs)))
        call = self._call_mode(fns, InputSets(inputs, random_names, plan.sets, refill), plan,
                               keep, rng, kept)
        kernel = {n: statistics.median(s) for n, s in samples.items()}
        times = {n: Times(kernel_ms=kernel[n], call_ms=call[n], graph_ms=None,
                          graph_error="CUDA graphs need a GPU", host_us=kernel[n] * 1e3)
                 for n in fns}
        return Measurement(times, kept, {n: None for n in fns}, dict(kernel), {})
