"""A shared GPU's turns: held from the end of the set-up to the end of timing, yielded while
Triton compiles during the checks only, the device synchronised before it is yielded; a set-up
in steps, each of which lets a due timing go first."""
from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from evoattn.child.gpu_turn import GpuTurn


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


def test_a_due_timing_waits_for_a_set_up_s_step_not_the_whole_set_up(tmp_path: Path) -> None:
    """Another evaluation (a run's spare) sets up in steps; a timing that falls due runs after
    the step in progress, and that set-up's next step waits for the timing to end."""
    import threading
    path = tmp_path / "gpu.lock"
    theirs: list[str] = []
    setting_up = GpuTurn(str(path), theirs.append)        # its set-up, in progress
    mine = GpuTurn(str(path), lambda s: None)
    mine.set_up(lambda: None)
    mine.take("time")
    due = threading.Thread(target=mine.timing)
    due.start()
    due.join(timeout=0.5)
    assert due.is_alive()                                  # the step in progress goes on
    synced: list[int] = []
    step = threading.Thread(target=lambda: setting_up.step(lambda: synced.append(1),
                                                          "reference"))
    step.start()
    due.join(timeout=10)
    assert not due.is_alive() and synced == [1]            # in at the step's end
    step.join(timeout=0.5)
    assert step.is_alive() and theirs == ["gpu-wait"]      # the next step waits ...
    mine.release()
    step.join(timeout=10)
    assert not step.is_alive() and theirs == ["gpu-wait", "reference"]   # ... for its end
    assert not _free(Path(str(path) + ".quiet"))
    setting_up.set_up(lambda: None)
    assert _free(Path(str(path) + ".quiet")) and _free(Path(str(path) + ".next"))


def test_a_measurement_alone_waits_for_a_set_up_s_step_and_holds_the_next_back(
        tmp_path: Path) -> None:
    """The seed's GPU ceiling is measured alone, as a timing is: not beside a spare's set-up."""
    import threading
    path = tmp_path / "gpu.lock"
    theirs: list[str] = []
    setting_up = GpuTurn(str(path), theirs.append)
    mine = GpuTurn(str(path), lambda s: None)
    synced: list[str] = []
    mine.set_up(lambda: synced.append("mine"))
    inside = threading.Event()
    leave = threading.Event()

    def measure() -> None:
        with mine.alone():
            inside.set()
            leave.wait(10)
    t = threading.Thread(target=measure)
    t.start()
    assert not inside.wait(0.5)                         # the step in progress goes first
    step = threading.Thread(target=lambda: setting_up.step(lambda: None, "reference"))
    step.start()
    assert inside.wait(10)
    step.join(timeout=0.5)
    assert step.is_alive() and theirs == ["gpu-wait"]    # no step while it measures
    leave.set()
    t.join(timeout=10)
    step.join(timeout=10)
    assert not step.is_alive() and theirs[-1] == "reference" and synced[-1] == "mine"
    setting_up.set_up(lambda: None)
    assert _free(Path(str(path) + ".quiet")) and _free(Path(str(path) + ".next"))


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
    with turn.alone():
        pass
    turn.timing()
    turn.take("reference")
    turn.checking = True
    turn._compiling()
    turn._compiled()
    turn.release()
    assert stages == ["reference"]


def test_a_set_up_put_aside_for_a_build_lets_a_timing_run_and_waits_for_it_after(
        tmp_path: Path) -> None:
    import threading
    path = tmp_path / "gpu.lock"
    quiet = Path(str(path) + ".quiet")
    stages: list[str] = []
    events: list[str] = []
    turn = GpuTurn(str(path), stages.append)
    assert not _free(quiet)                         # its set-up began: shared
    turn.aside(lambda: events.append("sync"))
    assert _free(quiet) and events == ["sync"]      # the build holds nothing
    turn.aside(lambda: events.append("sync"))       # once only
    assert events == ["sync"]
    timing = open(quiet, "a+")                      # another evaluation times meanwhile
    fcntl.flock(timing.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    back = threading.Thread(target=turn.resume, args=("build",))
    back.start()
    back.join(timeout=0.5)
    assert back.is_alive() and stages == ["gpu-wait"]   # the set-up waits for that timing
    fcntl.flock(timing.fileno(), fcntl.LOCK_UN)
    timing.close()
    back.join(timeout=10)
    assert not back.is_alive() and stages == ["gpu-wait", "build"] and not _free(quiet)
    turn.resume("build")                            # nothing put aside: nothing to do
    assert stages == ["gpu-wait", "build"]
    turn.set_up(lambda: None)
    turn.aside(lambda: events.append("sync"))       # a set-up that is done (a spare's)
    assert _free(quiet) and events == ["sync"]


_PROBE = """
import json, sys
from pathlib import Path
from evoattn.child import harness
from evoattn.contract.request import EvalRequest
from test_gpu_turn import _free
lock, cand, cache = sys.argv[1:4]
seen = {}
real_build, real_prepare = harness.build_candidate, harness.prepare
def build(*a, **k):
    seen["build"] = _free(Path(lock + ".quiet"))
    return real_build(*a, **k)
def prepare(*a, **k):
    seen["prepare"] = _free(Path(lock + ".quiet"))
    return real_prepare(*a, **k)
harness.build_candidate, harness.prepare = build, prepare
req = EvalRequest(device="cpu", candidate=cand, cache_dir=cache, gpu_lock=lock, reps=2,
                  warmup=1, policy="allow-library")
r = harness.evaluate(req, lambda s: None)
print(json.dumps({**seen, "verdict": r.verdict.value}))
"""


def test_a_fresh_child_builds_without_the_set_up_lock_and_sets_up_with_it(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    cand = tmp_path / "c.py"
    cand.write_text("import torch\n\ndef attention(q, k, v, causal=False, scale=None):\n"
                    "    return torch.nn.functional.scaled_dot_product_attention("
                    "q, k, v, is_causal=causal, scale=scale)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "l" / "gpu.lock"),
                           str(cand), str(tmp_path / "cache")], capture_output=True, text=True,
                          cwd=root, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"build": True, "prepare": False, "verdict": "pass"}


_SALT = iter(range(1, 1 << 30))


def _run_fresh_triton_kernel() -> None:
    """Launches a Triton kernel on a specialisation this process has not compiled (a new
    constexpr), so Triton goes through its compile path and its hooks."""
    import time

    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, out_ptr, n, SALT: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) + SALT, mask=i < n)

    salt = int(time.time()) % 100000 * 1000 + next(_SALT)
    x = torch.arange(100, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    add[(1,)](x, out, 100, SALT=salt, BLOCK=128)
    torch.cuda.synchronize()
    assert torch.equal(out, x + salt)


@pytest.mark.gpu
def test_a_real_triton_compile_on_the_gpu_yields_the_turn_and_takes_it_back(tmp_path: Path) -> None:
    """The hooks as the installed Triton calls them: during a compile in the check stage the
    turn is free, after it held again; outside the checks a compile keeps it."""
    import torch
    from triton import knobs
    path = tmp_path / "gpu.lock"
    keep = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    seen: list[tuple[str, bool]] = []
    turn = GpuTurn(str(path), lambda s: None)
    try:
        turn.set_up(torch.cuda.synchronize)
        turn.install_compile_hooks()
        compiling, compiled = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

        def on_compiling(*a, **k):
            out = compiling(*a, **k)
            seen.append(("compiling", _free(path)))
            return out

        def on_compiled(*a, **k):
            out = compiled(*a, **k)
            seen.append(("compiled", _free(path)))
            return out
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = on_compiling, on_compiled
        turn.take("reference")
        _run_fresh_triton_kernel()                # a reference's compile: the turn is kept
        assert seen == [("compiling", False), ("compiled", False)], seen
        seen.clear()
        turn.checking = True
        _run_fresh_triton_kernel()
        assert seen == [("compiling", True), ("compiled", False)], seen
        assert turn.held and not _free(path)
        turn.release()
        assert _free(path)
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = keep
