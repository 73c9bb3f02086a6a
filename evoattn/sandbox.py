"""Parent side of the evaluator boundary: one child process per candidate.

The orchestrator never imports candidate code and never touches CUDA. Each candidate runs
in a process of its own (forked from a warm zygote, or a fresh `python -m evoattn.child.worker`),
in a fresh process session, in a temporary directory, with an environment stripped of
secrets, and under deadlines for its build and its run. Whatever happens to the child, the
parent returns an EvalResult; when the evaluator itself fails (the zygote or the child
killed from outside), that is an `evaluator_fault`, not a verdict on the kernel, and the
candidate is evaluated once more on a fresh zygote.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from evoattn.contract import program
from evoattn.contract.names import Stage
from evoattn.contract.request import EvalRequest
from evoattn.contract.types import EvalResult, Verdict

from .childenv import SPARES, SandboxSettings, child_env, default_cache_dir, gpu_lock_path
from .launch import LaunchError, PopenChild, Zygote, ZygoteChild, pid_alive, private_dir
from .station import Station, StationError
from .watch import Watch, classify_death, stage_seconds, tail


def run_deadline(seed: EvalResult, factor: float, floor_s: float, ceiling_s: float) -> float:
    """Returns a run-stage deadline from the seed's: `factor` × its run stages (everything
    after its build), at least `floor_s` and at most `ceiling_s`."""
    ran = sum(v for k, v in seed.stage_s.items()
              if k not in (Stage.START, Stage.BUILD, Stage.GPU_WAIT))
    return max(floor_s, min(ceiling_s, factor * ran)) if ran > 0 else ceiling_s


class SubprocessEvaluator:
    """Evaluates candidates in child processes (implements evoattn.types.Evaluator)."""

    def __init__(self, request: EvalRequest, sandbox: SandboxSettings = SandboxSettings(),
                 plain: dict[str, Any] | None = None) -> None:
        """`plain`: request fields a plain candidate's evaluation (one without a rival) takes
        instead of `request`'s (a run's candidate_width, no graph mode); duels keep `request`."""
        cache = os.path.realpath(sandbox.cache_dir or default_cache_dir())
        os.makedirs(cache, exist_ok=True)
        self.sandbox = dataclasses.replace(sandbox, cache_dir=cache)
        self.request = dataclasses.replace(request, cache_dir=cache)
        self._spares = sandbox.spare and sandbox.zygote and sandbox.station_refresh_s is None
        if (sandbox.gpu_share > 1 and request.device == "cuda") or self._spares:
            self.request = dataclasses.replace(self.request, gpu_lock=gpu_lock_path(
                cache, sandbox.visible_device or "default"))
        if sandbox.timing_cpus:
            self.request = dataclasses.replace(self.request, timing_cpus=sandbox.timing_cpus)
        self.plain = dict(plain or {})
        # the station times baselines for plain candidates only: by their protocol
        plain_request = dataclasses.replace(self.request, **self.plain)
        self._zygote: Zygote | None = None
        self._zygote_failed = False
        self._zygote_lock = threading.Lock()
        self._closed = False
        self._abort = threading.Event()
        self._station: Station | None = None
        self._spare_queue: list[_Spare] = []     # oldest (most likely set up) first
        self._spare_lock = threading.Lock()
        if sandbox.station_refresh_s is not None:
            env = child_env(dict(os.environ), "", cache, request.device, sandbox.secret_env_names)
            if sandbox.visible_device is not None and request.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = sandbox.visible_device
            self._station = Station(plain_request, env, sandbox.station_refresh_s)

    def evaluate(self, source: str, suffix: str, label: str = "candidate",
                 rival: str | None = None) -> EvalResult:
        """Returns the verdict on `source` (a program text, see evoattn/contract/program.py).

        `rival`: another program's text, timed beside it in the same rounds against the same
        baselines (a duel); the result carries the rival's fitness and the gain."""
        result = self._evaluate_once(source, suffix, label, rival)
        if result.verdict is Verdict.EVALUATOR_FAULT and not self._abort.is_set():
            # once more, on a fresh zygote
            self._stop_zygote()
            again = self._evaluate_once(source, suffix, label, rival)
            if again.verdict is Verdict.EVALUATOR_FAULT:
                return dataclasses.replace(again, reason=f"twice: {again.reason} (first: "
                                           f"{result.reason})")
            # an evaluator condition, not an integrity flag: a run counts flags as suspicions
            return dataclasses.replace(again, device_info={
                **again.device_info, "evaluated_again": result.reason})
        if result.verdict is Verdict.OOM and self._spares and not self._abort.is_set() and \
                not result.reason.startswith("host memory"):
            return self._without_spares(result, source, suffix, label, rival)
        return result

    def _without_spares(self, result: EvalResult, source: str, suffix: str, label: str,
                        rival: str | None) -> EvalResult:
        """A candidate out of GPU memory beside this slot's spares (which hold memory of their
        own) is evaluated again with none. If it fits alone, the spares were the cause: this
        slot keeps none from now on (said once); if not, the verdict stands."""
        self._spares = False
        self._drop_spares()
        again = self._evaluate_once(source, suffix, label, rival)
        if again.verdict is Verdict.OOM:
            self._spares = True
            return again
        print("evoattn: a candidate ran out of GPU memory beside this slot's spare processes "
              "and not alone; the slot keeps none from now on (evaluator.spare)", file=sys.stderr)
        return dataclasses.replace(again, flags=again.flags + (
            f"evaluated again without spare processes: {result.reason}",))

    def calibrate(self, seed: EvalResult) -> None:
        """Derives the run deadline from the seed's evaluation (SandboxSettings.run_factor),
        and takes the GPU's matmul ceiling its child measured (alone on the GPU) for every
        later child."""
        s, deadline = self.sandbox, self.request.run_timeout_s
        if s.run_factor is not None:
            deadline = run_deadline(seed, s.run_factor, s.run_floor_s, deadline)
        ceiling = (seed.device_info or {}).get("measured_matmul_tflops")
        self.request = dataclasses.replace(
            self.request, run_timeout_s=deadline,
            ceiling_tflops=self.request.ceiling_tflops or ceiling or None)

    def abort(self) -> None:
        """Ends the evaluation in progress, if any, at once (its child is killed); for good."""
        self._abort.set()

    def prestart(self) -> None:
        """Starts the zygote now, if it is used (a pool's slots start theirs while the seed
        is evaluated: seconds of imports each); a failure is left for the first launch."""
        if self.sandbox.zygote:
            try:
                self._ready_zygote()
            except LaunchError:
                pass

    def close(self) -> None:
        """Stops the zygote, its spare children and the station, if they were started."""
        with self._zygote_lock:
            self._closed = True
        self._stop_zygote()
        if self._station is not None:
            self._station.close()

    def child_environment(self, work: str) -> dict[str, str]:
        """Returns a candidate's environment: the scrubbed one, with this evaluator's GPU."""
        s = self.sandbox
        env = child_env(dict(os.environ), work, s.cache_dir, self.request.device,
                        s.secret_env_names)
        if s.visible_device is not None and self.request.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = s.visible_device
        return env

    def _stop_zygote(self) -> None:
        self._drop_spares()                    # the zygote's children
        with self._zygote_lock:
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None

    def _spare_template(self) -> EvalRequest:
        """The request a spare prepares for: a plain candidate's, its secret drawn now."""
        return dataclasses.replace(self.request, **self.plain, secret_seed=secrets.randbits(62))

    def _fork_spare(self, only_if_none: bool = False) -> None:
        """Forks a spare child for a later candidate, up to SPARES of them (`only_if_none`: if
        there is none)."""
        if not self._spares or self._zygote_failed or self._abort.is_set():
            return
        with self._spare_lock:
            if len(self._spare_queue) >= (1 if only_if_none else SPARES):
                return
        work = tempfile.mkdtemp(prefix="evoattn-")
        template = self._spare_template()
        log_path = private_dir(work) / "child.log"
        try:
            child = self._ready_zygote().launch({"nonce": "", "request": template.to_json()},
                                                work, self.child_environment(work), log_path,
                                                spare=True)
        except LaunchError:
            shutil.rmtree(work, ignore_errors=True)
            return                              # the candidate's own launch will say why
        with self._spare_lock:
            self._spare_queue.append(_Spare(child, work, template))

    def _take_spare(self, req: EvalRequest) -> "_Spare | None":
        """Returns the oldest spare that is alive and set up for `req` (its secret seed
        aside, which the caller takes from it, as its directory); drops those that are not."""
        while True:
            with self._spare_lock:
                if not self._spare_queue:
                    return None
                spare = self._spare_queue.pop(0)
            probe = dataclasses.replace(req, secret_seed=spare.template.secret_seed)
            if spare.alive() and spare.template.same_set_up(probe):
                return spare
            spare.discard()

    def _drop_spares(self) -> None:
        with self._spare_lock:
            spares, self._spare_queue = self._spare_queue, []
        for spare in spares:
            spare.discard()

    def _ready_zygote(self) -> Zygote:
        """Returns the zygote, started if it is not running."""
        with self._zygote_lock:
            if self._closed:
                raise LaunchError("the evaluator is closed")
            if self._zygote is None or not self._zygote.alive():
                s = self.sandbox
                self._zygote = Zygote(child_env(dict(os.environ), "", s.cache_dir,
                                                self.request.device, s.secret_env_names))
            return self._zygote

    def _evaluate_once(self, source: str, suffix: str, label: str,
                       rival: str | None = None) -> EvalResult:
        t0 = time.monotonic()
        base = self.request if rival is not None else dataclasses.replace(self.request,
                                                                          **self.plain)
        spare = self._take_spare(base) if self._spares else None
        work = spare.work if spare is not None else tempfile.mkdtemp(prefix="evoattn-")
        try:
            try:
                main = program.write(source, work, f"candidate{suffix}")
                rival_main = program.write(rival, os.path.join(work, "rival"),
                                           f"rival{suffix}") if rival is not None else None
            except (program.ProgramError, OSError) as e:
                return EvalResult.failure(Verdict.LOAD_ERROR, f"cannot write the program: {e}",
                                          problem=self.request.problem, candidate=label)
            req = dataclasses.replace(base, candidate=str(main),
                                      allowed_dirs=(work, os.path.join(self.sandbox.cache_dir,
                                                                       "triton")),
                                      secret_seed=spare.template.secret_seed if spare else
                                      secrets.randbits(62),
                                      rival=str(rival_main or ""))
            # A duel times the baselines beside both programs; otherwise the station's times.
            req = req if rival is not None else self._with_station(req)
            result, stages = self._run_child(req, work, spare)
            return dataclasses.replace(result, candidate=label, stage_s=stages,
                                       duration_s=round(time.monotonic() - t0, 3))
        finally:
            if spare is not None:
                spare.discard()                 # its handle, and `work`, its directory
            else:
                shutil.rmtree(work, ignore_errors=True)

    def _with_station(self, req: EvalRequest) -> EvalRequest:
        """Adds the station's baseline times and ceiling; without a station, or once it has
        failed (said once), the child times the baselines itself."""
        if self._station is None:
            return req
        try:
            times, ceiling = self._station.for_candidate()
        except StationError as e:
            print(f"evoattn: {e}; each candidate times its baselines itself from now on",
                  file=sys.stderr)
            self._station.close()
            self._station = None
            return req
        return dataclasses.replace(req, baseline_times=times, ceiling_tflops=ceiling)

    def _launch(self, message: dict[str, Any], work: str, env: dict[str, str],
                log_path: Path) -> Any:
        """Starts the candidate's process: a zygote fork when possible, else a fresh one."""
        s = self.sandbox
        if s.zygote and not self._zygote_failed:
            try:
                return self._ready_zygote().launch(message, work, env, log_path)
            except LaunchError as e:
                self._zygote_failed = True     # say so once, then use fresh interpreters
                print(f"evoattn: the zygote failed ({e}); starting each candidate in a "
                      "fresh interpreter", file=sys.stderr)
        return PopenChild(message, work, env, log_path)

    def _run_child(self, req: EvalRequest, work: str,
                   spare: "_Spare | None" = None) -> tuple[EvalResult, dict[str, float]]:
        """Returns the child's result and the wall seconds spent in each stage it reported;
        `spare`: a prepared child for it, told its candidate here (else one is started)."""
        s = self.sandbox
        env = self.child_environment(work)
        log_path = private_dir(work) / "child.log"
        nonce = secrets.token_hex(16)
        marks: list[tuple[str, float]] = [(Stage.START, time.monotonic())]   # zygote start too
        message = {"nonce": nonce, "request": req.to_json()}
        if spare is not None:
            spare.child.go(message)
            child = spare.child
        else:
            child = self._launch(message, work, env, log_path)
        self._fork_spare(only_if_none=True)    # the next candidate's, set up meanwhile
        # More once this child's timing is over: their set-up (which waits for the end of any
        # timing) then overlaps the next candidate's checks, not its timing.
        watch = Watch(child, req, s, self._zygote if s.zygote else None, self._abort,
                       self._fork_spare)
        try:
            result, reason = watch.follow(nonce, marks)
        finally:
            child.kill()
            if spare is None:
                child.close()
        stages = stage_seconds(marks, time.monotonic())
        log = tail(log_path)
        common = dict(log_tail=log, problem=req.problem, timing=req.timing,
                      baseline=req.baseline, timing_device=req.device)
        if reason is not None:
            return EvalResult.failure(reason[0], reason[1], **common), stages
        if result is not None:
            return dataclasses.replace(EvalResult.from_json(result), log_tail=log), stages
        return EvalResult.failure(*classify_death(child.returncode(), log, watch.stage),
                                  **common), stages


@dataclasses.dataclass
class _Spare:
    """A spare child (evoattn/child/worker.serve_spare), its directory and what it prepares for."""

    child: ZygoteChild
    work: str
    template: EvalRequest
    closed: bool = False

    def alive(self) -> bool:
        """Whether the child still waits (its zygote reports its exit only while it lives)."""
        child = self.child
        return child.zygote.alive() and child.returncode() is None and pid_alive(child.pid)

    def discard(self) -> None:
        """Ends the child, closes its handle and removes its directory; once."""
        if self.closed:
            return
        self.closed = True
        self.child.kill()
        self.child.close()
        shutil.rmtree(self.work, ignore_errors=True)


