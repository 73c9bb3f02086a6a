"""`python -m evoattn.child.zygote`: a fork server that saves each candidate the import of torch.

It imports torch, Triton and the harness once, never touches CUDA, then forks one
fresh process per candidate on request. The forked child starts a session of its
own, moves into the candidate's directory, takes the candidate's environment,
keeps only its log and its result FIFO open, and runs `worker.serve`. The zygote
itself was started with the scrubbed child environment, so it holds no secrets.

A job with a "go" FIFO forks a run's spare (worker.serve_spare): it sets up what needs no
candidate, then reads its candidate's request from that FIFO.

Protocol (one JSON object or word per line):
    parent -> zygote   {"workdir", "env", "fifo", "log", "request"[, "go"]}   (paths)
    zygote -> parent   "ready" | "pid N" | "exit N STATUS" | "error TEXT"
"""
from __future__ import annotations

import json
import os
import select
import signal
import sys

from ..contract.types import CHILD_NO_RESULT


def _child(job: dict, zygote_pid: int) -> None:
    """Becomes the candidate's process: never returns."""
    try:
        from .worker import die_with_parent
        die_with_parent(zygote_pid)
        os.setsid()
        os.chdir(job["workdir"])
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        fd = os.open(job["fifo"], os.O_WRONLY)
        keep = os.dup2(fd, 3)          # the result channel is fd 3; nothing else stays open
        os.closerange(4, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)
        os.environ.clear()
        os.environ.update(job["env"])
        import tempfile
        tempfile.tempdir = None        # an import in the zygote cached the zygote's TMPDIR
        with open(job["request"]) as f:
            request = json.load(f)
        os.unlink(job["request"])      # the nonce lives only in this process from here on
        if job.get("go"):              # a spare: set up first, told its candidate later
            from .worker import serve_spare
            serve_spare(keep, request, job["go"])
        from .worker import serve
        serve(keep, request)
    except BaseException as e:  # noqa: BLE001 - report on the log, then die without a result
        try:
            os.write(2, f"evoattn zygote child failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(CHILD_NO_RESULT)
    os._exit(0)


def _cuda_driver_initialised() -> bool:
    """Returns True if Triton's CUDA driver object was created in this process."""
    config = getattr(sys.modules.get("triton.runtime.driver"), "driver", None)
    return any(getattr(config, name, None) is not None for name in ("_default", "_active"))


def _warm_imports(torch, guards) -> None:  # noqa: ANN001
    """Imports, on a CPU tensor, what every candidate's first checked call would import
    (the dispatch watch pulls in torch._dynamo and sympy: seconds per candidate otherwise)."""
    try:
        import triton.experimental.gluon  # noqa: F401  (Triton's launcher imports it lazily)
    except ImportError:
        pass
    try:
        with guards.DispatchWatch(guards.Violations()):
            torch.empty(2).add_(1)
        from ..contract import runtime
        runtime.toolchain_id()           # `nvcc --version`, cached: not once per CUDA candidate
        from triton.runtime.cache import triton_key
        triton_key()                   # hashes Triton's own files (cached): ~0.6 s once
    except Exception:  # noqa: BLE001 - only a speed-up: the candidates import what is missing
        pass


def main() -> None:
    from .worker import die_with_parent
    die_with_parent(int(sys.argv[sys.argv.index("--parent") + 1]))
    import torch  # (the point of the zygote: imported once, CUDA untouched)
    # Triton's modules are imported here too; its driver is initialised lazily, on the first
    # launch, so that happens in the candidate's own process (checked below with torch's).
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        pass
    import torch.profiler  # noqa: F401  (the harness's library-kernel check)
    from . import guards, harness, worker  # noqa: F401
    _warm_imports(torch, guards)
    if torch.cuda.is_initialized() or _cuda_driver_initialised():
        print("error CUDA was initialised in the zygote", flush=True)   # a fork would share it
        return
    _serve(os.getpid())


def _serve(me: int) -> None:
    """Forks a child per job line on stdin; when stdin closes (the parent has gone, however it
    ended), kills every child's session and exits."""
    out = sys.stdout
    children: set[int] = set()

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    say("ready")
    stdin = sys.stdin.fileno()
    buf = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.1)
        while True:                                # reap and report finished children
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            say(f"exit {pid} {status}")
        if not ready:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:                              # the parent went away: tidy up and go
            for pid in children:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            here = os.getcwd()
            if os.path.basename(here).startswith("evoattn-zygote-"):
                import shutil
                shutil.rmtree(here, ignore_errors=True)
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                job = json.loads(line)
            except ValueError:
                say("error malformed job")
                continue
            pid = os.fork()
            if pid == 0:
                _child(job, me)
            children.add(pid)
            say(f"pid {pid}")


if __name__ == "__main__":
    main()
