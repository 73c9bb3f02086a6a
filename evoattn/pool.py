"""Evaluation slots: where the search's evaluations run, and how many at once.

    as_pool(evaluator)   a one-slot Evaluator (types.py) as a pool (the tests' fakes)
    LocalPool            `per_gpu` slots per GPU of this machine (CUDA_VISIBLE_DEVICES set per
                         child, never in this process; the children of one GPU take turns on
                         it through a file lock), or one on the CPU; a CUDA candidate's nvcc
                         builds start on CPU threads when it is submitted (evoattn/prebuild.py)
    make_evaluator(...)  what a run config asks for: the local pool, or a Dask cluster, their
                         slots made from one SlotSpec (evoattn/slots.py)

Every pool implements types.Pool: `slots`, `gpus`, `prefetch`, `submit(source, suffix,
label) -> Future[EvalResult]`, `calibrate(seed_result)` and `close()`. A pool starts jobs in
the order they were submitted, except that a job whose CPU build is still running lets later
jobs that are ready go first; the search commits results in its own order, so neither that
nor how fast a slot is ever changes a run.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import subprocess
import threading
import time
from typing import Any, Callable, Sequence

from evoattn.child.cpu_pin import gpu_block
from evoattn.contract.names import Stage
from evoattn.contract.request import EvalRequest
from evoattn.contract.types import EvalResult

from .childenv import SandboxSettings
from .errors import UsageError
from .prebuild import Prebuilder
from .slots import slot_spec
from .types import Evaluator, Pool


class SerialPool:
    """A one-slot Evaluator as a pool: each job runs when submitted."""

    slots = gpus = 1
    prefetch = 0

    def __init__(self, evaluator: Evaluator) -> None:
        self.evaluator = evaluator

    def submit(self, source: str, suffix: str, label: str,
               rival: str | None = None) -> cf.Future[EvalResult]:
        fut: cf.Future[EvalResult] = cf.Future()
        try:
            fut.set_result(self.evaluator.evaluate(source, suffix, label, **_duel(rival)))
        except Exception as e:  # noqa: BLE001 - delivered to whoever waits on it
            fut.set_exception(e)
        return fut

    def calibrate(self, seed: EvalResult) -> None:
        self.evaluator.calibrate(seed)

    def close(self) -> None:
        self.evaluator.close()


def _duel(rival: str | None) -> dict[str, str]:
    """The keyword a duel adds to evaluate() (none otherwise, so plain fakes still fit)."""
    return {} if rival is None else {"rival": rival}


def as_pool(evaluator: Pool | Evaluator) -> Pool:
    """Returns the evaluator as a pool (a pool as it is)."""
    return evaluator if isinstance(evaluator, Pool) else SerialPool(evaluator)


@dataclasses.dataclass
class _Job:
    future: cf.Future[EvalResult]
    source: str
    suffix: str
    label: str
    build: cf.Future[Any] | None = None     # its nvcc builds on a CPU thread, if any
    rival: str | None = None                # a duel's rival program


PREFETCH = 2                  # jobs queued beyond the slots where builds run ahead
BUILD_WAIT_SHOWN_S = 0.01     # a shorter wait for builds is not shown as a stage


class LocalPool:
    """One slot per device id, each a thread driving its own evaluator, taking the first job
    that is ready; `prebuild` starts each CUDA job's builds on CPU threads at submission, and
    such a job is ready once they are done."""

    def __init__(self, devices: Sequence[str], make: Callable[[str], Evaluator],
                 prebuild: Prebuilder | None = None, per_device: int = 1) -> None:
        if not devices:
            raise UsageError("no evaluation slot: the list of GPUs is empty")
        self.devices = list(devices)
        self.gpus = len(self.devices)
        self._prebuild = prebuild
        # The search keeps this many more jobs queued than there are slots: their builds
        # start that much ahead, and one still building lets a ready one go first.
        self.prefetch = PREFETCH if prebuild is not None else 0
        slots = [d for d in self.devices for _ in range(max(1, per_device))]
        self.slots = len(slots)
        self._evaluators = [make(d) for d in slots]
        self._jobs: list[_Job] = []
        self._ready = threading.Condition()
        self._threads = [threading.Thread(target=self._serve, args=(ev,), daemon=True,
                                          name=f"evoattn-slot-{d}-{i}")
                         for i, (ev, d) in enumerate(zip(self._evaluators, slots))]
        self._closed = False
        for t in self._threads:
            t.start()

    def submit(self, source: str, suffix: str, label: str,
               rival: str | None = None) -> cf.Future[EvalResult]:
        fut: cf.Future[EvalResult] = cf.Future()
        build = self._prebuild.submit(source, suffix) if self._prebuild is not None else None
        with self._ready:
            self._jobs.append(_Job(fut, source, suffix, label, build, rival))
            self._ready.notify_all()
        if build is not None:
            build.add_done_callback(lambda _: self._wake())
        return fut

    def _wake(self) -> None:
        with self._ready:
            self._ready.notify_all()

    def _next_job(self) -> tuple[_Job | None, float]:
        """Waits for the first queued job that is ready (or cancelled: dropped at once, not
        after its build); returns it (None once the pool is closed) and the seconds this slot
        waited while jobs were queued, none ready."""
        waited = 0.0
        with self._ready:
            while not self._closed:
                for i, job in enumerate(self._jobs):
                    if job.build is None or job.build.done() or job.future.cancelled():
                        return self._jobs.pop(i), waited
                t0, queued = time.monotonic(), bool(self._jobs)
                self._ready.wait(timeout=1.0 if queued else None)   # a cancel does not notify
                if queued:
                    waited += time.monotonic() - t0
        return None, waited

    def calibrate(self, seed: EvalResult) -> None:
        for ev in self._evaluators:
            ev.calibrate(seed)

    def close(self) -> None:
        """Stops the slots: queued jobs are dropped, running children are killed."""
        with self._ready:
            self._closed = True
            dropped, self._jobs = self._jobs, []
            self._ready.notify_all()
        for job in dropped:
            job.future.cancel()
        if self._prebuild is not None:
            self._prebuild.close()
        for ev in self._evaluators:
            ev.abort()
        for t in self._threads:
            t.join(timeout=15)
        for ev in self._evaluators:
            ev.close()

    def _serve(self, evaluator: Evaluator) -> None:
        # Each slot's zygote starts at once, while another slot works or the seed's build
        # runs, and from this thread, which lives as long as the pool: Linux kills a child
        # that asked to die with its parent when the thread that started it ends.
        if self.slots > 1 or self._prebuild is not None:
            evaluator.prestart()
        while True:
            job, waited = self._next_job()   # built first: the child finds its libraries cached
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(_with_wait(evaluator.evaluate(
                    job.source, job.suffix, job.label, **_duel(job.rival)), waited))
            except BaseException as e:  # noqa: BLE001 - delivered to whoever waits on it
                job.future.set_exception(e)


def _with_wait(result: EvalResult, waited: float) -> EvalResult:
    """Counts the slot's wait for CPU builds (started at submission) in the result of the job
    it then took: a stage of its own ("build wait") and part of its duration."""
    if waited < BUILD_WAIT_SHOWN_S:
        return result
    return dataclasses.replace(result, stage_s={Stage.BUILD_WAIT: round(waited, 3), **result.stage_s},
                               duration_s=round(result.duration_s + waited, 3))


def visible_gpus(chosen: Sequence[int] | None = None) -> list[str]:
    """Returns the CUDA_VISIBLE_DEVICES value of each slot: the GPUs this process may use (its
    own CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists), or those `chosen` among them."""
    own = os.environ.get("CUDA_VISIBLE_DEVICES")
    if own is not None:
        ids = [d.strip() for d in own.split(",") if d.strip()]
    else:
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        ids = [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
        ids = ids or ["0"]
    if chosen is None:
        return ids
    bad = [i for i in chosen if not 0 <= i < len(ids)]
    if bad:
        raise UsageError(f"evaluator.gpus: no GPU {bad[0]} here ({len(ids)} visible)")
    return [ids[i] for i in chosen]


def make_evaluator(cfg: Any, request: EvalRequest, secret_names: tuple[str, ...]) -> Pool:
    """Returns the pool a run config asks for (local slots or a Dask cluster)."""
    ev = cfg.evaluator
    spec = slot_spec(cfg, request, secret_names)
    if ev.backend == "dask":
        from .backends.dask import DaskPool
        return DaskPool(ev.scheduler_address, spec)
    if request.device == "cpu":
        return LocalPool(["cpu"], lambda device: spec.slot())
    gpus = visible_gpus(ev.gpus)
    blocks = {g: gpu_block(g, i, len(gpus)) for i, g in enumerate(gpus)} \
        if hasattr(os, "sched_getaffinity") else {}
    return LocalPool(gpus, lambda device: spec.slot(device, ev.per_gpu, blocks.get(device, ())),
                     Prebuilder(request, SandboxSettings(secret_env_names=secret_names)),
                     per_device=ev.per_gpu)
