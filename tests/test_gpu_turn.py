"""A shared GPU's turns: held from the references to the end of timing, yielded while Triton
compiles during the checks only, the device synchronised before it is yielded."""
from __future__ import annotations

import fcntl
from pathlib import Path

from evaluator.gpu_turn import GpuTurn


def _free(path: Path) -> bool:
    """Returns whether another process could take the lock now (a second open file)."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return True


def test_a_compile_in_the_checks_yields_the_turn_and_takes_it_back(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "gpu.lock"
    stages: list[str] = []
    events: list[str] = []
    turn = GpuTurn(str(path), stages.append)
    assert _free(path) and not _free(Path(str(path) + ".quiet"))     # its set-up: shared
    turn.set_up(lambda: events.append("sync"))
    assert _free(Path(str(path) + ".quiet")) and events == ["sync"]
    events.clear()
    turn.take("reference")
    assert not _free(path) and stages == ["reference"]        # free: no wait reported
    turn._compiling()                        # outside the checks (a reference, the timer)
    assert not _free(path) and events == []
    turn.checking = True
    turn._compiling()
    assert _free(path) and events == ["sync"] and not turn.held
    other = open(path, "a+")
    fcntl.flock(other.fileno(), fcntl.LOCK_EX)              # a waiting evaluation's turn
    import threading
    back = threading.Thread(target=turn._compiled)
    back.start()
    back.join(timeout=0.5)
    assert back.is_alive() and stages[-1] == "gpu-wait"      # waits until that turn ends
    fcntl.flock(other.fileno(), fcntl.LOCK_UN)
    other.close()
    back.join(timeout=10)
    assert not _free(path) and stages[-2:] == ["gpu-wait", "check"]
    turn.checking = False
    turn.take("time")
    assert stages[-1] == "time" and not _free(path)
    turn.timing()
    assert not _free(Path(str(path) + ".quiet"))
    turn.release()
    assert _free(path) and _free(Path(str(path) + ".quiet")) and events == ["sync", "sync"]


def test_a_set_up_waits_while_another_evaluation_times(tmp_path: Path) -> None:
    import threading
    import time
    path = tmp_path / "gpu.lock"
    quiet = open(str(path) + ".quiet", "a+")
    fcntl.flock(quiet.fileno(), fcntl.LOCK_EX)           # another child's timing
    stages: list[str] = []
    made: list[GpuTurn] = []
    t = threading.Thread(target=lambda: made.append(GpuTurn(str(path), stages.append)))
    t.start()
    time.sleep(0.5)
    assert not made and stages == ["gpu-wait"]
    fcntl.flock(quiet.fileno(), fcntl.LOCK_UN)
    t.join(timeout=10)
    quiet.close()
    assert made and not _free(Path(str(path) + ".quiet"))


def test_the_compile_hooks_are_triton_s_own(tmp_path: Path) -> None:
    from triton import knobs
    keep = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    turn = GpuTurn(str(tmp_path / "gpu.lock"), lambda s: None)
    try:
        turn.install_compile_hooks()
        assert knobs.runtime.jit_cache_hook == turn._compiling
        assert knobs.runtime.jit_post_compile_hook == turn._compiled
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = keep


def test_without_a_path_nothing_is_locked_and_the_stages_still_report(tmp_path: Path) -> None:
    stages: list[str] = []
    turn = GpuTurn("", stages.append)
    turn.set_up(lambda: None)
    turn.timing()
    turn.take("reference")
    turn.checking = True
    turn._compiling()
    turn._compiled()
    turn.release()
    assert stages == ["reference"]
