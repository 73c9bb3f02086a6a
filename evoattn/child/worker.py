"""Child-process entry: `python -m evoattn.child.worker --fd N`, request JSON on stdin.

The result travels back as JSON lines on an inherited pipe (fd N), each line
carrying the nonce from the request. stdout/stderr are only logs: the parent
never parses them, so a candidate printing a forged result changes nothing.
"""
from __future__ import annotations

import json
import os
import sys

from ..contract.types import CHILD_NO_RESULT, SPARE_UNPREPARED


def die_with_parent(parent_pid: int) -> None:
    """Asks Linux to SIGKILL this process when its parent dies (so no evaluator process outlives
    the tool, however it ends), and exits now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)   # PR_SET_PDEATHSIG, SIGKILL
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(CHILD_NO_RESULT)


class Channel:
    """Writes framed messages to the parent over the result pipe."""

    def __init__(self, fd: int, nonce: str) -> None:
        self._fd = fd
        self._nonce = nonce
        self._write = os.write          # captured before the candidate is imported

    def send(self, kind: str, payload: object) -> None:
        line = json.dumps({"nonce": self._nonce, "type": kind, "payload": payload}) + "\n"
        data = line.encode()
        while data:
            n = self._write(self._fd, data)
            data = data[n:]


def serve(fd: int, message: dict, prepared: object = None) -> None:
    """Evaluates one request ({"nonce", "request"}), sends the result on fd, and exits.
    `prepared`: what this process set up as a spare (preparation.prepare)."""
    chan = Channel(fd, message["nonce"])
    from .harness import evaluate
    from ..contract.request import EvalRequest
    from ..contract.types import EvalResult, Verdict
    try:
        request = EvalRequest.from_json(message["request"])
        result = evaluate(request, lambda stage: chan.send("stage", stage),
                          prepared)  # type: ignore[arg-type]
    except BaseException as e:  # noqa: BLE001 - the harness itself failed; still answer
        import traceback
        traceback.print_exc()
        result = EvalResult.failure(Verdict.CRASH, f"evaluation aborted: {type(e).__name__}: {e}")
    chan.send("result", result.to_json())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)                        # skip candidate atexit hooks and destructors


def serve_spare(fd: int, template: dict, go: str) -> None:
    """A run's spare: sets up what the template request ({"request"}) needs before any
    candidate is named (preparation.prepare), then waits on the FIFO `go` for its candidate's
    message ({"nonce", "request"}) and evaluates it. Exits without a result when the parent
    closes `go` first (it had no candidate for it), and with SPARE_UNPREPARED when the
    set-up failed (the parent then starts the candidate in a fresh process)."""
    from .preparation import prepare
    from ..contract.request import EvalRequest
    try:
        prepared = prepare(EvalRequest.from_json(template["request"]), lambda stage: None)
    except BaseException:  # noqa: BLE001 - no candidate yet: not a verdict on anyone
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(SPARE_UNPREPARED)
    with open(go, "rb") as f:          # blocks until the parent writes or closes
        line = f.readline()
    os.unlink(go)
    if not line.endswith(b"\n"):
        os._exit(0)
    serve(fd, json.loads(line), prepared)


def main() -> None:
    die_with_parent(int(sys.argv[sys.argv.index("--parent") + 1]))
    fd = int(sys.argv[sys.argv.index("--fd") + 1])
    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    serve(fd, request)


if __name__ == "__main__":
    main()
