"""However evoattn ends, nothing it started keeps running; a dead evaluator is not blamed on
the candidate; a hang costs seconds, not minutes; and the exit codes are the README's."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from evoattn.contract.types import Verdict
from fakes import sandboxed

ROOT = Path(__file__).resolve().parents[1]
ADV = ROOT / "tests" / "adversarial"
HANG = ADV / "hang.py"


def _children(pid: int) -> set[int]:
    """Returns every live descendant of a process (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _as_from_a_terminal() -> None:
    """SIGINT as a user's Ctrl-C delivers it: a shell starts background jobs (CI's, say) with
    SIGINT ignored, and a child inherits that; Python then installs no handler for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _hanging(args: list[str], tmp: Path) -> tuple[subprocess.Popen, set[int]]:
    """Starts evoattn on a hanging candidate; returns it once its candidate runs, and the
    processes it started by then."""
    env = dict(os.environ, EVOATTN_CACHE=str(tmp / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "evoattn.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=_as_from_a_terminal)
    deadline = time.time() + 180
    seen: set[int] = set()
    while time.time() < deadline:
        seen |= _children(proc.pid)
        busy = [p for p in seen if _alive(p) and _cpu_seconds(p) > 1.0]   # the hang spins
        if busy:
            time.sleep(0.5)
            return proc, seen | _children(proc.pid)
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the hanging candidate never started")


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _run_config(tmp: Path) -> Path:
    cfg = {"problem": "sdpa", "seed": str(HANG), "device": "cpu", "iterations": 2,
           "output": str(tmp / "run")}
    path = tmp / "hang.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("command", ["eval", "run"])
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130),
                                       (signal.SIGHUP, 129), (signal.SIGKILL, -9)])
def test_no_evaluation_process_outlives_the_tool(tmp_path: Path, command: str, sig: int,
                                                 code: int) -> None:
    args = (["eval", str(HANG), "--device", "cpu"] if command == "eval"
            else ["run", "--config", str(_run_config(tmp_path)), "--quiet"])
    proc, started = _hanging(args, tmp_path)
    assert started, "no evaluation process was seen"
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    assert proc.returncode == code, proc.stderr.read().decode()[-2000:]
    time.sleep(5)
    left = [p for p in started if _alive(p)]
    assert not left, f"still running 5 s after {signal.Signals(sig).name}: {left}"


def _killed_from_outside(ev, source: str) -> tuple:  # noqa: ANN001
    """Evaluates source in a thread; kills the child and the zygote from outside while the
    candidate runs; returns (result, seconds)."""
    box: dict = {}
    t0 = time.time()
    worker = threading.Thread(target=lambda: box.setdefault("r", ev.evaluate(source, ".py")))
    worker.start()
    killed = False
    while worker.is_alive() and not killed and time.time() - t0 < 120:
        zygote = ev._zygote
        kids = _children(zygote.proc.pid) if zygote is not None else set()
        busy = [p for p in kids if _cpu_seconds(p) > 0.5]
        if zygote is not None and busy:
            for pid in busy + [zygote.proc.pid]:
                os.kill(pid, signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    worker.join(timeout=300)
    return box.get("r"), time.time() - t0, killed


SLOW_FIRST_CALL = '''
import time
import torch
_calls = [0]

def attention(q, k, v, causal=False, scale=None):
    _calls[0] += 1
    if _calls[0] == 1:              # spin (CPU time) long enough to be killed in
        t = time.time()
        while time.time() - t < 3.0:
            pass
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
'''


def test_a_dead_evaluator_is_not_blamed_on_the_candidate(tmp_path: Path) -> None:
    ev = sandboxed(device="cpu", cache_dir=str(tmp_path), zygote=True, run_timeout_s=600)
    try:
        result, seconds, killed = _killed_from_outside(ev, SLOW_FIRST_CALL)
    finally:
        ev.close()
    assert killed and result is not None
    assert result.verdict is Verdict.PASS, result.reason    # evaluated again on a new zygote
    # said as an evaluator condition, not raised as an integrity flag against the candidate
    assert not result.flags and "zygote process died" in result.device_info["evaluated_again"]
    from evoattn.report import remeasured_lines
    assert any(ln.startswith("measured again: the whole candidate, after an evaluator fault")
               for ln in remeasured_lines(result))
    assert seconds < 120                      # not the 600 s deadline


def test_a_candidate_killed_from_outside_twice_is_an_evaluator_fault(tmp_path: Path) -> None:
    src = ("import os, signal\n\ndef attention(q, k, v, causal=False, scale=None):\n"
           "    os.kill(os.getpid(), signal.SIGKILL)\n")
    ev = sandboxed(device="cpu", cache_dir=str(tmp_path))
    try:
        r = ev.evaluate(src, ".py")
    finally:
        ev.close()
    assert r.verdict is Verdict.EVALUATOR_FAULT and r.reason.startswith("twice:")
    assert "killed from outside (SIGKILL)" in r.reason


HANGS_WHEN_SET = '''
import torch
HANG = False  # evoattn: choice(True, False)

def attention(q, k, v, causal=False, scale=None):
    while HANG:
        pass
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
'''


def test_a_hang_in_a_run_costs_seconds_not_the_ten_minute_ceiling(tmp_path: Path) -> None:
    (tmp_path / "seed.py").write_text(HANGS_WHEN_SET)
    cfg = {"problem": "sdpa", "seed": str(tmp_path / "seed.py"), "device": "cpu",
           "iterations": 1, "output": str(tmp_path / "run"),
           "evaluator": {"run_factor": 3.0, "run_floor_s": 10.0, "policy": "allow-library"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "evoattn.cli", "run", "--config",
                        str(tmp_path / "c.yaml"), "--quiet"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "timeout" in p.stdout and "limit 10 s" in p.stdout, p.stdout
    assert time.time() - t0 < 200


def test_the_run_deadline_rule() -> None:
    from evoattn.contract.types import EvalResult
    from evoattn.sandbox import run_deadline
    seed = EvalResult(Verdict.PASS, "", 1.0, stage_s={"start": 4.0, "build": 50.0,
                                                      "reference": 1.0, "check": 2.0,
                                                      "time": 3.0})
    assert run_deadline(seed, 10.0, 60.0, 600.0) == 60.0          # 10 x 6 s = the floor
    assert run_deadline(seed, 5.0, 60.0, 600.0) == 60.0           # 5 x 6 s, raised to the floor
    assert run_deadline(seed, 20.0, 60.0, 600.0) == 120.0         # build time is not counted
    assert run_deadline(seed, 1000.0, 60.0, 600.0) == 600.0       # never past the ceiling
    assert run_deadline(EvalResult(Verdict.PASS, "", 1.0), 10.0, 60.0, 600.0) == 600.0


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoattn.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))


@pytest.mark.parametrize("args, message", [
    (["eval"], "Missing argument 'PATH'"),
    (["run", "--iterations", "many"], "is not a valid integer"),
    (["export"], "Missing argument 'RUN_DIR'"),
    (["eval", "seeds/sdpa/naive_torch.py", "--device", "cuda"], "--device cuda: no NVIDIA GPU"),
])
def test_usage_errors_exit_4_with_one_line(args: list[str], message: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if "cuda" in args and any(os.path.exists(f"/dev/nvidia{i}") for i in range(4)):
        pytest.skip("a GPU is visible here")
    p = _cli(*args)
    assert p.returncode == 4, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("UsageError"), lines


def test_an_empty_config_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    p = _cli("run", "--config", str(empty), "--output", str(tmp_path / "run"))
    assert p.returncode == 4 and str(empty) in p.stderr and "the file is empty" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["empty.yaml"]          # no run directory made


def test_a_cuda_file_without_a_gpu_is_compiled_only_exit_6(tmp_path: Path) -> None:
    import shutil
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    p = _cli("eval", "seeds/sdpa/naive.cu", "--device", "cpu")
    assert p.returncode == 6, p.stdout + p.stderr
    assert "Compiled:" in p.stdout and "need a GPU to run" in p.stdout
