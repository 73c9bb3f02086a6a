"""The GPU spin that runs before each timed call: it holds every SM of the GPU.

The spin exists so that the host's launch work overlaps GPU work instead of leaving the GPU
idle inside the timed region (see timing.py). A one-thread spin (`torch.cuda._sleep`) leaves
the rest of the GPU free, so a candidate could run work on a side stream while it spins,
block on the host until that work is done, and have the events time only the remainder.
This spin launches blocks of 512 threads until they fill every thread slot of every SM (4
per SM on Hopper's 2,048): no other kernel, on any stream, can start until it ends, so work
that a call launches runs after the start event, inside the timed region. The timer
synchronises before queueing it: work launched while the L2 flush or the input refill still
ran could otherwise take a slot first (measured on an H200: a side stream's 0.2 ms sleep hid
there, and only the work after it was timed).

Set up once per process, before any candidate code is imported:
- compiled by Triton into the evaluator's trusted cache (or a fresh directory), never the
  shared Triton cache that candidates can write to (a poisoned cubin there would reach every
  later evaluation);
- captured in a CUDA graph, which the timer replays: a candidate's Triton launch hooks,
  pre-run hooks or a replaced `_hold.run` never see or change the spin's launches;
- checked once: one replay must take one wave (at most 1.6x its duration), or the blocks
  did not all fit at once and some SM slots stayed free.
"""
from __future__ import annotations

import os
import tempfile

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

THREADS_PER_SM = 2048            # sm_80, sm_90: 2,048 resident threads per SM (1,536 on sm_86/89)
WARPS_PER_BLOCK = 16             # 512 threads: divides 2,048, 1,536 and 1,024
ONE_WAVE = 1.6                   # a replay longer than this many durations ran in two waves


@triton.jit(do_not_specialize=["ns"])
def _hold(out_ptr, ns):
    """Every program spins until `ns` nanoseconds have passed on the GPU's global timer."""
    t0 = globaltimer()
    t = t0
    while t - t0 < ns:
        t = globaltimer()
    tl.store(out_ptr + tl.program_id(0), (t - t0).to(tl.int32))


def blocks_for(num_sms: int, threads_per_sm: int = THREADS_PER_SM) -> int:
    """Returns the number of 512-thread blocks that fill every thread slot of the GPU."""
    per_sm = max(1, threads_per_sm // (WARPS_PER_BLOCK * 32))
    return per_sm * num_sms


class SpinError(RuntimeError):
    """The spin could not be set up to hold the whole GPU (an evaluator fault, not a candidate's)."""


class FullGpuSpin:
    """Queues, on the current stream, a spin of `ns` nanoseconds that holds every SM."""

    def __init__(self, ns: int, cache_dir: str | None = None) -> None:
        import torch
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        threads = getattr(props, "max_threads_per_multi_processor", THREADS_PER_SM)
        self.blocks = blocks_for(props.multi_processor_count, threads)
        self.ns = int(ns)
        self.out = torch.zeros(self.blocks, dtype=torch.int32, device="cuda")
        with triton.knobs.cache.scope():
            # A directory candidates cannot write (not a shared, writable cache): the
            # evaluator's trusted one when given, else a fresh one.
            triton.knobs.cache.dir = (os.path.join(cache_dir, "baselines", "spin") if cache_dir
                                      else tempfile.mkdtemp(prefix="evoattn-spin-"))
            self._launch()                           # compiles here, into that directory
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._launch()
        self.replay = graph.replay       # bound now (and holds the graph): patches miss it
        self._check_one_wave(torch)

    def _launch(self) -> None:
        _hold[(self.blocks,)](self.out, self.ns, num_warps=WARPS_PER_BLOCK)

    def _check_one_wave(self, torch) -> None:  # noqa: ANN001
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.out.zero_()
        torch.cuda.synchronize()
        start.record()
        self.replay()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        if int(self.out.min()) < self.ns or ms > ONE_WAVE * self.ns / 1e6:
            raise SpinError(f"the timer's GPU spin took {ms:.3f} ms for {self.ns / 1e6:.3f} ms "
                            f"({self.blocks} blocks): it does not hold every SM in one wave")

    def __call__(self) -> None:
        self.replay()
