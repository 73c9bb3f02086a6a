"""The CPU a timing runs on: the fastest of those the process may use, held while it times.

On a GPU the host's speed decides every launch-bound time (a call's Python, the binding, the
launch), and the CPUs of one machine do not all run at one speed: on a cloud H200 (16 vCPUs)
SDPA's host time per call at (1,8,512,64) causal was 18-21 µs on ten vCPUs and 27-31 µs on
six (benchmarks/experiments/host_probe.py), and which ones were slow changed within seconds. A process
left to the scheduler lands on either, and moves between them while it times: the same
program's launch-bound figures then differ between processes by the ratio of the CPUs'
speeds, and within one by where each round ran.

So the timing thread (only it; Triton's and nvcc's compiles keep every CPU) is pinned to the
fastest CPU of its set, measured by a fixed slice of interpreter work on each, and checked
again before each config: when its CPU has slowed (another tenant of the host), it moves to
the fastest again. It is checked after a host-bound config too (evoattn/child/measure.py): one
timed while its CPU slowed is measured again, on the fastest. Linux only
(sched_setaffinity); elsewhere, or where the call is refused (a container's policy), it does
nothing.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable

SLOWER = 1.15                 # a pinned CPU this much slower than when it was picked: re-pick


def interpreter_work() -> None:
    """A fixed slice of interpreter work (about 0.1 ms on a current server core)."""
    d: dict[int, int] = {}
    for i in range(2000):
        d[i & 63] = d.get(i & 31, 0) + i


def median_seconds(work: Callable[[], Any], repeats: int = 5,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Returns the median wall time of `work` over `repeats` runs, in seconds."""
    ts = []
    for _ in range(repeats):
        t0 = clock()
        work()
        ts.append(clock() - t0)
    ts.sort()
    return ts[len(ts) // 2]


class TimingCpu:
    """Pins the calling thread to the fastest CPU of `cpus` (None or empty: those the thread
    may use now) from pick() until release(). Made before any candidate code runs: the
    functions it calls are bound then."""

    def __init__(self, cpus: Iterable[int] | None = None,
                 speed: Callable[[], float] | None = None) -> None:
        clock, work = time.perf_counter, interpreter_work
        self._speed = speed or (lambda: median_seconds(work, 5, clock))
        self._set = getattr(os, "sched_setaffinity", None)
        self._saved: set[int] = set(os.sched_getaffinity(0)) if self._set else set()
        wanted = set(cpus or ()) & self._saved
        self.cpus = sorted(wanted or self._saved)
        self.cpu: int | None = None                    # the pinned CPU, None when not pinned
        self.probe: dict[int, float] = {}              # seconds of the work per CPU, last pick
        self._picked_s = 0.0

    def _pin(self, cpus: set[int]) -> bool:
        try:
            self._set(0, cpus)                         # pid 0: this thread only (Linux)
            return True
        except OSError:
            return False

    def pick(self) -> int | None:
        """Measures each CPU of the set and pins this thread to the fastest; returns it."""
        if self._set is None or len(self.cpus) < 1:
            return None
        self.probe = {}
        for c in self.cpus:
            if self._pin({c}):
                self.probe[c] = self._speed()
        if not self.probe:
            self.cpu = None
            return None
        best = min(self.probe, key=self.probe.__getitem__)
        self.cpu = best if self._pin({best}) else None
        self._picked_s = self.probe[best]
        return self.cpu

    def refresh(self) -> int | None:
        """Picks again when the pinned CPU has slowed by more than SLOWER since its pick."""
        self.slowed()
        return self.cpu

    def slowed(self) -> str | None:
        """Says how much the pinned CPU has slowed since its pick, picking again, when by more
        than SLOWER; None when it has not (or nothing is pinned)."""
        if self.cpu is None:
            return None
        now, cpu = self._speed(), self.cpu
        if now <= SLOWER * self._picked_s:
            return None
        ratio = now / self._picked_s if self._picked_s else float("inf")
        self.pick()
        return f"the timing CPU ({cpu}) ran {ratio:.2f}x slower than when it was picked"

    def spread(self) -> float:
        """The slowest CPU's time over the fastest's, at the last pick (1.0: not measured)."""
        return max(self.probe.values()) / min(self.probe.values()) if self.probe else 1.0

    def release(self) -> None:
        """Gives the thread back every CPU it had."""
        if self._set is not None and self.cpu is not None:
            self._pin(self._saved)
        self.cpu = None


def host_gpu_count() -> int | None:
    """The NVIDIA GPUs of this machine, whatever this process may see (None: unknown)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus")) or None
    except OSError:
        return None


def gpu_block(gpu_id: str, index: int, count: int, cpus: Iterable[int] | None = None,
              host_gpus: int | None = None) -> tuple[int, ...]:
    """The CPUs whose fastest a GPU's timings pin to: the machine's CPUs split into one block
    per GPU of the machine, by the GPU's own index (`gpu_id`, as CUDA_VISIBLE_DEVICES names
    it), so that separate runs and Dask workers on one machine, each with its GPU, do not pick
    the same CPU; where that index is not known (a UUID, no driver listing), by its place
    `index` among the `count` GPUs this process uses."""
    mine = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    host = host_gpus if host_gpus is not None else host_gpu_count()
    if host and gpu_id.isdigit() and int(gpu_id) < host:
        return cpu_blocks(mine, host)[int(gpu_id)]
    return cpu_blocks(mine, max(1, count))[min(index, max(1, count) - 1)]


def cpu_blocks(cpus: Iterable[int], parts: int) -> list[tuple[int, ...]]:
    """Splits `cpus` into `parts` contiguous blocks (one per GPU of a machine, so that the
    timings of different GPUs do not pick the same CPU); with fewer CPUs than parts, every
    part gets all of them."""
    ordered = sorted(cpus)
    if parts <= 1 or len(ordered) < parts:
        return [tuple(ordered)] * max(1, parts)
    n = len(ordered)
    return [tuple(ordered[i * n // parts:(i + 1) * n // parts]) for i in range(parts)]
