"""Evaluation on a Dask distributed cluster: each candidate is one Dask task on a GPU worker.

    DaskPool        the orchestrator's side: a types.Pool, as evoattn/pool.py's LocalPool
    evaluate_task   the worker's side: one candidate, in a sandboxed child process

Workers are the standard ones, one per GPU, with evoattn installed:
`CUDA_VISIBLE_DEVICES=N dask worker tcp://HOST:8786 --resources GPU=1 --nthreads 1`. Every
task asks for {"GPU": 1}, so a worker evaluates one candidate at a time, through a slot
(evoattn/slots.py) kept warm in the worker process (its zygote serves every candidate).

What travels to a worker: the run's SlotSpec as JSON (evoattn/slots.py: the EvalRequest, which
holds no secret, the NAMES of the variables a candidate must never see, the plain protocol and
the station's refresh, so a worker's slot is the one a local run builds), and the program
text; a candidate's environment is built from the worker's own by the sandbox's scrub. What
comes back: the EvalResult's JSON.

Faults:
  a candidate crashes    its child dies, never the worker: a verdict, as on one machine
  a worker dies          the candidate runs once more on another worker; a second death
                         marks it an evaluator_fault. The scheduler re-runs a task whose
                         worker died up to `distributed.scheduler.allowed-failures` times:
                         at 1 it does exactly that; at 0 this pool sends the task again
                         itself; above 1 this pool cancels the third try when it starts.
  the scheduler goes     every waiting result raises ClusterError: the search stops with what
                         it committed, and `evoattn run --resume` goes on once it is back
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from evoattn.child.cpu_pin import gpu_block
from evoattn.contract.types import EvalResult, Verdict

from ..errors import ClusterError, UsageError
from ..slots import SlotSpec

CONNECT_TIMEOUT_S = 10.0       # a scheduler that does not answer in this time is not there
SLOTS_REFRESH_S = 5.0          # how often the GPU count of the cluster is asked again
TRIES = 2                      # a worker's death costs one more try; the second marks it
START_TOPIC = "evoattn-task-start"


@dataclasses.dataclass
class _Candidate:
    """One submitted candidate and its tries on the cluster."""

    future: cf.Future[EvalResult]
    source: str
    suffix: str
    label: str
    rival: str | None = None           # a duel's rival program
    task: Any = None                   # the Dask future of the current try
    deaths: int = 0                    # tries whose worker died (the scheduler's count)
    workers: list[str] = dataclasses.field(default_factory=list)   # each try's, as it starts


class DaskPool:
    """Evaluation slots on a Dask cluster: one per GPU its workers declare (at least 1)."""

    prefetch = 0                       # builds run on the workers, not ahead here

    def __init__(self, scheduler_address: str, spec: SlotSpec,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """`spec`: what each worker's slot is made from (calibrate() adds the deadline)."""
        distributed = _import_distributed()
        # The client's own reports of a lost scheduler (tracebacks included) say what
        # ClusterError says in one line.
        logging.getLogger("distributed.client").setLevel(logging.CRITICAL)
        self.address = scheduler_address
        self._spec = spec
        self._killed_worker = distributed.KilledWorker
        try:
            _probe(scheduler_address, connect_timeout_s)   # fails fast, leaving no client
            self._client = distributed.Client(scheduler_address, timeout=connect_timeout_s,
                                              set_as_default=False, name="evoattn")
        except ValueError as e:          # not an address distributed can parse
            raise UsageError(f"evaluator.scheduler_address: {scheduler_address!r} is not a "
                             f"Dask scheduler address ({e})") from None
        except (OSError, TimeoutError) as e:
            raise ClusterError(f"cannot reach the Dask scheduler at {scheduler_address} "
                               f"({_first_line(e)}); start it (`dask scheduler`) or fix "
                               "evaluator.scheduler_address") from None
        self._lock = threading.Lock()
        self._tokens: dict[str, _Candidate] = {}
        self._closing = False
        self._helper = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="evoattn-dask")
        self._slots, self._slots_at = 1, time.monotonic()
        self._client.subscribe_topic(START_TOPIC, self._on_start)
        gpus = self._declared_gpus()
        if gpus == 0:
            print(f"evoattn: no worker of the Dask cluster at {scheduler_address} declares a "
                  "GPU (dask worker ADDRESS --resources GPU=1); evaluations wait for one",
                  file=sys.stderr)
        self._slots = max(1, gpus or 1)

    @property
    def slots(self) -> int:
        """Returns the GPUs the cluster's workers declare (`--resources GPU=N`), at least 1."""
        now = time.monotonic()
        if now - self._slots_at >= SLOTS_REFRESH_S:
            self._slots_at = now
            gpus = self._declared_gpus()
            if gpus is not None:
                self._slots = max(1, gpus)
        return self._slots

    @property
    def gpus(self) -> int:
        """Returns the GPUs the evaluations share: one per slot."""
        return self.slots

    def _declared_gpus(self) -> int | None:
        """Returns the GPUs the workers declare now (None: the scheduler cannot say)."""
        if self._client.status != "running":
            return None
        try:
            workers = self._client.scheduler_info()["workers"].values()
        except Exception:  # noqa: BLE001 - a lost scheduler shows on the next result
            return None
        return int(sum(w.get("resources", {}).get("GPU", 0) for w in workers))

    def submit(self, source: str, suffix: str, label: str,
               rival: str | None = None) -> cf.Future[EvalResult]:
        """Sends one candidate (with a duel's rival) to the cluster; its result arrives on the
        returned future."""
        fut: cf.Future[EvalResult] = cf.Future()
        cand = _Candidate(fut, source, suffix, label, rival)
        fut.add_done_callback(lambda f: self._forget(cand, f.cancelled()))
        self._send(cand)
        return fut

    def calibrate(self, seed: EvalResult) -> None:
        """Derives every later candidate's run deadline from the seed's evaluation."""
        self._spec = self._spec.calibrated(seed)

    def close(self) -> None:
        """Cancels the tasks still out and leaves the cluster (the workers go on serving)."""
        if self._closing:
            return
        self._closing = True
        with self._lock:
            tasks = [c.task for c in self._tokens.values() if c.task is not None]
            waiting = [c.future for c in self._tokens.values()]
        for fut in waiting:
            fut.cancel()
        try:
            if tasks and self._client.status == "running":
                self._client.cancel(tasks)
            self._client.close(timeout=CONNECT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - leaving a cluster that is already gone
            pass
        self._helper.shutdown(wait=False, cancel_futures=True)

    # ---- the tries of one candidate ----------------------------------------------------
    def _send(self, cand: _Candidate) -> None:
        """Submits one try of a candidate as a task that needs one GPU."""
        token = f"{cand.label}-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._tokens[token] = cand
        try:
            task = self._client.submit(
                evaluate_task, self._spec.to_json(), cand.source, cand.suffix, cand.label, token,
                cand.rival, key=f"evoattn-{token}",
                pure=False, resources={"GPU": 1})
        except Exception as e:  # noqa: BLE001 - a client that lost its scheduler
            self._lost(cand, e)
            return
        cand.task = task
        task.add_done_callback(lambda t: self._on_done(cand, t))

    def _on_done(self, cand: _Candidate, task: Any) -> None:
        """Turns a finished try into the candidate's result, another try, or ClusterError."""
        if cand.future.done() or task is not cand.task:
            return                                # marked already, or a cancelled earlier try
        if task.status == "finished":
            try:
                result = EvalResult.from_json(task.result())
            except Exception as e:  # noqa: BLE001 - a worker running another evoattn
                result = _fault(cand, f"the worker's answer cannot be read: {e}")
            _settle(cand.future, result)
        elif task.status == "error":
            exc = task.exception()
            if not isinstance(exc, self._killed_worker):
                _settle(cand.future, _fault(cand, "the Dask task failed on its worker: "
                                                  f"{type(exc).__name__}: {_first_line(exc)}"))
                return
            cand.deaths += exc.allowed_failures + 1
            if cand.deaths < TRIES and not self._closing:
                task.release()
                self._send(cand)                  # the scheduler did not retry it: once more
            else:
                _settle(cand.future, _died(cand, cand.deaths, exc.last_worker.address))
        elif not self._closing:
            self._lost(cand, None)

    def _on_start(self, event: tuple[float, dict[str, Any]]) -> None:
        """Counts the tries of a candidate as they start (on the client's event loop); cancels
        a third one, which only a scheduler with allowed-failures above 1 starts."""
        msg = event[1]
        with self._lock:
            cand = self._tokens.get(str(msg.get("token")))
            if cand is None or cand.future.done():
                return
            cand.workers.append(str(msg.get("worker")))
            if len(cand.workers) <= TRIES:
                return
            task = cand.task
        _settle(cand.future, _died(cand, len(cand.workers) - 1, cand.workers[-2]))
        if not self._closing:
            self._helper.submit(_cancel, task)    # off the event loop: cancel() waits on it

    def _forget(self, cand: _Candidate, cancelled: bool) -> None:
        """Drops a settled candidate and its task: a result kept on a worker would be computed
        again if that worker died; a task the search cancelled is stopped."""
        with self._lock:
            for token in [t for t, c in self._tokens.items() if c is cand]:
                del self._tokens[token]
            task, cand.task = cand.task, None
        if task is None or self._closing:
            return
        if cancelled:
            self._helper.submit(_cancel, task)
        else:
            task.release()

    def _lost(self, cand: _Candidate, error: BaseException | None) -> None:
        detail = f": {_first_line(error)}" if error is not None else ""
        err = ClusterError(f"lost the Dask scheduler at {self.address}{detail}; the run can "
                           "go on with --resume once it is back")
        try:
            cand.future.set_exception(err)
        except cf.InvalidStateError:
            pass


# ---- the worker's side ---------------------------------------------------------------------
_here_lock = threading.Lock()
_here: dict[str, Any] = {}             # this worker process's slot and its spec's key


def evaluate_task(spec_json: dict[str, Any], source: str, suffix: str, label: str, token: str,
                  rival: str | None = None) -> dict[str, Any]:
    """Evaluates one candidate on this Dask worker (a task); returns its EvalResult's JSON."""
    _announce(token)
    with _here_lock:
        if "thread" not in _here:
            # One long-lived thread starts every zygote: a process's parent-death signal
            # follows the thread that started it, and Dask may retire its task threads.
            _here["thread"] = cf.ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="evoattn-eval")
        thread = _here["thread"]
    return thread.submit(_evaluate_here, spec_json, source, suffix, label, rival).result()


def _evaluate_here(spec_json: dict[str, Any], source: str, suffix: str, label: str,
                   rival: str | None = None) -> dict[str, Any]:
    key = json.dumps(spec_json, sort_keys=True)
    if _here.get("key") != key:                  # a new run, or the calibrated deadline
        old = _here.pop("slot", None)
        if old is not None:
            old.close()
        # The worker's own cache, and the timing CPUs of its GPU: the worker's CUDA devices
        # reach the children as they are.
        _here["slot"] = SlotSpec.from_json(spec_json).slot(timing_cpus=worker_cpus())
        _here["key"] = key
    return _here["slot"].evaluate(source, suffix, label, rival).to_json()


def worker_cpus() -> tuple[int, ...]:
    """The CPUs this worker's timings pick from: its GPU's block of the machine's (the first
    of CUDA_VISIBLE_DEVICES, as dask-cuda sets it per worker), so that the workers of one
    machine do not all pin their timings to its one fastest CPU; () where that is unknown."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not first or not hasattr(os, "sched_getaffinity"):
        return ()
    return gpu_block(first, 0, 1)


def _announce(token: str) -> None:
    """Tells the client that a try of this candidate starts on this worker."""
    try:
        from distributed import get_worker
        worker = get_worker()
    except (ImportError, ValueError):             # called outside a worker
        return
    worker.log_event(START_TOPIC, {"token": token, "worker": worker.address})


# ---- helpers -------------------------------------------------------------------------------
def _import_distributed() -> Any:
    try:
        import distributed
    except ImportError:
        raise UsageError("evaluator.backend: dask needs Dask distributed: "
                         "pip install 'evoattn[dask]'") from None
    return distributed


def _probe(address: str, timeout_s: float) -> None:
    """Raises OSError at once when nothing listens at a tcp:// or tls:// address (ValueError
    when it is no address); a Client would retry for its whole timeout first."""
    from distributed.comm import get_address_host_port, parse_address
    scheme, _ = parse_address(address)
    host, port = get_address_host_port(address)
    if scheme in ("tcp", "tls"):
        socket.create_connection((host, port), timeout=timeout_s).close()


def _fault(cand: _Candidate, reason: str) -> EvalResult:
    return EvalResult.failure(Verdict.EVALUATOR_FAULT, reason, candidate=cand.label)


def _died(cand: _Candidate, deaths: int, last_worker: str) -> EvalResult:
    return _fault(cand, f"the Dask worker evaluating it died {deaths} times (last: "
                        f"{last_worker}); no verdict on the kernel")


def _settle(future: cf.Future[EvalResult], result: EvalResult) -> None:
    try:
        future.set_result(result)
    except cf.InvalidStateError:                  # cancelled by the search, or marked already
        pass


def _cancel(task: Any) -> None:
    try:
        task.cancel()
    except Exception:  # noqa: BLE001 - the cluster may be gone already
        pass


def _first_line(e: BaseException | None) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
