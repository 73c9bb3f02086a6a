"""Parent side of the evaluator boundary: one child process per candidate.

The orchestrator never imports candidate code and never touches CUDA. Each
candidate runs in `python -m evaluator.worker` in a fresh process session, in a
temporary directory of its own, with an environment stripped of secrets, and
under hard deadlines for build and run. Whatever happens to the child, the
parent returns an EvalResult.
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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from evaluator.types import EvalResult, Verdict

from .launch import LaunchError, PopenChild, Zygote

_ENV_KEEP = re.compile(r"^(PATH|LD_LIBRARY_PATH|LANG|LC_\w+|CUDA_\w+|NVIDIA_\w+|TRITON_\w+|"
                       r"TORCH_\w+|PYTORCH_\w+|NCCL_\w+|CC|CXX|CUDAHOSTCXX|OMP_NUM_THREADS|"
                       r"MKL_\w+|OPENBLAS_\w+|TERM|VIRTUAL_ENV|CONDA_PREFIX|NVCC_\w+|"
                       r"TORCH_CUDA_ARCH_LIST|MAX_JOBS|TORCH_EXTENSIONS_DIR)$")
_ENV_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE",
                         re.IGNORECASE)
_STARTUP_S = 120.0   # importing torch and CUDA initialisation, before the build starts


def child_env(base: dict[str, str], workdir: str, cache_dir: str, device: str,
              extra_secret_names: tuple[str, ...] = ()) -> dict[str, str]:
    """Returns the child's environment: an allow-list of the parent's, minus anything secret."""
    env = {k: v for k, v in base.items()
           if _ENV_KEEP.match(k) and not _ENV_SECRET.search(k) and k not in extra_secret_names}
    repo_root = str(Path(__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(p for p in [repo_root, base.get("PYTHONPATH", "")] if p)
    env.update(HOME=workdir, TMPDIR=workdir, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1",
               PYTHONDONTWRITEBYTECODE="1", TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               TORCH_EXTENSIONS_DIR=os.path.join(cache_dir, "torch_ext"))
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What to evaluate against: the request fields the child needs besides the candidate."""

    problem: str = "sdpa"
    configs: tuple[dict[str, Any], ...] | None = None
    dtype: str | None = None
    device: str = "cuda"
    trials: int = 3
    warmup: int | None = None
    reps: int | None = None
    tolerance: dict[str, Any] = dataclasses.field(default_factory=dict)
    policy: str = "kernel-only"
    all_backends: bool = False
    build_timeout_s: float = 300.0
    run_timeout_s: float = 600.0
    max_host_mem_bytes: int = 32 * 2 ** 30
    cache_dir: str = ""
    gpu_index: int | None = None
    secret_env_names: tuple[str, ...] = ()
    check_only: bool = False
    screen: bool = True               # stop checking at the first failing config
    # Fork candidates from a warm zygote (torch imported once); EVOATTN_ZYGOTE=0 turns it off.
    zygote: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("EVOATTN_ZYGOTE", "1") != "0")


class SubprocessEvaluator:
    """Evaluates candidates in child processes (implements evoattn.types.Evaluator)."""

    def __init__(self, settings: EvalSettings) -> None:
        cache = settings.cache_dir or default_cache_dir()
        os.makedirs(cache, exist_ok=True)
        self.settings = dataclasses.replace(settings, cache_dir=os.path.realpath(cache))
        self._zygote: Zygote | None = None
        self._zygote_failed = False

    def evaluate(self, source: str, suffix: str, label: str = "candidate") -> EvalResult:
        """Returns the verdict on `source` (a .py or .cu program)."""
        s = self.settings
        work = tempfile.mkdtemp(prefix="evoattn-")
        t0 = time.monotonic()
        try:
            cand = Path(work) / f"candidate{suffix}"
            cand.write_text(source)
            request = {
                "candidate": str(cand), "problem": s.problem,
                "configs": [dict(c) for c in s.configs] if s.configs else None,
                "dtype": s.dtype, "device": s.device, "trials": s.trials,
                "tolerance": s.tolerance, "policy": s.policy, "all_backends": s.all_backends,
                "build_timeout_s": s.build_timeout_s, "cache_dir": s.cache_dir,
                "allowed_dirs": [work, s.cache_dir], "secret_seed": secrets.randbits(62),
                "check_only": s.check_only, "screen": s.screen,
                "nonce": secrets.token_hex(16),
            }
            if s.warmup is not None:
                request["warmup"] = s.warmup
            if s.reps is not None:
                request["reps"] = s.reps
            result, stages = self._run_child(request, work)
            return dataclasses.replace(result, candidate=label, stage_s=stages,
                                       duration_s=round(time.monotonic() - t0, 3))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def close(self) -> None:
        """Stops the zygote, if one was started."""
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None

    def _launch(self, request: dict[str, Any], work: str, env: dict[str, str],
                log_path: Path) -> Any:
        """Starts the candidate's process: a zygote fork when possible, else a fresh one."""
        if self.settings.zygote and not self._zygote_failed:
            try:
                if self._zygote is None or not self._zygote.alive():
                    template = child_env(dict(os.environ), work, self.settings.cache_dir,
                                         self.settings.device, self.settings.secret_env_names)
                    self._zygote = Zygote(template)
                return self._zygote.launch(request, work, env, log_path)
            except LaunchError:
                self._zygote_failed = True     # say so once, then use fresh interpreters
                print("evoattn: the zygote failed; starting each candidate in a fresh "
                      "interpreter", file=sys.stderr)
        return PopenChild(request, work, env, log_path)

    def _run_child(self, request: dict[str, Any], work: str
                   ) -> tuple[EvalResult, dict[str, float]]:
        """Returns the child's result and the wall seconds spent in each stage it reported."""
        s = self.settings
        env = child_env(dict(os.environ), work, s.cache_dir, s.device, s.secret_env_names)
        if s.gpu_index is not None and s.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(s.gpu_index)
        log_path = Path(work) / "child.log"
        nonce = request["nonce"]
        marks: list[tuple[str, float]] = [("start", time.monotonic())]   # zygote start too
        child = self._launch(request, work, env, log_path)
        rfd = child.result_fd
        stage, result, reason = "start", None, None
        deadline = time.monotonic() + _STARTUP_S + s.build_timeout_s
        buf = b""
        try:
            while result is None:
                now = time.monotonic()
                if now > deadline:
                    limit = s.build_timeout_s if stage in ("start", "build") else s.run_timeout_s
                    reason = (Verdict.TIMEOUT, f"timed out in stage '{stage}' (limit {limit:.0f} s)")
                    break
                rss = _rss_bytes(child.pid)
                if rss > s.max_host_mem_bytes:
                    reason = (Verdict.OOM, f"host memory {rss / 2**30:.1f} GiB over the limit "
                              f"{s.max_host_mem_bytes / 2**30:.1f} GiB")
                    break
                dead = child.returncode() is not None
                ready, _, _ = select.select([rfd], [], [], 0 if dead else
                                            min(0.2, max(0.0, deadline - now)))
                chunk = _read(rfd) if ready else b""
                if chunk is None:                     # EOF: every writer has gone
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = _parse(line, nonce)
                    if msg is None:
                        continue
                    if msg["type"] == "stage":
                        stage = str(msg["payload"])[:40]
                        marks.append((stage, time.monotonic()))
                        if stage == "build":
                            deadline = time.monotonic() + s.build_timeout_s
                        elif stage == "reference":   # everything after the build
                            deadline = time.monotonic() + s.run_timeout_s
                    elif msg["type"] == "result" and result is None:
                        result = msg["payload"]       # first result wins
                if dead and not chunk:
                    break
        finally:
            child.kill()
            child.close()
        stages = _stage_seconds(marks, time.monotonic())
        tail = _tail(log_path)
        if reason is not None:
            return (EvalResult.failure(reason[0], reason[1], log_tail=tail, problem=s.problem),
                    stages)
        if result is not None:
            return dataclasses.replace(EvalResult.from_json(result), log_tail=tail), stages
        return EvalResult.failure(*_classify_death(child.returncode(), tail, stage),
                                  log_tail=tail, problem=s.problem), stages


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


def detect_device() -> str:
    """Returns 'cuda' when an NVIDIA GPU is visible (without initialising CUDA here), else 'cpu'."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "cpu"
    if any(os.path.exists(f"/dev/nvidia{i}") for i in range(16)):
        return "cuda"
    return "cpu"


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


def resolve_device(device: str) -> str:
    """Returns the device to run on: 'auto' becomes what detect_device() finds."""
    return detect_device() if device == "auto" else device
