"""Parent side of the evaluator boundary: one child process per candidate.

The orchestrator never imports candidate code and never touches CUDA. Each candidate runs
in a process of its own (forked from a warm zygote, or a fresh `python -m evaluator.worker`),
in a fresh process session, in a temporary directory, with an environment stripped of
secrets, and under deadlines for its build and its run. Whatever happens to the child, the
parent returns an EvalResult; when the evaluator itself fails (the zygote or the child
killed from outside), that is an `evaluator_fault`, not a verdict on the kernel, and the
candidate is evaluated once more on a fresh zygote.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from evaluator import program
from evaluator.names import Stage
from evaluator.request import EvalRequest
from evaluator.types import EvalResult, Verdict
from evaluator.types import SPARE_UNPREPARED

from .launch import LaunchError, PopenChild, Zygote, ZygoteChild, pid_alive, private_dir
from .station import Station, StationError

_ENV_KEEP = re.compile(r"^(PATH|LD_LIBRARY_PATH|LANG|LC_\w+|CUDA_\w+|NVIDIA_\w+|TRITON_\w+|"
                       r"TORCH_\w+|PYTORCH_\w+|NCCL_\w+|CC|CXX|CUDAHOSTCXX|OMP_NUM_THREADS|"
                       r"MKL_\w+|OPENBLAS_\w+|TERM|VIRTUAL_ENV|CONDA_PREFIX|NVCC_\w+|"
                       r"TORCH_CUDA_ARCH_LIST|MAX_JOBS|TORCH_EXTENSIONS_DIR)$")
_ENV_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE",
                         re.IGNORECASE)
_STARTUP_S = 120.0   # importing torch and CUDA initialisation, before the build starts
GPU_WAIT_SLACK_S = 10.0   # a turn's end: the kill of a child past its deadline, its exit
SPARES = 2                # spare children a slot keeps (SandboxSettings.spare): one set up,
                          # one setting up while a candidate checks


def child_env(base: dict[str, str], workdir: str, cache_dir: str, device: str,
              extra_secret_names: tuple[str, ...] = ()) -> dict[str, str]:
    """Returns the child's environment: an allow-list of the parent's, minus anything secret."""
    env = {k: v for k, v in base.items()
           if _ENV_KEEP.match(k) and not _ENV_SECRET.search(k) and k not in extra_secret_names}
    repo_root = str(Path(__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(p for p in [repo_root, base.get("PYTHONPATH", "")] if p)
    env.update(HOME=workdir, TMPDIR=workdir, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1",
               PYTHONDONTWRITEBYTECODE="1", TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               TORCH_EXTENSIONS_DIR=os.path.join(cache_dir, "torch_ext"),
               TORCHINDUCTOR_COMPILE_THREADS="1")   # compiles in-process, no worker pool
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


@dataclasses.dataclass(frozen=True)
class SandboxSettings:
    """How the parent runs children: limits, the cache, which GPU, what never reaches them."""

    cache_dir: str = ""                        # "" = $EVOATTN_CACHE or ~/.cache/evoattn
    max_host_mem_bytes: int = 32 * 2 ** 30
    visible_device: str | None = None          # the child's CUDA_VISIBLE_DEVICES (one GPU)
    secret_env_names: tuple[str, ...] = ()     # e.g. the LLM key's variable
    # Fork candidates from a warm zygote (torch imported once); EVOATTN_ZYGOTE=0 turns it off.
    zygote: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("EVOATTN_ZYGOTE", "1") != "0")
    # A run's station (evoattn/station.py) times the baselines once for every candidate,
    # again when its times are older than station_refresh_s; None: each child times them.
    station_refresh_s: float | None = None
    # Evaluations sharing visible_device (a run's `evaluator.per_gpu`): their children take
    # turns on it through a lock file in the cache (gpu_lock_path).
    gpu_share: int = 1
    # The CPUs the children's timing picks its CPU from (evaluator/cpu_pin.py); empty: any
    # of theirs. A machine's GPUs get disjoint blocks.
    timing_cpus: tuple[int, ...] = ()
    # Keep spare children (SPARES), forked from the zygote, that set up the next candidates'
    # evaluations (CUDA, the baselines' plans, inputs and references) while one is evaluated;
    # a set-up never overlaps another evaluation's timing (a GPU lock, evaluator/gpu_turn.py).
    # A run's slots on a GPU keep them; without the zygote or with a station, none is kept.
    spare: bool = False

    def gpu_wait_s(self, run_timeout_s: float) -> float:
        """How long a child may wait for its turn: each other sharer's turn (its run stage,
        after which its parent kills it) and some slack."""
        return max(1, self.gpu_share - 1) * (run_timeout_s + GPU_WAIT_SLACK_S)


def run_deadline(seed: EvalResult, factor: float, floor_s: float, ceiling_s: float) -> float:
    """Returns a run-stage deadline from the seed's: `factor` × its run stages (everything
    after its build), at least `floor_s` and at most `ceiling_s`."""
    ran = sum(v for k, v in seed.stage_s.items() if k not in (Stage.START, Stage.BUILD, Stage.GPU_WAIT))
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
        """Returns the verdict on `source` (a program text, see evaluator/program.py).

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
        import sys
        print("evoattn: a candidate ran out of GPU memory beside this slot's spare processes "
              "and not alone; the slot keeps none from now on (evaluator.spare)", file=sys.stderr)
        return dataclasses.replace(again, flags=again.flags + (
            f"evaluated again without spare processes: {result.reason}",))

    def calibrate(self, seed: EvalResult, factor: float, floor_s: float) -> float:
        """Derives the run deadline from the seed's evaluation, and takes the GPU's matmul
        ceiling its child measured (alone on the GPU) for every later child; returns the
        deadline."""
        deadline = run_deadline(seed, factor, floor_s, self.request.run_timeout_s)
        ceiling = (seed.device_info or {}).get("measured_matmul_tflops")
        self.request = dataclasses.replace(
            self.request, run_timeout_s=deadline,
            ceiling_tflops=self.request.ceiling_tflops or ceiling or None)
        return deadline

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
            import sys
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
                import sys
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
        watch = _Watch(child, req, s, self._zygote if s.zygote else None, self._abort,
                       self._fork_spare)
        try:
            result, reason = watch.follow(nonce, marks)
        finally:
            child.kill()
            if spare is None:
                child.close()
        stages = _stage_seconds(marks, time.monotonic())
        tail = _tail(log_path)
        common = dict(log_tail=tail, problem=req.problem, timing=req.timing,
                      baseline=req.baseline, timing_device=req.device)
        if reason is not None:
            return EvalResult.failure(reason[0], reason[1], **common), stages
        if result is not None:
            return dataclasses.replace(EvalResult.from_json(result), log_tail=tail), stages
        return EvalResult.failure(*_classify_death(child.returncode(), tail, watch.stage),
                                  **common), stages


@dataclasses.dataclass
class _Spare:
    """A spare child (evaluator/worker.serve_spare), its directory and what it prepares for."""

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


class _Watch:
    """Follows one child: its messages, its deadlines, its memory, and the evaluator's health."""

    def __init__(self, child: Any, req: EvalRequest, s: SandboxSettings,
                 zygote: Zygote | None, abort: threading.Event,
                 timed: Callable[[], None] = lambda: None) -> None:
        """`timed`: called once the child is past its timing (or has answered)."""
        self.child, self.req, self.s, self.zygote = child, req, s, zygote
        self.abort = abort
        self.stage = Stage.START
        self._timed: Callable[[], None] | None = timed

    def follow(self, nonce: str, marks: list[tuple[str, float]]
               ) -> tuple[dict[str, Any] | None, tuple[Verdict, str] | None]:
        """Returns (the child's result JSON, None) or (None, a verdict the parent reached)."""
        req, rfd = self.req, self.child.result_fd
        deadline = time.monotonic() + _STARTUP_S + req.build_timeout_s
        left = req.run_timeout_s           # the run stage's time left when it began to wait
        buf = b""
        while True:
            now = time.monotonic()
            if self.abort.is_set():
                return None, (Verdict.EVALUATOR_FAULT, "the evaluation was stopped (the run "
                              "is ending)")
            if now > deadline and self.stage == Stage.GPU_WAIT:
                return None, (Verdict.EVALUATOR_FAULT, "waited over "
                              f"{self.s.gpu_wait_s(req.run_timeout_s):.0f} s for its turn on "
                              "the GPU, which another evaluation held")
            if now > deadline:
                limit = req.build_timeout_s if self.stage in (Stage.START, Stage.BUILD) else \
                    req.run_timeout_s
                return None, (Verdict.TIMEOUT, f"timed out in stage '{self.stage}' "
                              f"(limit {limit:.0f} s)")
            rss = _rss_bytes(self.child.pid)
            if rss > self.s.max_host_mem_bytes:
                return None, (Verdict.OOM, f"host memory {rss / 2**30:.1f} GiB over the limit "
                              f"{self.s.max_host_mem_bytes / 2**30:.1f} GiB")
            fault = self._fault()
            if fault:
                return None, (Verdict.EVALUATOR_FAULT, fault)
            dead = self.child.returncode() is not None
            ready, _, _ = select.select([rfd], [], [], 0 if dead else
                                        min(0.2, max(0.0, deadline - now)))
            chunk = _read(rfd) if ready else b""
            if chunk is None:                     # EOF: every writer has gone
                return None, self._death_fault()
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = _parse(line, nonce)
                if msg is None:
                    continue
                if msg["type"] == "stage":
                    now, was = time.monotonic(), self.stage
                    self.stage = str(msg["payload"])[:40]
                    marks.append((self.stage, now))
                    if was == Stage.TIME != self.stage:
                        self._past_timing()
                    if was == Stage.BUILD != self.stage:  # the run: everything after the build
                        deadline = now + req.run_timeout_s
                    if self.stage == Stage.BUILD:
                        deadline = now + req.build_timeout_s
                    elif self.stage == Stage.GPU_WAIT:    # the others' turns: not its own time
                        left = deadline - now
                        deadline = now + self.s.gpu_wait_s(req.run_timeout_s)
                    elif was == Stage.GPU_WAIT:
                        deadline = now + left
                elif msg["type"] == "result":
                    self._past_timing()
                    return msg["payload"], None    # the first result wins
            if dead and not chunk:
                return None, self._death_fault()

    def _past_timing(self) -> None:
        if self._timed is not None:
            timed, self._timed = self._timed, None
            timed()

    def _fault(self) -> str | None:
        """Returns why the evaluator itself failed (its zygote died), or None."""
        if self.zygote is not None and not self.zygote.alive():
            return (f"the evaluator's zygote process died (exit code {self.zygote.exit_code()}) "
                    f"in stage '{self.stage}', taking the candidate's process with it")
        return None

    def _death_fault(self) -> tuple[Verdict, str] | None:
        """A child killed by SIGKILL that the parent did not send: the OOM killer or a stray
        kill, from outside; the candidate is evaluated again (None: judge the death as usual)."""
        code = self.child.returncode()
        until = time.monotonic() + 2.0        # the zygote reports a child's exit within 0.1 s
        while code is None and time.monotonic() < until and self._fault() is None:
            time.sleep(0.02)
            code = self.child.returncode()
        if code == -signal.SIGKILL or (code is None and not pid_alive(self.child.pid)):
            return Verdict.EVALUATOR_FAULT, (f"the candidate's process was killed from outside "
                                             f"(SIGKILL) in stage '{self.stage}'")
        if code == SPARE_UNPREPARED and self.stage == Stage.START:
            return Verdict.EVALUATOR_FAULT, "the spare process's set-up failed before it " \
                "was told its candidate"
        return self._fault_verdict()

    def _fault_verdict(self) -> tuple[Verdict, str] | None:
        fault = self._fault()
        return (Verdict.EVALUATOR_FAULT, fault) if fault else None


def _stage_seconds(marks: list[tuple[str, float]], end: float) -> dict[str, float]:
    """Turns (stage, time it began) marks into wall seconds per stage ('start': the launch
    and imports before the child's first report)."""
    out: dict[str, float] = {}
    for (name, t), nxt in zip(marks, [m[1] for m in marks[1:]] + [end]):
        out[name] = round(out.get(name, 0.0) + nxt - t, 3)
    return out


def _read(fd: int) -> bytes | None:
    """Returns what is readable on fd (b"" when nothing), or None at end of file."""
    try:
        chunk = os.read(fd, 1 << 20)
    except BlockingIOError:
        return b""
    return chunk or None


def gpu_lock_path(cache_dir: str, device: str) -> str:
    """Returns the file that the children sharing one GPU lock to take turns on it (named by
    the GPU's id as the orchestrator sees it: runs on one machine with one cache share it)."""
    return os.path.join(cache_dir, "gpu-locks", f"gpu-{device}.lock")


def default_cache_dir() -> str:
    """Returns the build/Triton cache directory ($EVOATTN_CACHE or ~/.cache/evoattn)."""
    return os.environ.get("EVOATTN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "evoattn")


def _parse(line: bytes, nonce: str) -> dict[str, Any] | None:
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    if not isinstance(msg, dict) or msg.get("nonce") != nonce:
        return None
    return msg


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _classify_death(code: int | None, tail: str, stage: str) -> tuple[Verdict, str]:
    low = tail.lower()
    if "out of memory" in low or "outofmemoryerror" in low or "cudaerrormemoryallocation" in low:
        return Verdict.OOM, f"ran out of memory in stage '{stage}'"
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return Verdict.CRASH, f"child died with {name} in stage '{stage}'"
    hint = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
    return Verdict.CRASH, f"child exited with code {code} in stage '{stage}' without a result" + (
        f": {hint[:200]}" if hint else "")


def _tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def detect_target(device: str) -> str | None:
    """The run's `@target` fact for knob conditions: "cpu", or "smXY" from the visible GPUs'
    compute capability (nvidia-smi, so CUDA is not initialised here) when they all agree;
    None when that cannot be told (the mutator then rules nothing out)."""
    if device == "cpu":
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    caps = {c.strip() for c in out.splitlines() if re.fullmatch(r"\d+\.\d+", c.strip())}
    return "sm" + caps.pop().replace(".", "") if len(caps) == 1 else None
