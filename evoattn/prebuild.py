"""Compile-only work on CPU threads: a CUDA candidate's nvcc builds, started at submission.

A GPU slot evaluates one candidate at a time, and a CUDA candidate spends its first seconds
in nvcc, which needs no GPU. So the local pool hands each submitted program here first: its
fast-form `.cu` files (a `.cu` main file, or the `.cu` companions of a `.py` main file whose
conditions hold on this GPU) are built on a CPU thread, into the cache the candidate's child
reads, with the child's scrubbed environment (never this process's secrets). When the slot
takes the job, the child finds the library cached. A build that fails here is no verdict:
the child builds again and reports it. On Linux these builds run in the idle scheduling class
(SCHED_IDLE, inherited by nvcc from the thread that starts it): they take only CPU time no
one else wants, so an evaluation timing launch-bound calls meanwhile keeps its CPU. On a
machine whose every CPU stays busy with other work, such a build may wait until its deadline
(`build_timeout_s`); the child then builds at normal priority.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import re
import shutil
import tempfile
from pathlib import Path

from evoattn.contract import program, runtime
from evoattn.contract.knobs import find_knobs, values_of
from evoattn.child.loader import companion_headers
from evoattn.contract.request import EvalRequest

from .childenv import SandboxSettings, child_env, default_cache_dir, detect_target

BUILD_THREADS = max(1, (os.cpu_count() or 2) // 2)


def arch_of(target: str | None) -> str | None:
    """Returns the nvcc target the child picks on a GPU of this `@target` ("sm90" ->
    "sm_90a"), or None for anything else ("cpu", unknown)."""
    m = re.fullmatch(r"sm(\d+)(\d)", target or "")
    return runtime.arch_for(int(m[1]), int(m[2])) if m else None


class Prebuilder:
    """Builds the CUDA files of submitted programs on a pool of CPU threads."""

    def __init__(self, request: EvalRequest, sandbox: SandboxSettings,
                 threads: int = BUILD_THREADS) -> None:
        self.cache_dir = os.path.realpath(sandbox.cache_dir or default_cache_dir())
        self.secret_names = sandbox.secret_env_names
        self.timeout_s = request.build_timeout_s
        target = runtime.target_fact(request.arch) if request.arch else detect_target(request.device)
        # None: the GPU cannot be told from here, so only the child knows what to build.
        self.arch = request.arch or arch_of(target)
        self.facts = {"target": target or "", **request.facts}
        self._threads = cf.ThreadPoolExecutor(max_workers=threads,
                                              thread_name_prefix="evoattn-nvcc")

    def names(self, source: str, suffix: str) -> tuple[str, ...]:
        """Returns the files of a program that its child would build with nvcc (fast form)."""
        if self.arch is None:
            return ()
        try:
            files = program.split(source, f"candidate{suffix}")
        except program.ProgramError:
            return ()
        main = files.main_name
        if main.endswith(".cu"):
            return (main,) if runtime.cuda_form(files.main_text) == "cuda-fast" else ()
        if not main.endswith(".py"):
            return ()
        values = values_of(find_knobs(files.main_text))
        present = [(c.name, c.when) for c in files.companions() if c.name in files.names]
        return tuple(runtime.cuda_companions(present, values, self.facts))

    def submit(self, source: str, suffix: str) -> cf.Future[tuple[runtime.BuildResult, ...]] | None:
        """Starts the program's builds on a CPU thread; None when it has nothing to build."""
        names = self.names(source, suffix)
        if not names:
            return None
        return self._threads.submit(self._build, source, suffix, names)

    def close(self) -> None:
        """Drops the builds not started; those running finish (nvcc has its own deadline)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _build(self, source: str, suffix: str,
               names: tuple[str, ...]) -> tuple[runtime.BuildResult, ...]:
        assert self.arch is not None
        idle_priority()
        work = tempfile.mkdtemp(prefix="evoattn-nvcc-")
        try:
            main = program.write(source, work, f"candidate{suffix}")
            headers = companion_headers(main, main.read_text())   # the build's cache key
            env = child_env(dict(os.environ), work, self.cache_dir, "cuda", self.secret_names)
            return tuple(runtime.build_fast(Path(work) / name, self.cache_dir, self.arch,
                                          self.timeout_s, extra_files=headers, env=env)
                         for name in names)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def idle_priority() -> bool:
    """Puts the calling thread (and the processes it starts from now on) in Linux's idle
    scheduling class; returns whether it is there. Elsewhere, or where refused, nothing."""
    setter = getattr(os, "sched_setscheduler", None)
    idle = getattr(os, "SCHED_IDLE", None)
    if setter is None or idle is None:
        return False
    try:
        if os.sched_getscheduler(0) != idle:
            setter(0, idle, os.sched_param(0))     # pid 0: this thread
        return True
    except OSError:
        return False
