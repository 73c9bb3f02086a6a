"""Follows one candidate's child process: its messages, its deadlines, its memory, its death.

The child reports stages and its result as JSON lines carrying a nonce on a pipe of its own
(evoattn/child/worker.py); anything else on the pipe is ignored. The parent turns what it sees
into either the child's result or a verdict of its own (a timeout, host memory, a crash, or
an evaluator fault when the zygote or an outside kill took the child).
"""
from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from evoattn.contract.names import Stage
from evoattn.contract.request import EvalRequest
from evoattn.contract.types import SPARE_UNPREPARED, Verdict

from .childenv import SandboxSettings
from .launch import Zygote, pid_alive

STARTUP_S = 120.0   # importing torch and CUDA initialisation, before the build starts


class Watch:
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
        deadline = time.monotonic() + STARTUP_S + req.build_timeout_s
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
            rss = rss_bytes(self.child.pid)
            if rss > self.s.max_host_mem_bytes:
                return None, (Verdict.OOM, f"host memory {rss / 2**30:.1f} GiB over the limit "
                              f"{self.s.max_host_mem_bytes / 2**30:.1f} GiB")
            fault = self._fault()
            if fault:
                return None, (Verdict.EVALUATOR_FAULT, fault)
            dead = self.child.returncode() is not None
            ready, _, _ = select.select([rfd], [], [], 0 if dead else
                                        min(0.2, max(0.0, deadline - now)))
            chunk = read_ready(rfd) if ready else b""
            if chunk is None:                     # EOF: every writer has gone
                return None, self._death_fault()
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = parse(line, nonce)
                if msg is None:
                    continue
                if msg["type"] == "stage":
                    now, was = time.monotonic(), self.stage
                    self.stage = str(msg["payload"])[:40]
                    marks.append((self.stage, now))
                    if was == "time" != self.stage:
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


def stage_seconds(marks: list[tuple[str, float]], end: float) -> dict[str, float]:
    """Turns (stage, time it began) marks into wall seconds per stage ('start': the launch
    and imports before the child's first report)."""
    out: dict[str, float] = {}
    for (name, t), nxt in zip(marks, [m[1] for m in marks[1:]] + [end]):
        out[name] = round(out.get(name, 0.0) + nxt - t, 3)
    return out


def read_ready(fd: int) -> bytes | None:
    """Returns what is readable on fd (b"" when nothing), or None at end of file."""
    try:
        chunk = os.read(fd, 1 << 20)
    except BlockingIOError:
        return b""
    return chunk or None


def parse(line: bytes, nonce: str) -> dict[str, Any] | None:
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    if not isinstance(msg, dict) or msg.get("nonce") != nonce:
        return None
    return msg


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def classify_death(code: int | None, tail: str, stage: str) -> tuple[Verdict, str]:
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


def tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


