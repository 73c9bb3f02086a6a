"""Starting a candidate's process: a fresh interpreter, or a fork of a warm zygote.

Both give the evaluator the same handle: the child's pid (the leader of its own
session), a file descriptor the result arrives on, its exit code once it has
died, and a kill that ends the whole session. The zygote (evoattn/child/zygote.py)
saves each candidate the seconds of importing torch and Triton; it never touches
CUDA, so every candidate still gets a CUDA context of its own.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ZYGOTE_START_S = 180.0


def private_dir(work: str) -> Path:
    """Returns (made) the directory in a candidate's `work` for its log and its channels, out
    of reach of the program's own file names (which cannot begin with a dot: program.py)."""
    own = Path(work) / ".evoattn"
    own.mkdir(exist_ok=True)
    return own


class LaunchError(Exception):
    """The zygote could not start a child (the caller falls back to a fresh interpreter)."""


class PopenChild:
    """A candidate process started as `python -m evoattn.child.worker`."""

    def __init__(self, request: dict[str, Any], work: str, env: dict[str, str],
                 log_path: Path) -> None:
        rfd, wfd = os.pipe()
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "evoattn.child.worker", "--fd", str(wfd),
                 "--parent", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd=work, env=env,
                pass_fds=(wfd,), start_new_session=True)
        os.close(wfd)
        self.pid = self.proc.pid
        self.result_fd = rfd
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request).encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass

    def returncode(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        _killpg(self.pid)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        os.close(self.result_fd)


class ZygoteChild:
    """A candidate process forked by the zygote; its exit status comes from the zygote."""

    def __init__(self, zygote: "Zygote", pid: int, rfd: int, keepalive_fd: int,
                 go_fd: int | None = None) -> None:
        self.zygote = zygote
        self.pid = pid
        self.result_fd = rfd
        self._keepalive = keepalive_fd     # our own writer: the FIFO never reads as EOF
        self._go = go_fd                   # a spare's: where its candidate's request goes

    def go(self, request: dict[str, Any]) -> None:
        """Tells a spare its candidate: one line on its go FIFO, whose end stays open (the
        line stays readable) until close(); closed without a line, the spare exits."""
        assert self._go is not None
        data = (json.dumps(request) + "\n").encode()
        while data:
            data = data[os.write(self._go, data):]

    def returncode(self) -> int | None:
        status = self.zygote.exit_status(self.pid)
        return None if status is None else os.waitstatus_to_exitcode(status)

    def kill(self) -> None:
        _killpg(self.pid)
        deadline = time.monotonic() + 10       # until the zygote reports the exit (if alive)
        while self.returncode() is None and self.zygote.alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        os.close(self.result_fd)
        os.close(self._keepalive)
        if self._go is not None:
            os.close(self._go)
            self._go = None


class Zygote:
    """The parent's end of one `python -m evoattn.child.zygote` process."""

    def __init__(self, env: dict[str, str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="evoattn-zygote-")
        env = dict(env, HOME=self._dir, TMPDIR=self._dir)
        self.proc = subprocess.Popen([sys.executable, "-m", "evoattn.child.zygote",
                                      "--parent", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, cwd=self._dir, env=env,
                                     start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self._out = self.proc.stdout.fileno()
        os.set_blocking(self._out, False)
        self._buf = b""
        self._exits: dict[int, int] = {}
        self._pending: list[str] = []
        if self._next_line(_ZYGOTE_START_S) != "ready":
            self.close()
            raise LaunchError("the zygote did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self) -> int | None:
        """Returns the zygote's exit code once it has died (negative: killed by that signal)."""
        return self.proc.poll()

    def launch(self, request: dict[str, Any], work: str, env: dict[str, str],
               log_path: Path, spare: bool = False) -> ZygoteChild:
        """Forks a child for this request; raises LaunchError if the zygote fails.
        `spare`: the child sets up for the request, then waits for ZygoteChild.go()."""
        own = private_dir(work)
        req_path = own / "request.json"
        fd = os.open(req_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(request, f)
        fifo = own / "result.fifo"
        os.mkfifo(fifo, 0o600)
        rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        keep = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        job = {"workdir": work, "env": env, "fifo": str(fifo), "log": str(log_path),
               "request": str(req_path)}
        go = None
        if spare:
            job["go"] = str(own / "go.fifo")
            os.mkfifo(job["go"], 0o600)
            go = os.open(job["go"], os.O_RDWR)    # a writer from the start: its open never waits
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
            deadline = time.monotonic() + 30
            while True:
                line = self._next_line(max(0.0, deadline - time.monotonic()))
                if line is None:
                    raise LaunchError("the zygote did not answer")
                if line.startswith("pid "):
                    return ZygoteChild(self, int(line.split()[1]), rfd, keep, go)
        except (OSError, LaunchError, ValueError) as e:
            os.close(rfd)
            os.close(keep)
            if go is not None:
                os.close(go)
            req_path.unlink(missing_ok=True)
            raise LaunchError(f"zygote launch failed: {e}") from None

    def exit_status(self, pid: int) -> int | None:
        """Returns a child's raw wait status once the zygote has reaped it."""
        self._pump()
        return self._exits.get(pid)

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        _killpg(self.proc.pid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        import shutil
        shutil.rmtree(self._dir, ignore_errors=True)

    def _pump(self) -> None:
        """Reads what the zygote said so far; records exit lines."""
        while True:
            try:
                chunk = os.read(self._out, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            self._buf += chunk
            self._collect()

    def _collect(self) -> None:
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            text = line.decode(errors="replace")
            if text.startswith("exit "):
                _, pid, status = text.split()
                self._exits[int(pid)] = int(status)
            else:
                self._pending.append(text)

    def _next_line(self, timeout: float) -> str | None:
        """Returns the next line that is not an exit report, waiting up to timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self._pump()
            if self._pending:
                return self._pending.pop(0)
            left = deadline - time.monotonic()
            if left <= 0 or not self.alive():
                return None
            select.select([self._out], [], [], min(left, 0.2))


def pid_alive(pid: int) -> bool:
    """Returns whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
