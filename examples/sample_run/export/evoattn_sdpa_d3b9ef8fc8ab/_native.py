"""attention()'s per-call work in C++ (_callkey.cpp), built in the background on first use.

The module is built once per source, Python, torch and compiler into the kernel cache (see
_loader.cache_root) by torch.utils.cpp_extension in a child process (a C++ compiler and ninja
are needed; about 15 s on two cores), in a daemon thread, so no call waits for it: until it is
loaded, and wherever it cannot be built, calls take the Python path, which decides the same.
A build still running when the process exits is killed and what it wrote removed, so a
process that exits within the build's time never gets the C++ path: `call_path(wait_s=None)`
builds it once for all later processes. EVOATTN_NATIVE=0 turns it off.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable

from . import _loader, _runtime

SOURCE = Path(__file__).resolve().parent / "_callkey.cpp"
BUILD_TIMEOUT_S = 600
log = logging.getLogger(__name__.rpartition(".")[0] or __name__)

_lock = threading.Lock()
_ready = threading.Event()
_state: dict[str, Any] = {"thread": None, "call": None, "error": None, "procs": []}


def enabled() -> bool:
    """Whether the C++ path may be built and used (EVOATTN_NATIVE is not 0)."""
    return os.environ.get("EVOATTN_NATIVE", "1").strip().lower() not in ("0", "false", "no")


def start(on_ready: Callable[[Callable[..., Any]], None]) -> None:
    """Starts loading (building first, where the cache lacks it) the C++ path once per
    process; `on_ready` gets its `call` when it is loaded. Returns at once."""
    with _lock:
        if _state["thread"] is not None:
            return
        if not enabled():
            _state["error"] = "turned off by EVOATTN_NATIVE"
            _state["thread"] = False
            _ready.set()
            return
        thread = threading.Thread(target=_load, args=(on_ready,), daemon=True,
                                  name="evoattn-native-build")
        _state["thread"] = thread
    thread.start()


def wait(timeout_s: float | None = None) -> bool:
    """Waits until the C++ path is loaded or has failed; returns whether it is loaded."""
    _ready.wait(timeout_s)
    return _state["call"] is not None


def status() -> str:
    """'native', 'building', 'not started' or 'python (<why>)'."""
    if _state["call"] is not None:
        return "native"
    if _state["error"] is not None:
        return f"python ({_state['error']})"
    return "building" if _state["thread"] else "not started"


def _load(on_ready: Callable[[Callable[..., Any]], None]) -> None:
    try:
        built = _runtime.build_host_module(SOURCE, _loader.cache_root(), BUILD_TIMEOUT_S,
                                           started=lambda p, d: _state["procs"].append((p, d)))
        if not built.ok:
            last = (built.log.strip().splitlines() or ["no log"])[-1]
            raise RuntimeError(f"cannot build {SOURCE.name}: {last}")
        call = _runtime.load_module(built.path).call
    except Exception as e:  # noqa: BLE001 - any failure leaves the Python path in place
        _state["error"] = f"{type(e).__name__}: {e}"
        log.debug("the C++ call path is unavailable: %s", _state["error"])
    else:
        _state["call"] = call
        on_ready(call)
    finally:
        _ready.set()


def _stop_builds() -> None:
    """Kills a build still running, with its compiler, and removes what it wrote."""
    for proc, directory in _state["procs"]:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                continue
            shutil.rmtree(directory, ignore_errors=True)


def _forget_in_child() -> None:
    """A forked child neither stops its parent's build at its exit nor waits for it: where
    the parent's was still building, the child starts its own on its first call."""
    global _lock
    _lock = threading.Lock()               # another thread may have held it at the fork
    _state["procs"] = []
    if _state["call"] is None and _state["error"] is None:
        _state["thread"] = None
        _ready.clear()


atexit.register(_stop_builds)
if hasattr(os, "register_at_fork"):        # POSIX only
    os.register_at_fork(after_in_child=_forget_in_child)
