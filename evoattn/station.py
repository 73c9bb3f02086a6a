"""The parent's end of an evaluation slot's station (evoattn/child/station.py).

A run's candidates are timed each in its own sandboxed child; the baselines they are compared
with, and the GPU's matmul ceiling, come from the slot's station, a warm trusted process that
measured them once instead of once per candidate (cuDNN's per-shape plans, FlexAttention's
compile). The baselines are measured again between candidates once their times are older
than `refresh_s`, so candidate and baseline see the GPU at nearly the same moment. Never used
by `evoattn eval`, which times both side by side in one process.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from evoattn.contract.request import EvalRequest

from .launch import _killpg


class StationError(Exception):
    """The station could not start or answer (the slot falls back to side-by-side timing)."""


class Station:
    """Starts on first use; answers (baseline times, ceiling) for the next candidate."""

    def __init__(self, request: EvalRequest, env: dict[str, str], refresh_s: float = 60.0,
                 answer_timeout_s: float = 900.0) -> None:
        self.request = request
        self.env = env
        self.refresh_s = refresh_s
        self.timeout_s = answer_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = ""
        self._times: dict[str, Any] | None = None
        self._measured_at = 0.0
        self.ceiling_tflops: float | None = None

    def for_candidate(self) -> tuple[dict[str, Any], float | None]:
        """Returns the baseline times (measured again when old) and the ceiling."""
        if self._proc is None:
            self._start()
        if self._times is None or time.monotonic() - self._measured_at > self.refresh_s:
            reply = self._ask({"op": "time"})
            self._times = reply["baseline_times"]
            self._measured_at = time.monotonic()
        return self._times, self.ceiling_tflops

    def close(self) -> None:
        """Stops the station's process."""
        if self._proc is not None:
            try:
                if self._proc.stdin:
                    self._proc.stdin.close()
            except OSError:
                pass
            _killpg(self._proc.pid)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._proc = None
        if self._dir:
            import shutil
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="evoattn-station-")
        env = dict(self.env, HOME=self._dir, TMPDIR=self._dir)
        log = open(Path(self._dir) / "station.log", "wb")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "evoattn.child.station", "--parent", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=self._dir,
                env=env, start_new_session=True)
        except OSError as e:
            raise StationError(f"cannot start the station: {e}") from None
        finally:
            log.close()
        reply = self._ask({"op": "setup", "request": self.request.to_json()})
        self.ceiling_tflops = reply.get("ceiling_tflops")

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write((json.dumps(msg) + "\n").encode())
            proc.stdin.flush()
        except OSError as e:
            raise StationError(f"the station is gone ({e}){self._log_hint()}") from None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + self.timeout_s
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise StationError(f"the station did not answer {msg['op']!r} in "
                                   f"{self.timeout_s:.0f} s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise StationError(f"the station exited{self._log_hint()}")
                buf += chunk
        reply = json.loads(buf.decode())
        if not reply.get("ok"):
            raise StationError(f"the station failed at {msg['op']!r}: {reply.get('error')}")
        return reply

    def _log_hint(self) -> str:
        try:
            tail = (Path(self._dir) / "station.log").read_text(errors="replace").strip()
        except OSError:
            return ""
        return f": {tail.splitlines()[-1][:300]}" if tail else ""
