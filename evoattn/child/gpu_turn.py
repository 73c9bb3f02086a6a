"""An evaluation's turn on a GPU it shares with other evaluations (a run's `per_gpu` slots
and their spare children).

The turn is an exclusive lock on a file (flock): a child takes it after its set-up (its
baselines' plans, its inputs and references, its timer) and keeps it to the end of its timing,
so that no other evaluation's checks or timing run on the GPU while it checks and times:
another process's kernels slow a GPU-bound baseline more than a host-bound candidate, which
would bias the ratio (measured: with only the timing stage locked, one of four evaluations of
the same program read 11% high).

Its timing needs more: no GPU work of any other evaluation at all, not even the set-up a
waiting child does before its turn (CUDA's start, the baselines' inputs and first calls:
with that alone beside it, one of five evaluations of the same program read a config 18%
off). A second lock on `path + ".quiet"` keeps them apart: a child holds it shared through
each step of its set-up (a run's spare child too, before it is told its candidate), and the
turn's holder holds it exclusively while it times. A timing that is due waits for the step in
progress, not for the whole set-up: it first takes `path + ".next"` exclusively, which every
set-up step passes through (shared) before it begins, so no new step starts until the timing
has ended (flock alone would let back-to-back shared holders starve it). A fresh child puts
its shared lock down while it builds its candidate (CPU work: nvcc, for seconds to minutes,
after CUDA's start) and takes it again before its set-up's GPU work.

One exception, during the checks only: while Triton compiles one of the candidate's kernels
(seconds of CPU work, the GPU idle), the turn passes to a waiting evaluation; it is taken
back, after that one's turn, before the candidate's next GPU work. The device is
synchronised first, so nothing of this child runs on the GPU while another has the turn.

The lock file and the functions used here are bound before any candidate code runs; the
kernel releases the lock however the process ends. No path: nothing is locked.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

from ..contract.names import Stage

Report = Callable[[str], None]     # reports the stage an evaluation enters


class GpuTurn:
    def __init__(self, path: str, stage: Report) -> None:
        """Opens the locks (a child's first step: it then holds the set-up's shared one)."""
        import fcntl
        self._flock, self._sh, self._nb = fcntl.flock, fcntl.LOCK_SH, fcntl.LOCK_NB
        self._ex, self._un = fcntl.LOCK_EX, fcntl.LOCK_UN
        self.report = stage               # a spare's turn reports to its candidate's parent
        self._sync: Callable[[], None] = lambda: None
        self._file = self._quiet = self._next = None
        self.held = False
        self.checking = False              # compiles may yield the turn (the check stage)
        self._setting_up = False
        self._put_aside = False            # aside(): the set-up's lock put down for a build
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._file = open(path, "a+")
            self._quiet = open(path + ".quiet", "a+")
            self._next = open(path + ".next", "a+")
            self._begin_step()                     # blocks while another evaluation times
            self._setting_up = True

    def _begin_step(self) -> bool:
        """Takes the set-up's shared lock once no timing is running or due; returns whether
        it waited."""
        assert self._next is not None and self._quiet is not None
        waited = self._wait(self._next, self._sh)
        self._flock(self._next.fileno(), self._un)
        return self._wait(self._quiet, self._sh) or waited

    def step(self, sync: Callable[[], None], then: str) -> None:
        """Between two steps of the set-up: a timing that is due runs now (the device
        synchronised first); the set-up goes on after it (reporting stage `then` again if it
        waited)."""
        if self._quiet is None or not self._setting_up:
            return
        sync()
        self._flock(self._quiet.fileno(), self._un)
        if self._begin_step():
            self.report(then)

    def aside(self, sync: Callable[[], None]) -> None:
        """A set-up that has begun puts its shared lock down for CPU-only work (a fresh
        child's build: nvcc, seconds to minutes), so that another evaluation's timing need not
        wait for it; resume() takes it again before the set-up's next GPU work. Between the
        two, this process runs nothing on the GPU (`sync` first)."""
        if self._quiet is None or not self._setting_up or self._put_aside:
            return
        sync()
        self._flock(self._quiet.fileno(), self._un)
        self._put_aside = True

    def resume(self, then: str) -> None:
        """Takes the set-up's shared lock again after aside() (waiting, as a set-up step does,
        for a timing in progress or due; reporting stage `then` again if it waited)."""
        if not self._put_aside:
            return
        self._put_aside = False
        if self._begin_step():
            self.report(then)

    def _wait(self, f: Any, mode: int) -> bool:
        """Takes a lock, reporting stage 'gpu-wait' first when it has to wait for it; returns
        whether it waited."""
        try:
            self._flock(f.fileno(), mode | self._nb)
        except BlockingIOError:
            self.report(Stage.GPU_WAIT)
            self._flock(f.fileno(), mode)
            return True
        return False

    def set_up(self, sync: Callable[[], None]) -> None:
        """The set-up is done (its GPU work too: `sync`, the device-wide synchronisation, is
        also what the turn uses from here on)."""
        self._sync = sync
        if self._quiet is not None:
            sync()
            self._flock(self._quiet.fileno(), self._un)
            self._setting_up = False

    def timing(self) -> None:
        """From here to release(), no other evaluation's set-up runs on the GPU (one in
        progress ends its step first)."""
        if self._quiet is not None and self._next is not None:
            self._flock(self._next.fileno(), self._ex)
            self._flock(self._quiet.fileno(), self._ex)

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Inside, as in a timing, no other evaluation's set-up runs on the GPU (for a
        measurement outside the timing; the device synchronised before the end)."""
        if self._quiet is None or self._next is None:
            yield
            return
        self._flock(self._next.fileno(), self._ex)
        self._flock(self._quiet.fileno(), self._ex)
        try:
            yield
        finally:
            self._sync()
            self._flock(self._quiet.fileno(), self._un)
            self._flock(self._next.fileno(), self._un)

    def take(self, then: str) -> None:
        """Takes the turn (stage 'gpu-wait' while it waits), then reports stage `then`."""
        if self._file is not None and not self.held:
            self._wait(self._file, self._ex)
            self.held = True
        self.report(then)

    def release(self) -> None:
        """Ends the turn (the device synchronised first)."""
        if self._file is not None and self.held:
            self._sync()
            if self._quiet is not None and self._next is not None:
                self._flock(self._quiet.fileno(), self._un)
                self._flock(self._next.fileno(), self._un)
            self._flock(self._file.fileno(), self._un)
            self.held = False

    def install_compile_hooks(self) -> None:
        """Makes Triton's compiles in the check stage yield the turn (where Triton has the
        hooks, 3.4 and later)."""
        if self._file is None:
            return
        try:
            from triton import knobs
        except ImportError:
            return
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return
        runtime.jit_cache_hook = self._compiling
        runtime.jit_post_compile_hook = self._compiled

    def _compiling(self, *args: Any, **kwargs: Any) -> None:
        """Triton is about to compile (returns None: it goes on)."""
        if self.checking and self.held:
            self.release()

    def _compiled(self, *args: Any, **kwargs: Any) -> None:
        if self.checking and self._file is not None and not self.held:
            self.take(Stage.CHECK)
